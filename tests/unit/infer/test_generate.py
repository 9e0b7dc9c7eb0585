"""Generation: the KV cache and batching change nothing but speed, seeds reproduce, each sampling
control does what its definition says, and streamed text never breaks a character."""

import pytest
import torch

from kiln.data.tokenizer import ByteTokenizer
from kiln.infer.generate import Sampling, TextStream, generate, next_tokens
from kiln.model import GPT, GPTConfig

VOCAB = 200  # the tokenizer's; the model pads to 256


@pytest.fixture(scope="module", params=["gpt", "llama"])
def model(request):
    torch.manual_seed(0)
    shape = {"arch": "llama", "n_kv_head": 2, "tie_embeddings": False} if request.param == "llama" else {}
    m = GPT(GPTConfig(vocab_size=256, seq_len=96, n_layer=2, n_head=4, d_model=64, **shape)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(6)  # peaked logits, so that greedy text varies and a wrong cache would show
    return m


PROMPTS = [[3, 14, 15, 92, 65], [35], [89, 79, 32, 38, 46, 26, 43, 38, 32]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_and_batching_change_nothing(model, temperature):
    s = Sampling(max_new_tokens=30, temperature=temperature, top_k=50, seed=7, stop_at_eot=False)
    one_by_one = [generate(model, [p], s, eot_id=0, vocab_size=VOCAB).tokens[0] for p in PROMPTS]
    if temperature == 0:  # a batch draws its rows' samples together: only greedy rows must agree
        assert generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB).tokens == one_by_one
    uncached = [generate(model, [p], s, eot_id=0, vocab_size=VOCAB, use_cache=False).tokens[0] for p in PROMPTS]
    assert uncached == one_by_one
    assert all(len(t) == 30 and max(t) < VOCAB for t in one_by_one)  # padded ids never sampled
    assert len({t for row in one_by_one for t in row}) > 10


@pytest.mark.parametrize("static", [False, True], ids=["KVCache", "StaticKVCache"])
def test_a_cache_fed_in_chunks_gives_the_logits_of_one_forward(model, static):
    """The cache's three cases: a first chunk (plainly causal), later chunks of several tokens
    (an explicit mask over the past), single tokens (every key); and the same with left padding.
    The static cache (compiled generation's) masks its unwritten slots instead."""
    from kiln.kv_cache import KVCache, StaticKVCache

    def cache():
        return StaticKVCache(model.cfg.n_layer, 32) if static else KVCache(model.cfg.n_layer)

    idx = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    full = model(idx)
    for valid in (None, torch.ones_like(idx, dtype=torch.bool)):
        held, got = cache(), []
        for a, b in [(0, 4), (4, 7), (7, 8), (8, 9), (9, 14)]:
            got.append(model.decode(idx[:, a:b], held, None if valid is None else valid[:, a:b]))
        assert held.length == idx.shape[1] and (static or held.valid is None)  # no padding: no mask kept
        torch.testing.assert_close(torch.stack(got, 1), full[:, [3, 6, 7, 8, 13]], atol=1e-4, rtol=1e-4)
    padded, valid = torch.cat([torch.zeros(1, 3, dtype=torch.long), idx], 1), torch.ones(1, 17, dtype=torch.bool)
    valid[:, :3] = False
    held = cache()
    first = model.decode(padded[:, :10], held, valid[:, :10])
    rest = model.decode(padded[:, 10:], held)  # real tokens after padding: the mask is kept
    assert held.valid is not None
    torch.testing.assert_close(torch.stack([first, rest], 1), full[:, [6, 13]], atol=1e-4, rtol=1e-4)


def test_a_cache_sized_ahead_is_allocated_once_and_gives_the_same_logits(model):
    """Sized for the whole generation, the cache writes each step's keys in place (its buffers
    never move); grown by doubling, or sized exactly, the logits are the same. The decode's RoPE
    table holds, bitwise, the angles a forward computes for those positions."""
    from kiln.kv_cache import KVCache
    from kiln.model import rotary

    idx = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    runs = {}
    for capacity in (0, idx.shape[1]):
        cache = KVCache(model.cfg.n_layer, capacity)
        logits = [model.decode(idx[:, :5], cache)]
        buffers = (cache.k[0].data_ptr(), cache.v[-1].data_ptr())
        logits += [model.decode(idx[:, t : t + 1], cache) for t in range(5, idx.shape[1])]
        moved = (cache.k[0].data_ptr(), cache.v[-1].data_ptr()) != buffers
        assert moved == (capacity == 0), capacity  # 5 slots, doubled to 10 and to 20
        runs[capacity] = torch.stack(logits, 1)
    torch.testing.assert_close(runs[0], runs[idx.shape[1]], atol=0, rtol=0)
    if model.cfg.arch == "llama":
        positions = torch.tensor([[0, 5, 17, 95], [3, 3, 40, 2]])
        for got, want in zip(model._decode_rope(positions), rotary(positions, model.cfg)):
            assert torch.equal(got, want)


def test_a_seed_reproduces_a_sample_and_another_seed_differs(model):
    runs = {
        seed: generate(model, PROMPTS, Sampling(max_new_tokens=40, temperature=1.0, seed=seed), 0, VOCAB).tokens
        for seed in (1, 1, 2)
    }
    again = generate(model, PROMPTS, Sampling(max_new_tokens=40, temperature=1.0, seed=1), 0, VOCAB).tokens
    assert again == runs[1] and runs[2] != runs[1]


def test_generation_stops_at_end_of_text(model):
    s = Sampling(max_new_tokens=30, temperature=0, stop_at_eot=False)
    free = generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB).tokens
    eot = free[0][4]  # pretend the fifth token of row 0 ends the text
    stopped = generate(model, PROMPTS, Sampling(max_new_tokens=30, temperature=0), eot_id=eot, vocab_size=VOCAB).tokens
    assert stopped[0] == free[0][: free[0].index(eot)]
    for row, full in zip(stopped[1:], free[1:]):
        assert row == (full[: full.index(eot)] if eot in full else full)


def test_each_sampling_control_follows_its_definition():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, 0.5]])
    none = torch.tensor([[-1]])
    g = torch.Generator().manual_seed(0)
    draws = lambda s, hist=none: {next_tokens(logits, hist, s, g).item() for _ in range(300)}  # noqa: E731
    assert draws(Sampling(temperature=0)) == {0}
    assert draws(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    # softmax([4, 3, 2, -1, .5]) = .66, .24, .09, ...: p = .8 keeps the first two, p = .5 one.
    assert draws(Sampling(temperature=1.0, top_p=0.8)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_p=0.5)) == {0}
    assert len(draws(Sampling(temperature=1.0))) == 5
    # CTRL penalty 3: token 0's logit 4 -> 1.33, below token 1's 3; a negative one is multiplied.
    assert draws(Sampling(temperature=0, repetition_penalty=3.0), torch.tensor([[0]])) == {1}
    penalised = logits.clone()
    penalised[0, 0], penalised[0, 3] = 4.0 / 3, -3.0
    hist = torch.tensor([[0, 3]])
    want = penalised.softmax(-1)[0]
    s = Sampling(temperature=1.0, repetition_penalty=3.0)
    counts = torch.bincount(torch.stack([next_tokens(logits, hist, s, g) for _ in range(4000)]).flatten(), minlength=5)
    assert torch.allclose(counts / 4000, want, atol=0.03)


def test_streamed_text_is_the_text_and_never_half_a_character():
    tok = ByteTokenizer()
    text = "naïve café ☃ — 日本語 ok\n"
    stream, pieces = TextStream(tok.decode), []
    for b in text.encode():  # one byte per token: every multi-byte character arrives in parts
        pieces.append(stream.push(b))
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 10  # it streamed, not all at the end


def test_a_prompt_too_long_for_the_context_is_refused(model):
    with pytest.raises(ValueError, match="exceeds the model's context of 96"):
        generate(model, [[1] * 90], Sampling(max_new_tokens=10), 0, VOCAB)


def test_bits_per_byte_count_each_byte_once(corpus, tmp_path):
    """Every token's byte count, summed over an encoded text, is the text's UTF-8 length: for a
    byte-level BPE whose tokens split characters, and for the byte tokenizer."""
    from pathlib import Path

    from kiln.data.tokenizer import BPETokenizer, token_bytes

    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    text = "naïve ☃ 日本語\n" + texts[0][:2000]
    for tok in (BPETokenizer.train(texts, 400), ByteTokenizer()):
        ids = tok.encode_batch([text])[0]
        assert int(token_bytes(tok)[ids].sum()) == len(text.encode("utf-8"))
        assert token_bytes(tok)[tok.eot_id] == 0


def test_the_compiled_decode_gives_the_eager_tokens_and_compiles_once(model):
    """`compile`: a StaticKVCache and the decode step under torch.compile (fullgraph: a graph
    break fails here). Greedy tokens equal the eager decode's, prompts of unequal lengths
    (left padding) included; a second call of the same shapes traces nothing new."""
    from torch._dynamo.utils import counters

    s = Sampling(max_new_tokens=20, temperature=0, stop_at_eot=False)
    eager = generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB).tokens
    before = counters["stats"]["unique_graphs"]
    assert generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB, compile=True).tokens == eager
    traced = counters["stats"]["unique_graphs"]
    assert traced == before + 1  # one graph for every decode step
    again = generate(model, PROMPTS[::-1], s, eot_id=0, vocab_size=VOCAB, compile=True).tokens
    assert counters["stats"]["unique_graphs"] == traced  # same batch, same slots: no new trace
    assert again == eager[::-1]
    with pytest.raises(ValueError, match="compile needs the KV cache"):
        generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB, use_cache=False, compile=True)


def test_the_compiled_decode_sees_weights_changed_in_place(model):
    """The compiled step freezes the weights into its graph: after an in-place update (a
    fine-tune, a loaded state dict) it must decode with the new weights, not the frozen ones.
    On the shared model, whose step the test above compiled, and put back after: one compile
    here, not two."""
    s = Sampling(max_new_tokens=20, temperature=0, stop_at_eot=False)
    before = generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB, compile=True).tokens
    weight = model.blocks[0].mlp.proj.weight
    try:
        with torch.no_grad():
            weight.mul_(-1)  # the same parameter objects, new values
        eager = generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB).tokens
        assert eager != before  # the change shows in the text
        assert generate(model, PROMPTS, s, eot_id=0, vocab_size=VOCAB, compile=True).tokens == eager
    finally:
        with torch.no_grad():
            weight.mul_(-1)  # negation is exact: the fixture's weights again
