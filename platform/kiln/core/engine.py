"""The seam between the training loop and whatever trains the model in parallel.

The loop, the step, the meter and the checkpoint policy talk to an `Engine` and to nothing
else of the parallel machinery, in the style of `kiln.core.sinks`. DeepSpeed's implementation,
and every read of DeepSpeed's own attributes, is `kiln.parallel.deepspeed_engine`; torch's
FSDP2 is `kiln.parallel.fsdp2_engine`. Local SGD and DiLoCo (`kiln.parallel.periodic_sync`)
wrap DeepSpeed's and sync the replicas inside `step`; the loop does not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch


class Engine(Protocol):
    """One rank's model, optimizer and their parallel wrapping, as the loop uses them."""

    pipeline: bool
    """Whether a step runs as one pipeline schedule (`train_batch`) rather than micro-batch by
    micro-batch (`forward`, `backward`, `step`)."""

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One micro-batch's mean loss, on the device, with the graph for `backward`; with
        `documents`, attention within them (`kiln.model.GPT.forward`)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of `loss`, accumulated until the step's last micro-batch."""

    def step(self) -> None:
        """The optimizer step at the accumulation boundary (clipping, reduction, the LR
        schedule); before the boundary, nothing."""

    def train_batch(self, pairs: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A pipeline's whole step over its micro-batches; their mean loss."""

    def eval_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One validation batch's mean loss (every pipeline stage takes part), no gradients."""

    def set_training(self, on: bool) -> None:
        """Training mode (dropout on) or evaluation mode."""

    def save(self, directory: str, client_state: dict) -> None:
        """Every rank writes its shards of the model and optimizer state under `directory`,
        with `client_state` (the step, the data position)."""

    def load(self, directory: str, reshard: bool = False) -> dict:
        """Restore what `save` wrote there; its `client_state`. `reshard`: it was written by
        another number of data-parallel ranks, whose optimizer partitions are cut anew."""

    def set_micro_batches(self, n: int) -> None:
        """Micro-batches per optimizer step from now on (a resume that keeps the global batch
        on another number of replicas changes gradient accumulation)."""

    def grad_norm(self) -> torch.Tensor | float | None:
        """The last step's global gradient norm (None: not known)."""

    def overflow(self) -> tuple[int, float]:
        """fp16 dynamic loss scaling: (steps skipped on overflow so far, the loss scale now)."""

    def measure_comm(self, on: bool) -> None:
        """Whether to measure the coming step's communication (only steps whose metrics are
        read are, as with the phase timer); off again once the step is done."""

    def comm_metrics(self) -> dict[str, float]:
        """The measured step's communication: the bytes this rank sent (`comm/bytes_per_step`),
        on CPU workers the seconds in those collectives (`comm/time_s`), and the seconds of the
        collectives the engine times itself (`time/*_comm_s`, part of the forward and backward
        times)."""

    def memory(self) -> dict[str, float]:
        """Bytes this rank holds in parameters, fp32 master copies and optimizer state,
        measured from the tensors themselves (`memory/*_bytes`)."""
