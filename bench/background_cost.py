"""What a background load costs a training loop on few cores.

Runs the plain loop (`bench/plain_loop.py`) alone and beside `--processes` processes that
together use `--share` of the machine in short bursts, as Ray's daemons and helper actors do
beside a Ray Train worker, alternating the two `--rounds` times, and measures the share the
load took. A loop whose step runs on two intra-op threads waits at every op for the slower
thread, so a burst that takes one core from it stalls the other as well. Appends a table to
bench/results/startup.md.

    python -m bench.background_cost --share 0.09 --processes 15 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import time

import psutil

from bench.common import BIN, REPO, machine, publish, results_file

PERIOD_S = 0.25  # each background process wakes 4 times a second, as Ray's periodic work does


def burn(burst_s: float, stop) -> None:
    """Spin for `burst_s` of CPU, sleep out the rest of the period; until `stop` is set."""
    while not stop.is_set():
        start = time.process_time()
        while time.process_time() - start < burst_s:
            pass
        time.sleep(max(0.0, PERIOD_S - burst_s))


def plain(args) -> float:
    cmd = [
        str(BIN / "python"),
        "-m",
        "bench.plain_loop",
        "--data",
        args.data,
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])["tokens_per_s"]


def with_load(args) -> tuple[float, float]:
    """(the loop's tokens/s, the share of the machine the load took meanwhile, measured)."""
    stop = mp.Event()
    burst = args.share * psutil.cpu_count() * PERIOD_S / args.processes
    procs = [mp.Process(target=burn, args=(burst, stop), daemon=True) for _ in range(args.processes)]
    for p in procs:
        p.start()
    watched = [psutil.Process(p.pid) for p in procs]
    try:
        start, cpu = time.time(), sum(sum(w.cpu_times()[:2]) for w in watched)
        rate = plain(args)
        took = (sum(sum(w.cpu_times()[:2]) for w in watched) - cpu) / (time.time() - start) / psutil.cpu_count()
        return rate, took
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib-bpe")
    p.add_argument("--share", type=float, default=0.09, help="the machine's CPU the background takes")
    p.add_argument("--processes", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=0, help="the loop's torch threads; 0: all cores")
    p.add_argument("--results", default=results_file("startup"))
    args = p.parse_args()
    rows = [(plain(args), *with_load(args)) for _ in range(args.rounds)]
    ratios = [loaded / alone for alone, loaded, _ in rows]
    threads = args.threads or psutil.cpu_count(logical=False)
    text = "\n".join(
        [
            f"\n## Background load against the plain loop, {time.strftime('%Y-%m-%d %H:%M')} ({machine()})\n",
            f"`python -m bench.background_cost --share {args.share} --processes {args.processes} --rounds "
            f"{args.rounds} --threads {args.threads}`: {threads} thread(s), micro-batch {args.batch}, "
            f"{args.steps} steps; the load is {args.share:.0%} of the machine in {args.processes} processes.\n",
            "| round | alone, tokens/s | beside the load, tokens/s | ratio | the load's measured share |",
            "|---|---:|---:|---:|---:|",
            *[f"| {i + 1} | {a:,.0f} | {b:,.0f} | {b / a:.3f} | {took:.1%} |" for i, (a, b, took) in enumerate(rows)],
            f"\nMedian ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}).\n",
        ]
    )
    publish(text, args.results)


if __name__ == "__main__":
    main()
