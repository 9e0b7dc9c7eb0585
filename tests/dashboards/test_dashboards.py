"""dashboards/: Prometheus config and alert rules checked and unit-tested by Debian's promtool,
and the Grafana dashboard generated from build_dashboard.py, querying only series that exist."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.ray.live_metrics import exported_names

REPO = Path(__file__).resolve().parents[2]
DASH = REPO / "dashboards"
sys.path.insert(0, str(DASH))
from build_dashboard import OUT, build, render  # noqa: E402

# Ray's own node series the dashboard uses (checked against a live endpoint in the integration
# test; the GPU ones appear on GPU nodes only).
RAY_NODE = {
    "ray_node_cpu_utilization",
    "ray_node_gpus_utilization",
    "ray_node_gram_used",
    "ray_node_network_receive_speed",
    "ray_node_network_send_speed",
}
PROMQL_WORDS = {
    "by",
    "max",
    "avg",
    "sum",
    "rate",
    "time",
    "abs",
    "and",
    "or",
    "quantile_over_time",
    "avg_over_time",
    "run",
    "rank",
    "Inf",
    "histogram_quantile",
    "le",
    "experiment",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("no `promtool` on PATH: `make test` installs Debian's prometheus package")
    return subprocess.run([tool, *args], capture_output=True, text=True, cwd=DASH, timeout=120)


def test_prometheus_config_and_rules_pass_promtool():
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "tests/alerts_test.yml"),
    ):
        out = promtool(*args)
        assert out.returncode == 0, (args, out.stdout + out.stderr)


def test_every_alert_has_a_unit_test_and_an_action():
    rules = yaml.safe_load((DASH / "alerts.yml").read_text())["groups"][0]["rules"]
    tests = yaml.safe_load((DASH / "tests/alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for group in tests for t in group["alert_rule_test"] if t.get("exp_alerts")}
    quiet = {t["alertname"] for group in tests for t in group["alert_rule_test"] if not t.get("exp_alerts")}
    names = {r["alert"] for r in rules}
    assert len(names) == 9 and names == tested == quiet
    for r in rules:
        assert len(r["annotations"]["description"]) > 80, r["alert"]  # says what to do


def test_a_broken_rule_fails_promtool(tmp_path):
    (tmp_path / "tests").mkdir()
    broken = (DASH / "alerts.yml").read_text().replace("> 0.95", "> 0.99")
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(DASH / "tests/alerts_test.yml", tmp_path / "tests/alerts_test.yml")
    out = promtool("test", "rules", str(tmp_path / "tests/alerts_test.yml"))
    assert out.returncode != 0 and "KilnDeviceMemoryNearLimit" in out.stdout + out.stderr


def metric_names(expr: str) -> set[str]:
    without_labels = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_labels) if w not in PROMQL_WORDS}


def unknown_metrics(dashboard: dict, alerts: list[dict]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]] + [r["expr"] for r in alerts]
    known = exported_names() | RAY_NODE
    return {n for e in exprs for n in metric_names(e)} - known


def test_dashboard_json_is_generated_and_queries_only_exported_series():
    assert OUT.read_text() == render(), "run `python dashboards/build_dashboard.py` and commit the JSON"
    dashboard = json.loads(OUT.read_text())
    alerts = yaml.safe_load((DASH / "alerts.yml").read_text())["groups"][0]["rules"]
    assert unknown_metrics(dashboard, alerts) == set()
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Loss",
        "Throughput",
        "MFU",
        "Step time breakdown",
        "Memory per rank",
        "Data wait share",
        "Checkpoints",
    } <= titles
    assert dashboard["templating"]["list"][1]["name"] == "run"
    # a panel on a series Kiln does not export is caught
    bad = build()
    bad["panels"][0]["targets"][0]["expr"] = 'ray_kiln_train_losss{run=~"$run"}'
    assert unknown_metrics(bad, alerts) == {"ray_kiln_train_losss"}
