"""Screenshot the MLflow UI comparing the trials of one Kiln sweep (headless Chromium).

    python -m bench.screenshot_mlflow --tracking-uri sqlite:///runs/bench-mlflow.db \
        --experiment kiln-sweeps --sweep NAME --out runs/mlflow-sweep-compare.png

Starts `mlflow server` on loopback, opens its compare-runs page for the sweep's child runs, and
checks through MLflow's REST API that the page's runs are the sweep's trials before it shoots.
Needs Debian's chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from kiln.launch.local import free_port  # noqa: E402

BIN = Path(sys.executable).parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracking-uri", required=True)
    p.add_argument("--experiment", default="kiln-sweeps")
    p.add_argument("--sweep", required=True)
    p.add_argument("--out", default="runs/mlflow-sweep-compare.png")
    p.add_argument("--size", default="1600,1100")
    args = p.parse_args()
    chromium = shutil.which("chromium") or sys.exit("chromium not found: apt-get install chromium")
    port = free_port()
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            args.tracking_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        exp = _api(base, "experiments/get-by-name", {"experiment_name": args.experiment})["experiment"]
        runs = _api(
            base,
            "runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "filter": f"tags.`kiln.sweep` = '{args.sweep}'",
                "max_results": 100,
            },
            post=True,
        ).get("runs", [])
        tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
        children = [r["info"]["run_id"] for r, t in zip(runs, tags) if "mlflow.parentRunId" in t]
        if not children:
            sys.exit(f"no trials of sweep {args.sweep!r} in experiment {args.experiment!r}")
        query = urllib.parse.urlencode(
            {"runs": json.dumps(children), "experiments": json.dumps([exp["experiment_id"]])}
        )
        url = f"{base}/#/compare-runs?{query}"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    "--hide-scrollbars",
                    f"--window-size={args.size}",
                    "--virtual-time-budget=30000",
                    f"--screenshot={Path(args.out).resolve()}",
                    url,
                ],
                check=True,
                capture_output=True,
                timeout=180,
            )
        print(f"wrote {args.out}: {len(children)} trials of sweep {args.sweep!r} at {url}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def _api(base: str, path: str, params: dict, post: bool = False) -> dict:
    url = f"{base}/api/2.0/mlflow/{path}"
    if post:
        req = urllib.request.Request(
            url, data=json.dumps(params).encode(), headers={"Content-Type": "application/json"}
        )
    else:
        req = urllib.request.Request(f"{url}?{urllib.parse.urlencode(params)}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


if __name__ == "__main__":
    main()
