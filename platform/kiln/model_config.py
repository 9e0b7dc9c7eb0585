"""The `model` section of a run, and the one function that turns it into the model's shape.

`ModelConfig.shape` is pure: with `model.init_from` it takes the checkpoint's own shape, read
once before launch (`kiln.hf_checkpoint.pretrained_shape`, called by preflight) and handed to
every worker with the config, so no worker reads config.json again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kiln.knobs import check_ranges, knob, span
from kiln.limits import MAX_SEQ_LEN
from kiln.lora import LoraConfig
from kiln.model import FLAVOURS, GPTConfig, config_for


@dataclass
class ModelConfig:
    flavour: str = knob("debug", lambda v: v in FLAVOURS, f"one of {sorted(FLAVOURS)}")
    """Model family and shape: one of kiln.model.FLAVOURS. GPT-2 architecture: debug, gpt2-124m,
    350m, 1.3b, 2.7b, 6.7b, 13b; Llama architecture (RoPE, RMSNorm, SwiGLU, grouped-query
    attention): llama-debug, llama-1b, llama-7b."""
    vocab_size: int = knob(0, *span(0, 10_000_000, note="0: from the data"))
    """0: the dataset's vocab padded to a multiple of 64. Must be >= the dataset's vocab."""
    seq_len: int = knob(0, *span(0, MAX_SEQ_LEN, note="0: from the data"))
    """0: the dataset's sequence length. Otherwise it must equal it."""
    dropout: float = knob(0.0, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Dropout on attention, MLP and embeddings; 0 is right for single-pass pretraining."""
    activation_checkpointing: bool = False
    """Recompute each block's activations during backward to save memory."""
    n_layer: int = knob(0, *span(0, 1024, note="0: the flavour's depth"))
    """0: the flavour's depth. Otherwise that many blocks of the flavour's width (a deeper debug
    model gives a pipeline's stages something to split)."""
    init_from: str = ""
    """A Hugging Face checkpoint directory or s3:// prefix (config.json and safetensors, GPT-2 or
    Llama architecture; S3 through data.s3_endpoint) to start from, e.g. a model to fine-tune or a `kiln export`. Its shape replaces
    the flavour's and its weights the random init; the data must be tokenized with its tokenizer
    (`kiln data prepare --tokenizer <the directory>`), which is checked before launch."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (`kiln.lora`): with lora.rank > 0 the checkpoint's weights stay frozen
    and only the adapters train, and checkpoints hold only them."""

    def check(self) -> None:
        check_ranges(self, "model")
        self.lora.check()

    def shape(self, pretrained: GPTConfig | None = None) -> GPTConfig:
        """The model's shape; vocab_size and seq_len must be resolved (non-zero) by now. With
        init_from, `pretrained` is the checkpoint's shape (its context may be longer than the
        data's rows)."""
        assert self.vocab_size > 0 and self.seq_len > 0, "resolve model.vocab_size/seq_len from the data first"
        if self.init_from:
            if pretrained is None:
                raise ValueError("model.init_from's shape is read before launch: pass it as `pretrained`")
            return dataclasses.replace(
                pretrained, dropout=self.dropout, activation_checkpointing=self.activation_checkpointing
            )
        depth = {"n_layer": self.n_layer} if self.n_layer else {}
        return config_for(
            self.flavour,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            dropout=self.dropout,
            activation_checkpointing=self.activation_checkpointing,
            **depth,
        )

    @property
    def base_name(self) -> str:
        """The model's short name: its flavour, or the name of the checkpoint it starts from."""
        return Path(self.init_from).name if self.init_from else self.flavour

    @property
    def display_name(self) -> str:
        """What the console calls the model: its flavour, or the checkpoint it starts from."""
        return f"{self.base_name} (init_from)" if self.init_from else self.flavour
