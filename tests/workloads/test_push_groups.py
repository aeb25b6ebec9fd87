"""Against a real Pushgateway (loopback): every point is its own series, and a
resumed run's pushes never erase the series of the points pushed before the resume."""

import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.serve import find_binary
from tests.suite_helpers import tiny_suite
from tests.waiting import free_port, wait_for
from workloads.core import results
from workloads.core.push import PointPublisher, SweepPusher
from workloads.kinds import parse_suite

PUSHGATEWAY = find_binary("prometheus-pushgateway")
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PUSHGATEWAY is None, reason="prometheus-pushgateway not installed"),
]

SUITE = dict(
    kind="batch",
    name="t",
    model="tiny-llama",
    compression_ratios=[2],
    batch_sizes=[1],
    prompt_tokens=[64],
    new_tokens=[16],
    policies=["scissorhands", {"name": "scissorhands", "params": {"recent_window": 4}}],
)


@pytest.fixture()
def pushgateway(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"127.0.0.1:{port}"

    def up():
        try:
            return urllib.request.urlopen(f"http://{url}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_for(up, 30, "the Pushgateway to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _series(url: str, name: str, run_id: str) -> dict[str, float]:
    """point_id -> value of every pushed series `name` of the run."""
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("run_id") == run_id:
                out[s.labels.get("point_id", "")] = s.value
    return out


def _records(run_id: str) -> list[dict]:
    suite = parse_suite(SUITE)
    return [
        results.build_record(
            kind="batch",
            run_id=run_id,
            commit="c",
            suite=suite,
            point=p,
            status="ok",
            metrics={
                "budget_tokens": 40,
                "batch_size": 1,
                "kv_cache_bytes": 1000 + p.index,
                "output_throughput_tok_per_s": 10.0 + p.index,
            },
        )
        for p in suite.points()
    ]


def test_points_differing_only_in_recent_window_have_their_own_series(pushgateway):
    a, b = _records("run-window")
    assert a["point_id"] != b["point_id"] and a["policy"] == b["policy"] == "scissorhands"
    pusher = SweepPusher(pushgateway, "run-window")
    assert pusher.push_point(a) and pusher.push_point(b)
    assert _series(pushgateway, "scissorhands_sweep_kv_cache_bytes", "run-window") == {
        a["point_id"]: 1000,
        b["point_id"]: 1001,
    }


def test_a_resumed_run_keeps_the_series_pushed_before_the_resume(pushgateway, tmp_path):
    a, b = _records("run-resume")
    path = str(tmp_path / "points.jsonl")
    first = PointPublisher(path, SweepPusher(pushgateway, "run-resume"), done=0, planned=2)
    first(a)  # the run stops after its first point
    resumed = PointPublisher(path, SweepPusher(pushgateway, "run-resume"), done=1, planned=2)
    resumed(b)
    assert _series(pushgateway, "scissorhands_sweep_output_throughput_tokens_per_second", "run-resume") == {
        a["point_id"]: 10.0,
        b["point_id"]: 11.0,
    }
    assert _series(pushgateway, "scissorhands_sweep_points_completed", "run-resume") == {"": 2}
    # the largest completed batch still counts the point recorded before the resume
    assert resumed.pusher._max_batch == {("scissorhands", "2", "", "tiny-llama"): 1}


def test_after_resume_of_a_quality_run_the_earlier_points_keep_their_series(pushgateway, tmp_path):
    """the quality runner (`--local`, tiny model), stopped after its first point's
    record and resumed, pushes the rest; every point, the earlier one included, has its series."""
    import yaml

    from workloads.quality import runner

    suite = tiny_suite(
        "quality", name="q", compression_ratios=[1, 3], perplexity={"tokens": 32, "windows": 1}, replicas=1
    )
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(dict(suite, policies=["full"])))  # the first run: one point
    args = ["--local", "--pushgateway", pushgateway, "--results-dir", str(tmp_path / "r")]
    assert runner.main([str(path), *args, "--run-id", "q-resume"]) == 0
    [first] = results.read_records(str(tmp_path / "r" / "q-resume" / "points.jsonl"))
    path.write_text(yaml.safe_dump(suite))  # resumed with the whole suite
    assert runner.main([str(path), *args, "--resume", "q-resume"]) == 0
    records = results.read_records(str(tmp_path / "r" / "q-resume" / "points.jsonl"))
    assert len(records) == 3 and records[0]["point_id"] == first["point_id"]
    pushed = _series(pushgateway, "scissorhands_sweep_perplexity", "q-resume")
    assert pushed == {r["point_id"]: pytest.approx(r["perplexity"]) for r in records}
