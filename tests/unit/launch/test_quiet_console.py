"""`kiln train` on the embedded Ray prints Kiln's lines only, and its summary last: Ray's and
DeepSpeed's output goes to the run's workers.log, which the summary names."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
KILN = str(Path(sys.executable).parent / "kiln")
KILN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ kiln[\w.]*: ")  # the driver's and the router's format


def test_the_demo_console_is_kilns_own_lines_ending_in_the_summary(byte_dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    out = subprocess.run(
        [KILN, "train", "--config", str(REPO / "jobs/configs/debug.yaml"), "--set", f"data.path={byte_dataset}",
         "--set", "train.max_steps=40", "--set", "train.eval_every=20", "--set", "train.checkpoint_every=40"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-4000:]
    start = next(i for i, line in enumerate(lines) if line.startswith("Kiln run '"))
    summary, before = lines[start:], lines[:start]
    # The summary is last: every line after its first is one of its own indented fields.
    assert all(line.startswith("  ") for line in summary[1:]), summary
    assert summary[-1].startswith("  worker logs ")
    # Before it, only Kiln's own lines: no Ray report dicts, DeepSpeed notices or tracebacks.
    assert [line for line in before if not KILN_LINE.match(line)] == [], out.stdout[-4000:]
    assert len(lines) <= 40, out.stdout
    assert any("kiln.console: training debug" in line for line in before)
    assert any("step 40/40" in line for line in before)

    # What left the console is in the worker log, whole.
    log = Path(re.search(r"worker logs\s+(\S+)", summary[-1]).group(1))
    assert log.parent == tmp_path / "runs" / log.parent.name
    said = log.read_text()
    assert "TrainingReport(" in said and "Setting up process group" in said
    assert "kiln.console" in said  # Kiln's own worker lines are kept there too
