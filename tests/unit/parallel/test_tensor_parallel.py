"""The split Kiln states to DeepSpeed AutoTP, and its inverse for export, agree with each other
and with the model (the end-to-end proof, against DeepSpeed's own sharding, is in
test_parallelism.py)."""

import pytest
import torch

from kiln.model import GPT, config_for
from kiln.parallel.tensor_parallel import merge_shards, partition_config, shard_of


@pytest.mark.parametrize("flavour", ["debug", "llama-debug"])
@pytest.mark.parametrize("bias", [False, True])  # GPT-2 checkpoints have biases: q/k/v's split, proj's whole
def test_shards_merge_back_to_the_whole_model(flavour, bias):
    cfg = config_for(flavour, vocab_size=64, seq_len=16, bias=bias)
    state = GPT(cfg).state_dict()
    shards = [shard_of(state, cfg, r, 2) for r in range(2)]
    qkv = "blocks.0.attn.qkv.weight"
    assert shards[0][qkv].shape[0] == state[qkv].shape[0] // 2
    assert not torch.equal(shards[0][qkv], state[qkv][: state[qkv].shape[0] // 2])  # q, k and v each split
    merged = merge_shards(shards, cfg)
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)


def test_a_model_with_a_rank_s_share_of_heads_computes_its_part_of_the_attention():
    """A block's attention on rank r's q/k/v and output-projection slices: the two ranks' outputs
    sum to the whole block's (what AutoTP's row-parallel all-reduce does)."""
    cfg = config_for("llama-debug", vocab_size=64, seq_len=16)
    whole = GPT(cfg).blocks[0].attn
    x = torch.randn(2, 8, cfg.d_model)
    parts = []
    for r in range(2):
        half = GPT(cfg).blocks[0].attn
        sd = shard_of({f"blocks.0.attn.{k}": v for k, v in whole.state_dict().items()}, cfg, r, 2)
        half.qkv.weight = torch.nn.Parameter(sd["blocks.0.attn.qkv.weight"])
        half.proj.weight = torch.nn.Parameter(sd["blocks.0.attn.proj.weight"])
        parts.append(half(x))
    with torch.no_grad():
        assert (sum(parts) - whole(x)).abs().max().item() < 1e-5


def test_the_partition_config_names_kilns_modules_and_keeps_the_head_whole():
    cfg = config_for("llama-debug")
    specs = partition_config(cfg)["layer_specs"]
    qkv = next(s for s in specs if "qkv" in s["patterns"][0])
    assert qkv["shape"] == [[4 * 32, 2 * 32, 2 * 32], -1] and qkv["partition_type"] == "column"
    assert next(s for s in specs if "fc" in s["patterns"][0])["shape"] == [2, -1]  # gate and up
    assert any("lm_head" in s["patterns"][0] and s["partition_type"] == "skip" for s in specs)
