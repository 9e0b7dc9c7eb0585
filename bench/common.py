"""What every benchmark shares: the repository's paths, the machine line, and publishing a
section to its topic's results file (`bench/results/<topic>.md`, newest first)."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RESULTS = REPO / "bench" / "results"
TOPICS = ("throughput", "gpu", "data", "startup", "generation", "sweeps", "resize")


KILN_TRAIN = [str(BIN / "kiln"), "train"]  # on the embedded Ray
LOCAL = [sys.executable, "-m", "kiln.launch.local"]  # one process, or torchrun's


def train_summary(
    overrides: list[str], tmp: str, name: str, *, launcher: list[str] = KILN_TRAIN, env: dict[str, str] | None = None
) -> dict:
    """One run of jobs/configs/debug.yaml with `overrides` by `launcher`, in `tmp`: its summary
    (`--summary-json`); the bench ends with the run's stderr if it fails."""
    import json
    import subprocess

    out = f"{tmp}/{name}.json"
    cmd = [*launcher, "--config", str(REPO / "jobs/configs/debug.yaml")]
    cmd += [a for o in overrides for a in ("--set", o)] + ["--summary-json", out]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"run failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(out).read_text())


def results_file(topic: str) -> str:
    """The results file of `topic` (one of TOPICS)."""
    assert topic in TOPICS, topic
    return str(RESULTS / f"{topic}.md")


def publish(text: str, results: str) -> None:
    """Show a benchmark's section and put it first in its results file, after the file's header
    (the newest first), written whole: to a temporary file, then renamed over the old one."""
    sys.stdout.write(text)
    path = Path(results)
    old = path.read_text() if path.exists() else f"# {path.stem}\n\n"
    cut = old.find("\n## ")
    head, rest = (old, "") if cut < 0 else (old[: cut + 1], old[cut + 1 :])
    section = text.strip("\n") + "\n\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(head.rstrip("\n") + "\n\n" + section + rest)
    os.replace(tmp, path)


def machine() -> str:
    """This machine in one line: CPU, cores, RAM, Python, torch and any GPU."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    desc = f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()}"
    return desc
