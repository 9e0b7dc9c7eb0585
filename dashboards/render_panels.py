"""Renders the Kiln Grafana dashboard's panels to one PNG from a real Prometheus' data.

The same panels, queries, layout and legends as grafana/kiln-training.json, drawn with
matplotlib from Prometheus' HTTP API, for where Grafana cannot run and for a quick look at a finished run:

    python dashboards/render_panels.py --prometheus http://127.0.0.1:9090 --run debug-20261123-101500 \\
        --last 15m --out dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

from build_dashboard import OUT as DASHBOARD  # the committed dashboard JSON (beside this file)

# Grafana units -> (scale, axis label)
UNITS = {
    "percentunit": (100.0, "%"),
    "percent": (1.0, "%"),
    "bytes": (1 / 2**30, "GiB"),
    "s": (1.0, "s"),
    "Bps": (1 / 2**20, "MiB/s"),
    "none": (1.0, ""),
}


def query_range(prom: str, expr: str, start: float, end: float, step: str = "2s") -> list:
    """Prometheus' /api/v1/query_range result: [{"metric": labels, "values": [[t, "v"], ...]}]."""
    qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{qs}", timeout=30) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def panel_expr(expr: str, run: str, rate_interval: str = "10s") -> str:
    """A dashboard target with Grafana's variables filled in: the run selector and rate window."""
    return expr.replace("$run", run).replace("$__rate_interval", rate_interval)


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def render(prom: str, run: str, start: float, end: float, out: str | Path, step: str = "5s") -> dict[str, int]:
    """Draw every panel over [start, end] with the run selector set to `run`; return the number
    of series each panel drew (0 where Prometheus had no data, e.g. GPU panels on CPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    plt.style.use("dark_background")
    fig = plt.figure(figsize=(24, rows * 0.55), facecolor="#111217")
    grid = fig.add_gridspec(rows, 24, hspace=2.2, wspace=1.6, left=0.03, right=0.99, top=0.95, bottom=0.03)
    fig.suptitle(
        f"{dashboard['title']} — run {run}   ({time.strftime('%Y-%m-%d %H:%M', time.localtime(start))}"
        f" to {time.strftime('%H:%M', time.localtime(end))}, from Prometheus)",
        color="#d8d9da",
        fontsize=14,
        x=0.03,
        ha="left",
    )
    drawn: dict[str, int] = {}
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_subplot(grid[g["y"] : g["y"] + g["h"] - 1, g["x"] : g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        scale, unit = UNITS.get(p["fieldConfig"]["defaults"]["unit"], (1.0, ""))
        count = 0
        for target in p["targets"]:
            for series in query_range(prom, panel_expr(target["expr"], run), start, end, step):
                t = [float(ts) - start for ts, _ in series["values"]]
                v = [float(val) * scale for _, val in series["values"]]
                ax.plot(
                    t,
                    v,
                    linewidth=1.4,
                    marker="o" if len(v) < 30 else None,
                    markersize=3,
                    label=legend(target["legendFormat"], series["metric"])[:40],
                )
                count += 1
        drawn[p["title"]] = count
        ax.set_title(p["title"] + (f" ({unit})" if unit else ""), color="#d8d9da", fontsize=11, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=8)
        ax.grid(color="#2c3235", linewidth=0.6)
        for side in ax.spines.values():
            side.set_color("#2c3235")
        if count:
            ax.legend(fontsize=7, loc="best", framealpha=0.3)
            ax.set_xlabel("seconds since start", color="#8e8e8e", fontsize=8)
        else:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="#8e8e8e")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return drawn


def _seconds(text: str) -> float:
    n, unit = float(text[:-1]), text[-1]
    return n * {"s": 1, "m": 60, "h": 3600}[unit]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--run", required=True, help="the run name (the dashboard's run selector)")
    p.add_argument("--start", type=float, help="unix seconds (default: --last before --end)")
    p.add_argument("--end", type=float, help="unix seconds (default: now)")
    p.add_argument("--last", default="30m", help="window when --start is not given: 90s, 15m, 2h")
    p.add_argument("--out", default="dashboard.png")
    a = p.parse_args()
    end = a.end or time.time()
    start = a.start or end - _seconds(a.last)
    drawn = render(a.prometheus, a.run, start, end, a.out)
    empty = [t for t, n in drawn.items() if not n]
    print(
        f"wrote {a.out}: {len(drawn) - len(empty)} of {len(drawn)} panels with data"
        + (f" (no data: {', '.join(empty)})" if empty else "")
    )


if __name__ == "__main__":
    main()
