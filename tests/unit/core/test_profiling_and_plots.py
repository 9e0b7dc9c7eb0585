"""The profiling window (a real torch.profiler trace and operator table) and the end-of-run plots."""

import json
import re

import pytest
import torch

from kiln.config import load_config
from kiln.core.profiling import ProfileConfig, StepProfiler
from kiln.errors import ConfigError
from kiln.tracking.plots import training_plots


def _keep_mib(n: int) -> bytearray:
    return bytearray(n * 2**20)  # memray names this frame: it is entered while the window tracks


def test_profiler_window_writes_a_chrome_trace_top_operators_and_a_host_memory_profile():
    prof = StepProfiler(
        ProfileConfig(start_step=2, steps=2, ranks="0,1"), rank=1, world_size=2, device=torch.device("cpu")
    )
    a = torch.randn(64, 64)
    windows, held = [], []
    for step in range(1, 6):
        prof.begin(step)
        (a @ a).relu_()
        held.append(_keep_mib(24) if step in (2, 3) else None)  # 24 MiB kept in each profiled step
        windows.append(prof.end(step))
    assert windows[:2] == [None, None] and windows[3:] == [None, None]
    out = windows[2]
    trace = json.loads((out / "trace_rank1.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "aten::relu_" in names
    assert "aten::mm" in (out / "top_ops_rank1.txt").read_text()
    # memray saw the 48 MiB this test kept, and says where it was allocated
    report = (out / "host_memory_rank1.txt").read_text()
    peak = float(re.search(r"peak host memory in the window: ([\d.]+) MiB", report).group(1))
    assert peak >= 48, report
    assert re.search(
        r"^\s+48\.\d\d MiB in\s+2 allocation\(s\)  _keep_mib .*test_profiling_and_plots\.py", report, re.M
    ), report
    assert (out / "host_memory_rank1.html").read_text().lstrip().startswith("<!DOCTYPE html>")
    # ranks not listed, and start_step 0, do not profile
    assert not StepProfiler(ProfileConfig(start_step=2, ranks="0"), 1, 2, torch.device("cpu")).enabled
    assert not StepProfiler(ProfileConfig(start_step=0, ranks="all"), 0, 2, torch.device("cpu")).enabled
    assert ProfileConfig(ranks="all").rank_set(3) == {0, 1, 2}


@pytest.mark.parametrize(
    "override, says",
    [
        ("train.profile.start_step=199", "run past train.max_steps = 200"),
        ("train.profile.ranks=0,x", "expected comma-separated ranks or 'all'"),
        ("train.profile.ranks=2", "ranks run 0..1"),
        ("train.profile.steps=0", "steps >= 1"),
    ],
)
def test_bad_profile_windows_are_refused(override, says):
    sets = ["train.max_steps=200", "train.profile.start_step=5", "train.profile.steps=3", override]
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, sets)


def test_profile_window_is_a_nested_config_section():
    cfg = load_config(None, ["train.profile.start_step=10", "train.profile.ranks=all"])
    assert cfg.train.profile == ProfileConfig(start_step=10, steps=3, ranks="all")
    assert cfg.to_dict()["train"]["profile"]["start_step"] == 10


def test_training_plots_from_a_history(tmp_path):
    steps = range(1, 31)
    history = {
        "loss/train": [(s, 6.0 / s**0.3) for s in steps],
        "loss/val": [(10, 3.1), (20, 2.8), (30, 2.7)],
        "lr": [(s, 1e-3 * min(1, s / 5)) for s in steps],
        "throughput/tokens_per_s": [(s, 1000.0 + s) for s in steps],
        "time/data_wait_s": [(s, 0.01) for s in steps],
        "time/forward_s": [(s, 0.1) for s in steps],
        "time/backward_s": [(s, 0.2) for s in steps],
        "time/optimizer_s": [(s, 0.05) for s in steps],
    }
    written = training_plots(history, tmp_path)
    assert [p.name for p in written] == ["loss.png", "lr.png", "throughput.png", "step_time.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # a pipeline run logs no forward/backward split: that plot is left out, not drawn empty
    only_loss = training_plots({"loss/train": history["loss/train"]}, tmp_path / "b")
    assert [p.name for p in only_loss] == ["loss.png"]


def test_without_memray_a_profile_warns_and_leaves_the_host_part_out(monkeypatch, caplog, tmp_path):
    """memray is the `profile` extra, not a dependency: where it is missing, the host memory
    profile is left out with one warning naming the extra's package, and nothing is written."""
    import sys

    from kiln.core import profiling

    monkeypatch.setitem(sys.modules, "memray", None)  # as if not installed: its import fails
    with caplog.at_level("WARNING", logger="kiln.core.profiling"):
        assert profiling._host_tracker(tmp_path / "host.bin") is None
    assert "memray is not installed" in caplog.text and not list(tmp_path.iterdir())
