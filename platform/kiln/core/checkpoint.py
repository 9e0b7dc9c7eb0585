"""Checkpoints that count only once complete.

DeepSpeed writes each rank's shards with plain `torch.save` and points its `latest` file at a
tag before every rank has finished, so a writer killed midway leaves a directory that looks like
a checkpoint and is not one. Kiln therefore:

- writes a checkpoint into `step_N.partial/` and renames it to `step_N/` only after this rank's
  DeepSpeed files are closed and its completion marker is written (a rename is atomic on a local
  filesystem; under Ray Train the directory then goes to storage through `ray.train.report`,
  which registers it only after the upload);
- writes one marker per rank, `kiln_complete.rank<r>.json`, last, holding the step and the
  world size; a checkpoint is complete when every rank's marker is there and agrees;
- keeps each rank's RNG states (`kiln_rng.rank<r>.pt`: torch, CUDA, numpy, random), written
  before its marker, so dropout after a resume draws what the uninterrupted run drew;
- resumes only from complete checkpoints: `latest_complete(root)` skips partial or unmarked
  ones, and an explicit `train.resume_from` that is incomplete is refused with its name.

`CheckpointPolicy` is the loop's side: when to evaluate and save, and what a save does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln import guard
from kiln.core.collectives import barrier
from kiln.core.config import TrainConfig
from kiln.core.engine import Engine
from kiln.core.resize import Regroup, Written, batch_card, regroup
from kiln.errors import ConfigError
from kiln.storage import is_url

if TYPE_CHECKING:  # the config composes this module's sections: a type here, never an import
    from kiln.config import RunConfig
    from kiln.core.sinks import Restored
    from kiln.model import GPTConfig

log = logging.getLogger(__name__)

TAG = "state"  # DeepSpeed's tag: the subdirectory holding the shards
MARKER = "kiln_complete.rank{rank}.json"
RNG = "kiln_rng.rank{rank}.pt"
CARD = "kiln_model.json"  # rank 0's: the model's shape and where its data (and tokenizer) is
STEP_DIR = re.compile(r"^step_(\d{8})$")
RAY_DIR = re.compile(r"^checkpoint_\d{4}-\d\d-\d\d_")  # Ray Train's name for a registered checkpoint
CHECKPOINT = "checkpoint"  # the write guard's kind for a step_N directory
SCORE = "loss/val"  # what `keep_checkpoints_by: loss/val` ranks by, lowest best


def model_card(cfg: RunConfig, mcfg: GPTConfig) -> dict:
    """What a checkpoint records of its model: the GPT's shape, how it was sharded, and the
    dataset whose manifest names the tokenizer. Secrets are masked (an endpoint's userinfo)."""
    from dataclasses import asdict

    from kiln.redact import redact_tree

    d = cfg.data
    return redact_tree(
        {
            "format": 1,
            "gpt": asdict(mcfg),
            **layout_card(cfg),
            "data": {"path": d.path, "s3_endpoint": d.s3_endpoint, "s3_region": d.s3_region},
        }
    )


def lora_card(cfg: RunConfig) -> dict:
    """A LoRA checkpoint holds the adapters alone: the card names them and the base they adapt,
    which `kiln export` reads the frozen weights from (with the data's S3 endpoint)."""
    from dataclasses import asdict

    m = cfg.model
    return {"lora": asdict(m.lora), "init_from": m.init_from} if m.lora.on else {}


def layout_card(cfg: RunConfig) -> dict:
    """The part of the card a resume is judged by: how the state was sharded, its precision
    layout and its batch."""
    return {
        "parallel": {
            "engine": cfg.parallel.engine,
            "zero_stage": cfg.parallel.zero_stage,
            "pipeline_stages": cfg.parallel.pipeline_stages,
            "tensor_parallel": cfg.parallel.tensor_parallel,
        },
        "precision": precision_record(cfg),
        "batch": batch_card(cfg),
        "optimizer": cfg.optim.name,
        **lora_card(cfg),
    }


def precision_record(cfg: RunConfig) -> dict:
    """What decides the layout of DeepSpeed's optimizer state: the precision, and for bf16
    whether it ran as autocast over fp32 weights or as DeepSpeed's bf16 weights. FSDP2 keeps fp32
    weights and state in every precision (`fp32_weights`)."""
    record = {"precision": cfg.train.precision, "bf16_autocast": cfg.autocast}
    return record | ({"fp32_weights": True} if cfg.parallel.engine == "fsdp2" else {})


def _check_precision(directory: str, had: dict | None, want: dict) -> None:
    """Refuse a resume across weight layouts (DeepSpeed would fail inside its load with a
    KeyError). fp32 and bf16 autocast share one (fp32 weights, the torch optimizer's state), so
    an fp32 run resumes under autocast. `had`: the checkpoint card's record; cards written before
    the record say nothing and are not checked."""
    if had is None or _layout(had) == _layout(want):
        return
    raise ConfigError(
        f"train.resume_from = {directory!r} was written with {_words(had)}; this run has {_words(want)}, "
        "and DeepSpeed's optimizer state differs between them: set train.precision and "
        "train.mixed_precision as the checkpoint had them"
    )


def _layout(record: dict) -> str:
    fp32 = record["precision"] == "fp32" or record["bf16_autocast"] or record.get("fp32_weights", False)
    return "fp32 weights" if fp32 else record["precision"]


def _words(record: dict) -> str:
    if record["precision"] != "bf16":
        return f"train.precision = {record['precision']!r}"
    return f"train.precision = 'bf16' as {'autocast' if record['bf16_autocast'] else 'weights'}"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def save(
    engine: Engine,
    root: str,
    step: int,
    rank: int,
    world_size: int,
    client_state: dict,
    score: float | None = None,
    card: dict | None = None,
) -> str:
    """Write the engine's state for `step` under `root`; return the completed directory.
    `score` (the validation loss at this step) goes into the marker, for `prune(by="loss/val")`;
    `card` (rank 0's) describes the model, so that `kiln export` needs nothing but the directory."""
    final = step_dir(root, step)
    partial = final + ".partial"
    if rank == 0 and os.path.isdir(partial):
        guard.discard(partial, CHECKPOINT)  # a writer killed earlier at this step marked it
    barrier(world_size)
    os.makedirs(partial, exist_ok=True)
    guard.mark(partial, CHECKPOINT)  # every rank: under Ray each may write its own local copy
    engine.save(partial, client_state)
    _save_rng(os.path.join(partial, RNG.format(rank=rank)))
    if rank == 0 and card is not None:
        _write_synced(os.path.join(partial, CARD), json.dumps(card, indent=2))
    marker = {"step": step, "world_size": world_size, "rank": rank, "tag": TAG}
    if score is not None:
        marker[SCORE] = score
    _write_synced(os.path.join(partial, MARKER.format(rank=rank)), json.dumps(marker))
    barrier(world_size)  # every rank's marker is written before the directory appears
    try:
        guard.move(partial, final)
    except FileNotFoundError:
        if not os.path.isdir(final):  # another rank sharing this directory renamed it already
            raise
    except OSError:
        if not os.path.isdir(final):
            raise
    barrier(world_size)
    return final


def _save_rng(path: str) -> None:
    import random

    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def restore_rng(directory: str, rank: int) -> bool:
    """Set this process's RNGs to what rank `rank` had when it saved `directory`; False for a
    checkpoint without them (written before Kiln kept them)."""
    import random

    import numpy as np
    import torch

    path = os.path.join(directory, RNG.format(rank=rank))
    if not os.path.exists(path):
        return False
    state = torch.load(path, weights_only=False)  # Kiln's own file, in a checkpoint it completed
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def prune(root: str, keep: int, by: str = "newest") -> list[str]:
    """Delete all but `keep` complete checkpoints under root (keep 0: none deleted); return what
    was deleted. `by="newest"` keeps the newest; `by="loss/val"` keeps the lowest validation
    losses (a checkpoint without one ranks last) and the newest as well, since a resume starts
    there (as Ray Train does). Incomplete directories are left for `save` to clear or a human
    to inspect, and never count."""
    if keep <= 0:
        return []
    complete = [d for d in _step_dirs(root) if is_complete(d)]
    if by == "newest":
        doomed = complete[:-keep]
    else:

        def score(d: str) -> float:
            value = (_markers(d) or {}).get(SCORE)
            return float("inf") if value is None else float(value)

        kept = set(sorted(complete, key=score)[:keep]) | set(complete[-1:])
        doomed = [d for d in complete if d not in kept]
    for directory in doomed:
        # Rename first: a crash mid-delete leaves a `.partial`, never a half-deleted step_N.
        trash = directory + ".partial"
        guard.move(directory, trash)
        guard.discard(trash, CHECKPOINT, proofs=(MARKER.format(rank=0),))
    return doomed


def is_complete(directory: str) -> bool:
    return _markers(directory) is not None


def _markers(directory: str) -> dict | None:
    """The agreed {step, world_size} of a complete checkpoint, else None."""
    first = _read_marker(os.path.join(directory, MARKER.format(rank=0)))
    if first is None or not os.path.isdir(os.path.join(directory, first.get("tag", TAG))):
        return None
    for rank in range(1, int(first["world_size"])):
        other = _read_marker(os.path.join(directory, MARKER.format(rank=rank)))
        if other is None or (other["step"], other["world_size"]) != (first["step"], first["world_size"]):
            return None
    return first


def latest_complete(root: str) -> str | None:
    """The newest complete `step_N` directory under root, or None."""
    for directory in reversed(_step_dirs(root)):
        if is_complete(directory):
            return directory
        log.warning("skipping %s: it is not a complete checkpoint (a writer died while saving it)", directory)
    return None


def _step_dirs(root: str) -> list[str]:
    """Every `step_N` directory under root (complete or not), oldest first; [] if root is missing."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root)) if STEP_DIR.match(n)]  # zero-padded


def newest_reported(root: str) -> str | None:
    """The complete checkpoint of highest step among a Ray run's directory's: Ray Train stores
    what each rank reported as `checkpoint_<time>/` (the `step_N` contents, markers included)."""
    found = [
        (m["step"], d)
        for d in (os.path.join(root, n) for n in os.listdir(root) if RAY_DIR.match(n))
        if (m := _markers(d)) is not None
    ]
    return max(found)[1] if found else None


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run starts from, and how it continues it on its own layout."""

    directory: str
    step: int
    regroup: Regroup | None
    """Set where the checkpoint was written by another number of data-parallel replicas."""


def resolve_resume(path: str, world_size: int, card: dict | None = None, allow_batch_change: bool = False) -> Resume:
    """The checkpoint that train.resume_from names: a checkpoint directory, or a run's directory
    (the local launcher's `step_N`s, or Ray Train's `checkpoint_<time>`s) whose newest complete
    checkpoint is taken. `card`: this run's `layout_card` (None: a plain run, as many ranks,
    precision unchecked). Refuses anything incomplete, in another precision layout, or laid out
    in a way this run cannot continue (`kiln.core.resize.regroup`)."""
    directory, marker = find_checkpoint(path)
    card = card or {}
    had = _read_marker(os.path.join(directory, CARD)) or {}
    _check_engine(directory, had, card)
    _check_lora(directory, had, card)
    if card.get("precision") is not None:
        _check_precision(directory, had.get("precision"), card["precision"])
    if had.get("optimizer") and card.get("optimizer") and had["optimizer"] != card["optimizer"]:
        raise ConfigError(
            f"train.resume_from = {directory!r} was written with optim.name = {had['optimizer']!r}, and "
            f"its optimizer state is that optimizer's; this run has {card['optimizer']!r}: keep "
            "optim.name (its settings, such as optim.lr, may change)"
        )
    written = Written.of(marker, had)
    run = Written.of({"world_size": world_size}, card)
    return Resume(directory, int(marker["step"]), regroup(directory, written, run, allow_batch_change))


def find_checkpoint(path: str) -> tuple[str, dict]:
    """(directory, rank 0's marker) of the checkpoint `path` names: itself, or a run directory's
    newest complete one; refuses a path that holds none."""
    if not os.path.isdir(path):
        raise ConfigError(f"train.resume_from = {path!r}: no such directory")
    directory = (
        path
        if (os.path.exists(os.path.join(path, MARKER.format(rank=0))) or os.path.isdir(os.path.join(path, TAG)))
        else latest_complete(path) or newest_reported(path)
    )
    if directory is None:
        raise ConfigError(
            f"train.resume_from = {path!r}: holds no complete Kiln checkpoint "
            "(expected step_N or checkpoint_<time> directories with a kiln_complete marker per rank)"
        )
    marker = _markers(directory)
    if marker is None:
        raise ConfigError(
            f"train.resume_from = {directory!r} is incomplete: its writer died before every "
            "rank's kiln_complete marker was written; pick an earlier checkpoint"
        )
    return directory, marker


def engine_of(card: dict) -> str:
    """The engine a checkpoint card (or a run's `layout_card`) names; cards from before
    `parallel.engine` were DeepSpeed's."""
    return (card.get("parallel") or {}).get("engine", "deepspeed")


def _check_engine(directory: str, had: dict, card: dict) -> None:
    """Refuse a resume across engines: each writes its own checkpoint format (DeepSpeed's
    per-rank files, torch's distributed checkpoint)."""
    if not had or not card.get("parallel") or engine_of(had) == engine_of(card):
        return
    raise ConfigError(
        f"train.resume_from = {directory!r} was written by parallel.engine = {engine_of(had)!r}; this "
        f"run has {engine_of(card)!r}, and each engine loads its own checkpoint format: set "
        f"parallel.engine = {engine_of(had)!r}, or start from its weights with model.init_from after "
        "kiln export"
    )


def _check_lora(directory: str, had: dict, card: dict) -> None:
    """Refuse a resume between LoRA and full training, or onto other adapters: a LoRA
    checkpoint holds its adapters alone, a full one no adapters."""
    if not card.get("parallel") or had.get("lora") == card.get("lora"):
        return
    raise ConfigError(
        f"train.resume_from = {directory!r} was written with model.lora = {_adapters(had)}; this run has "
        f"{_adapters(card)}, and a checkpoint holds the weights its run trained: keep model.lora as it was, "
        "or start from its weights with model.init_from after kiln export"
    )


def _adapters(card: dict) -> str:
    lora = card.get("lora")
    return f"rank {lora['rank']} on {lora['targets']}" if lora else "off (every weight trained)"


def _read_marker(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run stands: steps done, micro-batches each replica had consumed (as the
    checkpoint counted them), and how it continues on another data-parallel size."""

    done: int
    consumed: int
    regroup: Regroup | None = None


class CheckpointPolicy:
    """When a run evaluates and saves, and what a save does: save, prune, remember for rollback.

    Every rank takes the same decisions: step counts are shared, and the time since the last
    save is averaged over ranks by the caller before `wants_save` sees it.
    """

    def __init__(
        self,
        t: TrainConfig,
        root: str | None,
        rank: int,
        world_size: int,
        card: dict | None = None,
        copy_remote: Callable[[str, str], str] | None = None,
    ):
        self.t, self.root, self.rank, self.world_size = t, root, rank, world_size
        # (uri, into) -> a local copy of an s3:// train.resume_from (kiln.core.remote_checkpoint)
        self.copy_remote = copy_remote
        self.card = card  # written into each checkpoint (see `save`)
        self.last_good: str | Callable[[], str] | None = None
        """What a rollback reloads: a directory, or under Ray a function that downloads one."""
        self._last_save = time.monotonic()

    def resume(self, engine: Engine, restored: Restored | None = None) -> Resumed:
        """Load `restored` (a restarted run's checkpoint, kept in storage), else
        `train.resume_from`, into the engine, for this run as its card describes it. A restored
        checkpoint's local copy is removed once loaded. The clock for time-based saves starts
        here."""
        self._last_save = time.monotonic()
        if restored is None and not self.t.resume_from:
            return Resumed(0, 0)
        card = self.card or {}
        copy = None  # a local copy of an s3:// train.resume_from, removed once loaded
        source = restored() if restored is not None else self.t.resume_from
        if restored is None and is_url(source) and self.copy_remote is not None:
            copy = guard.temp_dir(None, f"ckpt-{os.getpid()}")  # a dead worker's is removed by the next
            source = self.copy_remote(source, str(copy))
        try:
            resume = resolve_resume(source, self.world_size, card, self.t.allow_batch_change)
            client = engine.load(resume.directory, reshard=resume.regroup is not None and resume.regroup.reshard)
            restore_rng(resume.directory, self.rank)  # where this rank wrote one
        finally:
            if restored is not None:
                restored.release()
            if copy is not None:
                guard.discard(copy)
        done = int(client["step"])
        # The data position: micro-batches this replica drew so far, the ones the health guard
        # left out included (older checkpoints lack it: steps x micro-batches).
        consumed = int(
            client.get("batches_consumed", done * (card.get("batch") or {}).get("micro_batches_per_step", 1))
        )
        if self.rank == 0:
            log.info(
                "resumed from %s at step %d (micro-batch %d of the data)", restored or resume.directory, done, consumed
            )
        # a rollback before this run's first save reloads what it resumed from (not an s3:// one,
        # whose copy is gone: the health guard then stops the run instead)
        self.last_good = restored or (None if copy is not None else resume.directory)
        return Resumed(done, consumed, resume.regroup)

    def seconds_since_save(self) -> float:
        return time.monotonic() - self._last_save

    def wants_save(self, step: int, since_save: float) -> bool:
        t = self.t
        return bool(
            (t.checkpoint_every and step % t.checkpoint_every == 0)
            or step == t.max_steps
            or (t.checkpoint_every_minutes and since_save >= 60 * t.checkpoint_every_minutes)
        )

    def wants_eval(self, step: int, save: bool) -> bool:
        scored_save = save and self.t.keep_checkpoints_by == SCORE  # each checkpoint gets its score
        return bool((self.t.eval_every and step % self.t.eval_every == 0) or step == self.t.max_steps or scored_save)

    def save(self, engine: Engine, step: int, client_state: dict, score: float | None) -> tuple[str | None, float]:
        """(the checkpoint directory, seconds the save took); (None, 0) where nothing is kept."""
        if self.root is None:
            return None, 0.0
        start = time.perf_counter()
        ckpt = save(engine, self.root, step, self.rank, self.world_size, client_state, score, self.card)
        seconds = time.perf_counter() - start
        if self.rank == 0:  # after save's final barrier: every rank is done with the old ones
            prune(self.root, self.t.keep_checkpoints, self.t.keep_checkpoints_by)
        self._last_save = time.monotonic()
        self.last_good = ckpt
        return ckpt, seconds
