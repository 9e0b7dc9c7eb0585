import pytest
import torch

from kiln.core.optim import (
    OptimConfig,
    Settings,
    StepGate,
    build_optimizer,
    build_scheduler,
    gate_optimizer,
    param_groups,
    parameter_kinds,
)
from kiln.core.schedule import ScheduleConfig, lr_multiplier
from kiln.model import GPT, config_for


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


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "rmsprop", "lamb"])
def test_optimizers_build_and_step(name):
    torch.manual_seed(0)
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    lr = {"sgd": 0.3, "rmsprop": 1e-3}.get(name, 1e-2)
    opt = build_optimizer(model, OptimConfig(name=name, lr=lr))
    idx = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # torch's fused kernel wherever it has one, CPU included (bench/optimizer_step.py: AdamW's
    # step 4-5x faster than foreach there); RMSprop has none, LAMB is Kiln's own
    fused = {g.get("fused") for g in opt.param_groups}
    assert fused == ({True} if name in ("adamw", "adam", "sgd") else {None})


def test_no_decay_is_configurable():
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    kinds = parameter_kinds(model)
    assert kinds[id(model.wte.weight)] == "embeddings"  # tied to the head, still an embedding
    assert kinds[id(model.blocks[0].ln_1.weight)] == "norms"
    everything = param_groups(model, 0.1, no_decay="")
    assert len(everything) == 1 and everything[0]["weight_decay"] == 0.1
    only_norms = param_groups(model, 0.1, no_decay="norms")
    decayed = {id(p) for p in only_norms[0]["params"]}
    assert id(model.wte.weight) in decayed and id(model.blocks[0].ln_1.weight) not in decayed


def test_sgd_nesterov_and_rmsprop_take_their_settings():
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    sgd = build_optimizer(model, OptimConfig(name="sgd", momentum=0.8, nesterov=True))
    assert sgd.defaults["nesterov"] and sgd.defaults["momentum"] == 0.8
    rms = build_optimizer(model, OptimConfig(name="rmsprop", rmsprop_alpha=0.9, momentum=0.0))
    assert rms.defaults["alpha"] == 0.9 and rms.defaults["momentum"] == 0.0
    assert sgd.param_groups[0]["weight_decay"] == 0.1 and sgd.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["optim.name=adagrad"], "optim.name = 'adagrad' is not allowed"),
        (["optim.nesterov=true", "optim.name=adamw"], "Nesterov needs optim.name = 'sgd'"),
        (["optim.no_decay=norms,gains"], "optim.no_decay = 'norms,gains' is out of range"),
        (["schedule.restart_mult=0"], "schedule.restart_mult = 0 is out of range"),
    ],
)
def test_bad_optimizer_settings_are_named(sets, needle):
    from kiln.config import load_config
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, sets)


def _gated(model, optim: OptimConfig, sched: ScheduleConfig, max_steps: int):
    gate = StepGate()
    opt = gate_optimizer(build_optimizer(model, optim), gate)
    return opt, build_scheduler(opt, sched, max_steps, gate), gate


def test_a_load_keeps_this_runs_settings_and_its_own_gate(tmp_path):
    """A checkpoint's optimizer and schedule state, loaded as DeepSpeed loads them (through a
    pickle), into a run with another LR, weight decay, betas and schedule: the moments and the
    step count are the checkpoint's, every setting is the new run's, and the gate that the
    health guard shuts still stops the optimizer and the schedule."""
    torch.manual_seed(0)
    model = GPT(config_for("debug", vocab_size=64, seq_len=16))
    sched_cfg = ScheduleConfig(name="cosine", warmup_steps=2)
    opt, sched, _ = _gated(model, OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1), sched_cfg, 20)
    for _ in range(3):
        opt.zero_grad()
        sum((q * q).sum() for q in model.parameters()).backward()
        opt.step()
        sched.step()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)

    new_optim = OptimConfig(name="adamw", lr=5e-3, weight_decay=0.02, beta2=0.99)
    new_sched = ScheduleConfig(name="linear", warmup_steps=2)
    opt2, sched2, gate2 = _gated(model, new_optim, new_sched, 30)
    settings = Settings.of(sched2)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.param_groups[0]["lr"] != 5e-3 * lr_multiplier(3, new_sched, 30)  # the load brought the old back
    settings.restore(sched2)

    assert sched2.last_epoch == 3 and sched2.gate is gate2
    want = 5e-3 * lr_multiplier(3, new_sched, 30)
    assert [g["lr"] for g in opt2.param_groups] == [want, want] and sched2.get_last_lr() == [want, want]
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.02, 0.0]
    assert opt2.param_groups[0]["betas"][1] == 0.99
    assert opt2.state.keys() == opt.state.keys()
    assert all(torch.equal(opt2.state[q]["exp_avg"], opt.state[q]["exp_avg"]) for q in opt.state)

    before = model.wte.weight.detach().clone()
    gate2.open = False  # the guard withholds this step: neither the weights nor the schedule move
    opt2.step()
    sched2.step()
    assert torch.equal(model.wte.weight, before) and sched2.last_epoch == 3 and gate2.withheld == 1
    gate2.open = True
    sched2.step()
    assert sched2.last_epoch == 4 and sched2.get_last_lr()[0] == 5e-3 * lr_multiplier(4, new_sched, 30)
