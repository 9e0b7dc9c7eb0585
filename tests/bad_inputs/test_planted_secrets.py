"""Every command that succeeds, run with secrets planted in the environment, the config, URLs
and the DeepSpeed passthrough: nothing it prints or writes holds one. (`kiln train`'s real run,
with its checkpoints and MLflow store, is checked the same way in
tests/unit/launch/test_quiet_console.py; the sweep's state file in tests/unit/sweep.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cases import DS_SECRET, DS_SET, ENV_SECRETS, PW, TOKEN_USER  # noqa: E402

from kiln.launch.local import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

KILN = str(Path(sys.executable).parent / "kiln")
REPO = Path(__file__).resolve().parents[2]
SECRETS = [*ENV_SECRETS.values(), PW, TOKEN_USER, DS_SECRET]


def test_no_command_prints_or_writes_a_planted_secret(tmp_path, corpus):
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "RAY_AUTH_MODE": "token",
        **ENV_SECRETS,
    }
    (ws / "c.yaml").write_text(
        "data:\n  path: ds\n  s3_endpoint: http://" + TOKEN_USER + "@127.0.0.1:9\n"
        "logging:\n  tracking_uri: sqlite:///m.db\n  run_name: planted\n"
        "parallel:\n  deepspeed:\n    aws_secret_access_key: " + DS_SECRET + "\n"
        "train:\n  max_steps: 50\n"
    )
    commands = [
        [
            "data",
            "prepare",
            "--input",
            corpus[0],
            "--output",
            "ds",
            "--tokenizer",
            "byte",
            "--seq-len",
            "32",
            "--s3-endpoint",
            f"http://kiln:{PW}@127.0.0.1:9",
        ],
        ["data", "verify", "ds", "--s3-endpoint", f"http://{TOKEN_USER}@127.0.0.1:9"],
        ["config", "--config", "c.yaml", "--set", f"logging.tracking_uri=http://kiln:{PW}@127.0.0.1:9"],
        ["plan", "--config", "c.yaml", "--set", DS_SET],
        ["lr", "plot", "--config", "c.yaml", "--out", "lr.png"],
        ["train", "--dry-run", "--config", "c.yaml", "--set", DS_SET],
        ["cluster", "check", str(REPO / "cluster/aws-gpu.yaml")],
        ["services", "up", "--dir", "svc", "--port", str(free_port())],
        ["services", "status", "--dir", "svc"],
        ["services", "down", "--dir", "svc"],
    ]
    said = []
    for argv in commands:
        out = subprocess.run([KILN, *argv], cwd=ws, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (argv, out.stderr[-3000:])
        said.append(out.stdout + out.stderr)
    assert "kiln train --dry-run: every pre-launch check passed" in said[5]
    assert "running" in said[8] and "stopped mlflow" in said[9]
    assert "aws_secret_access_key: '***'" in said[2] and "http://kiln:***@127.0.0.1:9" in said[2]

    assert not [(argv[0], s) for argv, text in zip(commands, said) for s in SECRETS if s in text]
    written = [p for p in [*ws.rglob("*"), *home.rglob("*")] if p.is_file()]
    assert {"manifest.json", "lr.png", "c.yaml", "mlflow.log", "mlflow.db"} <= {p.name for p in written}
    leaks = [(p.name, s) for p in written if p.name != "c.yaml" for s in SECRETS if s.encode() in p.read_bytes()]
    assert leaks == []
