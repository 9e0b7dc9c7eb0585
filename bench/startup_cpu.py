"""Where a run's start-up goes, in CPU-seconds per process, next to its wall-clock breakdown.

Runs `kiln train` (the demo config by default) while sampling every process on the machine
(psutil), and adds up the CPU time each kind of process (the driver, Ray's daemons, each Ray
actor class, Kiln's workers) had spent by the run's first optimizer step. On a machine with
few cores start-up is CPU-bound: the sum over processes, divided by the cores, is the floor on
its wall time, and this says which processes make it up. A timeline says when each process
started and took its role, and how busy the machine's cores were every 2 s: where they idle,
start-up waits on a chain of process starts rather than on CPU. Appends both to bench/results/startup.md.

    python -m bench.startup_cpu                    # demo config, 10 steps
    python -m bench.startup_cpu --set parallel.num_workers=1 --set parallel.cpus_per_worker=2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.common import BIN, REPO, machine, publish, results_file
from kiln.clock import STARTUP, startup_breakdown


def sample(stop: threading.Event, seen: dict, busy: list, interval: float = 0.2) -> None:
    """Every `interval`: each process's (sample time, cumulative CPU seconds, kind) into `seen`,
    and the machine's (sample time, CPU seconds busy over all cores) into `busy`."""
    me = os.getpid()
    while not stop.is_set():
        now = time.time()
        cores = psutil.cpu_times()
        busy.append((now, cores.user + cores.nice + cores.system + cores.irq + cores.softirq))
        for p in psutil.process_iter(["pid", "create_time", "cmdline", "name", "cpu_times"]):
            try:
                if p.info["pid"] == me or p.info["cpu_times"] is None:
                    continue
                cpu = p.info["cpu_times"].user + p.info["cpu_times"].system
                key = (p.info["pid"], p.info["create_time"])
                seen.setdefault(key, []).append((now, cpu, kind(p.info["cmdline"] or [p.info["name"]], p.name())))
            except (psutil.Error, TypeError):
                continue
        stop.wait(interval)


def kind(cmdline: list[str], name: str) -> str:
    """A process's role, as its command line or Ray's process title says."""
    line = " ".join(cmdline)
    if name.startswith("ray::") or line.startswith("ray::"):
        return re.sub(r"[ .].*", "", (line if line.startswith("ray::") else name))
    for tag in (
        "kiln train",
        "gcs_server",
        "raylet",
        "dashboard.py",
        "dashboard_agent",
        "runtime_env",
        "log_monitor",
        "monitor.py",
        "default_worker.py",
        "ray-dashboard",
    ):
        if tag in line or tag in name:
            return tag
    return "other: " + os.path.basename(cmdline[0])[:40]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="jobs/configs/debug.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra Kiln override, repeatable")
    p.add_argument("--results", default=results_file("startup"))
    args = p.parse_args()
    seen: dict = {}
    busy: list = []
    stop = threading.Event()
    before = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/summary.json"
        sets = [f"train.max_steps={args.steps}", f"logging.run_name=startup-{int(before)}", *args.sets]
        cmd = [
            str(BIN / "kiln"),
            "train",
            "--config",
            args.config,
            "--summary-json",
            out,
            *[a for s in sets for a in ("--set", s)],
        ]
        sampler = threading.Thread(target=sample, args=(stop, seen, busy), daemon=True)
        sampler.start()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop.set()
        sampler.join()
        metrics = json.loads(Path(out).read_text())["metrics"]
    first_step = metrics[f"{STARTUP}first_step_unix"]
    by_kind: collections.Counter = collections.Counter()
    started = []  # (created, role reached at, role, CPU-s) of each process the run started
    for (_, created), samples in seen.items():
        upto = [(t, cpu, k) for t, cpu, k in samples if t <= first_step]
        if not upto:
            continue
        if created < before - 1:  # running before the command (the OS, other work): their growth
            by_kind["processes older than the run (their CPU meanwhile)"] += upto[-1][1] - samples[0][1]
            continue
        role = role_of([k for _, _, k in upto])
        by_kind[role] += upto[-1][1]
        started.append((created - before, next(t for t, _, k in upto if k == role) - before, role, upto[-1][1]))
    # One section, published once: publish puts each call's text first in the file, so a second
    # call put the timeline above its own section's heading.
    timeline = report_timeline(sorted(started), [(t - before, b) for t, b in busy if t <= first_step])
    publish("\n".join(report(args, metrics, by_kind) + timeline) + "\n", args.results)


def role_of(kinds: list[str]) -> str:
    """A process's role from its kinds over time: a Ray worker starts under the raylet's name,
    idles, runs an actor or tasks, and may idle again; its role is what it last ran."""
    ran = [k for k in kinds if k not in ("ray::IDLE", "raylet")]
    return ran[-1] if ran else kinds[-1]


def report(args, metrics: dict, by_kind: collections.Counter) -> list[str]:
    wall = sum(s for _, s in startup_breakdown(metrics))
    total, cores = sum(by_kind.values()), psutil.cpu_count()
    lines = [
        f"\n## Start-up CPU, {time.strftime('%Y-%m-%d %H:%M')} ({machine()})\n",
        f"`python -m bench.startup_cpu --config {args.config} --steps {args.steps}"
        + "".join(f" --set {s}" for s in args.sets)
        + "`\n",
        f"Command start to first step: {wall:.1f} s wall; {total:.1f} CPU-s over all processes, "
        f"{total / cores:.1f} s on {cores} cores if perfectly spread.\n",
        "wall: " + ", ".join(f"{what} {s:.1f} s" for what, s in startup_breakdown(metrics)) + "\n",
        "| process | CPU-s by the first step |",
        "|---|---:|",
    ]
    return lines + [f"| {k.replace('|', '/')} | {v:.1f} |" for k, v in by_kind.most_common() if v >= 0.1]


def report_timeline(started: list, busy: list, bin_s: float = 2.0) -> list[str]:
    """The processes that used at least 0.3 CPU-s by the first step, in the order they
    started, and the machine's busy share per `bin_s`."""
    cores = psutil.cpu_count()
    lines = [
        "\nTimeline (s after the command started; a Ray worker process takes its role once it has "
        "started and imported what the role needs):\n",
        "| process | started | role taken | CPU-s by the first step |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {role.replace('|', '/')} | {at:.1f} | {took:.1f} | {cpu:.1f} |"
        for at, took, role, cpu in started
        if cpu >= 0.3
    ]
    shares, mark = [], None
    for t, b in busy:
        if mark is None or t - mark[0] >= bin_s:
            if mark is not None:
                shares.append(f"{mark[0]:.0f}-{t:.0f} s {100 * (b - mark[1]) / (t - mark[0]) / cores:.0f}%")
            mark = (t, b)
    return [*lines, f"\nBusy share of the {cores} cores: " + ", ".join(shares) + "\n"]


if __name__ == "__main__":
    main()
