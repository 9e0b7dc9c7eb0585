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
