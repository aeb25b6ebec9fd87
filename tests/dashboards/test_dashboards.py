"""Dashboards, provisioning and Prometheus config, checked without servers (metrics against the
catalogue, datasources). The live checks (every panel returns data, metrics against the exporters, quantile accuracy) are in
test_metrics_prometheus.py."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import connect, local_head, serve_app
from dashboards import check, serve
from replica.metrics import (
    METRICS,
    PAGED_LAYOUT_METRICS,
    PREFIX_CACHE_METRICS,
    SERVE_METRICS,
    catalogue_markdown,
    strip_sample_suffix,
)

ROOT = Path(__file__).resolve().parents[2]
DASH = ROOT / "dashboards"
BOARDS = check.load_dashboards()
DS_VAR = "${datasource}"


def test_there_are_two_dashboards_with_unique_uids():
    assert set(BOARDS) == {"sweep-overview.json", "live-replicas.json"}
    uids = [b["uid"] for b in BOARDS.values()]
    assert len(set(uids)) == len(uids) and all(uids)
    for board in BOARDS.values():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        assert len(list(check.iter_panels(board))) >= 10


# --------------------------------------------------------------------------- datasources
def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


@pytest.mark.parametrize("file", sorted(BOARDS))
def test_no_literal_datasource_uid_and_every_panel_uses_the_variable(file):
    board = BOARDS[file]
    text = (DASH / "grafana" / "dashboards" / file).read_text()
    assert "DS_PROMETHEUS" not in text and "__inputs" not in board  # no import-time placeholders
    # every datasource reference anywhere in the JSON is the variable
    for path, key, value in _walk(board):
        if key == "datasource":
            if isinstance(value, dict):
                assert value == {"type": "prometheus", "uid": DS_VAR}, (path, value)
            else:
                assert value == DS_VAR, (path, value)
        if key == "uid" and path != "":
            assert value == DS_VAR, f"literal uid {value!r} at {path}"
    # the variable exists and is a Prometheus datasource picker
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == {"type": "prometheus", "uid": DS_VAR}
    # every panel, and every one of its targets, names the variable
    for panel in check.iter_panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_VAR}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": DS_VAR}
            assert target["expr"].strip()


def test_import_into_a_grafana_with_another_datasource_uid():
    """Resolve every datasource reference as Grafana does on import: through the variable only."""
    other_uid = "P1809F7CD0C75ACF3"  # some other Grafana's Prometheus
    for board in BOARDS.values():
        resolved = json.loads(json.dumps(board).replace(DS_VAR, other_uid))
        refs = [v for _, k, v in _walk(resolved) if k == "datasource" and isinstance(v, dict)]
        assert refs and all(r["uid"] == other_uid for r in refs)


# --------------------------------------------------------------------------- metrics against the catalogue
def test_promql_metric_name_extraction():
    expr = (
        'histogram_quantile(0.99, sum by (le, policy) (rate(ray_x_seconds_bucket{run_id=~"$run_id", '
        'a="b{c}"}[$__rate_interval]))) / ignoring(policy) group_left scissorhands_y_bytes{p="full"} '
        "+ 1e3 * time() - on(le) z offset 5m"
    )
    assert check.metric_names(expr) == {"ray_x_seconds_bucket", "scissorhands_y_bytes", "z"}
    assert check.metric_names('label_join(m{a="x"}, "series", " x", "policy")') == {"m"}
    assert check.metric_names("sum(foo) by (bar) and baz") == {"foo", "baz"}


def test_every_dashboard_metric_is_in_the_catalogue():
    exported = set()
    for spec in METRICS + SERVE_METRICS:
        exported |= {strip_sample_suffix(n) for n in spec.sample_names}
    used = {strip_sample_suffix(n) for n in check.dashboard_metric_names(BOARDS)}
    assert used, "no metric names found in the dashboards"
    assert used <= exported, f"unknown metrics in dashboards: {sorted(used - exported)}"
    # and every catalogue metric is shown somewhere (no dead exports, no Serve metric listed for nothing)
    missing = {strip_sample_suffix(m.exported_name) for m in METRICS + SERVE_METRICS} - used
    assert not missing, sorted(missing)


def test_no_panel_takes_a_mean_from_a_histogram_sum():
    histograms = {m.exported_name for m in METRICS + SERVE_METRICS if m.kind == "histogram"}
    assert check.inexact_sums(BOARDS, histograms) == []
    # every histogram's mean is shown, from its exact sum over its count
    used = check.dashboard_metric_names(BOARDS)
    for name in histograms - {m.exported_name for m in SERVE_METRICS}:  # Serve's: quantiles only
        assert {name + "_exact_sum_total", name + "_count"} <= used, name
    bad = {
        "x.json": {
            "panels": [
                {
                    "title": "mean",
                    "targets": [
                        {
                            "expr": "rate(ray_scissorhands_ttft_seconds_sum[1m]) / rate(ray_scissorhands_ttft_seconds_count[1m])"
                        }
                    ],
                }
            ]
        }
    }
    assert check.inexact_sums(bad, histograms) == ["x.json / mean: ray_scissorhands_ttft_seconds_sum"]


def _top_buckets() -> dict[str, float]:
    return {m.exported_name: m.buckets[-1] for m in METRICS + SERVE_METRICS if m.kind == "histogram"}


def test_every_quantile_panel_shows_the_inf_bucket_as_text():
    """Every `histogram_quantile` on a dashboard is NaN above its histogram's top bucket (never the top bound
    as a number), and its panel shows that NaN as "above the top bucket"."""
    assert check.unguarded_quantiles(BOARDS, _top_buckets()) == []
    exprs = [t["expr"] for b in BOARDS.values() for _, t in check.iter_targets(b) if "histogram_quantile" in t["expr"]]
    assert len(exprs) == 11  # p50 and p99 of TTFT, TPOT, prefill, decode step and HTTP; the deployment's p50
    # a raw quantile, and a guarded one whose panel lacks the text, are both refused
    call = "histogram_quantile(0.99, sum by (le) (rate(ray_scissorhands_ttft_seconds_bucket[1m])))"
    raw = {"x.json": {"panels": [{"title": "TTFT", "targets": [{"refId": "A", "expr": call}]}]}}
    assert check.unguarded_quantiles(raw, _top_buckets()) == [
        f"x.json / TTFT [A]: {call} is not guarded by its top bucket 100000",
        "x.json / TTFT [A]: no override showing NaN as 'above the top bucket (100,000 s)'",
    ]
    guarded = check.guard_quantile(call, 100_000.0)
    assert guarded == f"({call} < 100000 or ({call} >= 100000) * NaN)"
    raw["x.json"]["panels"][0]["targets"][0]["expr"] = guarded
    raw["x.json"]["panels"][0]["fieldConfig"] = {"overrides": [check.above_top_override("A", 100_000.0, "s")]}
    assert check.unguarded_quantiles(raw, _top_buckets()) == []
    # Serve's histograms count milliseconds: the text says seconds
    assert check.above_top_text(600_000.0, "ms") == "above the top bucket (600 s)"


def test_quantile_calls_are_found_whole():
    expr = "(histogram_quantile(0.5, sum by (le) (rate(a_bucket[1m]))) < 3) / histogram_quantile(0.9, b_bucket)"
    assert check.quantile_calls(expr) == [
        "histogram_quantile(0.5, sum by (le) (rate(a_bucket[1m])))",
        "histogram_quantile(0.9, b_bucket)",
    ]
    with pytest.raises(ValueError, match="unbalanced"):
        check.quantile_calls("histogram_quantile(0.5, sum(x)")


def test_template_substitution():
    values = {"run_id": "smoke-1", "policy": ".*", "datasource": "prometheus"}
    expr = 'rate(x{run_id="$run_id", policy=~"${policy}"}[$__rate_interval])'
    assert check.substitute(expr, values, "20s") == 'rate(x{run_id="smoke-1", policy=~".*"}[20s])'
    assert check.substitute('label_replace(x, "s", "$1 int$2", "b", "(.*);(.+)")', values) == (
        'label_replace(x, "s", "$1 int$2", "b", "(.*);(.+)")'
    )
    with pytest.raises(KeyError, match=r"\$nope"):
        check.substitute('x{a="$nope"}', values)


# --------------------------------------------------------------------------- provisioning, compose, config
def test_grafana_provisioning_points_at_the_dashboards():
    prov = DASH / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    [source] = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True and "uid" not in source
    assert source["url"] == "${SCISSORHANDS_PROMETHEUS_URL}"
    dp = yaml.safe_load((prov / "dashboards" / "scissorhands.yml").read_text())
    [provider] = dp["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "${SCISSORHANDS_GRAFANA_DASHBOARDS}"
    compose = yaml.safe_load((DASH / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    mounts = dict(v.rsplit(":", 2)[:2] if v.endswith(":ro") else v.split(":", 1) for v in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == env["SCISSORHANDS_GRAFANA_DASHBOARDS"]
    assert mounts["./grafana/provisioning"] == env["GF_PATHS_PROVISIONING"]
    assert env["SCISSORHANDS_PROMETHEUS_URL"] == "http://127.0.0.1:9090"
    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert set(compose["services"]) == {"prometheus", "pushgateway", "grafana"}
    assert "--web.listen-address=127.0.0.1:9090" in compose["services"]["prometheus"]["command"]
    assert "--web.listen-address=127.0.0.1:9091" in compose["services"]["pushgateway"]["command"]
    assert compose["services"]["prometheus"]["image"].endswith(":v2.42.0")


def test_prometheus_config_scrapes_ray_the_pushgateway_and_itself():
    config = yaml.safe_load((DASH / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["ray"]["file_sd_configs"][0]["files"] == [
        "/tmp/ray/prom_metrics_service_discovery.json",  # ray start --head
        "/tmp/scissorhands-ray/prom_metrics_service_discovery.json",  # the embedded Ray of make sweep
        "/tmp/scissorhands-cluster/prom_metrics_service_discovery.json",  # make cluster-up
        "/tmp/scissorhands-serve/prom_metrics_service_discovery.json",  # make serve (Ray Serve's own metrics)
    ]
    assert serve.CLUSTER_UP_SD_FILE == f"{local_head.DEFAULT_TEMP_DIR}/prom_metrics_service_discovery.json"
    assert serve.DEFAULT_SD_FILES == tuple(jobs["ray"]["file_sd_configs"][0]["files"])
    assert serve.EMBEDDED_RAY_SD_FILE == f"{connect.EMBEDDED_RAY_TEMP_DIR}/prom_metrics_service_discovery.json"
    assert serve.SERVE_SD_FILE == f"{serve_app.SERVE_RAY_TEMP_DIR}/prom_metrics_service_discovery.json"
    assert jobs["pushgateway"]["honor_labels"] is True
    assert jobs["pushgateway"]["static_configs"][0]["targets"] == ["127.0.0.1:9091"]
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["127.0.0.1:9090"]
    assert config["global"]["scrape_interval"] == "5s"
    rendered = yaml.safe_load(serve.render_config(19090, 19091, ("/tmp/a.json", "/tmp/b.json"), "1s"))
    jobs = {j["job_name"]: j for j in rendered["scrape_configs"]}
    assert jobs["ray"]["file_sd_configs"][0]["files"] == ["/tmp/a.json", "/tmp/b.json"]
    assert jobs["pushgateway"]["static_configs"][0]["targets"] == ["127.0.0.1:19091"]
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["127.0.0.1:19090"]
    assert rendered["global"]["scrape_interval"] == "1s"


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_config(tmp_path):
    rendered = tmp_path / "prometheus.yml"
    rendered.write_text(serve.render_config(19090, 19091))
    for path in (DASH / "prometheus.yml", rendered):
        out = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_monitoring_page_lists_every_panel():
    body = (ROOT / "docs" / "monitoring.md").read_text()
    for board in BOARDS.values():
        for panel in check.iter_panels(board):
            assert panel["title"] in body, f"docs/monitoring.md does not list panel {panel['title']!r}"
            for target in panel["targets"]:
                assert re.sub(r"\s+", " ", target["expr"]) in re.sub(r"\s+", " ", body.replace("\\|", "|"))


def test_the_http_row_shows_ray_serves_own_metrics():
    """the live dashboard has an HTTP row whose panels read Ray Serve's metrics
    (requests by status code, latency, queue and ongoing requests), shown in base units."""
    board = BOARDS["live-replicas.json"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert "HTTP (Ray Serve)" in rows
    start = next(i for i, p in enumerate(board["panels"]) if p.get("title") == "HTTP (Ray Serve)")
    http = [p for p in board["panels"][start + 1 :] if p["type"] != "row"]
    names = set().union(*(check.metric_names(t["expr"]) for p in http for t in p["targets"]))
    assert {strip_sample_suffix(n) for n in names} == {strip_sample_suffix(m.exported_name) for m in SERVE_METRICS}
    by_title = {p["title"]: p for p in http}
    assert "status_code" in by_title["HTTP requests/s by status code"]["targets"][0]["expr"]
    latency = by_title["HTTP request latency p50 / p99"]
    assert latency["fieldConfig"]["defaults"]["unit"] == "s"
    assert all(t["expr"].endswith("/ 1000") for t in latency["targets"])  # Serve's ms -> s


def test_paged_layout_panels_say_so_and_show_each_replica():
    """A panel of the paged layout's series (absent on the preallocated layout) is titled "(paged layout)", reads
    only those series, per replica, and says in its description that the preallocated layout has none; every
    other panel reads none of them (the live sweep test exempts exactly these panels from a batch sweep)."""
    board = BOARDS["live-replicas.json"]
    paged = {m.exported_name for m in METRICS if m.name in PAGED_LAYOUT_METRICS}
    seen = set()
    for panel in check.iter_panels(board):
        names = set().union(*(check.metric_names(t["expr"]) for t in panel["targets"]))
        if names & paged:
            assert names <= paged and panel["title"].endswith("(paged layout)"), panel["title"]
            assert "preallocated layout" in panel["description"], panel["title"]
            assert all(t["expr"].startswith("sum by (replica, ") for t in panel["targets"]), panel["title"]
            seen |= names
        else:
            assert "(paged layout)" not in panel["title"]
    assert seen == paged
    assert not any(
        names & paged
        for names in (check.metric_names(t["expr"]) for _, t in check.iter_targets(BOARDS["sweep-overview.json"]))
    )


def test_prefix_cache_panels_say_so_read_only_its_series_and_the_hit_rate_is_hits_over_admitted_tokens():
    """A panel of the prefix cache's series (absent with the cache off and on OpenVINO) is titled "(prefix cache)",
    reads only those series, per replica, and says that OpenVINO has none; the hit rate panel divides the hit
    tokens' rate by the hit + miss tokens' rate, in 0..1 (unit percentunit); the sweep overview reads none of them."""
    board = BOARDS["live-replicas.json"]
    prefix = {m.exported_name for m in METRICS if m.name in PREFIX_CACHE_METRICS}
    seen, titles = set(), []
    for panel in check.iter_panels(board):
        names = set().union(*(check.metric_names(t["expr"]) for t in panel["targets"]))
        if names & prefix:
            assert names <= prefix and panel["title"].endswith("(prefix cache)"), panel["title"]
            assert "openvino" in panel["description"] and "enable_prefix_caching" in panel["description"]
            assert all(t["expr"].startswith("sum by (replica, ") for t in panel["targets"]), panel["title"]
            seen |= names
            titles.append(panel["title"])
    assert seen == prefix and len(titles) == 3
    [rate] = [p for p in check.iter_panels(board) if p["title"] == "Prefix cache hit rate (prefix cache)"]
    expr = rate["targets"][0]["expr"]
    hit = expr.split(" / ")[0]
    assert "ray_scissorhands_prefix_cache_hit_tokens_total" in hit and "miss" not in hit
    assert expr.endswith(" + " + hit.replace("hit_tokens", "miss_tokens") + ")")
    assert rate["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert not any(
        names & prefix
        for names in (check.metric_names(t["expr"]) for _, t in check.iter_targets(BOARDS["sweep-overview.json"]))
    )


def test_monitoring_page_lists_the_catalogue_as_generated():
    """docs/monitoring.md carries `python -m replica.metrics`' table as is (our metrics and Ray Serve's)."""
    assert catalogue_markdown() in (ROOT / "docs" / "monitoring.md").read_text()


def test_the_sweep_overview_shows_slo_attainment_and_goodput_per_policy_against_the_load():
    """One panel for attainment (0..1) and one for goodput (req/s), each reading only its pushed series, one bar per
    policy x ratio at each load, the load taken from whichever load label the point's mode sets; the table of points
    shows attainment and both goodputs."""
    board = BOARDS["sweep-overview.json"]
    panels = {p["title"]: p for p in check.iter_panels(board)}
    wanted = {
        "SLO attainment vs load, per policy": ("scissorhands_sweep_slo_attainment_ratio", "percentunit"),
        "Goodput vs load, per policy": ("scissorhands_sweep_goodput_requests_per_second", "reqps"),
    }
    for title, (name, unit) in wanted.items():
        panel = panels[title]
        [target] = panel["targets"]
        assert check.metric_names(target["expr"]) == {name}
        assert '"load", "", "batch_size", "concurrency", "request_rate"' in target["expr"]
        assert panel["fieldConfig"]["defaults"]["unit"] == unit
        [grouping] = panel["transformations"]
        assert grouping["options"] == {"columnField": "series", "rowField": "load", "valueField": "Value"}
    assert (
        panels["SLO attainment vs load, per policy"]["fieldConfig"]["defaults"] | {"min": 0, "max": 1}
        == (panels["SLO attainment vs load, per policy"]["fieldConfig"]["defaults"])
    )
    table = set().union(*(check.metric_names(t["expr"]) for t in panels["Points of the run"]["targets"]))
    assert {
        "scissorhands_sweep_slo_attainment_ratio",
        "scissorhands_sweep_goodput_requests_per_second",
        "scissorhands_sweep_goodput_tokens_per_second",
    } <= table
    # the catalogue reads them from the record keys the load generator's summary writes
    keys = {m.name: m.record_key for m in METRICS}
    assert keys["scissorhands_sweep_slo_attainment_ratio"] == "slo_attainment"
    assert keys["scissorhands_sweep_goodput_requests_per_second"] == "goodput_req_per_s"
    assert keys["scissorhands_sweep_goodput_tokens_per_second"] == "goodput_tok_per_s"


class FakePrometheus:
    """Instant queries answered from which metrics have samples now (per run) and within the lookback."""

    def __init__(self, now: dict[str, set[str]], recent: dict[str, set[str]]):
        self.now, self.recent = now, recent  # metric -> run ids with samples now / within the lookback

    def __call__(self, promql: str) -> list[float]:
        m = re.fullmatch(r'count\((?:last_over_time\()?(\w+)(?:\{run_id="([^"]+)"\})?(\[1h\]\))?\)', promql)
        assert m, promql
        seen = self.now if m.group(3) is None else {k: self.now.get(k, set()) | v for k, v in self.recent.items()}
        runs = seen.get(m.group(1), set())
        return [1.0] if (m.group(2) in runs if m.group(2) else runs) else []


def test_query_tells_panels_that_do_not_apply_or_whose_replicas_are_gone_from_broken_ones():
    prom = FakePrometheus(
        now={"scissorhands_point_ttft_seconds": {"serving-run"}, "scissorhands_point_decode_s": {"batch-run"}},
        recent={"scissorhands_replica_running_sequences": {"serving-run"}},
    )
    ttft = 'scissorhands_point_ttft_seconds{run_id="serving-run", policy=~".*"}'
    assert check.classify(ttft, "serving-run", prom) == "BROKEN"  # its metric is there for the run: the query is wrong
    decode = 'max(scissorhands_point_decode_s{run_id="serving-run"})'
    assert check.classify(decode, "serving-run", prom) == "N/A"  # only another run (a batch sweep) exported it
    live = 'sum(scissorhands_replica_running_sequences{run_id="serving-run"})'
    assert check.classify(live, "serving-run", prom) == "GONE"  # a live gauge whose replicas ended
    assert check.classify("sum(scissorhands_never_exported_total)", None, prom) == "N/A"


def test_live_panels_keep_each_engine_apart_and_say_which_series_openvino_lacks():
    """Ours' full cache and OpenVINO's are both policy ``full``: every live panel that groups by policy also groups
    by ``engine`` (else the two would be summed), filters on the ``$engine`` variable and names the engine in its
    legend; the panels of series OpenVINO's pipeline does not report say so (replica/backends/openvino.py)."""
    board = BOARDS["live-replicas.json"]
    assert [v["name"] for v in board["templating"]["list"]][:4] == ["datasource", "run_id", "engine", "policy"]
    grouped = 0
    for panel, target in check.iter_targets(board):
        expr = target["expr"]
        if "ray_scissorhands_" not in expr:
            continue
        assert 'engine=~"$engine"' in expr, panel["title"]
        for by in re.findall(r"by \(([^)]*)\)", expr):
            if "policy" in by.split(", "):
                assert "engine" in by.split(", "), (panel["title"], by)
                grouped += 1
        if "{{policy}}" in target.get("legendFormat", ""):
            assert "{{engine}} {{policy}}" in target["legendFormat"], panel["title"]
    assert grouped >= 30
    lacking = {m.exported_name for m in METRICS if m.source == "ray"} & {
        f"ray_scissorhands_{n}"
        for n in ("preemptions_total", "recomputed_tokens_total", "evicted_tokens_total", "decode_batch_size_count")
    }
    for panel in check.iter_panels(board):
        names = set().union(*(check.metric_names(t["expr"]) for t in panel["targets"]))
        if names & lacking:
            assert "Engine openvino (OpenVINO GenAI's pipeline) reports none of these" in panel["description"]
