import json
import shutil

import pytest

from kiln.data.manifest import check_shards, load_manifest
from kiln.errors import DataError
from kiln.storage import resolve


@pytest.fixture
def dataset_copy(byte_dataset, tmp_path):
    dst = tmp_path / "ds"
    shutil.copytree(byte_dataset, dst)
    return dst


def _first_shard(ds):
    return ds / json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"][0]["path"]


def test_corrupt_shard_is_named(dataset_copy):
    shard = _first_shard(dataset_copy)
    data = bytearray(shard.read_bytes())
    data[-12:-8] = b"\xff\xff\xff\x7f"  # wreck the footer length, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"shard {shard} is not a readable Parquet file"):
        check_shards(load_manifest(resolve(str(dataset_copy))))


def test_truncated_and_missing_shards_are_named(dataset_copy):
    shard = _first_shard(dataset_copy)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match=f"shard {shard} is 100 bytes but the manifest says"):
        check_shards(load_manifest(resolve(str(dataset_copy))))
    shard.unlink()
    with pytest.raises(DataError, match=f"shard {shard} listed in the manifest is missing"):
        check_shards(load_manifest(resolve(str(dataset_copy))))


def test_missing_or_incomplete_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist; create it with `kiln data prepare`"):
        load_manifest(resolve(str(tmp_path / "none")))
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="holds no manifest.json"):
        load_manifest(resolve(str(tmp_path / "half")))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.__setitem__("tokenizer", "byte"), "tokenizer: expected an object (got 'byte')"),
        (lambda d: d["splits"]["train"]["shards"][0].pop("bytes"), "splits.train.shards.0.bytes: Field required"),
        (lambda d: d["splits"].pop("val"), "splits.val: Field required"),
        (lambda d: d.__setitem__("seq_len", "x"), "seq_len: Input should be a valid integer"),
        (lambda d: d["splits"]["train"]["shards"][0].__setitem__("sha256", "00"), "splits.train.shards.0.sha256"),
        (lambda d: d.clear() or d.update({"x": 42}), "is not a Kiln manifest"),
    ],
    ids=["tokenizer-a-string", "shard-without-bytes", "no-val-split", "seq-len-a-string", "bad-sha", "foreign-json"],
)
def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(dataset_copy, mutate, needle):
    path = dataset_copy / "manifest.json"
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        load_manifest(resolve(str(dataset_copy)))
    assert needle in str(e.value) and "\n" not in str(e.value)
    (dataset_copy / "manifest.json").write_text("42")
    with pytest.raises(DataError, match="the file: expected an object"):
        load_manifest(resolve(str(dataset_copy)))


def test_verify_checks_the_seq_len_against_the_shards(dataset_copy):
    import subprocess
    import sys
    from pathlib import Path

    path = dataset_copy / "manifest.json"
    doc = json.loads(path.read_text())
    doc["seq_len"] = 16
    path.write_text(json.dumps(doc))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kiln"), "data", "verify", str(dataset_copy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr  # a runtime failure, not a usage error
    assert "has column 'tokens'" in out.stderr and "(seq_len 16) needs" in out.stderr
