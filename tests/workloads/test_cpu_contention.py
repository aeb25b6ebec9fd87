"""A point whose processes waited for cores is flagged contended (`replica.cpu_share`), in its record, its
progress line and its table; an idle one is not.

The busy neighbour is started here: bounded Python spin loops, three per core this process may run on, so that the
point's threads get about a quarter of the time they are runnable (CFS shares a core evenly between runnable
threads), far below the 0.75 threshold.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from bench import bench_scheduler
from replica import cpu_share
from tests.neighbour import busy_neighbour
from tests.suite_helpers import serving_suite, tiny_batch, uniform
from workloads import sweep


def spin_for(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass


def sample(wall_s, cpu_s, run_s, wait_s, *, threads=1, steal=0, total=1000) -> dict:
    return dict(
        wall_s=wall_s,
        process_cpu_s=cpu_s,
        run_s=run_s,
        wait_s=wait_s,
        threads=threads,
        steal_ticks=steal,
        total_ticks=total,
        pressure_some_us=0,
        loadavg_1m=0.5,
    )


def test_measure_gives_ran_over_runnable_and_busy_share():
    f = cpu_share.measure(sample(10, 1, 1, 1), sample(12, 2, 2, 4, threads=2))
    assert f["cpu_share"] == pytest.approx(1 / 4)  # ran 1 s, waited 3 s
    assert f["cpu_busy_share"] == pytest.approx(1 / (2 * 2))  # 1 CPU-s of 2 s x 2 threads
    assert f["cpu_wait_s"] == pytest.approx(3)
    assert f["contended"] is True
    idle = cpu_share.measure(sample(10, 1, 1, 1), sample(20, 1.1, 1.1, 1.0))
    assert idle["cpu_share"] == pytest.approx(1.0) and idle["contended"] is False  # slept: not starved


def test_steal_alone_flags_a_point_and_replicas_combine_to_the_most_starved():
    stolen = cpu_share.measure(sample(0, 0, 0, 0, steal=0, total=1000), sample(1, 1, 1, 0, steal=200, total=2000))
    assert stolen["cpu_steal_share"] == pytest.approx(0.2) and stolen["contended"] is True
    ok = cpu_share.measure(sample(0, 0, 0, 0), sample(1, 1, 0.95, 0.05, total=2000))
    both = cpu_share.combine([ok, stolen])
    assert both["cpu_share"] == pytest.approx(0.95) and both["contended"] is True
    assert both["cpu_process_s"] == pytest.approx(2)
    assert cpu_share.combine([]) == cpu_share.empty() and cpu_share.empty()["contended"] is None


def test_a_few_milliseconds_decide_nothing():
    f = cpu_share.measure(sample(10, 1, 1, 1), sample(10.01, 1.001, 1.001, 1.02))  # 21 ms runnable, 1 of it ran
    assert f["cpu_share"] is None and f["cpu_busy_share"] is None and f["contended"] is None


def test_samples_of_two_processes_are_refused():
    with pytest.raises(ValueError, match="end: sampled before start"):
        cpu_share.measure(sample(5, 0, 0, 0), sample(4, 0, 0, 0))


def test_busy_neighbour_gives_a_spinning_thread_a_low_share():
    with busy_neighbour(), cpu_share.CpuMeter(threads=1) as m:
        spin_for(1.5)
    # 1 of (3 x cores + 1) runnable threads per core: about 0.25 on any core count; 0.5 leaves a clear margin
    assert m.fields["cpu_share"] < 0.5, m.fields
    assert m.fields["contended"] is True


def _machine_busy(fields: dict) -> bool:
    """Other work held the cores during an 'idle' measurement (a shared developer machine, not CI)."""
    return (fields.get("cpu_pressure_share") or 0) > 0.2


def test_idle_spinning_thread_is_not_contended():
    with cpu_share.CpuMeter(threads=1) as m:
        spin_for(1.0)
    if _machine_busy(m.fields):
        pytest.skip(f"this machine ran other work during the idle measurement: {m.fields}")
    assert m.fields["cpu_share"] > 0.9, m.fields
    assert m.fields["contended"] is False


def run_one_point(tmp_path, capsys) -> tuple[dict, str, str]:
    """A one-point batch sweep in this process (``--local``): its record, its stderr and its table."""
    path = tmp_path / "one.yaml"
    suite = tiny_batch(policies=["full"], compression_ratios=[1], batch_sizes=[4], new_tokens=[48], replicas=1)
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "r"
    rc = sweep.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "run"])
    assert rc == 0
    err = capsys.readouterr().err
    (record,) = [json.loads(line) for line in (out / "run" / "points.jsonl").read_text().splitlines()]
    return record, err, (out / "run" / "table.md").read_text()


def test_in_process_point_with_a_busy_neighbour_is_flagged_contended(tmp_path, capsys):
    with busy_neighbour():
        record, err, table = run_one_point(tmp_path, capsys)
    assert record["status"] == "ok"
    assert record["cpu_share"] < 0.5, {k: record.get(k) for k in cpu_share.FIELDS}
    assert record["contended"] is True and record["contended_rule"] == cpu_share.CONTENDED_RULE
    assert "[contended: CPU share" in err
    assert f"{record['cpu_share']:.2f} !" in table and "`!` contended" in table


def test_in_process_point_on_an_idle_machine_is_not_flagged(tmp_path, capsys):
    record, err, table = run_one_point(tmp_path, capsys)
    if _machine_busy(record):
        pytest.skip(f"this machine ran other work during the idle point: {record['cpu_pressure_share']}")
    assert record["cpu_share"] > 0.9 and record["contended"] is False
    assert "[contended" not in err and "`!` contended" not in table


def test_bench_rows_with_a_busy_neighbour_are_flagged_in_the_table_and_json(tmp_path, capsys):
    args = ["--model", "tiny-llama", "--prompt-tokens", "64", "--new-tokens", "24", "--requests", "4"]
    with busy_neighbour():
        rc = bench_scheduler.main(args + ["--budgets", "16", "--block-tokens", "4", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert all(r["cpu_share"] < 0.5 and r["contended"] is True for r in rows.values()), rows
    captured = capsys.readouterr()
    assert "| CPU share |" in captured.out and "`!` contended" in captured.out
    assert "bench-scheduler: warning: `!` contended" in captured.err


def test_in_process_serving_point_with_a_busy_neighbour_is_flagged_contended(tmp_path, capsys):
    """A serving point measures its replica's share between two `cpu_samples` calls around its load."""
    suite = serving_suite(
        mode="concurrency",
        loads=[4],
        policies=["full"],
        prompt_tokens=uniform(48, 64),
        new_tokens=uniform(24, 32),
        num_requests=8,
        name="busy",
    )
    path = tmp_path / "busy.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "r"
    with busy_neighbour():
        rc = sweep.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "run"])
    assert rc == 0
    (record,) = [json.loads(line) for line in (out / "run" / "points.jsonl").read_text().splitlines()]
    assert record["status"] == "ok" and record["cpu_share"] < 0.5 and record["contended"] is True, record
    assert "[contended: CPU share" in capsys.readouterr().err
    assert f"{record['cpu_share']:.2f} !" in (out / "run" / "table.md").read_text()
