"""grafana/populora-dashboard.json reads only metrics that a run exports, and shows each of them.

That a run really exports each of these names on its Prometheus endpoint is checked in
tests/test_integration.py::test_training_metrics_reach_the_prometheus_endpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from driver.telemetry import exported_metrics

ROOT = Path(__file__).resolve().parents[1]
METRIC = re.compile(r"\bray_[a-z_]+\b")
LABELS = {"member", "role", "phase", "SessionName"}  # the gauges' tags, and the one Ray adds


def _dashboard() -> dict:
    return json.loads((ROOT / "grafana/populora-dashboard.json").read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_every_panel_query_names_an_exported_metric():
    exported = exported_metrics()
    panels = _panels(_dashboard())
    assert panels
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            assert names, f"panel {panel['title']!r}: query {target['expr']!r} names no ray_ metric"
            assert names <= exported, \
                f"panel {panel['title']!r}: {sorted(names - exported)} not exported (exported: {sorted(exported)})"
            grouped = {label.strip() for by in re.findall(r"by \(([^)]*)\)", target["expr"]) for label in by.split(",")}
            filtered = set(re.findall(r"([A-Za-z_]+)\s*(?:=~|!~|!=|=)\s*\"", target["expr"]))
            assert grouped | filtered <= LABELS, f"panel {panel['title']!r}: unknown label in {target['expr']!r}"
            assert target["datasource"] == panel["datasource"] == "${datasource}"


def test_every_exported_metric_has_a_panel_and_the_variables_read_exported_metrics():
    dashboard = _dashboard()
    shown = {name for panel in _panels(dashboard) for t in panel["targets"] for name in METRIC.findall(t["expr"])}
    assert shown == exported_metrics(), f"no panel for {sorted(exported_metrics() - shown)}"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert set(METRIC.findall(variable["definition"])) <= exported_metrics(), variable["definition"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
