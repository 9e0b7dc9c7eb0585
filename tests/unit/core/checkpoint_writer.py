"""Test helper for test_checkpoint_kill.py: a real DeepSpeed engine (debug GPT, ZeRO-2, Adam
state) that checkpoints through kiln.core.checkpoint.

    python checkpoint_writer.py write ROOT        # save step 1, 2, ... until killed
    python checkpoint_writer.py load ROOT...      # resume each root; print {root: step} as JSON
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from kiln.config import load_config
from kiln.core import checkpoint
from kiln.core.optim import build_scheduler
from kiln.launch.local import _world_from_env
from kiln.parallel.deepspeed_engine import DeepSpeedEngine
from kiln.parallel.engine import initialize


def engine():
    cfg = load_config(
        None,
        [
            "model.flavour=debug",
            "model.vocab_size=512",
            "model.seq_len=64",
            "parallel.num_workers=1",
            "parallel.zero_stage=2",
            "train.precision=fp32",
        ],
    )
    _world_from_env(use_gpu=False)
    ds, _ = initialize(
        cfg,
        cfg.model.shape(),
        1,
        device=torch.device("cpu"),
        scheduler_fn=lambda opt: build_scheduler(opt, cfg.schedule, cfg.train.max_steps),
    )
    eng = DeepSpeedEngine(ds, pipeline=False)
    # One real step, so the checkpoint carries Adam's moments as well as the weights.
    x = torch.randint(0, 512, (2, 65))
    loss = eng.forward(x[:, :-1], x[:, 1:])
    eng.backward(loss)
    eng.step()
    return eng


def main() -> None:
    mode, roots = sys.argv[1], sys.argv[2:]
    eng = engine()
    if mode == "write":
        print("ready", flush=True)
        for step in itertools.count(1):
            checkpoint.save(eng, roots[0], step, rank=0, world_size=1, client_state={"step": step})
            print(f"saved {step}", flush=True)
    loaded = {}
    for root in roots:
        resume = checkpoint.resolve_resume(root, world_size=1)
        directory, step = resume.directory, resume.step
        client = eng.load(directory)
        assert client["step"] == step, (client["step"], step)
        loaded[root] = step
    print(json.dumps(loaded), flush=True)


if __name__ == "__main__":
    main()
