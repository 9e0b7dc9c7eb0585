"""Evaluates every PromQL expression of the Grafana dashboard through Prometheus' HTTP API."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dashboards"))
from build_dashboard import GPU_ONLY, OUT  # noqa: E402
from render_panels import panel_expr, query_range  # noqa: E402


def dashboard_queries_without_data(prom: str, run: str, start: float, end: float) -> list[str]:
    """'panel / legend: expr' for each target with no data over [start, end] (GPU-only ones
    excepted on CPU), the run selector set to `run`."""
    dashboard = json.loads(OUT.read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = panel_expr(target["expr"], run)
            if any(g in expr for g in GPU_ONLY) and not torch.cuda.is_available():
                continue  # no GPU here to report them; on a GPU node they are checked like the rest
            if not query_range(prom, expr, start - 5, end + 30):
                empty.append(f"{panel['title']} / {target['legendFormat']}: {expr}")
    return empty
