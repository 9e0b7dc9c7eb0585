"""Shared fixtures: a small real corpus from the stdlib, and prepared datasets."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

# The suite's helper modules (mlflow_store, hf_models, ...) import by name from any test module.
sys.path.insert(0, str(Path(__file__).parent))

# Ray reads RAY_AUTH_MODE once per process and caches it, and importing some of Ray's modules
# (ray.train does, at collection time) is enough to fix it. The session's head uses token auth,
# so the mode must be set before any test module is imported, or every in-process driver
# connects without its token.
os.environ.setdefault("RAY_AUTH_MODE", "token")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
REPO = Path(__file__).resolve().parents[1]

# Small stdlib packages: real text nobody here wrote, ~300 KB of Python.
CORPUS_DIRS = [STDLIB / "json", STDLIB / "logging", STDLIB / "email" / "mime", STDLIB / "http"]


@pytest.fixture(scope="session", autouse=True)
def _mlflow_store_home(tmp_path_factory) -> None:
    """Where `mlflow_store.sqlite_store` keeps the session's template store (made on first use)."""
    import mlflow_store

    mlflow_store.HOME = tmp_path_factory.mktemp("mlflow-template")


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return [str(d) for d in CORPUS_DIRS]


@pytest.fixture(scope="session")
def byte_dataset(tmp_path_factory, corpus) -> Path:
    """A byte-tokenized dataset with seq_len 64, shared read-only by tests."""
    from kiln.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("data") / "bytes"
    prepare(PrepareConfig(inputs=corpus, output=str(out), tokenizer="byte", seq_len=64, shard_tokens=1 << 16))
    return out


@pytest.fixture(scope="session")
def prose_dataset(tmp_path_factory) -> Path:
    """A second byte-tokenized dataset (seq_len 64) of other text, the stdlib's xml and html
    packages: the other half of a mixture with `byte_dataset`."""
    from kiln.data.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("data") / "prose"
    prepare(
        PrepareConfig(
            inputs=[str(STDLIB / "xml"), str(STDLIB / "html")],
            output=str(out),
            tokenizer="byte",
            seq_len=64,
            shard_tokens=1 << 16,
        )
    )
    return out


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """Run with the cwd in a temp dir and no inherited MLflow/S3 settings."""
    for var in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "RAY_ADDRESS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tensors(obj, prefix=""):
    """Every tensor inside nested dicts/lists/tuples, by its path."""
    import torch

    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


@pytest.fixture
def checkpoint_tensors():
    """directory -> {file/path/to/tensor: tensor} over every .pt file of a checkpoint: weights,
    optimizer shards, RNG states. Two runs that trained alike give bitwise-equal ones."""
    import torch

    def load(directory) -> dict:
        files = sorted(Path(directory).rglob("*.pt"))
        assert files, f"no .pt files under {directory}"
        return {
            f"{f.name}{k}": t for f in files for k, t in _tensors(torch.load(f, map_location="cpu", weights_only=False))
        }

    return load


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, corpus) -> Path:
    """A tiny random GPT-2 in Hugging Face format (transformers' `save_pretrained`, one
    safetensors file) with a 300-token BPE tokenizer: a checkpoint a user downloaded."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kiln.data.tokenizer import BPETokenizer

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    config = transformers.GPT2Config(
        n_positions=64, n_embd=32, n_layer=2, n_head=4, vocab_size=300, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(d)
    texts = [p.read_text() for p in sorted(Path(corpus[0]).glob("*.py"))]
    (d / "tokenizer.json").write_text(BPETokenizer.train(texts, 300).to_json())
    return d


@pytest.fixture(scope="session")
def tiny_llama():
    """Makes a tiny random Llama in Hugging Face format (transformers' `save_pretrained`) with a
    300-token BPE tokenizer trained on `texts`, as a checkpoint a user downloaded:
    `tiny_llama(directory, texts, **LlamaConfig fields)` returns (the transformers model, the
    tokenizer). Grouped-query attention (4 heads, 2 key/value heads), 2 layers, vocab 320."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kiln.data.tokenizer import BPETokenizer

    def make(directory: Path, texts: list[str], **fields):
        tok = BPETokenizer.train(texts, 300)
        torch.manual_seed(0)
        shape = dict(vocab_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        shape |= dict(bos_token_id=tok.eot_id, eos_token_id=tok.eot_id)  # as GPT-2's: end-of-text both
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape | fields)).eval()
        model.save_pretrained(directory)
        (directory / "tokenizer.json").write_text(tok.to_json())
        return model, tok

    return make


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration carries the `integration` marker (`make test-fast`
    leaves them out with the `slow` ones)."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
