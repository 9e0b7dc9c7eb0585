"""Gradient clipping on DeepSpeed's plain fp32 path (ZeRO-0, fp32 weights: fp32 and bf16-autocast
runs), Kiln's in place of DeepSpeed's: the global norm summed over a pipeline's stages or a
tensor-parallel group, on the device, and recorded for the metrics."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def install_fp32_clipping(engine) -> None:
    """Replace DeepSpeed's clipping on its fp32, ZeRO-0 path (the only path that calls it; bf16
    autocast runs take it too, their weights being fp32).

    DeepSpeed 0.19's version, under a pipeline, counts only the first stage's gradients in the
    global norm (it keeps model-parallel rank 0's share and treats stages as model-parallel) and
    would count a tied weight twice, so a clipped pipeline run diverges from the same run on one
    device (measured: 1e-4 relative by step 3). It also never records the norm. This one sums
    squared norms over the pipeline's stages, counts tied weights once, and records the norm.
    The norm and the scaling are torch's multi-tensor ones (`get_total_norm`,
    `clip_grads_with_norm_`: a few kernels for all gradients on a GPU, not several per tensor),
    and the norm stays on the device: the host reads it only when a step's metrics are built.
    """
    import types

    group, split_only = None, False
    if hasattr(engine, "grid"):  # a pipeline: each stage's own weights, summed over the stages
        group = engine.grid.get_pipe_parallel_group()
    elif engine.autotp_size() > 1:  # tensor parallel: the split weights summed, the whole ones once
        group, split_only = engine.mpu.get_tensor_model_parallel_group(), True

    def clip_fp32_gradients(self):
        params = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p for p in params if not getattr(p, "ds_pipe_replicated", False)]
        whole = [p.grad for p in counted if split_only and not getattr(p, "tensor_model_parallel", False)]
        summed = [p.grad for p in counted if not split_only or getattr(p, "tensor_model_parallel", False)]
        norm = global_grad_norm(summed, group, params[0].grad.device if params else torch.device("cpu"), whole)
        torch.nn.utils.clip_grads_with_norm_(params, self.gradient_clipping(), norm)
        self._global_grad_norm = norm  # a device tensor; `get_global_grad_norm` hands it over
        return norm

    engine.clip_fp32_gradients = types.MethodType(clip_fp32_gradients, engine)


def global_grad_norm(
    grads: list[torch.Tensor], group, device: torch.device, whole: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The L2 norm of `grads` summed over `group`'s ranks (None: this rank's alone) together with
    `whole`, gradients every rank of the group holds alike (counted once), on the device."""
    local = _norm(grads, device)
    if group is None:  # gradients are averaged over data-parallel replicas already
        return local
    import torch.distributed as dist

    sq = local.square()
    dist.all_reduce(sq, group=group)
    return (sq + _norm(list(whole), device).square()).sqrt()


def _norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nn.utils.get_total_norm(grads, 2.0).float()
