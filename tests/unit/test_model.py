import math

import pytest
import torch

from kiln.model import FLAVOURS, GPT, config_for, flops_per_token, num_params, padded_vocab


def test_flavours_exist():
    assert {"debug", "gpt2-124m", "350m", "1.3b"} <= set(FLAVOURS)


@pytest.mark.parametrize("flavour, approx_millions", [("gpt2-124m", 124), ("350m", 354), ("1.3b", 1314)])
def test_param_counts_match_published_sizes(flavour, approx_millions):
    cfg = config_for(flavour, vocab_size=50304)
    assert num_params(cfg, non_embedding=False) / 1e6 == pytest.approx(approx_millions, rel=0.03)


def test_debug_forward_loss_and_tying():
    torch.manual_seed(0)
    cfg = config_for("debug", vocab_size=padded_vocab(257), seq_len=32)
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg, non_embedding=False)
    idx = torch.randint(0, 257, (4, 33))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.shape == (4, 32, cfg.vocab_size)
    # At init the prediction is near uniform: loss ~ ln(vocab).
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), rel=0.05)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_scaled_init_on_residual_projections():
    torch.manual_seed(0)
    cfg = config_for("gpt2-124m", vocab_size=1024, seq_len=64, n_layer=4)
    model = GPT(cfg)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_causality():
    torch.manual_seed(0)
    model = GPT(config_for("debug", vocab_size=64, seq_len=16)).eval()
    a = torch.randint(0, 64, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
        assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    cfg = config_for("debug", vocab_size=64, seq_len=16)
    plain = GPT(cfg)
    ckpt = GPT(config_for("debug", vocab_size=64, seq_len=16, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 17))
    for m in (plain, ckpt):
        m(idx[:, :-1], idx[:, 1:])[1].backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_flops_per_token_formula():
    cfg = config_for("gpt2-124m", vocab_size=50304)
    n = num_params(cfg)
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024
    # ~0.87 GFLOPs/token for GPT-2 small at 1024 context, as commonly quoted.
    assert flops_per_token(cfg) / 1e9 == pytest.approx(0.87, rel=0.05)


def test_too_long_sequence_is_refused():
    model = GPT(config_for("debug", vocab_size=64, seq_len=8))
    with pytest.raises(ValueError, match="exceeds the model's seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
