"""LoRA (kiln.lora) on the plain model: the trainable count is the formula's, training starts
from the base exactly, merging changes nothing the model computes, PEFT reads the adapters
as Kiln trained them, and each mistake is one line naming the field. Training under DeepSpeed,
resume and the checkpoint's size: tests/unit/parallel/test_parallelism.py."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kiln import lora as kiln_lora
from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.lora import LoraConfig, adapter_params, apply, merge
from kiln.model import GPT, config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model(flavour: str, **shape) -> GPT:
    torch.manual_seed(0)
    return GPT(config_for(flavour, vocab_size=320, seq_len=32, **shape)).eval()


# GQA with q/k/v biases (Qwen2's), an explicit head size, and GPT-2 (no gate).
SHAPES = {
    "llama-gqa-bias": ("llama-debug", {"qkv_bias": True}),
    "llama-head-size": ("llama-debug", {"head_size": 16}),
    "gpt": ("debug", {}),
}
TARGETS = ["q_proj,v_proj", "o_proj,down_proj", "k_proj,up_proj"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("targets", TARGETS)
def test_trainable_params_are_the_formulas_and_the_base_is_frozen(shape, targets):
    flavour, extra = SHAPES[shape]
    model = _model(flavour, **extra)
    before = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(rank=3, targets=targets)
    apply(model, lora, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(kiln_lora.is_adapter(n) for n in trainable)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert count == adapter_params(model.cfg, lora)
    assert sum(p.numel() for p in model.parameters()) == before + count


def test_every_target_of_llama_and_gpt():
    for flavour, names in (("llama-debug", kiln_lora.ALL_TARGETS), ("debug", kiln_lora.ATTENTION + kiln_lora.MLP_GPT)):
        model = _model(flavour)
        lora = LoraConfig(rank=2, targets=",".join(names))
        apply(model, lora, seed=0)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapter_params(model.cfg, lora)


def test_adapters_start_at_the_base_and_merging_changes_no_logit():
    base = _model("llama-debug", qkv_bias=True)
    x = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        want = base(x)
    lora = LoraConfig(rank=4, alpha=8.0, targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    model = apply(base, lora, seed=0)
    with torch.no_grad():
        assert torch.equal(model(x), want)  # B is zero: the adapted model is the base
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0, 0.2)
        adapted = model(x)
    assert (adapted - want).abs().max().item() > 1e-2
    plain = GPT(model.cfg).eval()
    plain.load_state_dict(merge(model.state_dict(), model.cfg, lora))
    with torch.no_grad():
        assert (plain(x) - adapted).abs().max().item() <= 1e-5


def test_the_same_seed_draws_the_same_adapters_and_leaves_the_rng_alone():
    a, b = _model("llama-debug"), _model("llama-debug")
    torch.manual_seed(7)
    apply(a, LoraConfig(rank=2), seed=3)
    after = torch.rand(1)
    apply(b, LoraConfig(rank=2), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    torch.manual_seed(7)
    assert torch.equal(torch.rand(1), after)


def test_peft_loads_the_adapter_export_with_the_same_logits(tmp_path, corpus):
    """Kiln's adapters on a Qwen2 checkpoint (q/k/v biases, GQA), written in PEFT's layout: peft
    on transformers' model gives the logits of Kiln's adapted model."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from hf_models import VOCAB, saved

    from kiln import hf_export
    from kiln.infer.load import load_model

    saved("qwen2", tmp_path / "base", corpus)
    loaded = load_model(str(tmp_path / "base"))
    model = loaded.build()
    lora = LoraConfig(rank=4, alpha=12.0, targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    apply(model, lora, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0, 0.2)
    adapters = {k: v for k, v in model.state_dict().items() if kiln_lora.is_adapter(k)}
    out = tmp_path / "adapters"
    out.mkdir()
    assert hf_export.write_adapters(loaded.cfg, adapters, lora, str(tmp_path / "base"), out) == [
        hf_export.ADAPTER_WEIGHTS,
        hf_export.ADAPTER_CONFIG,
    ]
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out
    ).eval()
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert (theirs(x).logits - model(x)[..., :VOCAB]).abs().max().item() <= 1e-5


def test_gpt2_adapters_are_refused_in_peft_layout():
    model = _model("debug")
    lora = LoraConfig(rank=2, targets="q_proj")
    apply(model, lora, seed=0)
    from kiln.hf_export import adapter_state

    with pytest.raises(ConfigError, match="--adapters: PEFT's layout for GPT-2"):
        adapter_state(model.cfg, model.state_dict(), lora)


# ---- mistakes: one line naming the field --------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.rank=4"], "model.lora.rank > 0 without model.init_from"),
        (["model.lora.rank=4", "model.lora.targets=q_proj,qkv"], "model.lora.targets = 'q_proj,qkv'"),
        (["model.lora.rank=-1"], "model.lora.rank = -1 is out of range"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha = 0"),
        (
            ["model.lora.rank=4", "model.init_from=/x", "parallel.zero_stage=3"],
            "parallel.zero_stage = 3 with model.lora",
        ),
        (
            ["model.lora.rank=4", "model.init_from=/x", "parallel.engine=fsdp2", "parallel.zero_stage=2"],
            "parallel.engine = 'fsdp2' with model.lora",
        ),
        (
            [
                "model.lora.rank=4",
                "model.init_from=/x",
                "parallel.num_workers=2",
                "parallel.pipeline_stages=2",
                "parallel.zero_stage=0",
            ],
            "parallel.pipeline_stages = 2 with model.lora",
        ),
    ],
)
def test_a_lora_mistake_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_a_target_the_architecture_lacks_is_named():
    cfg = dataclasses.replace(config_for("debug", vocab_size=320, seq_len=32))
    problem = kiln_lora.problem(LoraConfig(rank=2, targets="q_proj,gate_proj"), cfg)
    assert problem == (
        "model.lora.targets: ['gate_proj'] match no module of the gpt architecture "
        "(it has ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'up_proj', 'down_proj'])"
    )
    with pytest.raises(ConfigError, match="gate_proj"):
        apply(GPT(cfg), LoraConfig(rank=2, targets="gate_proj"), seed=0)
