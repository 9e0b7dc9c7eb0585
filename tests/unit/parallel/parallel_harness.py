"""Run several parallel configurations in one process group; rank 0 writes what each did.

Started by the tests beside it (`launch`) as one process, or under torchrun with N ranks:

    torchrun --nproc-per-node 2 tests/unit/parallel/parallel_harness.py OUT.json DATA ROOT SPECS.json

SPECS.json is a list of {"name": ..., "set": ["a.b=c", ...], "dtypes": bool, "state": bool}
("state": resume `train.resume_from` only, and write the engine's whole fp32 weights and
optimizer state, gathered, to ROOT/<name>.pt). Every run uses the
debug flavour in fp32 (unless set), fixed seeds and the same data order, through the same
`train_loop` that Ray Train and the local launcher call. One process group serves all runs, so
the costly start-up (torch, DeepSpeed, gloo) is paid once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.core.checkpoint import CheckpointPolicy, model_card
from kiln.core.loop import train_loop
from kiln.core.sinks import Sinks
from kiln.data.check import resolve_against_data
from kiln.data.sources import ParquetSource
from kiln.launch.local import _world_from_env
from kiln.launch.preflight import check_init_from
from kiln.parallel.deepspeed_engine import inner_optimizer
from kiln.parallel.engine import build_engine
from kiln.parallel.fsdp2_engine import gathered_state as fsdp2_gathered_state
from kiln.parallel.zero_checkpoint import gathered_state
from kiln.plan.memory import estimate, plan_input
from kiln.plan.throughput import data_parallel_bytes
from kiln.topology import ParallelDims

BASE = [
    "model.flavour=debug",
    "train.precision=fp32",
    "train.micro_batch_size=4",
    "train.max_steps=20",
    "train.eval_every=0",
    "train.eval_batches=2",
    "schedule.warmup_steps=5",
    "optim.lr=3e-3",
    "logging.progress_every=100",
]


class Capture:
    """The MetricLogger interface, kept in memory."""

    def __init__(self):
        self.history: dict[int, dict[str, float]] = {}
        self.tags: dict[str, str] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.history.setdefault(step, {}).update(metrics)

    def set_tag(self, key: str, value: str) -> None:
        self.tags[key] = value

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_one(spec: dict, data: str, root: str, world) -> dict:
    overrides = [*BASE, f"data.path={data}", f"parallel.num_workers={world.world_size}", *spec.get("set", [])]
    if spec.get("base"):  # start from a Hugging Face checkpoint of that flavour (LoRA needs one)
        overrides.append(f"model.init_from={pretrained_base(spec['base'], data, root, world)}")
    cfg = load_config(None, overrides)
    shape = check_init_from(cfg)
    cfg, _ = resolve_against_data(cfg, shape)
    dims = ParallelDims.of(cfg.parallel, world.world_size)
    mcfg = cfg.model.shape(shape)
    source = ParquetSource(
        cfg_manifest(cfg),
        dims.coords(world.rank).data_parallel_rank,
        dims.data_parallel_size,
        cfg.train.micro_batch_size,
    )
    out: dict = {}
    if spec.get("state"):
        engine, _ = build_engine(cfg, mcfg, world)
        CheckpointPolicy(cfg.train, None, world.rank, world.world_size, model_card(cfg, mcfg)).resume(engine)
        full = gathered_state(engine.ds) if hasattr(engine, "ds") else fsdp2_gathered_state(engine)
        if world.rank == 0:
            torch.save(full, os.path.join(root, spec["name"] + ".pt"))
        return {"state": sorted(full)}
    if spec.get("dtypes"):  # one step, then what dtypes the engine keeps
        engine, _ = build_engine(cfg, mcfg, world)
        batch = next(source.train_batches())
        loss = engine.forward(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return {"dtypes": {k: sorted(v) for k, v in state_dtypes(engine).items()}}
    capture = Capture()
    engine, scheduler = build_engine(cfg, mcfg, world)
    source = RecordingSource(source)
    final = train_loop(
        cfg, mcfg, world, engine, scheduler, source, Sinks(logger=capture), os.path.join(root, spec["name"])
    )
    out["ids"] = all_ranks(source.ids)  # every rank's micro-batches' sample ids, in the order read
    out["loss"] = [capture.history[s]["loss/train"] for s in sorted(capture.history)]
    out["steps"] = sorted(capture.history)
    out["comm_bytes"] = [capture.history[s].get("comm/bytes_per_step") for s in sorted(capture.history)]
    out["final"] = final
    planned = plan_input(cfg, mcfg, 1.0)
    est = estimate(planned)
    out["planned"] = {
        "params": est.params,
        "optimizer_states": est.optimizer_states,
        "comm_bytes": data_parallel_bytes(planned, cfg.micro_batches_per_step),
    }
    module = engine.ds.module if hasattr(engine, "ds") else engine.model
    out["trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    out["params"] = sum(p.numel() for p in module.parameters())
    return out


def pretrained_base(flavour: str, data: str, root: str, world) -> str:
    """A Hugging Face checkpoint of `flavour` (seeded random weights, the data's tokenizer),
    written once by rank 0 with `kiln.hf_export`; its directory."""
    import torch.distributed as dist

    from kiln import hf_export
    from kiln.model import GPT, config_for, padded_vocab

    directory = Path(root) / f"base-{flavour}"
    if world.rank == 0 and not directory.exists():
        manifest = cfg_manifest(load_config(None, [f"data.path={data}"]))
        tokenizer = manifest.tokenizer()
        vocab = int(tokenizer.vocab_size)
        mcfg = config_for(flavour, vocab_size=padded_vocab(vocab), seq_len=manifest.seq_len)
        torch.manual_seed(1)
        model = GPT(mcfg)
        directory.mkdir(parents=True)
        hf_export.write(mcfg, model.state_dict(), tokenizer, vocab, directory)
    if dist.is_initialized():
        dist.barrier()
    return str(directory)


class RecordingSource:
    """A source that keeps the sample ids of each micro-batch it hands out (read-ahead too)."""

    def __init__(self, inner):
        self.inner, self.ids = inner, []

    def numbered_samples(self, skip: int = 0):
        for epoch, ids, tokens in self.inner.numbered_samples(skip):
            self.ids.append(ids.tolist())
            yield epoch, ids, tokens

    def train_batches(self, skip: int = 0):
        for _, _, tokens in self.numbered_samples(skip):
            yield tokens

    def __getattr__(self, name):
        return getattr(self.inner, name)


def all_ranks(obj) -> list:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def state_dtypes(engine) -> dict[str, set[str]]:
    """dtypes of the model weights at rest, the stepped (master) weights and the optimizer state."""
    opt = inner_optimizer(engine.ds) if hasattr(engine, "ds") else engine.optimizer
    module = engine.ds.module if hasattr(engine, "ds") else engine.model
    return {
        "params": {str(p.dtype) for p in module.parameters()},
        "stepped": {str(p.dtype) for g in opt.param_groups for p in g["params"]},
        "optimizer_state": {
            str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        },
    }


def cfg_manifest(cfg):
    from kiln.data.manifest import load_manifest
    from kiln.storage import resolve

    return load_manifest(resolve(cfg.data.path))


def launch(tmp: Path, name: str, specs: list, ranks: int, data: Path, timeout: int) -> dict:
    """Run `specs` in one process group of `ranks` ranks (torchrun; one plain process for 1),
    checkpoints under tmp/ckpt ("{root}" in a spec's settings); what each did, by name."""
    import subprocess

    root = tmp / "ckpt"
    specs = json.loads(json.dumps(specs).replace("{root}", str(root)))
    (tmp / f"{name}.json").write_text(json.dumps(specs))
    out = tmp / f"{name}.out.json"
    launcher = [sys.executable]
    if ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--standalone",  # its rendezvous on a port the OS picks as it binds: none to lose
        ]
    proc = subprocess.run(
        [*launcher, __file__, str(out), str(data), str(root), str(tmp / f"{name}.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def main(out_path: str, data: str, root: str, specs_path: str) -> int:
    from kiln.parallel.ops import init_distributed, shutdown_distributed

    logging.basicConfig(level=logging.WARNING)
    world = _world_from_env(use_gpu=False)
    init_distributed(on_cuda=False)
    results = {}
    for spec in json.loads(Path(specs_path).read_text()):
        results[spec["name"]] = run_one(spec, data, root, world)
    if world.rank == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out_path + ".tmp", out_path)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
