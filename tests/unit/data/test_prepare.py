import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.manifest import check_shards, load_manifest
from kiln.data.prepare import PrepareConfig, prepare
from kiln.data.tokenizer import BPETokenizer
from kiln.errors import DataError, KilnError
from kiln.storage import resolve


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_byte_dataset_manifest_and_shards(byte_dataset):
    m = json.loads((byte_dataset / "manifest.json").read_text())
    assert m["tokenizer"] == {"type": "byte", "vocab_size": 257, "eot_id": 256}
    assert m["seq_len"] == 64
    assert 0 < m["unigram_entropy_bits"] < 8
    ids = []
    for split in ("train", "val"):
        s = m["splits"][split]
        assert s["rows"] > 0 and s["tokens"] == s["rows"] * 64
        assert sum(sh["rows"] for sh in s["shards"]) == s["rows"]
        for sh in s["shards"]:
            data = (byte_dataset / sh["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == sh["sha256"] and len(data) == sh["bytes"]
            table = pq.read_table(byte_dataset / sh["path"])
            rows = np.stack(table.column("tokens").to_numpy(zero_copy_only=False))
            assert rows.shape == (sh["rows"], 65) and rows.max() <= 256
            ids.extend(table.column("id").to_pylist())
    assert sorted(ids) == list(range(len(ids)))  # sample ids are unique and dense
    assert len(m["splits"]["train"]["shards"]) > 1
    check_shards(load_manifest(resolve(str(byte_dataset))))


def test_train_and_val_documents_are_disjoint(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"d{i}.txt").write_text(f"document number {i} " * 50)
    out = tmp_path / "ds"
    m = prepare(PrepareConfig(inputs=[str(docs)], output=str(out), tokenizer="byte", seq_len=16, val_fraction=0.2))
    assert m["documents"] == {"train": 8, "val": 2}

    def text(split):
        rows = []
        for sh in m["splits"][split]["shards"]:
            rows.extend(pq.read_table(out / sh["path"]).column("tokens").to_pylist())
        return bytes(t for r in rows for t in r if t < 256).decode()

    val_docs = {d for d in range(10) if f"number {d} " in text("val")}
    train_docs = {d for d in range(10) if f"number {d} " in text("train")}
    assert len(val_docs) == 2 and not (val_docs & train_docs)


def test_bpe_tokenizer_is_saved_and_round_trips(tmp_path, corpus):
    out = tmp_path / "bpe"
    m = prepare(PrepareConfig(inputs=corpus, output=str(out), tokenizer="bpe", vocab_size=512, seq_len=32))
    assert m["tokenizer"]["type"] == "bpe" and m["tokenizer"]["vocab_size"] == 512
    tok = BPETokenizer.from_json((out / "tokenizer.json").read_text())
    text = "def parse(s):\n    return json.loads(s)  # ünïcode\n"
    assert tok.decode(tok.encode_batch([text])[0].tolist()) == text
    # BPE compresses: fewer tokens than bytes
    assert m["splits"]["train"]["tokens"] < sum(f.stat().st_size for d in corpus for f in Path(d).rglob("*.py"))


def test_jsonl_and_parquet_inputs(tmp_path):
    import pyarrow as pa

    recs = [{"text": f"record {i} " * 40, "meta": i} for i in range(6)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    pq.write_table(pa.table({"body": [r["text"] for r in recs]}), tmp_path / "b.parquet")
    m1 = prepare(
        PrepareConfig(inputs=[str(tmp_path / "a.jsonl")], output=str(tmp_path / "o1"), tokenizer="byte", seq_len=16)
    )
    m2 = prepare(
        PrepareConfig(
            inputs=[str(tmp_path / "b.parquet")],
            output=str(tmp_path / "o2"),
            tokenizer="byte",
            seq_len=16,
            text_field="body",
        )
    )
    assert m1["documents"] == m2["documents"] == {"train": 5, "val": 1}
    assert m1["splits"]["train"]["tokens"] == m2["splits"]["train"]["tokens"]


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "holds no text files"),
        (lambda d: (d.mkdir(), (d / "a.txt").write_text("  \n\n ")), "the corpus is empty"),
        (
            lambda d: (d.mkdir(), (d / "x.parquet").write_bytes(b"PAR1 this is not parquet")),
            "x.parquet is not a readable Parquet file",
        ),
        (
            lambda d: (d.mkdir(), pq.write_table(pa.table({"body": ["some text"] * 9}), d / "x.parquet")),
            "x.parquet has no column 'text' (columns: ['body'])",
        ),
        (lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"text": "ok"}\n{broken\n')), "x.jsonl:2: not valid JSON"),
        (
            lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"content": "ok"}\n')),
            "expected an object with a string field 'text'",
        ),
        (
            lambda d: (d.mkdir(), (d / "a.txt").write_text("tiny"), (d / "b.txt").write_text("tiny")),
            "too small for --seq-len",
        ),
    ],
)
def test_bad_corpora_fail_cleanly_and_leave_nothing(tmp_path, setup, needle):
    src = tmp_path / "src"
    setup(src)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=re.escape(needle)):
        prepare(PrepareConfig(inputs=[str(src)], output=str(out), tokenizer="byte", seq_len=64))
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_existing_output_is_never_overwritten_silently(tmp_path, corpus):
    out = tmp_path / "ds"
    cfg = PrepareConfig(inputs=corpus[:1], output=str(out), tokenizer="byte", seq_len=32)
    first = prepare(cfg)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    other = PrepareConfig(inputs=corpus[:1], output=str(out), tokenizer="byte", seq_len=48)
    with pytest.raises(DataError, match="already holds a different dataset; it is never overwritten silently"):
        prepare(other)
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(DataError, match="already holds this same dataset.*--if-exists reuse"):
        prepare(cfg)
    cfg.if_exists = "reuse"
    assert prepare(cfg)["fingerprint"] == first["fingerprint"]
    other.if_exists = "overwrite"
    assert prepare(other)["seq_len"] == 48
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 48
    assert _leftovers(tmp_path) == []


def test_directory_of_foreign_files_is_refused(tmp_path, corpus):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="files that are not a Kiln dataset"):
        prepare(PrepareConfig(inputs=corpus[:1], output=str(out), tokenizer="byte", seq_len=32))
    assert (out / "notes.txt").read_text() == "mine"


def test_bad_settings():
    for kwargs, needle in [
        ({"tokenizer": "wordpiece"}, "--tokenizer"),
        ({"seq_len": 1}, "--seq-len"),
        ({"val_fraction": 1.5}, "--val-fraction"),
        ({"tokenizer": "bpe", "vocab_size": 10}, "--vocab-size"),
    ]:
        with pytest.raises(KilnError, match=needle):
            prepare(PrepareConfig(inputs=["x"], output="y", **kwargs))


def test_binary_input_is_refused_or_skipped_and_counted(tmp_path, corpus):
    binary = tmp_path / "ls.txt"
    binary.write_bytes(Path("/bin/ls").read_bytes())  # a real binary saved as .txt
    text = tmp_path / "latin.txt"
    text.write_bytes("caf\xe9 au lait, ".encode("latin-1") * 400)  # text, but not UTF-8
    inputs = [str(binary), str(text), corpus[0]]
    with pytest.raises(DataError, match=f"input {binary} holds binary data.*--on-binary skip"):
        prepare(PrepareConfig(inputs=inputs, output=str(tmp_path / "a"), tokenizer="byte", seq_len=32))
    assert not (tmp_path / "a").exists()
    m = prepare(
        PrepareConfig(inputs=inputs, output=str(tmp_path / "b"), tokenizer="byte", seq_len=32, on_binary="skip")
    )
    assert m["input"] == {"binary_files_skipped": 1, "invalid_utf8_chars": 400, "bad_records_skipped": 0}
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["input"] == m["input"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"vocab_size": -7}, "--vocab-size -7: expected a positive integer"),
        ({"shard_tokens": -1}, "--shard-tokens -1: expected at least one row"),
        ({"on_binary": "maybe"}, "--on-binary 'maybe'"),
    ],
)
def test_settings_that_would_be_ignored_or_absurd_are_refused(tmp_path, corpus, kwargs, needle):
    with pytest.raises(KilnError, match=needle):
        prepare(PrepareConfig(inputs=corpus[:1], output=str(tmp_path / "ds"), tokenizer="byte", seq_len=32, **kwargs))
    assert not (tmp_path / "ds").exists()
