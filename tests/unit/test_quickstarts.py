"""The README's quickstarts run as written, from a clean directory holding only the repository's
jobs/: each command line of their bash blocks goes to bash with `.venv/bin` first on the PATH.

What each run changes, and why:
- the CPU quickstart's `my-corpus/` is the stdlib's email and http packages, and it runs the data
  step and the dry run; its training and sampling lines are the two commands `make demo` runs on
  the demo's data (run here as written, with 5 steps, they passed in a fresh clone on 2026-11-27,
  and took 98 s of the suite's time, which is why they are left to `make demo`);
- the GPU quickstart runs its data step and `kiln plan` (the training line needs a GPU, and runs
  when a device is lent: bench/gpu_speed.sh);
- the fine-tuning quickstart's `/models/llama-3.2-1b-instruct` is a tiny random Llama
  (transformers' `save_pretrained`, a 1024-token context, a BPE tokenizer with a chat template),
  `chat.jsonl` holds conversations, and its `kiln train` line is a `--dry-run` (every pre-launch
  check against that checkpoint and data); the recipe itself, trained, exported, asked with
  `--chat` and served, runs in tests/integration/test_finetune_on_ray.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _block(heading: str) -> list[str]:
    section = README[README.index(f"## {heading}") :]
    section = section[: section.index("\n## ", 4)]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+#[^'\"]*$", "", line).strip() for line in lines if line.strip()]


def _run(line: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (line, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr, (line, out.stderr[-3000:])
    return out


@pytest.fixture
def clean_dir(tmp_path) -> Path:
    (tmp_path / "jobs").symlink_to(REPO / "jobs")
    return tmp_path


def test_the_cpu_quickstarts_data_and_pre_launch_checks(clean_dir):
    prepare, dry_run, train, generate, mlflow_ui = _block("CPU quickstart: your own text")
    for package in ("email", "http"):
        shutil.copytree(
            STDLIB / package, clean_dir / "my-corpus" / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    _run(prepare, clean_dir)
    assert (clean_dir / "data/mine/manifest.json").is_file()
    out = _run(dry_run, clean_dir)
    assert "memory" in out.stdout and "data/mine" in out.stdout, out.stdout
    # Training and sampling are `make demo`'s two commands on the demo's own data.
    demo = (REPO / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    assert (
        train.startswith("kiln train --config jobs/configs/debug.yaml")
        and "kiln train --config jobs/configs/debug.yaml" in demo
    )
    assert generate.startswith("kiln generate --model ") and "kiln generate --model" in demo
    assert mlflow_ui.startswith("mlflow ui --backend-store-uri sqlite:///mlflow.db")


def test_the_gpu_quickstarts_data_step_and_plan(clean_dir):
    install, prepare, plan, train = _block("GPU quickstart: GPT-2 small from a fresh clone")
    assert install == "make install && source .venv/bin/activate"
    _run(prepare, clean_dir)
    manifest = json.loads((clean_dir / "data/stdlib-bpe-1024/manifest.json").read_text())
    assert manifest["seq_len"] == 1024 and manifest["tokenizer"]["vocab_size"] == 8192
    out = _run(plan, clean_dir)
    assert "12 layers x d_model 768" in out.stdout and "micro-batch 64 x seq 1024" in out.stdout, out.stdout
    assert train.startswith("kiln train --config jobs/configs/gpt2-124m.yaml")


def test_the_fine_tuning_quickstarts_data_and_pre_launch_checks(clean_dir, tiny_llama):
    heading = "Fine-tuning quickstart: a LoRA chat fine-tune of a Hugging Face checkpoint"
    prepare, train, export, generate, serve = _block(heading)
    model = clean_dir / "models" / "llama-3.2-1b-instruct"
    texts = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    _, tok = tiny_llama(model, texts, hidden_size=32, intermediate_size=64, max_position_embeddings=1024)
    end = tok.id_to_token(tok.eot_id)
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": end, "chat_template": template}))
    with (clean_dir / "chat.jsonl").open("w") as f:
        for t in texts * 40:  # enough for a validation micro-batch on each of the recipe's 2 workers
            messages = [{"role": "user", "content": t[:200]}, {"role": "assistant", "content": t[200:900]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    here = str(model)
    _run(prepare.replace("/models/llama-3.2-1b-instruct", here), clean_dir)
    out = _run(train.replace("/models/llama-3.2-1b-instruct", here) + " --dry-run", clean_dir)
    assert "llama-3.2-1b-instruct (init_from)" in out.stdout and "Llama architecture" in out.stdout, out.stdout
    assert export.startswith("kiln export runs/llama3-lora-chat --output exports/llama3-lora-chat")
    assert generate.startswith("kiln generate --model exports/llama3-lora-chat --chat")
    assert serve.startswith("mlflow models serve -m models:/llama3-lora-chat/1")
