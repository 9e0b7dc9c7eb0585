"""Tiny random Hugging Face checkpoints of each family Kiln loads, built with transformers'
`save_pretrained` (nothing downloaded): the unit tests' interop checks and the fine-tunes on Ray
build theirs here."""

from pathlib import Path

import torch
import transformers

from kiln.data.tokenizer import BPETokenizer

VOCAB = 300


def build(kind: str, seed: int = 0):
    """A random transformers model whose biases and norms are not their init values (so a
    dropped or misplaced one shows), and whose logits are peaked enough for greedy text to vary.
    The Llamas: grouped-query attention (4 query heads, 2 key/value heads) with untied
    embeddings, and plain multi-head attention with tied ones."""
    torch.manual_seed(seed)
    ids = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    if kind.startswith("gpt2"):
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_positions=64, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=kind == "gpt2", **ids
            )
        )
    elif kind in FAMILIES:
        config_class, extra = FAMILIES[kind]
        model = transformers.AutoModelForCausalLM.from_config(
            config_class(
                hidden_size=32,
                intermediate_size=88,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
                rms_norm_eps=1e-6,
                rope_theta=500.0,
                **extra,
                **ids,
            )
        )
    else:
        gqa = kind != "llama-tied"
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=32,
                intermediate_size=88,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2 if gqa else 4,
                max_position_embeddings=64,
                tie_word_embeddings=not gqa,
                rms_norm_eps=1e-6,
                rope_parameters=ROPE.get(kind, {"rope_type": "default", "rope_theta": 500.0}),
                **ids,
            )
        )
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


# Llama 3.1's scaling with its context cut to 32 tokens, so that on 8-wide heads (wavelengths
# 6.3, 30, 140 and 660 tokens at theta 500) one pair is kept, one blended and two divided.
ROPE = {
    "llama3-rope": {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "llama-linear-rope": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
}


# Qwen2 (q/k/v biases), Mistral (a sliding window of 48 tokens, wider than what the tests feed:
# Kiln's context is the window) and a Llama whose heads are 16 wide on a 32-wide model.
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 48}),
    "llama-head-dim": (transformers.LlamaConfig, {"head_dim": 16}),
}


def saved(kind: str, d, corpus, **save):
    """`build(kind)` saved at `d` with a BPE tokenizer of its vocab, trained on the corpus; the model."""
    built = build(kind)
    built.save_pretrained(d, **save)
    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    (d / "tokenizer.json").write_text(BPETokenizer.train(texts, VOCAB).to_json())
    return built


# Every kind `build` makes.
KINDS = ["gpt2", "gpt2-untied", "llama-gqa", "llama-tied", *ROPE, *FAMILIES]
