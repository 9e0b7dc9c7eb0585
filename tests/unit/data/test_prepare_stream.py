"""The streaming prepare without Ray: units of work, JSONL byte ranges, bad records, resume after
a SIGKILL, and reads of only a replica's own row groups."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.data.inputs import Piece, ReadOptions
from kiln.data.manifest import load_manifest
from kiln.data.prepare import PrepareConfig, prepare
from kiln.data.prepare_progress import throughput
from kiln.data.shards import row_group_rows
from kiln.data.sources import ParquetSource
from kiln.errors import DataError
from kiln.storage import resolve

KILN = str(Path(sys.executable).parent / "kiln")


def _jsonl(path: Path, n: int, bad_at: int | None = None) -> list[str]:
    texts = [f"record {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(n)]
    lines = [json.dumps({"text": t}) for t in texts]
    if bad_at is not None:
        lines[bad_at - 1] = json.dumps({"body": "no text field"})
    path.write_text("\n".join(lines) + "\n")
    return texts


def test_jsonl_byte_ranges_read_each_record_once_and_bad_records_are_named_or_counted(tmp_path):
    src = tmp_path / "d.jsonl"
    _jsonl(src, 600, bad_at=517)
    common = dict(inputs=[str(src)], tokenizer="byte", seq_len=32, unit_bytes=4096)
    with pytest.raises(
        DataError, match=rf"{src}:517: expected an object with a string field 'text'.*--on-bad-record skip"
    ):
        prepare(PrepareConfig(output=str(tmp_path / "a"), **common))
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.partial-*"))  # nothing of it is left
    split = prepare(PrepareConfig(output=str(tmp_path / "b"), on_bad_record="skip", **common))
    whole = prepare(
        PrepareConfig(output=str(tmp_path / "c"), on_bad_record="skip", **(common | {"unit_bytes": 1 << 20}))
    )
    assert split["units"] > 10 and whole["units"] == 1  # the file was cut into byte ranges
    for m in (split, whole):
        assert sum(m["documents"].values()) == 599 and m["input"]["bad_records_skipped"] == 1


def test_a_large_parquet_file_is_cut_into_row_group_ranges_each_read_once_and_alone(tmp_path):
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.data.inputs import ReadStats, read_unit
    from kiln.data.listing import _cut, list_inputs

    texts = [f"row {i}: " + "lorem ipsum dolor sit amet " * (20 + i % 13) for i in range(4000)]
    src = tmp_path / "d.parquet"  # 40 row groups of 100 rows (~90 KB each), and a column not asked for
    pq.write_table(
        pa.table({"text": texts, "other": ["x" * 200] * len(texts)}),
        src,
        row_group_size=100,
        compression="none",
        use_dictionary=False,
    )
    units = list(_cut(list_inputs([str(src)]), 256 << 10))
    assert len(units) > 10 and all(len(u.pieces) == 1 and u.pieces[0].end > 0 for u in units)

    def read(unit):
        tracemalloc.start()
        docs = [d for _, d in read_unit(unit, ReadOptions(), ReadStats())]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return docs, peak

    parts = [read(u) for u in units]
    assert [d for docs, _ in parts for d in docs] == texts  # every row once, in the file's order
    assert all(len(docs) % 100 == 0 for docs, _ in parts)  # whole row groups
    whole_docs, whole_peak = read(dataclasses.replace(units[0], pieces=(Piece(units[0].pieces[0].file),)))
    assert whole_docs == texts
    assert max(peak for _, peak in parts) < whole_peak / 4  # a unit holds its range, not the file
    # end to end: cut or whole, the same documents, and the split ranges read as many
    common = dict(inputs=[str(src)], tokenizer="byte", seq_len=64)
    cut = prepare(PrepareConfig(output=str(tmp_path / "cut"), unit_bytes=256 << 10, **common))
    whole = prepare(PrepareConfig(output=str(tmp_path / "whole"), unit_bytes=64 << 20, **common))
    assert cut["units"] == len(units) and whole["units"] == 1
    assert sum(cut["documents"].values()) == sum(whole["documents"].values()) == len(texts)


def test_throughput_is_over_the_span_to_the_last_record_back():
    # two workers, 10 s from the pipeline's start to the last record back: 1 s before the first
    # unit (an actor's start), units of 4 + 5 s and 4 s, the last ending 0.5 s before the span's end
    rec = {"bytes": 10_000_000, "splits": {"train": {"tokens": 900}, "val": {"tokens": 100}}}
    done = [
        rec | {"started": 101.0, "seconds": 4.0, "pid": 1},
        rec | {"started": 105.0, "seconds": 4.5, "pid": 1},
        rec | {"started": 101.5, "seconds": 4.0, "pid": 2},
    ]
    t = throughput(done, began=100.0, ended=110.0)
    assert t["seconds"] == 10.0 and t["mb_per_s"] == 3.0 and t["tokens_per_s"] == 300.0 and t["workers"] == 2
    assert t["busy_s"] == 12.5 and t["mb_per_busy_s"] == 30 / 12.5
    assert t["first_unit_after_s"] == 1.0 and t["after_last_unit_s"] == 0.5


def test_a_prepare_killed_midway_resumes_and_gives_the_same_dataset(tmp_path, corpus):
    # Units of a file each, so the kill after the third leaves many to do: with a handful (CI of
    # 5d3d2f6: 5), the last ones could finish between two looks and nothing was left to kill.
    # A unit of one document draws it for validation with --val-fraction's chance: 0.3 of 22.
    inputs = [a for d in corpus for a in ("--input", d)]
    args = [
        "data",
        "prepare",
        *inputs,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "512",
        "--seq-len",
        "64",
        "--unit-bytes",
        "1024",
        "--val-fraction",
        "0.3",
        "--workers",
        "0",
    ]
    ref = subprocess.run([KILN, *args, "--output", str(tmp_path / "ref")], capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    n_units = json.loads((tmp_path / "ref/manifest.json").read_text())["units"]
    assert n_units >= 12, n_units

    out = tmp_path / "ds"
    for _ in range(3):  # a loaded machine can finish the prepare between two looks: then again
        finished = _kill_after_three_units(args, out)
        if not finished:
            break
        shutil.rmtree(out)
    kept = len(list(tmp_path.glob(".ds.partial-*/_units/*.json")))
    assert 3 <= kept < n_units, (kept, n_units)
    assert not out.exists()  # nothing half-written is visible as a dataset

    again = subprocess.run([KILN, *args, "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming: {kept} of {n_units} units were finished before" in again.stderr
    m, r = (json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "ref"))
    assert m["fingerprint"] == r["fingerprint"] and m["throughput"]["units"] == n_units - kept
    shards = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    assert shards == sorted(p.relative_to(tmp_path / "ref") for p in (tmp_path / "ref").rglob("*.parquet"))
    assert all((out / s).read_bytes() == (tmp_path / "ref" / s).read_bytes() for s in shards)
    assert not list(tmp_path.glob(".ds.partial-*")) and not (out / "_units").exists()


def _kill_after_three_units(args: list[str], out: Path) -> bool:
    """SIGKILL a prepare once three unit records are on disk; whether it had finished first."""
    proc = subprocess.Popen([KILN, *args, "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(out.parent.glob(f".{out.name}.partial-*/_units/*.json"))) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    return proc.wait() == 0


def test_each_replica_reads_about_its_share_of_the_bytes(tmp_path, corpus):
    """Micro-batches of whole row groups: n replicas read ~1/n of the split each. Micro-batches
    smaller than a row group: every replica fetches groups it mostly does not use."""
    prepare(
        PrepareConfig(
            inputs=corpus[:2], output=str(tmp_path / "ds"), tokenizer="byte", seq_len=64, shard_tokens=1 << 16
        )
    )
    manifest = load_manifest(resolve(str(tmp_path / "ds")))
    group = row_group_rows(64)
    assert group == manifest.raw["row_group_rows"] == 64
    total = sum(e["bytes"] for e, _ in manifest.shards("train"))

    def read(world: int, micro: int) -> list[int]:
        out = []
        for rank in range(world):
            source = ParquetSource(manifest, rank, world, micro)
            for _ in source.epoch("train"):
                pass
            out.append(source.bytes_read)
        return out

    for world in (1, 2, 4):
        shares = [b / total for b in read(world, group)]
        assert all(abs(s - 1 / world) < 0.05 + 0.02 * world for s in shares), (world, shares)
    small = [b / total for b in read(4, group // 4)]  # 4 replicas' micro-batches share each group
    assert all(s > 0.9 for s in small), small


def test_a_tokenizer_actor_starts_without_torch():
    """What a Ray tokenizer actor imports (its class's module) must not pull in torch, which
    cost each actor seconds of start (bench/results/data.md: the first unit waited 4.6 s)."""
    code = (
        "import sys, kiln.ray.prepare, kiln.data.shards, kiln.data.inputs\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_prepares_driver_loads_neither_torch_nor_ray_train(tmp_path):
    """`kiln data prepare` as a user runs it: whole without Ray, and on Ray up to where it checks
    the cluster (nothing listens on the port, so it stops there). Neither driver imports torch,
    DeepSpeed, MLflow or Ray Train: a prepare's driver paid 2 s and about 300 MiB for them while
    the CLI imported torch to build its --help, the address check lived in the training
    launcher, and the flag limits in the run config."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "a.txt").write_text("some text, and more of it\n" * 50)
    code = (
        "import sys\nfrom kiln.cli import main\ntry:\n    sys.exit(main())\nfinally:\n"
        "    print(sorted(m for m in ('torch', 'deepspeed', 'mlflow', 'ray.train', 'kiln.ray.prepare') "
        "if m in sys.modules), file=sys.stderr)"
    )
    common = [sys.executable, "-c", code, "data", "prepare", "--input", str(tmp_path / "a.txt"), "--seq-len", "16"]
    whole = subprocess.run(
        [*common, "--output", str(tmp_path / "ds"), "--workers", "0"], capture_output=True, text=True, timeout=120
    )
    assert whole.returncode == 0 and (tmp_path / "ds" / "manifest.json").exists(), whole.stderr[-2000:]
    assert whole.stderr.strip().splitlines()[-1] == "[]", whole.stderr[-2000:]
    on_ray = subprocess.run(
        [*common, "--output", str(tmp_path / "ds2"), "--address", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert on_ray.returncode == 1 and f"no Ray cluster answers at 127.0.0.1:{port}" in on_ray.stderr, on_ray.stderr
    assert on_ray.stderr.strip().splitlines()[-1] == "['kiln.ray.prepare']", on_ray.stderr[-2000:]
    assert not (tmp_path / "ds2").exists()
