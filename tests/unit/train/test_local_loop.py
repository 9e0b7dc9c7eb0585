"""The training loop is a plain function: run it in this process with DeepSpeed, no Ray."""

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.train.local import free_port

REPO = Path(__file__).resolve().parents[3]


def _run_local(byte_dataset, tmp_path, *overrides, ranks=1):
    launcher = [sys.executable, "-m", "kiln.train.local"]
    if ranks > 1:  # torchrun sets RANK/WORLD_SIZE/MASTER_* for each process
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                    "--master-port", str(free_port()), "-m", "kiln.train.local"]
    cmd = [*launcher, "--config", str(REPO / "jobs/configs/debug.yaml"),
           "--set", f"data.path={byte_dataset}", "--set", "train.max_steps=30", "--set", "train.eval_every=15",
           "--set", "schedule.warmup_steps=5", "--set", "train.micro_batch_size=8",
           "--set", f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "--set", "logging.experiment=local",
           "--set", f"train.storage_path={tmp_path}/runs", *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


@pytest.mark.parametrize("zero_stage, ranks", [(3, 1), (2, 2)], ids=["single-process-zero3", "torchrun-2-ranks-zero2"])
def test_loop_trains_without_ray(byte_dataset, tmp_path, zero_stage, ranks):
    out = _run_local(byte_dataset, tmp_path, f"parallel.zero_stage={zero_stage}", ranks=ranks)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "import ray" not in out.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("local").experiment_id])[0]
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert run.data.params["parallel.zero_stage"] == str(zero_stage)
    assert run.data.tags["kiln.launcher"] == "local"
    assert run.data.params["parallel.num_workers"] == str(ranks)  # the world size torchrun gave
    assert (tmp_path / "runs" / run.info.run_name / "step_00000030" / "latest").is_file()
    assert "val loss" in out.stdout and "unigram entropy" in out.stdout
