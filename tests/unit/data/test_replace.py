"""`--if-exists overwrite` replaces a Kiln dataset's own files and nothing else: files beside
it survive, anything without a Kiln manifest is refused without a hint to overwrite it, and
`.`, `~`, `/`, a repository root and a whole bucket are never overwritten. Locally and against a
real S3-compatible server (moto_server) on loopback."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.data.prepare import PrepareConfig, prepare
from kiln.errors import DataError
from kiln.launch.local import free_port
from kiln.storage import resolve

MOTO = str(Path(sys.executable).parent / "moto_server")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _cfg(corpus, output, seq_len=32, shard_tokens=4096, **kw) -> PrepareConfig:
    return PrepareConfig(
        inputs=corpus[:1], output=str(output), tokenizer="byte", seq_len=seq_len, shard_tokens=shard_tokens, **kw
    )


def test_overwrite_replaces_only_the_datasets_own_files(tmp_path, corpus):
    out = tmp_path / "ds"
    first = prepare(_cfg(corpus, out, shard_tokens=2048))  # more shards than the dataset that replaces it
    old_shards = {s["path"] for split in first["splits"].values() for s in split["shards"]}
    (out / "notes.txt").write_text("mine")
    (out / "train" / "README").write_text("also mine")
    (out / "other").mkdir()
    (out / "other" / "manifest.json").write_text("{}")
    second = prepare(_cfg(corpus, out, seq_len=48, if_exists="overwrite"))
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 48 == second["seq_len"]
    new_shards = {s["path"] for split in second["splits"].values() for s in split["shards"]}
    files = _files(out)
    assert files["notes.txt"] == b"mine" and files["train/README"] == b"also mine"
    assert files["other/manifest.json"] == b"{}"
    assert set(files) == new_shards | {"manifest.json", "notes.txt", "train/README", "other/manifest.json"}
    assert old_shards - new_shards, "the test should replace a shard layout with a different one"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_folder_of_other_things_is_refused_and_the_error_does_not_suggest_overwriting(tmp_path, corpus):
    out = tmp_path / "data"
    prepare(_cfg(corpus, out / "a"))  # a dataset one level down is not a dataset at `out`
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    for if_exists in ("error", "reuse", "overwrite"):
        with pytest.raises(DataError) as e:
            prepare(_cfg(corpus, out, if_exists=if_exists))
        assert "files that are not a Kiln dataset" in str(e.value)
        assert "--if-exists" not in str(e.value)
    assert _files(out) == before


@pytest.mark.parametrize("where", ["cwd", "home", "repository"])
def test_protected_places_are_never_overwritten(where, tmp_path, corpus, monkeypatch):
    place = tmp_path / where
    prepare(_cfg(corpus, place))  # even a real Kiln dataset there
    if where == "cwd":
        monkeypatch.chdir(place)
        output = "."
    elif where == "home":
        monkeypatch.setenv("HOME", str(place))
        output = "~"
    else:
        (place / ".git").mkdir()
        output = str(place)
    before = _files(place)
    with pytest.raises(DataError, match="Kiln never overwrites it"):
        prepare(_cfg(corpus, output, seq_len=48, if_exists="overwrite"))
    assert _files(place) == before


@pytest.fixture
def s3(monkeypatch):
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    proc = subprocess.Popen(
        [MOTO, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.2)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for bucket in ("kiln-replace", "kiln-root", "kiln-resume"):
        client.create_bucket(Bucket=bucket)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


def test_s3_overwrite_keeps_foreign_objects_and_a_bucket_is_never_overwritten(s3, corpus):
    uri = "s3://kiln-replace/ds"
    prepare(_cfg(corpus, uri, s3_endpoint=s3))
    ds = resolve(uri, s3)
    ds.join("notes.txt").write_bytes(b"mine")
    second = prepare(_cfg(corpus, uri, seq_len=48, s3_endpoint=s3, if_exists="overwrite"))
    shards = {s["path"] for split in second["splits"].values() for s in split["shards"]}
    assert set(ds.list_files()) == shards | {"manifest.json", "notes.txt"}
    assert ds.join("notes.txt").read_bytes() == b"mine"
    prepare(_cfg(corpus, "s3://kiln-root", s3_endpoint=s3))  # a Kiln dataset at a bucket's root
    bucket = resolve("s3://kiln-root", s3)
    before = {f: bucket.join(f).read_bytes() for f in bucket.list_files()}
    with pytest.raises(DataError, match="whole bucket"):
        prepare(_cfg(corpus, "s3://kiln-root", seq_len=48, s3_endpoint=s3, if_exists="overwrite"))
    assert {f: bucket.join(f).read_bytes() for f in bucket.list_files()} == before


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_prepare_stopped_before_its_first_unit_is_resumed_not_refused(where, s3, tmp_path, corpus):
    """Stopped once the listing's spill is placed and before any unit: on S3 the output prefix
    then holds only the spill, which the same prepare must take for its own (not for files that
    are not a Kiln dataset). Done, it leaves no spill or record behind."""
    uri = "s3://kiln-resume/ds" if where == "s3" else str(tmp_path / "ds")

    def stop(job, units):
        assert len(units) >= 1
        raise KeyboardInterrupt  # as Ctrl-C right after the spill is placed

    cfg = _cfg(corpus, uri, s3_endpoint=s3, unit_bytes=16384, val_fraction=0.3)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, executor=stop)
    staged = resolve(uri, s3) if where == "s3" else resolve(str(next(tmp_path.glob(".ds.partial-*"))))
    assert [f for f in staged.list_files() if f.startswith("_units/listing-")]  # the spill is kept
    m = prepare(cfg)
    assert m["units"] > 1 and m["throughput"]["units"] == m["units"]
    left = resolve(uri, s3).list_files()
    assert not [f for f in left if f.startswith("_units")], left
    assert not list(tmp_path.glob(".ds.partial-*"))


def test_a_large_parquet_input_on_s3_is_read_by_row_group_ranges(s3, tmp_path):
    """The ranges of a Parquet file cut into units are read from S3 (the footer, then the row
    groups that start in each range), and give what the same file gives locally."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "lorem ipsum dolor sit amet " * (20 + i % 13) for i in range(2000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=100, compression="none")
    resolve("s3://kiln-resume/in/d.parquet", s3).write_bytes((tmp_path / "d.parquet").read_bytes())
    common = dict(tokenizer="byte", seq_len=64, unit_bytes=200 << 10, s3_endpoint=s3)
    remote = prepare(PrepareConfig(inputs=["s3://kiln-resume/in/"], output=str(tmp_path / "a"), **common))
    local = prepare(PrepareConfig(inputs=[str(tmp_path / "d.parquet")], output=str(tmp_path / "b"), **common))
    assert remote["units"] == local["units"] > 4
    assert remote["documents"] == local["documents"] and sum(local["documents"].values()) == len(texts)
    assert remote["splits"]["train"]["tokens"] == local["splits"]["train"]["tokens"]
