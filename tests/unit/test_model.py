import math

import pytest
import torch

from kiln.model import FLAVOURS, GPT, config_for, padded_vocab
from kiln.model_size import flops_per_token, num_params


def test_flavours_exist():
    assert {"debug", "gpt2-124m", "350m", "1.3b"} <= set(FLAVOURS)


@pytest.mark.parametrize(
    "flavour, vocab, approx_millions",
    [
        ("gpt2-124m", 50304, 124),
        ("350m", 50304, 354),
        ("1.3b", 50304, 1314),
        ("llama-7b", 32000, 6738),
        ("llama-1b", 128256, 1236),  # Llama 2 7B; Llama 3.2 1B (tied)
    ],
)
def test_param_counts_match_published_sizes(flavour, vocab, approx_millions):
    cfg = config_for(flavour, vocab_size=vocab)
    assert num_params(cfg, non_embedding=False) / 1e6 == pytest.approx(approx_millions, rel=0.01)


def test_the_llama_family_counts_and_shapes():
    """GQA (4 query heads, 2 key/value heads) and an untied head: the count from shapes equals
    the built model's, and the head is a matrix of its own."""
    cfg = config_for("llama-debug", vocab_size=320)
    model = GPT(cfg)
    assert model.wpe is None and model.lm_head.weight is not model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg, non_embedding=False)
    assert model.blocks[0].attn.qkv.weight.shape == (128 + 2 * 2 * 32, 128)  # q 4 heads, k and v 2 heads of 32
    assert model.blocks[0].mlp.fc.weight.shape == (2 * 512, 128)  # gate and up, 8/3 x 128 rounded up to 256s


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


@pytest.mark.parametrize("flavour", ["debug", "llama-debug"])
def test_causality(flavour):
    torch.manual_seed(0)
    model = GPT(config_for(flavour, vocab_size=64, seq_len=16)).eval()
    a = torch.randint(0, 64, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
        assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])


@pytest.mark.parametrize("flavour", ["debug", "llama-debug"])
def test_activation_checkpointing_same_gradients(flavour):
    torch.manual_seed(0)
    cfg = config_for(flavour, vocab_size=64, seq_len=16)
    plain = GPT(cfg)
    ckpt = GPT(config_for(flavour, vocab_size=64, seq_len=16, activation_checkpointing=True))
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
