"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning", Algorithm 2), in torch.

Per parameter tensor (a "layer"), with g the gradient and x the weights:

    m_t = b1 m + (1 - b1) g            v_t = b2 v + (1 - b2) g^2
    m^  = m_t / (1 - b1^t)             v^  = v_t / (1 - b2^t)
    r   = m^ / (sqrt(v^) + eps)        u   = r + lambda x          (decoupled weight decay)
    x  <- x - lr * phi(||x||) / ||u|| * u,   phi = identity

The trust ratio ||x|| / ||u|| is taken as 1 when either norm is 0 (a zero-initialised layer
would otherwise never move), as NVIDIA's and DeepSpeed's implementations do. It runs on any
device; nothing here is CUDA-only.

Under ZeRO-1/2/3 DeepSpeed hands the optimizer flat partitions of many tensors, so the trust
ratio is then taken per partition rather than per layer: it still trains, but it is not the
paper's layer-wise rule. Use ZeRO-0 (or plain data parallelism) for exact LAMB.
"""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float = 0.0,
    ):
        """max_trust_ratio: clamp the trust ratio to at most this (0: no clamp, the paper's rule)."""
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                # Moments and the update in fp32 at least (bf16/fp16 weights included).
                dtype = torch.promote_types(p.dtype, torch.float32)
                grad = p.grad.to(dtype)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt_().add_(group["eps"]))
                weights = p.to(dtype)
                if group["weight_decay"]:
                    update.add_(weights, alpha=group["weight_decay"])
                w_norm, u_norm = weights.norm(), update.norm()
                # No host sync: the "either norm is zero" case is a tensor select.
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm)
                )
                if group["max_trust_ratio"]:
                    trust = trust.clamp(max=group["max_trust_ratio"])
                p.add_((update * (trust * -group["lr"])).to(p.dtype))
        return loss
