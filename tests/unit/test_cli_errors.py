"""Every user mistake: a non-zero exit, one clear line, no traceback, nothing half-written."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KILN = [str(Path(sys.executable).parent / "kiln")]


def kiln(*args, cwd, env=None, timeout=120):
    return subprocess.run([*KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_clean_error(out, needle):
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]


def test_missing_corpus(tmp_path):
    out = kiln("data", "prepare", "--input", "nope", "--output", "ds", "--tokenizer", "byte", cwd=tmp_path)
    assert_clean_error(out, "input 'nope' does not exist")
    assert not (tmp_path / "ds").exists()


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    out = kiln("data", "prepare", "--input", "empty", "--output", "ds", "--tokenizer", "byte", cwd=tmp_path)
    assert_clean_error(out, "the corpus is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_output_holding_a_different_dataset(tmp_path, byte_dataset, corpus):
    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    before = (ds / "manifest.json").read_bytes()
    out = kiln("data", "prepare", "--input", corpus[0], "--output", str(ds), "--tokenizer", "byte", "--seq-len", "32",
               cwd=tmp_path)
    assert_clean_error(out, "already holds a different dataset")
    assert (ds / "manifest.json").read_bytes() == before


def test_config_typo(tmp_path, byte_dataset):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", "optim.lrr=0.1", cwd=tmp_path)
    assert_clean_error(out, "unknown config key 'optim.lrr'; did you mean 'lr'?")


def test_bad_value_names_field_and_range(tmp_path):
    out = kiln("train", "--set", "parallel.zero_stage=4", cwd=tmp_path)
    assert_clean_error(out, "parallel.zero_stage = 4 is out of range: expected one of 0, 1, 2, 3")


@pytest.mark.parametrize("override, needle", [
    ("model.seq_len=32", "model.seq_len = 32 does not match the seq_len of"),
    ("model.vocab_size=128", "model.vocab_size = 128 is smaller than the vocab of"),
])
def test_model_data_mismatch(tmp_path, byte_dataset, override, needle):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", override, cwd=tmp_path)
    assert_clean_error(out, needle)
    assert not (tmp_path / "mlflow.db").exists()  # refused before any run was opened


def test_corrupt_parquet_shard_is_named(tmp_path, byte_dataset):
    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    shard = ds / json.loads((ds / "manifest.json").read_text())["splits"]["val"]["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[-8:-4] = b"\x00\x00\x00\x7f"
    shard.write_bytes(bytes(raw))
    out = kiln("train", "--set", f"data.path={ds}", cwd=tmp_path)
    assert_clean_error(out, f"shard {shard} is not a readable Parquet file")


def test_fp16_on_cpu_is_refused(tmp_path, byte_dataset):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", "train.precision=fp16", cwd=tmp_path)
    assert_clean_error(out, "train.precision = 'fp16' is not supported on CPU")


def test_unreachable_s3_endpoint(tmp_path, corpus):
    out = kiln("data", "prepare", "--input", corpus[0], "--output", "s3://bucket/ds", "--tokenizer", "byte",
               "--s3-endpoint", "http://127.0.0.1:9", cwd=tmp_path, timeout=120)
    assert_clean_error(out, "(S3 endpoint http://127.0.0.1:9)")
    out = kiln("train", "--set", "data.path=s3://bucket/ds", "--set", "data.s3_endpoint=http://127.0.0.1:9", cwd=tmp_path)
    assert_clean_error(out, "cannot access s3://bucket/ds")


def test_unreachable_mlflow_server(tmp_path, byte_dataset):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", "logging.tracking_uri=http://127.0.0.1:9",
               cwd=tmp_path)
    assert_clean_error(out, "MLflow tracking server http://127.0.0.1:9 is unreachable")
