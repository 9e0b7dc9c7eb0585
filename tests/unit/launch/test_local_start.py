"""The local launcher's start-up order: validation's rows are read while DeepSpeed builds the
engine, not after it (the Ray worker, kiln.ray.trainer, keeps the same order)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# A user's script around the launcher, with the two calls recorded in the order they come.
SCRIPT = """
import json
import sys

import kiln.launch.local as local
from kiln.data.sources import OrderedSource

order = []
prefetch, build_engine = OrderedSource.prefetch, local.build_engine


def recorded_prefetch(self):
    order.append("validation read" if self._val_thread is None else "again")
    return prefetch(self)


def recorded_build_engine(*args, **kwargs):
    order.append("engine")
    return build_engine(*args, **kwargs)


OrderedSource.prefetch, local.build_engine = recorded_prefetch, recorded_build_engine
code = local.main(sys.argv[1:])
print(json.dumps({"code": code, "order": order}))
"""


def test_validation_is_read_while_the_engine_builds(byte_dataset, tmp_path):
    sets = [f"data.path={byte_dataset}", "train.max_steps=2", "train.micro_batch_size=4",
            f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"train.storage_path={tmp_path}/runs"]
    out = subprocess.run([sys.executable, "-c", SCRIPT, "--config", str(REPO / "jobs/configs/debug.yaml"),
                          *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.splitlines()[-1])
    assert said["code"] == 0
    # Started before the engine; the loop's own call later finds it started and does nothing.
    assert said["order"] == ["validation read", "engine", "again"]
