"""`kiln train` on the embedded Ray prints Kiln's lines only, and its summary last: Ray's and
DeepSpeed's output goes to the run's workers.log, which the summary names. The same run carries
planted secrets (in the environment, a URL and the DeepSpeed passthrough), and nothing it
prints or writes (console, workers.log, checkpoints, the MLflow store and artifacts) holds one."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bad_inputs"))
from cases import DS_SECRET, DS_SET, ENV_SECRETS, TOKEN_USER  # noqa: E402

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[3]
KILN = str(Path(sys.executable).parent / "kiln")
KILN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ kiln[\w.]*: ")  # the driver's and the router's format


def test_the_demo_console_is_kilns_own_lines_ending_in_the_summary(byte_dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")} | ENV_SECRETS
    out = subprocess.run(
        [
            KILN,
            "train",
            "--config",
            str(REPO / "jobs/configs/debug.yaml"),
            "--set",
            f"data.path={byte_dataset}",
            "--set",
            "train.max_steps=40",
            "--set",
            "train.eval_every=20",
            "--set",
            "train.eval_batches=4",  # the config's 0 is the whole split: 100 batches a rank each time
            "--set",
            "train.checkpoint_every=40",
            "--set",
            DS_SET,
            "--set",
            f"data.s3_endpoint=http://{TOKEN_USER}@127.0.0.1:9",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
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

    # No planted secret in anything the run printed or wrote (the MLflow store's bytes included),
    # nor in `kiln runs list` over that store.
    listed = subprocess.run(
        [KILN, "runs", "list", "--experiment", "kiln-demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "debug" in listed.stdout, listed.stderr[-2000:]
    # The same as JSON, the experiment from MLflow's own variable.
    as_json = subprocess.run(
        [KILN, "runs", "list", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env | {"MLFLOW_EXPERIMENT_NAME": "kiln-demo"},
        timeout=120,
    )
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    (run,) = json.loads(as_json.stdout)
    assert run["status"] == "FINISHED" and run["params"]["train.max_steps"] == "40", run
    assert run["metrics"]["loss/val"] > 0 and len(run["run_id"]) == 32
    # The summary's own figures are in MLflow too, its text and the worker log as artifacts.
    said = run["metrics"]
    assert 0 < said["time/first_step_s"] < 600 and said["data/unigram_entropy_bits"] > 0, said
    assert said["time/startup/first_step_s"] > 0 and said["time/startup/preflight_s"] > 0, said
    artifacts = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert [a for a in artifacts if a.endswith("/artifacts/summary.txt")], sorted(artifacts)
    assert [a for a in artifacts if a.endswith("/artifacts/logs/workers.log")], sorted(artifacts)
    secrets = [*ENV_SECRETS.values(), DS_SECRET, TOKEN_USER]
    assert not [s for s in secrets if s in out.stdout + listed.stdout + listed.stderr]
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"mlflow.db", "workers.log"}
    assert not [(p, s) for p in written for s in secrets if s.encode() in p.read_bytes()]
