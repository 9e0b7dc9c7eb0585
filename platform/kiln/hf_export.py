"""Kiln's models out to the Hugging Face checkpoint format (`kiln export`), the inverse of
`kiln.hf_checkpoint`'s reading: the same name table, each fused matrix split back (q/k/v,
gate/up), GPT-2's `Conv1D` weights transposed back, a `config.json` transformers loads, and
the weights in safetensors shards as `save_pretrained` writes them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from kiln.errors import ConfigError
from kiln.hf_checkpoint import CONFIG, INDEX, name_table, tensor_shapes
from kiln.model import GPTConfig


def hf_state(cfg: GPTConfig, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Kiln's state dict as Hugging Face tensors: split, transposed, renamed. GPT-2 always has
    biases, so they are zeros where Kiln has none (bias=False); the vocab is cut to the
    tokenizer's (Kiln pads it to a multiple of 64, and those rows are never targets)."""
    full = tensor_shapes(replace(cfg, bias=True)) if cfg.arch == "gpt" else None
    out = {}
    for ours, (names, transposed) in name_table(cfg).items():
        t = state.get(ours)
        if t is None:  # a bias Kiln's model does not have (GPT-2's, which Hugging Face's always has)
            assert full is not None
            t = torch.zeros(full[ours])
        if ours in ("wte.weight", "lm_head.weight"):
            t = t[:vocab_size]
        sizes = _split_sizes(cfg, ours, len(names))
        for name, part in zip(names, t.split(sizes, dim=0) if sizes else [t]):
            out[name] = (part.t() if transposed else part).detach().float().contiguous().cpu()
    return out


def _split_sizes(cfg: GPTConfig, ours: str, parts: int) -> list[int] | None:
    if parts == 1:
        return None
    if ours.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return [cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    return [cfg.hidden, cfg.hidden]  # mlp.fc: gate, up


def hf_config(cfg: GPTConfig, vocab_size: int, eot_id: int) -> dict:
    common = {
        "vocab_size": vocab_size,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": "float32",
        "initializer_range": 0.02,
    }
    if cfg.arch == "gpt":
        return common | {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "scale_attn_weights": True,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,  # inference: dropout off
        }
    # q/k/v biases are Qwen2's; any other Kiln Llama (a Mistral within its window too) is a Llama
    family = (
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
        if cfg.qkv_bias
        else {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False}
    )
    return (
        common
        | family
        | {
            "max_position_embeddings": cfg.seq_len,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.hidden,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": _rope_parameters(cfg),
            "rope_theta": cfg.rope_theta,
            "attention_dropout": 0.0,
        }
    )


# `kiln export --dtype`: the names transformers' config.json gives each
EXPORT_DTYPES = {
    "fp32": (torch.float32, "float32"),
    "bf16": (torch.bfloat16, "bfloat16"),
    "fp16": (torch.float16, "float16"),
}
MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default: shards a loader streams one at a time


def write(
    cfg: GPTConfig,
    state: dict[str, torch.Tensor],
    tokenizer,
    vocab: int,
    directory: Path,
    dtype: str = "fp32",
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> list[str]:
    """Write a complete checkpoint of the first `vocab` rows into `directory` (which the caller
    stages and renames), its weights in `dtype` (an EXPORT_DTYPES name), in shards of at most
    `max_shard_size` with transformers' index where there is more than one; return the file
    names. `tokenizer` is one of kiln.data.tokenizer's."""
    eot = int(tokenizer.eot_id)
    eot_text = tokenizer.id_to_token(eot)
    base = dict(getattr(tokenizer, "companions", {}))  # a pretrained tokenizer's own files, kept as they are
    named = tokenizer.special_id("bos_token")  # the base tokenizer's, else end-of-text (as GPT-2's)
    bos = eot if named is None else int(named)
    cast, dtype_name = EXPORT_DTYPES[dtype]
    weights = {k: v.to(cast) if v.is_floating_point() else v for k, v in hf_state(cfg, state, vocab).items()}
    weight_files = _save_sharded(weights, directory, max_shard_size)
    files = {
        CONFIG: hf_config(cfg, vocab, eot) | {"dtype": dtype_name, "bos_token_id": bos},
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eot, "pad_token_id": eot},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": eot_text,
            "eos_token": eot_text,
            "unk_token": eot_text,
            "pad_token": eot_text,
            "model_max_length": cfg.seq_len,
        },
        "special_tokens_map.json": _special_tokens(base, eot_text),
    }
    for name, body in files.items():
        (directory / name).write_text(base[name] if name in base else json.dumps(body, indent=2) + "\n")
    for name in set(base) - set(files):  # the chat template
        (directory / name).write_text(base[name])
    (directory / "tokenizer.json").write_text(tokenizer.hf_json())
    return [*weight_files, *files, *sorted(set(base) - set(files)), "tokenizer.json"]


def _special_tokens(base: dict[str, str], eot_text: str) -> dict:
    """special_tokens_map.json: the base tokenizer's own tokens where its tokenizer_config.json
    names them (transformers reads this file over that one, so a different map here would
    change, say, the BOS its chat template writes), else end-of-text for each, as GPT-2's."""
    kinds = ("bos_token", "eos_token", "unk_token", "pad_token")
    named = json.loads(base.get("tokenizer_config.json", "{}"))
    if any(k in named for k in kinds):
        return {k: named[k] for k in kinds if k in named}
    return dict.fromkeys(kinds, eot_text)


def _save_sharded(weights: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str) -> list[str]:
    """`model.safetensors`, or shards and `model.safetensors.index.json`, as save_pretrained
    writes them (huggingface_hub's split, which transformers itself uses); the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(
        weights, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    for name, keys in split.filename_to_tensors.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(directory / name), metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files


def shard_size(text: str) -> int | str:
    """`--max-shard-size` (bytes, or with a unit as transformers takes it: 5GB, 500MB), checked
    before any work."""
    from huggingface_hub import split_torch_state_dict_into_shards

    size: int | str = int(text) if text.isdigit() else text.strip()
    try:
        split_torch_state_dict_into_shards({}, max_shard_size=size)  # parses it (the public way to)
    except ValueError:
        size = 0
    if not size:
        raise ConfigError(f"--max-shard-size {text}: expected a size such as 5GB, 500MB or a number of bytes")
    return size


def _rope_parameters(cfg: GPTConfig) -> dict:
    """The rope_parameters transformers 5 writes for `cfg`."""
    out: dict = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        out["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        out |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        }
    return out


# ---- LoRA adapters in PEFT's layout --------------------------------------------------------------
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_state(cfg: GPTConfig, adapters: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """Kiln's adapters (`blocks.i.<module>.lora_{a,b}.<target>`) under the names PEFT gives a
    Hugging Face Llama, Qwen2 or Mistral (`base_model.model.model.layers.i.self_attn.q_proj.
    lora_A.weight`, ...). Kiln's per-projection adapters are PEFT's, so nothing is split. GPT-2's
    c_attn fuses q, k and v, where PEFT would hold one adapter: refused."""
    if cfg.arch != "llama":
        raise ConfigError(
            "--adapters: PEFT's layout for GPT-2 gives its fused c_attn one adapter, where Kiln trains one per "
            "projection; export the merged model instead (without --adapters)"
        )
    from kiln.lora import ATTENTION, target_rows

    rows = target_rows(cfg)
    out = {}
    for i in range(cfg.n_layer):
        for t in lora.target_list:
            ours = f"blocks.{i}.{rows[t][0]}"
            theirs = f"base_model.model.model.layers.{i}.{'self_attn' if t in ATTENTION else 'mlp'}.{t}"
            out[f"{theirs}.lora_A.weight"] = adapters[f"{ours}.lora_a.{t}"].float().contiguous()
            out[f"{theirs}.lora_B.weight"] = adapters[f"{ours}.lora_b.{t}"].float().contiguous()
    return out


def write_adapters(
    cfg: GPTConfig, adapters: dict[str, torch.Tensor], lora, base: str, directory: Path, dtype: str = "fp32"
) -> list[str]:
    """The adapters as PEFT saves them (`adapter_model.safetensors`, `adapter_config.json`), for
    `PeftModel.from_pretrained(<the base>, directory)`; `base` is the checkpoint they adapt."""
    from safetensors.torch import save_file

    cast = EXPORT_DTYPES[dtype][0]
    weights = {k: v.to(cast) for k, v in adapter_state(cfg, adapters, lora).items()}
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_list),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
