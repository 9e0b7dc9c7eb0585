"""`kiln generate` and `kiln export` at their edges: a context shorter than the default
request, and exports that replace only Kiln's own earlier export."""

from __future__ import annotations

import shutil

import pytest

from kiln import guard
from kiln.cli import main


def test_generate_with_default_flags_fits_a_short_context(tiny_hf, capsys, caplog):
    # The tiny model's context is 64 tokens: the default 64 new tokens plus a prompt do not fit.
    assert main(["generate", "--model", str(tiny_hf), "--prompt", "def main():", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def main():") and "tokens in" in out.err
    assert any("--max-new-tokens 64 cut to" in r.getMessage() for r in caplog.records)


def test_generate_compile_prints_the_eager_text(tiny_hf, capsys):
    """`--compile` decodes over a static cache with the step compiled: greedy, the same text."""
    flags = ["generate", "--model", str(tiny_hf), "--prompt", "def main():", "--temperature", "0"]
    flags += ["--max-new-tokens", "24", "--no-stop"]
    assert main(flags) == 0
    eager = capsys.readouterr().out
    assert main([*flags, "--compile"]) == 0
    assert capsys.readouterr().out == eager and len(eager) > len("def main():")


def test_a_prompt_that_fills_the_context_names_the_flag(tiny_hf, capsys):
    assert main(["generate", "--model", str(tiny_hf), "--prompt", "x " * 200]) == 2
    assert "kiln: error: --prompt:" in capsys.readouterr().err


def test_export_replaces_only_its_own_earlier_export(tiny_hf, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(tiny_hf), "--output", str(out)]) == 0
    assert guard.owns_dir(out, "export") and (out / "model.safetensors").is_file()
    (out / "stale.txt").write_text("from an earlier export")  # inside Kiln's export: replaced whole
    assert main(["export", str(tiny_hf), "--output", str(out)]) == 2  # no --overwrite
    assert main(["export", str(tiny_hf), "--output", str(out), "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and guard.owns_dir(out, "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp or trash beside it

    lookalike = tmp_path / "hub"
    shutil.copytree(out, lookalike)
    (lookalike / guard.MARKER).unlink()
    (lookalike / "README.md").write_text("# model card")
    capsys.readouterr()
    assert main(["export", str(tiny_hf), "--output", str(lookalike), "--overwrite"]) == 2
    assert "no .kiln-output marker" in capsys.readouterr().err
    assert (lookalike / "README.md").read_text() == "# model card"


@pytest.mark.parametrize(
    "device,needle", [("cuda:7", "--device cuda:7"), ("gpu0", "--device gpu0"), ("meta", "--device meta")]
)
def test_a_device_this_machine_lacks_is_one_line(tiny_hf, capsys, device, needle):
    assert main(["generate", "--model", str(tiny_hf), "--prompt", "a", "--device", device]) == 2
    assert f"kiln: error: {needle}" in capsys.readouterr().err


def test_device_auto_is_a_gpu_where_torch_sees_one_else_the_cpu(tiny_hf, capsys):
    """The default: a machine without CUDA generates on the CPU, one with CUDA on its first GPU."""
    import torch

    from kiln.infer.commands import check_device

    assert check_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert check_device("cpu") == "cpu"
    assert main(["generate", "--model", str(tiny_hf), "--prompt", "a", "--max-new-tokens", "3"]) == 0


def test_export_in_bf16_shards_as_save_pretrained_does_and_loads_back(tiny_hf, tmp_path):
    """`--dtype bf16 --max-shard-size 40KB`: several shards and transformers' index, config.json
    saying bfloat16; transformers and Kiln both load it, every weight the fp32 export's, rounded."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file

    from kiln.infer.load import load_model

    whole, halved = tmp_path / "fp32", tmp_path / "bf16"
    assert main(["export", str(tiny_hf), "--output", str(whole)]) == 0
    assert main(["export", str(tiny_hf), "--output", str(halved), "--dtype", "bf16", "--max-shard-size", "40KB"]) == 0
    index = json.loads((halved / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (halved / "model.safetensors").exists(), shards
    assert all((halved / s).stat().st_size <= 40_000 + 1_000 for s in shards)  # the cap, and a header
    assert json.loads((halved / "config.json").read_text())["dtype"] == "bfloat16"
    reference = load_file(str(whole / "model.safetensors"))
    got = {k: v for s in shards for k, v in load_file(str(halved / s)).items()}
    assert sorted(got) == sorted(reference) == sorted(index["weight_map"])
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], reference[k].to(torch.bfloat16)) for k in got)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(halved)
    assert next(theirs.parameters()).dtype == torch.bfloat16
    mine = load_model(str(halved))
    assert torch.equal(mine.state["wte.weight"][:300], reference["transformer.wte.weight"].to(torch.bfloat16).float())
