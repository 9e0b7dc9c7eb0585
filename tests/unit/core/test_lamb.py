"""LAMB against the update rule of You et al. (2019), Algorithm 2, on hand-computed steps."""

import math

import pytest
import torch

from kiln.core.lamb import Lamb


def _step(x, grads, **hp):
    p = torch.nn.Parameter(torch.tensor(x, dtype=torch.float64))
    opt = Lamb([p], **hp)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach().tolist()


def test_first_step_by_hand():
    # x = (3, 4), ||x|| = 5; g = (0.1, -0.2); b1 = 0.9, b2 = 0.999, wd = 0.01, lr = 0.1.
    # Bias-corrected m^ = g and v^ = g^2, so r = g / |g| = (1, -1).
    # u = r + wd x = (1.03, -0.96); ||u|| = sqrt(1.0609 + 0.9216) = 1.4080128.
    # trust = 5 / 1.4080128 = 3.5511041; x' = x - 0.1 * 3.5511041 * u = (2.6342363, 4.3409060).
    x = _step([3.0, 4.0], [[0.1, -0.2]], lr=0.1, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.01)
    assert x == pytest.approx([2.6342363, 4.3409060], abs=1e-7)


def test_zero_norm_layer_takes_trust_ratio_one():
    # ||x|| = 0: the ratio would be 0 and the layer would never move; LAMB takes 1 instead.
    # r = (1, -1), u = r + wd * 0 = (1, -1), x' = 0 - 0.1 * 1 * u = (-0.1, 0.1).
    x = _step([0.0, 0.0], [[0.5, -0.5]], lr=0.1, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.01)
    assert x == pytest.approx([-0.1, 0.1], abs=1e-9)


def test_second_step_uses_bias_corrected_moments():
    # Step 2 from x1 = (2.6342363, 4.3409060) with g2 = (0.3, 0.1):
    # m2 = 0.9 * (0.01, -0.02) + 0.1 * (0.3, 0.1) = (0.039, -0.008);   m^ = m2 / 0.19
    # v2 = 0.999 * (1e-5, 4e-5) + 0.001 * (0.09, 0.01) = (9.999e-5, 4.996e-5);   v^ = v2 / 0.001999
    # r = m^ / sqrt(v^) = (0.9177811, -0.2663370); u = r + 0.01 x1 = (0.9441235, -0.2229280)
    # trust = ||x1|| / ||u|| = 5.0776634 / 0.9700856 = 5.2342427
    # x2 = x1 - 0.1 * trust * u = (2.1400591, 4.4575919)
    x = _step([3.0, 4.0], [[0.1, -0.2], [0.3, 0.1]], lr=0.1, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.01)
    assert x == pytest.approx([2.1400591, 4.4575919], abs=1e-7)


def test_trust_ratio_is_per_tensor_and_clampable():
    a = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor([30.0, 40.0], dtype=torch.float64))
    opt = Lamb([a, b], lr=0.1, betas=(0.9, 0.999), eps=1e-12, max_trust_ratio=10.0)
    a.grad = torch.tensor([0.1, -0.2], dtype=torch.float64)
    b.grad = a.grad.clone()
    opt.step()
    # Same r = (1, -1), ||r|| = sqrt 2. a: trust 5 / sqrt 2 = 3.5355; b: 50 / sqrt 2 = 35.36 -> 10.
    assert a.detach().tolist() == pytest.approx([3 - 0.1 * 5 / math.sqrt(2), 4 + 0.1 * 5 / math.sqrt(2)])
    assert b.detach().tolist() == pytest.approx([30 - 0.1 * 10, 40 + 0.1 * 10])


def test_float32_params_keep_float32_state():
    p = torch.nn.Parameter(torch.ones(4))
    opt = Lamb([p], lr=0.01)
    p.grad = torch.full((4,), 0.5)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and torch.isfinite(p).all()
