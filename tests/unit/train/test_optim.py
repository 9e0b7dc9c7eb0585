import math

import pytest
import torch

from kiln.config import OptimConfig, ScheduleConfig
from kiln.model import GPT, config_for
from kiln.train.optim import build_optimizer, lr_multiplier, param_groups


def test_warmup_then_cosine_to_floor():
    s = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, s, 110) == pytest.approx(0.1)
    assert lr_multiplier(9, s, 110) == pytest.approx(1.0)
    assert lr_multiplier(10, s, 110) == pytest.approx(1.0)
    # halfway through decay: floor + (1 - floor) * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_multiplier(60, s, 110) == pytest.approx(0.55)
    assert lr_multiplier(110, s, 110) == pytest.approx(0.1)
    assert lr_multiplier(35, s, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_linear_and_constant():
    lin = ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_multiplier(s, lin, 4) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    const = ScheduleConfig(name="constant", warmup_steps=2, min_lr_ratio=0.0)
    assert [lr_multiplier(s, const, 10) for s in range(4)] == pytest.approx([0.5, 1, 1, 1])


def test_no_decay_on_norms_biases_embeddings():
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    decay, no_decay = param_groups(model, 0.1)
    decay_ids = {id(p) for p in decay["params"]}
    assert id(model.wte.weight) not in decay_ids and id(model.wpe.weight) not in decay_ids
    assert id(model.blocks[0].attn.qkv.weight) in decay_ids
    assert id(model.blocks[0].ln_1.weight) in {id(p) for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    n_all = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_all


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_optimizers_build_and_step(name):
    torch.manual_seed(0)
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2), on_cuda=False)
    idx = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
