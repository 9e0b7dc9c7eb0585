"""Runs `kiln` commands the way a user does, fast: one Python process imports Kiln once, then
forks a child per case (fresh cwd, HOME, TMPDIR and environment; stdout and stderr to files),
so ~150 cases take a minute instead of the ~8 that 150 interpreter starts would.

The child is the real CLI (`kiln.cli.main`), with one change: `ray.init` records that it was
called and fails, since a bad input must be refused before Ray is contacted.

Each result has the exit code, the seconds the case took, and the child's peak resident set
(`wait4`'s ru_maxrss): the memory the command's process touched, the preloaded modules it
used included.

Run as `python harness.py CASES.json RESULTS.json`; `snapshot` lists a directory tree for the
before/after comparison.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

RAY_CONTACTED = "bad-input harness: ray.init was called"
CASE_TIMEOUT_S = 120


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root (itself excluded): kind, size, mtime and mode; contents are read
    separately where secrets are searched."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _preload() -> None:
    """Import what most commands import, once, before any fork."""
    import mlflow  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import ray
    import torch._dynamo  # noqa: F401 - its import makes torch's cache dir in $TMPDIR: once, here, not per case

    import kiln.cli  # noqa: F401
    import kiln.config  # noqa: F401
    import kiln.data.prepare  # noqa: F401
    import kiln.launch.on_ray  # noqa: F401
    import kiln.launch.preflight  # noqa: F401
    import kiln.sweep.run  # noqa: F401

    def refuse(*args, **kwargs):
        print(RAY_CONTACTED, file=sys.stderr, flush=True)
        raise ConnectionError(RAY_CONTACTED)

    ray.init = refuse


def _child(case: dict) -> None:
    import logging

    from kiln.cli import main

    os.chdir(case["cwd"])
    os.environ.clear()
    os.environ.update(case["env"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    import tempfile

    tempfile.tempdir = None  # read $TMPDIR afresh
    logging.root.handlers.clear()
    try:
        code = main(case["argv"])
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cases(cases: list[dict], parallel: int = 2) -> dict[str, dict]:
    """Each case in a forked child, `parallel` at a time (one per core of the 2-core CI)."""
    results: dict[str, dict] = {}
    running: dict[int, tuple[str, float]] = {}
    todo = list(cases)
    while todo or running:
        while todo and len(running) < parallel:
            case = todo.pop(0)
            pid = os.fork()
            if pid == 0:
                try:
                    _child(case)
                finally:
                    os._exit(99)
            running[pid] = (case["id"], time.time())
        for pid, (case_id, t0) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if not done and time.time() - t0 > CASE_TIMEOUT_S:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                results[case_id] = {"code": "timeout", "seconds": CASE_TIMEOUT_S, "peak_mb": 0}
                del running[pid]
            elif done:
                results[case_id] = {
                    "code": os.waitstatus_to_exitcode(status),
                    "seconds": round(time.time() - t0, 2),
                    "peak_mb": round(usage.ru_maxrss / 1024, 1),
                }
                del running[pid]
        time.sleep(0.005)
    return results


if __name__ == "__main__":
    _preload()
    todo = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_cases(todo)))
