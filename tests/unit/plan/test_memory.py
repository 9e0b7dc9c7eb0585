"""The memory planner: DeepSpeed's own estimators agree, and it plans clusters nobody here has."""

import dataclasses

import pytest

from kiln.errors import ConfigError
from kiln.model import config_for
from kiln.model_size import largest_layer_params, num_params
from kiln.plan.memory import GIB, PlanInput, estimate, plan_input
from kiln.plan.options import first_fit, format_table, options, refuse_if_too_big


@pytest.mark.parametrize("flavour", ["gpt2-124m", "1.3b", "13b"])
@pytest.mark.parametrize("gpus", [1, 8, 64])
def test_model_states_agree_with_deepspeed_estimators(flavour, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = config_for(flavour, vocab_size=50304)
    psi, largest = num_params(model, non_embedding=False), largest_layer_params(model)
    base = PlanInput(model=model, world_size=gpus, precision="bf16", optimizer="adamw")

    def device_bytes(**kw):
        return estimate(PlanInput(**{**base.__dict__, **kw})).model_states

    for offload in (False, True):
        _, ds = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=offload)
        ours = device_bytes(zero_stage=2, offload_optimizer="cpu" if offload else "none")
        assert ours == pytest.approx(ds, rel=1e-6), (offload, ours, ds)
    for opt_off, par_off in ((False, False), (True, False), (True, True)):
        _, ds, *_ = estimate_zero3_model_states_mem_needs(
            psi, largest, num_gpus_per_node=gpus, cpu_offload=opt_off, cpu_offload_params=par_off
        )
        ours = device_bytes(
            zero_stage=3, offload_optimizer="cpu" if opt_off else "none", offload_params="cpu" if par_off else "none"
        )
        assert ours == pytest.approx(ds, rel=1e-6), (opt_off, par_off, ours, ds)


def test_zero_paper_figure_for_7_5b_on_64_gpus():
    # ZeRO paper, figure 1: 7.5B params, Adam, mixed precision, 64 GPUs -> 120 / 31.4 / 16.6 / 1.9 GB.
    m = config_for("6.7b", vocab_size=50304)
    scale = 7.5e9 / num_params(m, non_embedding=False)
    paper = {0: 120, 1: 31.4, 2: 16.6}  # stage 3 (1.9 GB): DeepSpeed's own estimator, above
    for stage, gb in paper.items():
        est = estimate(PlanInput(model=m, world_size=64, zero_stage=stage, precision="bf16"))
        # The paper counts K=12 (no fp32 gradient copy) and no gathered layer: compare that part.
        psi = 7.5e9
        ideal = (est.params + est.grads) * scale + (12 * psi / (64 if stage else 1))
        assert ideal / 1e9 == pytest.approx(gb, rel=0.02), stage


def test_plans_a_13b_model_on_64_h100s_without_hardware():
    base = PlanInput(
        model=config_for("13b", vocab_size=50304),
        world_size=64,
        device_memory_gib=80,
        micro_batch=1,
        zero_stage=0,
        precision="bf16",
    )
    assert not estimate(base).fits  # 13B with plain data parallelism needs ~16 bytes x 13B per GPU
    best = first_fit(base)
    assert best is not None and best.estimate.fits and best.plan.zero_stage >= 1
    # cheapest first: nothing cheaper than the recommendation fits
    ranked = options(base)
    assert all(not o.estimate.fits or o.cost >= best.cost for o in ranked)
    table = format_table(base)
    assert "recommended (cheapest that fits)" in table and "12.9B params" in table
    assert len(
        [
            line
            for line in table.splitlines()
            if "tensor_parallel=" not in line
            and line.rstrip().endswith(("1.00", "1.15", "1.33", "1.50", "1.53", "1.72", "2.00", "2.29", "4.31", "5.74"))
        ]
    ) == len(ranked)


def test_activation_checkpointing_and_pipeline_shrink_activations():
    m = config_for("1.3b", vocab_size=50304)
    full = estimate(PlanInput(model=m, micro_batch=4)).activations
    ckpt = estimate(PlanInput(model=m, micro_batch=4, activation_checkpointing=True)).activations
    assert ckpt < 0.5 * full
    pp = estimate(PlanInput(model=m, micro_batch=4, world_size=4, pipeline_stages=4, micro_batches=8))
    flat = estimate(PlanInput(model=m, micro_batch=4, world_size=4))
    assert pp.params == pytest.approx(flat.params / 4, rel=0.01)


def test_refusal_names_the_overflow_and_the_first_option_that_fits():
    base = PlanInput(
        model=config_for("1.3b", vocab_size=50304),
        world_size=8,
        device_memory_gib=24,
        micro_batch=1,
        zero_stage=0,
        precision="bf16",
    )
    with pytest.raises(ConfigError) as e:
        refuse_if_too_big(base, "parallel.device_memory_gib")
    msg = str(e.value)
    assert "GiB over" in msg and "parallel.device_memory_gib gives 24.00 GiB" in msg
    assert "the first option that fits: parallel.zero_stage=" in msg
    fits = first_fit(base)
    assert f"({fits.estimate.total / GIB:.2f} GiB)" in msg


def test_autocast_keeps_fp32_states_and_residual_stream():
    """bf16 autocast holds fp32 weights and gradients (16 bytes per parameter with Adam at ZeRO-0,
    against DeepSpeed's bf16 weights' 20) and an fp32 residual stream; the run's resolution of
    `auto` reaches the planner."""
    from kiln.config import load_config

    m = config_for("gpt2-124m", vocab_size=8192, seq_len=1024)

    def est(precision, mixed="weights", **kw):
        return estimate(PlanInput(model=m, micro_batch=16, precision=precision, mixed_precision=mixed, **kw))

    weights, autocast, fp32 = est("bf16"), est("bf16", "autocast"), est("fp32")
    psi = num_params(m, non_embedding=False)
    assert (weights.model_states, autocast.model_states, fp32.model_states) == (20 * psi, 16 * psi, 16 * psi)
    assert weights.activations < autocast.activations < fp32.activations
    assert est("bf16", "auto").model_states == autocast.model_states  # a GPU at ZeRO-0
    assert est("bf16", "auto", zero_stage=2).model_states == est("bf16", zero_stage=2).model_states
    for zero, want in ((0, True), (2, False)):
        cfg = load_config(None, ["parallel.use_gpu=true", "train.precision=bf16", f"parallel.zero_stage={zero}"])
        assert plan_input(cfg, m, 80).autocast is want


def test_tensor_parallel_divides_the_split_weights_and_most_activations():
    from kiln.model_size import split_params

    m = config_for("llama-7b", vocab_size=32000)
    one = estimate(PlanInput(model=m, world_size=2, micro_batch=1, precision="bf16"))
    two = estimate(PlanInput(model=m, world_size=2, micro_batch=1, precision="bf16", tensor_parallel=2))
    assert one.params - two.params == 2 * (split_params(m) // 2)  # bf16: 2 bytes per split weight halved away
    assert 0.5 * one.activations < two.activations < 0.75 * one.activations  # norms and inputs stay whole
    base = PlanInput(
        model=m, world_size=8, micro_batch=1, precision="bf16", device_memory_gib=24, activation_checkpointing=True
    )
    table = format_table(base)
    assert "tensor_parallel=4 (2 data-parallel x 4 tensor-parallel)" in table
    # At 40 GiB ZeRO-3 fits without checkpointing (cost 1.15), and so does TP=2 at ZeRO-2 (1.10):
    # the planner recommends splitting inside the node.
    roomy = format_table(dataclasses.replace(base, device_memory_gib=40))
    assert "recommended (cheapest that fits): tensor_parallel=2, zero_stage=2" in roomy, roomy


def test_kiln_plan_tells_an_elastic_run_how_often_to_checkpoint():
    from kiln.config import load_config
    from kiln.plan.cli import elastic_advice

    assert elastic_advice(load_config(None, ["parallel.num_workers=2"])) == ""
    never = elastic_advice(load_config(None, ["parallel.num_workers=[1, 2]", "parallel.resize_check_s=120"]))
    assert "memory is planned for 1 worker(s)" in never and "checkpoint at least every 120 s" in never
    assert "train.checkpoint_every_minutes = 2" in never and "now never (each resize starts again at step 0)" in never
    some = elastic_advice(
        load_config(
            None, ["parallel.num_workers=[1, 2]", "train.checkpoint_every=50", "train.checkpoint_every_minutes=5"]
        )
    )
    assert "now every 50 steps and every 5 min" in some


def test_kiln_plan_without_a_config_plans_the_gpu_layout(capsys):
    """Without --config the plan is per GPU: bf16 at ZeRO-0 computes under autocast over fp32
    weights (auto's choice there), as a GPU run would; --set parallel.use_gpu=false plans CPU
    workers, which keep DeepSpeed's bf16 weights."""
    from kiln.cli import main

    def zero0_row(*more: str) -> list[str]:
        main(["plan", "--model", "gpt2-124m", "--precision", "bf16", "--zero-stage", "0", *more])
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("*")).split()

    gpu, cpu = zero0_row(), zero0_row("--set", "parallel.use_gpu=false")
    # columns: *, zero, offload, ckpt, params, grads, master+fp32g, ...: fp32 weights on the GPU
    assert float(gpu[4]) == pytest.approx(2 * float(cpu[4]), rel=0.01)
    assert float(gpu[6]) == 0 < float(cpu[6])  # no fp32 master beside fp32 weights


def test_lora_counts_gradients_and_optimizer_state_for_the_adapters_alone():
    """With LoRA the base is weights only: gradients, fp32 master copies and the optimizer's
    moments are the adapters' (kiln.lora.adapter_params), and the options keep to ZeRO 0-2
    without tensor parallelism, where LoRA trains."""
    from kiln.lora import LoraConfig, adapter_params

    m = config_for("llama-1b", vocab_size=32000, seq_len=2048)
    n = adapter_params(m, LoraConfig(rank=16))
    full = PlanInput(m, world_size=2, zero_stage=2, precision="bf16", use_gpu=True)
    lora = dataclasses.replace(full, adapters=n)
    e, f = estimate(lora), estimate(full)
    psi = num_params(m, non_embedding=False)
    assert e.params == 2 * (psi + n)  # bf16 weights, the adapters' too
    assert e.grads == 2 * n // 2 and e.optimizer_states == 4 * 2 * n // 2 and e.master == 2 * 4 * n // 2
    assert e.model_states < 0.2 * f.model_states
    assert {o.plan.zero_stage for o in options(lora)} == {0, 1, 2}
    assert {o.plan.tensor_parallel for o in options(lora)} == {1}
    assert "tensor_parallel=2" not in format_table(dataclasses.replace(lora, world_size=8))


def test_fsdp2_gathers_a_unit_of_blocks_at_zero3():
    """At ZeRO-3 FSDP2 holds two units gathered (the one computing and the next) and one unit's
    gradients: with gpt2-124m's 7M-parameter blocks the default unit (100M) is all twelve, and
    `fsdp2_unit_params=0` makes a unit one block."""
    from kiln.model_size import block_params

    m = config_for("gpt2-124m", vocab_size=50304)
    block, root = block_params(m), num_params(m, non_embedding=False) - m.n_layer * block_params(m)
    base = PlanInput(model=m, engine="fsdp2", zero_stage=3, precision="bf16")
    assert estimate(base).gathered == 2 * (root + 12 * block) + 6 * 12 * block
    assert estimate(dataclasses.replace(base, fsdp2_unit_params=0)).gathered == 2 * (root + 2 * block) + 6 * block
    five = dataclasses.replace(base, fsdp2_unit_params=5 * block)  # units of 5, 5 and 2 blocks
    assert estimate(five).gathered == 2 * (root + 10 * block) + 6 * 5 * block
