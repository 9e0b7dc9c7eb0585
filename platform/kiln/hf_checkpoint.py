"""Kiln's models in from the Hugging Face checkpoint format: GPT-2 and Llama architectures.
(`kiln.hf_export` writes the format back.)

A Hugging Face checkpoint is a directory: `config.json`, the weights as safetensors (one
`model.safetensors`, or shards listed in `model.safetensors.index.json`), and tokenizer files.
Reading and writing it needs only `safetensors` and JSON, not `transformers`: that import takes
seconds and a few hundred MB, and the format is stable and documented. The tests prove the
mapping with transformers itself (logits and greedy generation equal).

The weights differ from Kiln's by name and packing. GPT-2's linears are `Conv1D`s that store the
weight transposed ((in, out) where `nn.Linear` has (out, in)). Llama keeps q/k/v and gate/up as
separate matrices, which Kiln fuses into one matmul each (`attn.qkv`, `mlp.fc`): reading
concatenates them along the output dimension (writing splits them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import torch
from typing_extensions import Required, TypedDict

from kiln.errors import ConfigError, KilnError
from kiln.model import ROPE_SCALINGS, GPTConfig, shape_problem
from kiln.schemas import type_problems, validated

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class _GPT2Fields(TypedDict, total=False):
    """The fields of a GPT-2 `config.json` Kiln reads, with their JSON types."""

    n_embd: Required[int]
    n_layer: Required[int]
    n_head: Required[int]
    n_positions: Required[int]
    vocab_size: Required[int]
    n_inner: int | None
    layer_norm_epsilon: float


class _LlamaFields(TypedDict, total=False):
    """The fields of a Llama `config.json` Kiln reads, with their JSON types."""

    hidden_size: Required[int]
    intermediate_size: Required[int]
    num_hidden_layers: Required[int]
    num_attention_heads: Required[int]
    max_position_embeddings: Required[int]
    vocab_size: Required[int]
    num_key_value_heads: int | None
    head_dim: int | None
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None
    rope_parameters: dict | None
    rms_norm_eps: float
    sliding_window: int | None
    use_sliding_window: bool


# model_type -> its fields; Qwen2 (q/k/v biases) and Mistral (a sliding window) are Llamas to Kiln
_LLAMA = pydantic.TypeAdapter(_LlamaFields)
_FIELDS = {"gpt2": pydantic.TypeAdapter(_GPT2Fields), "llama": _LLAMA, "qwen2": _LLAMA, "mistral": _LLAMA}


class _IndexFile(TypedDict):
    weight_map: dict[str, str]
    """Each weight's name -> the file in the directory that holds it."""


_INDEX = pydantic.TypeAdapter(_IndexFile)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation Kiln's MLP uses


# ---- where it is -----------------------------------------------------------------------------------
def local_copy(uri: str, s3_endpoint: str = "", region: str = "us-east-1") -> Path:
    """A local directory holding the checkpoint at `uri`: the path itself, or for s3://
    a copy in ~/.cache/kiln/checkpoints/ (one per URI, downloaded whole: into a temporary
    sibling, then renamed), so every process on a machine reads the same files."""
    if not uri.startswith("s3://"):
        return Path(uri)
    import hashlib
    import os

    from kiln import guard
    from kiln.storage import resolve

    cache = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln")) / "checkpoints"
    target = cache / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if (target / CONFIG).exists():
        return target
    src = resolve(uri, s3_endpoint, region)
    files = src.list_files()
    if CONFIG not in files:
        raise ConfigError(f"{uri}: holds no {CONFIG}; expected a Hugging Face checkpoint prefix")
    cache.mkdir(parents=True, exist_ok=True)
    staged = guard.temp_dir(cache, target.name, "checkpoint-cache")
    try:
        for name in files:
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_bytes(src.join(name).read_bytes())
        try:
            guard.move(staged, target)
        except OSError:  # another process on this machine finished first
            if not (target / CONFIG).exists():
                raise
    finally:
        guard.discard(staged, "checkpoint-cache")
    return target


def init_from_dir(init_from: str, s3_endpoint: str = "", region: str = "us-east-1") -> Path:
    """`model.init_from` as a local directory (an s3:// prefix is copied into a local cache once
    per machine), its errors named by the field."""
    try:
        return local_copy(init_from, s3_endpoint, region)
    except KilnError as e:
        raise ConfigError(f"model.init_from = {init_from!r}: {e}") from None


def pretrained_shape(init_from: str, s3_endpoint: str = "", region: str = "us-east-1") -> GPTConfig:
    """The shape of `model.init_from`'s checkpoint, its config.json's errors named by the field.
    Read before launch (preflight); workers get the shape with the config."""
    path = init_from_dir(init_from, s3_endpoint, region)
    try:
        return read_config(path)
    except ConfigError as e:
        raise ConfigError(f"model.init_from = {init_from!r}: {e}") from None


# ---- the name tables -----------------------------------------------------------------------------
def name_table(cfg: GPTConfig) -> dict[str, tuple[list[str], bool]]:
    """Kiln name -> (the Hugging Face names concatenated along dim 0, stored transposed?)."""
    if cfg.arch == "gpt":
        block = {
            "ln_1.weight": "ln_1.weight",
            "ln_1.bias": "ln_1.bias",
            "ln_2.weight": "ln_2.weight",
            "ln_2.bias": "ln_2.bias",
            "attn.qkv.weight": "attn.c_attn.weight",
            "attn.qkv.bias": "attn.c_attn.bias",
            "attn.proj.weight": "attn.c_proj.weight",
            "attn.proj.bias": "attn.c_proj.bias",
            "mlp.fc.weight": "mlp.c_fc.weight",
            "mlp.fc.bias": "mlp.c_fc.bias",
            "mlp.proj.weight": "mlp.c_proj.weight",
            "mlp.proj.bias": "mlp.c_proj.bias",
        }
        table = {
            k: ([f"transformer.{v}"], False)
            for k, v in {
                "wte.weight": "wte.weight",
                "wpe.weight": "wpe.weight",
                "ln_f.weight": "ln_f.weight",
                "ln_f.bias": "ln_f.bias",
            }.items()
        }
        for i in range(cfg.n_layer):
            for k, v in block.items():
                table[f"blocks.{i}.{k}"] = ([f"transformer.h.{i}.{v}"], k.endswith(".weight") and "ln_" not in k)
        if not cfg.tie_embeddings:
            table["lm_head.weight"] = (["lm_head.weight"], False)
        return table
    table = {"wte.weight": (["model.embed_tokens.weight"], False), "ln_f.weight": (["model.norm.weight"], False)}
    if not cfg.tie_embeddings:
        table["lm_head.weight"] = (["lm_head.weight"], False)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        table |= {
            f"blocks.{i}.ln_1.weight": ([p + "input_layernorm.weight"], False),
            f"blocks.{i}.ln_2.weight": ([p + "post_attention_layernorm.weight"], False),
            f"blocks.{i}.attn.qkv.weight": ([p + f"self_attn.{x}_proj.weight" for x in "qkv"], False),
            f"blocks.{i}.attn.proj.weight": ([p + "self_attn.o_proj.weight"], False),
            **(
                {f"blocks.{i}.attn.qkv.bias": ([p + f"self_attn.{x}_proj.bias" for x in "qkv"], False)}
                if cfg.qkv_bias
                else {}
            ),
            f"blocks.{i}.mlp.fc.weight": ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], False),
            f"blocks.{i}.mlp.proj.weight": ([p + "mlp.down_proj.weight"], False),
        }
    return table


# ---- in ------------------------------------------------------------------------------------------
def read_config(directory: Path) -> GPTConfig:
    """Kiln's shape for a `config.json`; anything Kiln's models cannot express is refused."""
    path = directory / CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; a Hugging Face checkpoint directory holds config.json") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    kind = raw.get("model_type")
    if kind not in _FIELDS:
        raise ConfigError(f"{path}: model_type {kind!r} is not supported; expected one of {sorted(_FIELDS)}")
    problems = type_problems(_FIELDS[kind], raw)
    if problems:
        raise ConfigError(f"{path}: {problems[0]}")
    cfg = _gpt2_config(raw, path) if kind == "gpt2" else _llama_config(raw, path, kind)
    problem = shape_problem(cfg)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return cfg


def _refuse(raw: dict, path: Path, want: dict[str, tuple]) -> None:
    for key, allowed in want.items():
        if raw.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{path}: {key} = {raw[key]!r} is not supported; expected one of {list(allowed)}")


def _gpt2_config(raw: dict, path: Path) -> GPTConfig:
    _refuse(
        raw,
        path,
        {"activation_function": _GELU_TANH, "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,)},
    )
    d = int(raw["n_embd"])
    if raw.get("n_inner") not in (None, 4 * d):
        raise ConfigError(f"{path}: n_inner = {raw['n_inner']} is not supported; expected {4 * d} (4 x n_embd)")
    return GPTConfig(
        vocab_size=int(raw["vocab_size"]),
        seq_len=int(raw["n_positions"]),
        n_layer=int(raw["n_layer"]),
        n_head=int(raw["n_head"]),
        d_model=d,
        bias=True,
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _context(raw: dict, kind: str) -> int:
    """The context Kiln gives a checkpoint: its own, or a sliding window's width where one
    applies (Mistral's sliding_window, Qwen2's with use_sliding_window). Within the window,
    attention over every earlier token is exactly the sliding attention, so nothing changes; a
    longer row is refused before launch, as any row longer than a checkpoint's context is."""
    context = int(raw["max_position_embeddings"])
    window = raw.get("sliding_window") if kind == "mistral" or raw.get("use_sliding_window") else None
    return min(context, int(window)) if window else context


# RoPE scaling kinds Kiln's model computes (kiln.model.ROPE_SCALINGS), by transformers' name
ROPE_TYPES = {kind or "default": kind for kind in ROPE_SCALINGS}


def _rope_fields(rope: dict, path: Path) -> dict:
    """GPTConfig's rope_* fields from a config.json's rope_parameters (or rope_scaling)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{path}: rope type {kind!r} is not supported; expected one of {list(ROPE_TYPES)}")
    fields: dict[str, str | float | int] = {"rope_scaling": ROPE_TYPES[kind]}
    try:
        if kind != "default":
            fields["rope_factor"] = float(rope["factor"])
        if kind == "llama3":
            fields |= {
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_context": int(rope["original_max_position_embeddings"]),
            }
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: its {kind} RoPE scaling lacks a numeric {e}") from None
    return fields


def _llama_config(raw: dict, path: Path, kind: str) -> GPTConfig:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers 5 / 4 spelling
    # Qwen2 has q/k/v biases and no attention_bias key; a Llama's attention_bias would bias o_proj too.
    _refuse(
        raw,
        path,
        {
            "hidden_act": ("silu",),
            "mlp_bias": (False,),
            "pretraining_tp": (1,),
            **({} if kind == "qwen2" else {"attention_bias": (False,)}),
        },
    )
    d, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head = int(raw.get("head_dim") or d // heads)
    return GPTConfig(
        arch="llama",
        vocab_size=int(raw["vocab_size"]),
        seq_len=_context(raw, kind),
        head_size=0 if head * heads == d else head,
        qkv_bias=kind == "qwen2",
        n_layer=int(raw["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(raw.get("num_key_value_heads") or heads),
        d_model=d,
        ffn_hidden=int(raw["intermediate_size"]),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        **_rope_fields(rope, path),
    )


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX
    if index.exists():
        try:
            raw = index.read_bytes()
        except OSError as e:
            raise ConfigError(f"{index}: not readable ({e})") from None
        # A JSON object whose weight_map maps each weight's name to a file name.
        names = sorted(set(validated(_INDEX, raw, f"{index}", json=True)["weight_map"].values()))
        bad = [n for n in names if n != Path(n).name or n.startswith(".")]
        if bad:
            raise ConfigError(f"{index}: weight_map names {bad[0]!r}; expected a file name in the directory")
        return [directory / n for n in names]
    if (directory / WEIGHTS).exists():
        return [directory / WEIGHTS]
    raise ConfigError(f"{directory}: no {WEIGHTS} or {INDEX}; Kiln reads safetensors weights")


def check_weights(directory: Path, cfg: GPTConfig) -> None:
    """Before launch: the weight files are complete and their names and shapes fit `cfg`, from
    the safetensors headers alone (the tensors stay on disk)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, list[int]] = {}
    for f in _weight_files(directory):
        if not f.exists():
            raise ConfigError(f"{f}: missing; the checkpoint's index lists it")
        try:
            with safe_open(str(f), "pt") as st:  # checks the header against the file's size
                shapes |= {name: st.get_slice(name).get_shape() for name in st.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f}: not a complete safetensors file ({e})") from None
    kiln_state(cfg, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}, str(directory))


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by its Hugging Face name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(directory):
        if not f.exists():
            raise ConfigError(f"{f}: missing; the checkpoint's index lists it")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f}: not a complete safetensors file ({e})") from None
    return tensors


def kiln_state(cfg: GPTConfig, theirs: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors renamed, fused, transposed and shape-checked into Kiln's state dict."""
    if cfg.arch == "gpt" and not any(k.startswith("transformer.") for k in theirs):
        theirs = {f"transformer.{k}": v for k, v in theirs.items()}  # GPT-2's original files lack the prefix
    expected = tensor_shapes(cfg)
    state = {}
    for ours, (names, transposed) in name_table(cfg).items():
        for name in names:
            if name not in theirs:
                raise ConfigError(f"{source}: weight {name!r} is missing")
        parts = [theirs[n].t() if transposed else theirs[n] for n in names]
        t = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        if tuple(t.shape) != expected[ours]:
            got = ", ".join(f"{n} {tuple(theirs[n].shape)}" for n in names)
            raise ConfigError(
                f"{source}: weight shapes ({got}) do not fit config.json, which implies "
                f"{expected[ours]} for Kiln's {ours}"
            )
        state[ours] = t.float().contiguous()
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    return state


def tensor_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    from kiln.model import GPT

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg, init_weights=False).state_dict().items()}


def load(directory: str | Path, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The fp32 state dict of a checkpoint directory (of shape `read_config`), in Kiln's names."""
    directory = Path(directory)
    return kiln_state(cfg, read_weights(directory), str(directory))
