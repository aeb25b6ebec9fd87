"""`python -m bench.bench_detokenizer` prints its conditions, one row per length and the ratio."""

from bench import bench_detokenizer


def test_prints_the_per_token_cost_per_length_and_their_ratio(capsys):
    assert bench_detokenizer.main(["--lengths", "20,200", "--window", "10", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Conditions: ") and "threads: 1" in out[0]
    rows = [line for line in out if line.startswith("| 20 |") or line.startswith("| 200 |")]
    assert len(rows) == 2 and all(float(r.split("|")[2]) > 0 for r in rows)
    assert out[-1].startswith("Ratio 200 / 20 tokens: add ")
