"""Kiln's torch backend for Ray Train (kiln.ray.process_group): what the Train controller is handed
unpickles without torch. The process group it sets up is what every multi-worker run trains over
(the demo, tests/integration)."""

import subprocess
import sys
from pathlib import Path

import ray.cloudpickle
from ray.train.torch import TorchConfig

from kiln.config import load_config
from kiln.model import config_for
from kiln.ray.process_group import ProcessGroupConfig
from kiln.ray.trainer import build_trainer

REPO = Path(__file__).resolve().parents[3]

# A fresh interpreter, as the controller's process is: does unpickling import torch?
UNPICKLE = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"


def _imports_torch(blob: bytes) -> bool:
    out = subprocess.run([sys.executable, "-c", UNPICKLE], input=blob, capture_output=True, timeout=120, check=True)
    return out.stdout.decode().strip() == "True"


def test_the_train_controller_unpickles_its_config_and_callbacks_without_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")  # build_trainer sets it; restored after
    for use_gpu, backend in ((False, "gloo"), (True, "nccl")):
        cfg = load_config(REPO / "jobs/configs/debug.yaml", [f"parallel.use_gpu={str(use_gpu).lower()}"])
        trainer = build_trainer(
            cfg, config_for("debug"), "t", f"sqlite:///{tmp_path}/m.db", None, storage_path=str(tmp_path)
        )
        assert trainer.backend_config == ProcessGroupConfig(backend=backend)
        # What fit() hands the controller actor, besides the training function's object ref.
        handed = ray.cloudpickle.dumps((trainer.train_run_context, trainer._create_default_callbacks()))
        assert not _imports_torch(handed)
    assert _imports_torch(ray.cloudpickle.dumps(TorchConfig()))  # Ray's own does: the check can fail
