"""What ASHA saves: the example sweep run twice on the same grid, with ASHA and with every trial
run to the end (FIFO), on an embedded local Ray. Appends to bench/results/sweeps.md:

- compute: trial-steps ASHA ran over the trial-steps of the full sweep;
- quality: the best loss/val ASHA found against the best with every trial run to the end.

    python -m bench.sweep_asha                          (the 15-trial example, ~30 min on 2 cores)
    python -m bench.sweep_asha --set overrides.train.max_steps=20 --set scheduler.grace_period=5 \
        --set overrides.train.eval_every=5              (a quick CPU smoke)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, machine, publish, results_file

KILN = str(Path(sys.executable).parent / "kiln")


def run_sweep(sweep: str, scheduler: str, extra: list[str], tmp: Path, tracking: str) -> tuple[dict, float]:
    out = tmp / f"{scheduler}.json"
    cmd = [
        KILN,
        "sweep",
        "--config",
        sweep,
        "--summary-json",
        str(out),
        "--set",
        f"name=bench-{scheduler}-{int(time.time())}",
        "--set",
        f"scheduler.name={scheduler}",
        "--set",
        f"storage_path={tmp}/sweeps",
        "--set",
        f"overrides.logging.tracking_uri={tracking}",
        *extra,
    ]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"sweep with {scheduler} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), time.time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "jobs/configs/sweeps/optimizers-x-schedules.yaml"))
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a sweep-file field in both sweeps",
    )
    p.add_argument("--results", default=results_file("sweeps"))
    p.add_argument("--tracking-uri", default="", help="keep both sweeps' MLflow runs here (default: a temp store)")
    p.add_argument(
        "--asha-only",
        action="store_true",
        help="skip the FIFO sweep: report ASHA's trial-steps against the full budget, no quality comparison",
    )
    args = p.parse_args()
    extra = [x for o in args.overrides for x in ("--set", o)]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-sweep-") as tmp:
        tracking = args.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
        asha, asha_s = run_sweep(args.config, "asha", extra, Path(tmp), tracking)
        if args.asha_only:
            return report_asha_only(args, asha, asha_s)
        full, full_s = run_sweep(args.config, "fifo", extra, Path(tmp), tracking)

    def params(t: dict) -> str:
        return ", ".join(f"{v}" for _, v in sorted(t["params"].items()))

    saved = asha["trial_steps_run"] / full["trial_steps_full"]
    a_best, f_best = asha["best"], full["best"]
    rank_in_full = [params(t) for t in full["trials"]].index(params(a_best)) + 1
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — sweep: compute ASHA saved ({len(full['trials'])} trials)",
        "",
        f"Command: `python -m bench.sweep_asha {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| | trial-steps | share of the full sweep | wall s | best loss/val | best trial |",
        "|---|---:|---:|---:|---:|---|",
        f"| every trial to the end (FIFO) | {full['trial_steps_run']:,} | 1.00 | {full_s:.0f} | "
        f"{f_best['metric']:.4f} | {params(f_best)} |",
        f"| ASHA | {asha['trial_steps_run']:,} | {saved:.2f} | {asha_s:.0f} | {a_best['metric']:.4f} | "
        f"{params(a_best)} |",
        "",
        f"ASHA ran {100 * saved:.0f}% of the trial-steps, stopped "
        f"{sum(t['status'] == 'stopped early' for t in asha['trials'])} of {len(asha['trials'])} trials early, "
        f"and its best loss is {a_best['metric'] - f_best['metric']:+.4f} from the full sweep's best; its best "
        f"trial ranks {rank_in_full} of {len(full['trials'])} in the full sweep. Wall time also counts each "
        "trial's Ray Train start-up, which early stopping does not save.",
        "",
    ]
    text = "\n".join(lines)
    publish(text, args.results)


def report_asha_only(args: argparse.Namespace, asha: dict, asha_s: float) -> None:
    share = asha["trial_steps_run"] / asha["trial_steps_full"]
    best = asha["best"]
    rows = "\n".join(
        f"| {i} | {', '.join(str(v) for _, v in sorted(t['params'].items()))} | {t['metric']:.4f} | "
        f"{t['steps']} | {t['status']} |"
        for i, t in enumerate(asha["trials"], 1)
    )
    text = "\n".join(
        [
            f"## {time.strftime('%Y-%m-%d %H:%M')} — sweep: the example sweep with ASHA ({len(asha['trials'])} trials)",
            "",
            f"Command: `python -m bench.sweep_asha {' '.join(sys.argv[1:])}`  ",
            f"Machine: {machine()}",
            "",
            f"ASHA ran {asha['trial_steps_run']:,} of {asha['trial_steps_full']:,} trial-steps ({share:.2f} of the "
            f"full budget) in {asha_s:.0f} s, stopping {sum(t['status'] == 'stopped early' for t in asha['trials'])} of "
            f"{len(asha['trials'])} trials early. Best loss/val {best['metric']:.4f}: "
            f"{', '.join(str(v) for _, v in sorted(best['params'].items()))}. Trial-steps count what each trial "
            "really trained (read back from its MLflow run). The FIFO half was not run (`--asha-only`), so "
            "this does not say how close ASHA's best is to the best with every trial run to the end.",
            "",
            "| rank | optimizer, schedule | best loss/val | steps | status |",
            "|---:|---|---:|---:|---|",
            rows,
            "",
        ]
    )
    publish(text, args.results)


if __name__ == "__main__":
    main()
