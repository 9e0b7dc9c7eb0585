"""What a resize's reshard costs and keeps, on one device: a checkpoint written at each ZeRO stage,
loaded back once as it is and once through DeepSpeed's universal checkpoint (the path a resume on
another number of workers takes, `DeepSpeedEngine.load(reshard=True)`).

For each stage it reports the seconds of the plain load and of the resharding load (conversion
by `ds_to_universal`, then DeepSpeed's universal load), whether the gathered fp32 weights and
optimizer moments after the resharding load equal those after the plain one, and the largest
loss difference over the next steps. One process, no Ray or MLflow, so it runs on a lent GPU box:

    python -m bench.gpu_reshard --device cuda --flavour gpt2-124m --precision bf16 --out OUT.md
    python -m bench.gpu_reshard --device cpu --flavour debug --precision fp32 --stages 1,3   (CPU smoke)
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch

from kiln.config import load_config
from kiln.launch.local import _world_from_env
from kiln.parallel.engine import build_engine
from kiln.parallel.ops import init_distributed
from kiln.parallel.zero_checkpoint import gathered_state

log = logging.getLogger("bench.gpu_reshard")


def _config(args, stage: int):
    sets = [
        f"model.flavour={args.flavour}",
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq_len}",
        f"train.precision={args.precision}",
        f"parallel.zero_stage={stage}",
        f"train.micro_batch_size={args.batch}",
        f"parallel.use_gpu={'true' if args.device == 'cuda' else 'false'}",
        "train.max_steps=100",
        "schedule.warmup_steps=2",
    ]
    if args.precision == "bf16":
        sets.append("train.mixed_precision=weights")  # DeepSpeed's bf16 weights: the layout that needs converting
    return load_config(None, sets)


def _steps(engine, batches) -> list[float]:
    losses = []
    for x in batches:
        loss = engine.forward(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _timed_load(cfg, mcfg, world, directory: str, reshard: bool):
    engine, _ = build_engine(cfg, mcfg, world)
    sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.load(directory, reshard=reshard)
    sync()
    return engine, time.perf_counter() - t0


def one_stage(args, stage: int, world) -> dict:
    cfg = _config(args, stage)
    mcfg = cfg.model.shape()
    gen = torch.Generator().manual_seed(stage)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(world.device)
        for _ in range(args.steps * 2)
    ]
    engine, _ = build_engine(cfg, mcfg, world)
    _steps(engine, batches[: args.steps])
    with tempfile.TemporaryDirectory(prefix="kiln-reshard-bench-") as root:
        engine.save(root, {})
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        del engine
        plain, plain_s = _timed_load(cfg, mcfg, world, root, reshard=False)
        want = gathered_state(plain.ds)
        resharded, reshard_s = _timed_load(cfg, mcfg, world, root, reshard=True)
        got = gathered_state(resharded.ds)
    diff = (
        max((got[k].float() - want[k].float()).abs().max().item() for k in want)
        if got.keys() == want.keys()
        else float("inf")
    )
    after = [abs(a - b) for a, b in zip(_steps(plain, batches[args.steps :]), _steps(resharded, batches[args.steps :]))]
    return {
        "stage": stage,
        "checkpoint_mb": size / 2**20,
        "plain_load_s": plain_s,
        "reshard_load_s": reshard_s,
        "state_max_diff": diff,
        "states": len(want),
        "loss_max_diff": max(after),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--flavour", default="gpt2-124m")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=4, help="steps before the checkpoint, and again after each load")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--out", default=None, help="append the table to this Markdown file")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    world = _world_from_env(use_gpu=args.device == "cuda")
    init_distributed(on_cuda=args.device == "cuda")
    rows = [one_stage(args, int(s), world) for s in args.stages.split(",")]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [
        f"{args.flavour}, {args.precision}, micro-batch {args.batch} x {args.seq_len}, {args.steps} steps, {device}",
        "",
        "| ZeRO | checkpoint MB | plain load s | resharding load s | gathered state max diff | "
        "loss max diff, next steps |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['stage']} | {r['checkpoint_mb']:,.0f} | {r['plain_load_s']:.2f} | {r['reshard_load_s']:.2f} | "
        f"{r['state_max_diff']:.3g} ({r['states']} tensors) | {r['loss_max_diff']:.3g} |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    log.warning("\n%s", text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
