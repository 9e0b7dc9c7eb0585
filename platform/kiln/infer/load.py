"""A trained model, whole, from wherever it is: a Kiln checkpoint, a run, or an exported directory.

`kiln export`, `kiln generate` and the tests call `load_model`, which returns the GPT's shape,
its fp32 state dict in Kiln's names and its tokenizer.

A Kiln checkpoint is sharded as the run was (ZeRO 1-3 partitions the fp32 master weights and
optimizer state over ranks; a pipeline writes one file per layer). DeepSpeed's own
`zero_to_fp32` merges ZeRO shards; a pipeline's per-layer files and ZeRO-0's single module file
are read here, since DeepSpeed's tool covers neither.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import pydantic
import torch
from typing_extensions import NotRequired, TypedDict

from kiln import hf_checkpoint as hf
from kiln.core.checkpoint import CARD, MARKER, TAG, is_complete, latest_complete, newest_reported
from kiln.data.manifest import load_manifest
from kiln.data.tokenizer import Tokenizer, pretrained
from kiln.devices import name_deepspeed_accelerator
from kiln.errors import ConfigError, KilnError
from kiln.lora import LoraConfig
from kiln.model import GPT, GPTConfig, shape_problem
from kiln.parallel.fsdp2_engine import is_fsdp2_checkpoint, merged_state
from kiln.parallel.zero_checkpoint import is_zero_sharded, merged_fp32_state
from kiln.schemas import validated
from kiln.storage import resolve

log = logging.getLogger(__name__)
LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


@dataclass
class LoadedModel:
    cfg: GPTConfig
    state: dict[str, torch.Tensor]
    """fp32 weights in Kiln's names (lm_head is wte where the embeddings are tied)."""
    tokenizer: Tokenizer
    """A kiln.data.tokenizer tokenizer (vocab_size, eot_id, encode_batch, decode, hf_json)."""
    source: str
    """The directory the weights came from (a resolved run gives its newest checkpoint)."""
    vocab_size: int
    """The real vocab: rows past it are Kiln's padding to a multiple of 64, never targets, so
    never sampled and not exported."""
    adapters: dict[str, torch.Tensor] | None = None
    """A LoRA checkpoint's adapters, in Kiln's names (`state` has them merged already)."""
    lora: LoraConfig | None = None
    """And their rank, scale and targets."""
    base: str = ""
    """And the checkpoint they adapt (`model.init_from`)."""

    def build(self, device: str | torch.device = "cpu") -> GPT:
        """The GPT with these weights, in eval mode; weights that are not finite are refused
        (they would sample garbage, or fail deep inside the decode)."""
        for name, t in self.state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise KilnError(
                    f"{self.source}: weight {name!r} holds NaN or infinite values; this checkpoint "
                    "cannot generate (resume from an earlier one)"
                )
        model = GPT(self.cfg, init_weights=False)
        missing, unexpected = model.load_state_dict(self.state, strict=False)
        if self.cfg.tie_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]  # it is wte
        if missing or unexpected:
            raise KilnError(
                f"{self.source}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        return model.to(device).eval()


def load_model(spec: str) -> LoadedModel:
    """`spec`: a Hugging Face-format directory (config.json), a Kiln checkpoint directory, or a
    run's directory (its newest complete checkpoint)."""
    path = Path(spec)
    if not path.is_dir():
        raise ConfigError(
            f"--model {spec!r}: no such directory (expected a run's directory, a checkpoint "
            "directory or an exported Hugging Face directory)"
        )
    if (path / hf.CONFIG).exists():
        cfg = hf.read_config(path)
        tokenizer = hf_tokenizer(path, cfg.vocab_size)  # checked before the weights are read
        return LoadedModel(cfg, hf.load(path, cfg), tokenizer, str(path), cfg.vocab_size)
    ckpt = checkpoint_of(path)
    card = _card(ckpt)
    cfg = card["gpt"]
    try:
        state = consolidate(ckpt, cfg, card["parallel"]["pipeline_stages"], card["parallel"].get("tensor_parallel", 1))
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        raise KilnError(
            f"{ckpt}: its shards cannot be read (truncated, or not DeepSpeed's or torch's): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    tokenizer = _dataset_tokenizer(card, ckpt)
    loaded = LoadedModel(cfg, state, tokenizer, ckpt, int(tokenizer.vocab_size))
    return with_base(loaded, card) if "lora" in card else loaded


def with_base(loaded: LoadedModel, card: dict) -> LoadedModel:
    """A LoRA checkpoint's adapters merged into the base weights its card names: the model that
    computes what the adapted one did. The adapters stay on `adapters` for a PEFT export."""
    from kiln.lora import is_adapter, merge

    lora = LoraConfig(**card["lora"])
    data = card["data"]
    base_dir = card.get("init_from", "")
    try:
        base = hf.load(
            hf.init_from_dir(base_dir, data.get("s3_endpoint", ""), data.get("s3_region", "us-east-1")), loaded.cfg
        )
    except (ConfigError, OSError) as e:
        raise ConfigError(
            f"{loaded.source}: a LoRA checkpoint holds only its adapters, and the base model it adapts, "
            f"{base_dir!r}, cannot be read: {e}"
        ) from None
    adapters = {k: v for k, v in loaded.state.items() if is_adapter(k)}
    merged = merge(base | adapters, loaded.cfg, lora)
    if loaded.cfg.tie_embeddings:
        merged["lm_head.weight"] = merged["wte.weight"]
    return dataclasses.replace(loaded, state=merged, adapters=adapters, lora=lora, base=base_dir)


def checkpoint_of(path: Path) -> str:
    """The complete checkpoint `path` is, or the newest one under it (a run's directory)."""
    if (path / MARKER.format(rank=0)).exists() or (path / TAG).is_dir():
        if not is_complete(str(path)):
            raise ConfigError(
                f"{path}: an incomplete checkpoint (its writer died before every rank's "
                "kiln_complete marker was written); pick an earlier one"
            )
        return str(path)
    found = latest_complete(str(path)) or newest_reported(str(path))
    if found is None:
        raise ConfigError(
            f"{path}: holds no complete Kiln checkpoint, and is not a Hugging Face directory (no config.json)"
        )
    return found


class _Parallel(TypedDict):
    zero_stage: int
    pipeline_stages: int
    tensor_parallel: NotRequired[int]  # cards from before tensor parallelism: 1


class _Data(TypedDict):
    path: str
    s3_endpoint: NotRequired[str]
    s3_region: NotRequired[str]


class _Lora(TypedDict):
    rank: int
    alpha: float
    dropout: float
    targets: str


class _Card(TypedDict):
    """What `kiln.core.checkpoint.model_card` writes; checked as it is read."""

    gpt: GPTConfig
    parallel: _Parallel
    data: _Data
    lora: NotRequired[_Lora]  # a LoRA run's: its checkpoints hold the adapters alone
    init_from: NotRequired[str]  # and the base they adapt


_CARD = pydantic.TypeAdapter(_Card)


def _card(ckpt: str) -> dict:
    """The checkpoint's card, every field of the type Kiln wrote and the model's shape one
    that builds; each problem is one line naming the field."""
    path = os.path.join(ckpt, CARD)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(
            f"{ckpt}: has no {CARD} (written by Kiln from this version on); the model's "
            "shape is unknown, so it cannot be exported"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: not readable ({e})") from None
    card = validated(_CARD, raw, path, json=True)
    problem = shape_problem(card["gpt"])
    if problem:
        raise ConfigError(f"{path}: gpt: {problem}")
    for field in ("pipeline_stages", "tensor_parallel"):
        if card["parallel"].get(field, 1) < 1:
            raise ConfigError(f"{path}: parallel.{field}: expected a positive integer")
    return card


def consolidate(ckpt: str, cfg: GPTConfig, pipeline_stages: int, tensor_parallel: int = 1) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state dict from a checkpoint's shards."""
    state_dir = os.path.join(ckpt, TAG)
    if tensor_parallel > 1:
        state = _tensor_parallel_weights(state_dir, cfg, tensor_parallel)
    elif pipeline_stages > 1:
        state = _pipeline_layers(state_dir, cfg)
    elif is_fsdp2_checkpoint(state_dir):
        state = merged_state(state_dir)  # torch's distributed checkpoint: every shard of each weight, read whole
    elif is_zero_sharded(state_dir):
        name_deepspeed_accelerator(torch.cuda.is_available())  # merging is host work where no GPU is
        state = merged_fp32_state(ckpt, TAG)  # ZeRO 1-3: the fp32 master weights, from every rank's partition
    else:
        state = torch.load(
            os.path.join(state_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False
        )["module"]  # Kiln's own file (ZeRO-0: whole on each rank)
    state = {k: v.float() for k, v in state.items()}
    if cfg.tie_embeddings and "wte.weight" in state:  # a LoRA checkpoint has the adapters alone
        state["lm_head.weight"] = state["wte.weight"]
    return state


def _tensor_parallel_weights(state_dir: str, cfg: GPTConfig, k: int) -> dict[str, torch.Tensor]:
    """The k tensor-parallel ranks' module weights (ZeRO 0-2 keep them whole per rank, in the
    training precision), merged (`kiln.parallel.tensor_parallel.merge_shards`)."""
    from kiln.parallel.tensor_parallel import merge_shards

    shards = []
    for rank in range(k):
        path = os.path.join(state_dir, f"mp_rank_{rank:02d}_model_states.pt")
        if not os.path.exists(path):
            raise ConfigError(
                f"{state_dir}: mp_rank_{rank:02d}_model_states.pt is missing (tensor-parallel rank {rank} of {k})"
            )
        shards.append(torch.load(path, map_location="cpu", weights_only=False)["module"])
    return merge_shards(shards, cfg)


def _pipeline_layers(state_dir: str, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A pipeline's layers (see kiln.parallel.pipeline.to_pipeline): 0 the embeddings, 1..L the
    blocks, L+1 the final norm, L+2 the head (a tied one has no weights of its own)."""
    files = {int(m.group(1)): os.path.join(state_dir, n) for n in os.listdir(state_dir) if (m := LAYER_FILE.match(n))}
    names = {0: "", cfg.n_layer + 1: "ln_f."} | {i + 1: f"blocks.{i}." for i in range(cfg.n_layer)}
    if not cfg.tie_embeddings:
        names[cfg.n_layer + 2] = "lm_head."
    state: dict[str, torch.Tensor] = {}
    for layer, prefix in names.items():
        if layer not in files:
            raise ConfigError(f"{state_dir}: layer_{layer:02d}-model_states.pt is missing")
        part = torch.load(files[layer], map_location="cpu", weights_only=True)
        state |= {prefix + k: v for k, v in part.items()}
    return state


def _dataset_tokenizer(card: dict, ckpt: str):
    data = card["data"]
    try:
        return load_manifest(
            resolve(data["path"], data.get("s3_endpoint", ""), data.get("s3_region", "us-east-1"))
        ).tokenizer()
    except KilnError as e:
        raise ConfigError(
            f"{ckpt}: its tokenizer comes from the training data {data['path']!r}, which cannot be read: {e}"
        ) from None


def hf_tokenizer(directory: Path, vocab_size: int):
    """The tokenizer of a Hugging Face directory; its vocab must fit the model's."""
    if not (directory / "tokenizer.json").exists():
        raise ConfigError(f"{directory}: has no tokenizer.json (Kiln reads fast-tokenizer files)")
    tok = pretrained(str(directory))
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"{directory / 'tokenizer.json'}: the tokenizer has {tok.vocab_size} tokens, the "
            f"model's vocab_size is {vocab_size}; they must belong together"
        )
    return tok
