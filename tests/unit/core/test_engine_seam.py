"""The loop reaches the model only through the `Engine` seam: a plain-torch engine of a dozen
lines (no DeepSpeed anywhere) trains, validates, checkpoints and resumes through the same
`train_loop` that runs DeepSpeed's engine."""

import os

import torch

from kiln.config import load_config
from kiln.core import checkpoint
from kiln.core.loop import train_loop
from kiln.core.optim import build_optimizer, build_scheduler
from kiln.core.process import WorldInfo
from kiln.core.sinks import Sinks
from kiln.data.check import resolve_against_data
from kiln.data.sources import ParquetSource
from kiln.model import GPT


class PlainEngine:
    """The `Engine` protocol over a plain GPT and a torch optimizer: what a second engine writes."""

    pipeline = False

    def __init__(self, model: GPT, opt: torch.optim.Optimizer, sched, accum: int):
        self.model, self.opt, self.sched, self.accum, self.micro = model, opt, sched, accum, 0

    def forward(self, inputs, targets):
        return self.model(inputs, targets)[1]

    def backward(self, loss):
        (loss / self.accum).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.accum == 0:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()

    def train_batch(self, pairs):
        raise AssertionError("no pipeline here")

    def eval_loss(self, inputs, targets):
        return self.forward(inputs, targets)

    def set_training(self, on):
        self.model.train(on)

    def save(self, directory, client_state):
        os.makedirs(os.path.join(directory, checkpoint.TAG), exist_ok=True)
        torch.save(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(),
                "client": client_state,
            },
            os.path.join(directory, checkpoint.TAG, "plain.pt"),
        )

    def load(self, directory, reshard=False):  # one process: nothing is partitioned, nothing to re-cut
        state = torch.load(os.path.join(directory, checkpoint.TAG, "plain.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        return state["client"]

    def set_micro_batches(self, n):
        raise AssertionError("one process never regroups")

    def grad_norm(self):
        return None

    def overflow(self):
        return 0, 0.0

    def measure_comm(self, on):
        pass

    def comm_metrics(self):
        return {}

    def memory(self):
        return {"memory/params_bytes": float(sum(p.numel() * p.element_size() for p in self.model.parameters()))}


def _run(cfg, mcfg, root):
    torch.manual_seed(cfg.train.seed)
    model = GPT(mcfg)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.schedule, cfg.train.max_steps)
    engine = PlainEngine(model, opt, sched, cfg.micro_batches_per_step)
    source = ParquetSource(
        cfg.data.path and resolve_against_data(cfg)[1], 0, 1, cfg.train.micro_batch_size, cfg.train.eval_batches
    )
    return train_loop(cfg, mcfg, WorldInfo(), engine, sched, source, Sinks(), root), model


def test_a_plain_torch_engine_trains_checkpoints_and_resumes_through_the_loop(byte_dataset, tmp_path):
    overrides = [
        f"data.path={byte_dataset}",
        "parallel.num_workers=1",
        "train.max_steps=6",
        "train.eval_every=3",
        "train.checkpoint_every=3",
        "train.eval_batches=2",
        "train.grad_accum_steps=2",
        "train.micro_batch_size=4",
        "logging.progress_every=1000",
        "train.health.policy=off",
    ]
    cfg, _ = resolve_against_data(load_config(None, overrides))
    mcfg = cfg.model.shape()
    final, whole = _run(cfg, mcfg, str(tmp_path / "a"))
    assert final["step"] == 6 and torch.isfinite(torch.tensor(final["loss/val"]))
    assert checkpoint.is_complete(str(tmp_path / "a" / "step_00000003"))
    # Resuming from step 3 through the same seam ends where the run without a stop ended.
    resumed_cfg, _ = resolve_against_data(
        load_config(None, [*overrides, f"train.resume_from={tmp_path}/a/step_00000003"])
    )
    _, resumed = _run(resumed_cfg, mcfg, str(tmp_path / "b"))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
