"""Where Ray Train writes checkpoints: train.storage_path resolved for RunConfig, and an
unreachable S3 storage refused before launch."""

import os

import pyarrow.fs as pafs
import pytest

from kiln.config import RunConfig
from kiln.errors import StorageError
from kiln.launch.preflight import check_storage
from kiln.ray.trainer import train_storage


def test_local_storage_is_made_absolute_and_left_to_ray(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_storage("runs", RunConfig()) == (os.path.join(str(tmp_path), "runs"), None)


def test_s3_storage_gets_kilns_filesystem_with_the_data_endpoint():
    cfg = RunConfig()
    cfg.data.s3_endpoint = "http://127.0.0.1:9000"
    path, fs = train_storage("s3://bucket/runs/", cfg)
    assert path == "bucket/runs"  # Ray wants the path without its scheme next to a filesystem
    assert isinstance(fs, pafs.S3FileSystem)
    options = fs.__reduce__()[1][0]  # what travels to the workers when Ray pickles it
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:9000", "http")
    assert options["access_key"] is None  # credentials stay in the environment, not in the pickle


def test_unreachable_s3_storage_is_refused_naming_the_field():
    cfg = RunConfig()
    cfg.data.s3_endpoint = "http://127.0.0.1:9"  # discard port: nothing listens
    cfg.train.storage_path = "s3://bucket/runs"
    with pytest.raises(StorageError, match=r"train.storage_path: cannot reach s3://bucket/runs"):
        check_storage(cfg)


def test_local_storage_needs_no_check(tmp_path):
    cfg = RunConfig()
    cfg.train.storage_path = str(tmp_path / "does-not-exist-yet")
    check_storage(cfg)  # Ray Train creates local dirs itself
    assert not (tmp_path / "does-not-exist-yet").exists()


def test_storage_comes_from_the_config_then_kiln_storage_path_then_runs(monkeypatch):
    from kiln.launch.preflight import with_run_name

    monkeypatch.delenv("KILN_STORAGE_PATH", raising=False)
    assert with_run_name(RunConfig()).train.storage_path == "runs"
    monkeypatch.setenv("KILN_STORAGE_PATH", "s3://cluster-bucket/runs")  # what cluster/*.yaml export
    assert with_run_name(RunConfig()).train.storage_path == "s3://cluster-bucket/runs"
    cfg = RunConfig()
    cfg.train.storage_path = "/mnt/shared/mine"
    assert with_run_name(cfg).train.storage_path == "/mnt/shared/mine"
