"""`kiln data prepare`: text files, JSONL or Parquet (local or s3://) -> tokenized Parquet shards.

Output layout (local dir or s3://bucket/prefix):

    manifest.json                    written last: its presence means the dataset is complete
    tokenizer.json                   BPE and pretrained tokenizers
    train/part-UUUUUU-KKKK.parquet   columns: id int64, tokens fixed_size_list<int32>[seq_len + 1]
    val/part-UUUUUU-KKKK.parquet

The pipeline streams: the input listing is cut into units (`kiln.data.listing`); each unit is
read, tokenized, packed into rows, shuffled and written as shards by one tokenizer task
(`kiln.data.shards`), in this process (`run_here`) or in a pool of Ray Data actors
(`kiln.ray.prepare`); the driver gathers each unit's record and writes the manifest. The listing
is streamed and its units spilled to a file (`kiln.data.listing`), and no worker holds more
than one unit, so memory stays flat as the corpus grows.

The order, a shuffle with no global array: the listing in a seeded order, bundled into units;
each unit's train rows shuffled with a seed of their own; the manifest lists the shards unit by
unit. A document goes to validation by a seeded draw of its own (no document is in both splits).
Everything follows from the inputs and the settings, so the shards are byte-identical whatever
the number of workers.

Writing: locally into a hidden sibling directory named by the inputs and settings, renamed into
place after the manifest; on S3 in place, the manifest last. A finished unit leaves a record
there; a prepare that is killed or interrupted and run again with the same inputs and settings
keeps the units it finished and does the rest. A bad input removes what this prepare wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kiln
from kiln import guard
from kiln.data import listing as listing_rules
from kiln.data import replace
from kiln.data.inputs import ReadOptions, ReadStats, read_unit
from kiln.data.listing import UnitRef, Units, place, spill
from kiln.data.manifest import FORMAT_VERSION, MANIFEST, SAMPLE_ID, TOKENIZER_FILE, TOKENS
from kiln.data.shards import UNITS_DIR, UnitJob, UnitWorker, row_group_rows, write_once
from kiln.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    describe,
    pretrained,
    unigram_entropy_bits,
)
from kiln.errors import ConfigError, DataError
from kiln.guard import delete_stored
from kiln.limits import MAX_INT, MAX_SEQ_LEN
from kiln.schemas import validated
from kiln.storage import Location, resolve

log = logging.getLogger(__name__)

MAX_SHARD_TOKENS = 1 << 32  # 16 GiB of int32 tokens: a shard is built and read whole in memory

# Runs the units' jobs and yields each unit's record as it finishes, in any order.
Executor = Callable[[UnitJob, list[UnitRef]], Iterator[dict]]


def run_here(job: UnitJob, units: list[UnitRef]) -> Iterator[dict]:
    """The default executor: every unit in this process, one after another (no Ray)."""
    worker = UnitWorker(job)
    for ref in units:
        yield worker(ref.load()) | {"pid": os.getpid(), "node": "local"}


@dataclass
class PrepareConfig:
    inputs: list[str]
    """Text files, directories (searched recursively for text, .jsonl and .parquet files),
    quoted globs, and s3:// objects or prefixes."""
    output: str
    """Local directory or s3://bucket/prefix."""
    tokenizer: str = "bpe"
    """'byte' (257 ids, no training), 'bpe' (trained on a sample of the train split), or a
    pretrained one: a tokenizer.json, or a Hugging Face checkpoint directory holding one (to
    fine-tune that model)."""
    vocab_size: int = 4096
    """BPE vocabulary size, including the end-of-text token. Ignored for 'byte'."""
    seq_len: int = 128
    """Tokens a model sees per sequence; rows hold seq_len + 1 for the shifted targets."""
    val_fraction: float = 0.1
    """Share of documents held out for validation, each drawn on its own with this chance."""
    shard_tokens: int = 1 << 20
    """Target tokens per Parquet shard (~4 MiB at int32)."""
    text_field: str = "text"
    """Field of JSONL records / column of Parquet inputs that holds the text."""
    prompt_field: str = ""
    """Instruction data's prompt field; with response_field, see there."""
    response_field: str = ""
    """Instruction data: with both set, each JSONL record (or Parquet row) holds a prompt and a
    response, packed as prompt + response + EOT, and only the response and its EOT are scored
    (a prompt token is stored as -(id + 1): `kiln.model.inputs_and_targets`)."""
    seed: int = 1234
    """Seeds the train/val split, the order of the inputs and the row shuffle."""
    if_exists: str = "error"
    """What to do if the output holds a dataset: 'error', 'reuse' (same inputs and settings
    only) or 'overwrite'."""
    s3_endpoint: str = ""
    """S3-compatible endpoint for s3:// inputs and output (default $AWS_ENDPOINT_URL)."""
    on_binary: str = "error"
    """A text input that holds binary data (NUL bytes): 'error' names it and stops, 'skip'
    leaves it out and counts it in the manifest."""
    on_bad_record: str = "error"
    """A JSONL record that is not JSON or lacks the field: 'error' names the file and line,
    'skip' leaves it out and counts it in the manifest."""
    unit_bytes: int = 32 << 20
    """Input bytes per unit of work: a tokenizer task reads, tokenizes and writes this much at
    once, so it bounds each worker's memory (a few times it at peak)."""
    bpe_sample_bytes: int = 64 << 20
    """Text the BPE is trained on, at most: the first train documents in the seeded order.
    Bounds the driver's memory and time for a corpus of any size."""


# ---- identity, tokenizer, staging ---------------------------------------------------------------
def settings(cfg: PrepareConfig, tok) -> dict:
    """Everything besides the text that decides the dataset's bytes."""
    tokenizer = cfg.tokenizer
    if cfg.tokenizer not in ("byte", "bpe"):  # the tokenizer's content, wherever its file lies
        tokenizer = "sha256:" + hashlib.sha256(tok.to_json().encode()).hexdigest()
    out = dict(tokenizer=tokenizer, vocab_size=tok.vocab_size, seq_len=cfg.seq_len, val_fraction=cfg.val_fraction,
               seed=cfg.seed, format=FORMAT_VERSION, unit_bytes=cfg.unit_bytes, shard_tokens=cfg.shard_tokens)
    if cfg.tokenizer == "bpe":
        out["bpe_sample_bytes"] = cfg.bpe_sample_bytes
    if cfg.prompt_field:  # the same records packed with a loss mask are another dataset
        out["loss_mask"] = [cfg.prompt_field, cfg.response_field]
    return out


def fingerprint(settings_: dict, digests: Iterable[str]) -> str:
    """The dataset's identity: its settings and the text of every unit, in order."""
    h = hashlib.sha256(json.dumps(settings_, sort_keys=True).encode())
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()[:16]


def _key(cfg: PrepareConfig, listing: str) -> str:
    """Names this prepare before anything is read: the listing (URIs, sizes, mtimes) and every
    setting. A resume finds its staged units by it; `--if-exists reuse` compares it."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("inputs", "output", "if_exists", "s3_endpoint")}
    fields["cut"] = [listing_rules.CUT_RULE, listing_rules.WINDOW_FILES]  # read at call time
    if cfg.tokenizer not in ("byte", "bpe"):
        file = Path(cfg.tokenizer)
        file = file / TOKENIZER_FILE if file.is_dir() else file
        fields["tokenizer"] = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps([listing, fields], sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer(cfg: PrepareConfig, units: Units, opts: ReadOptions, staged: Location):
    """Byte, the pretrained one, or a BPE trained on a bounded sample of train documents (or
    the one this prepare trained before it was stopped)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer != "bpe":
        return pretrained(cfg.tokenizer)
    saved = staged.join(TOKENIZER_FILE)
    if saved.exists():
        return BPETokenizer.from_json(saved.read_bytes().decode())
    texts = list(_bpe_sample(units, opts, cfg.bpe_sample_bytes))
    if not texts:
        raise DataError(f"the corpus is empty: {cfg.inputs} hold no non-blank text")
    log.info("training a %d-token BPE on %d documents (%.1f MB)", cfg.vocab_size, len(texts),
             sum(map(len, texts)) / 1e6)
    return BPETokenizer.train(texts, cfg.vocab_size)


def _bpe_sample(units: Units, opts: ReadOptions, budget: int) -> Iterator[str]:
    held = 0
    for unit in units:
        for split, doc in read_unit(unit, opts, ReadStats()):
            if split != "train":
                continue
            text = doc if isinstance(doc, str) else doc[0] + doc[1]
            yield text
            held += len(text)
            if held >= budget:
                return


def _spill_name(key: str) -> str:
    return f"listing-{key}.pkl"


def _staging(out: Location, key: str) -> Location:
    """Where this prepare writes until its manifest: a hidden sibling named by its key (which a
    resume finds again), or the S3 prefix itself."""
    if out.is_s3:
        return out
    place = replace.writable_ancestor(out) / f".{Path(out.path).name}.partial-{key}"
    place.mkdir(exist_ok=True)
    guard.mark(place, replace.DATASET)  # the write guard's proof that this directory is Kiln's
    return resolve(str(place))


def _finished(staged: Location, key: str) -> dict[int, dict]:
    """The records of the units a stopped prepare of this key finished, which a resume keeps."""
    done = {}
    for rel in staged.join(UNITS_DIR).list_files():
        if not rel.endswith(".json"):
            continue  # the listing's spill
        try:
            rec = json.loads(staged.join(UNITS_DIR, rel).read_bytes())
        except ValueError:
            continue  # a record cut short: its unit is done again
        if isinstance(rec, dict) and rec.get("key") == key:
            done[int(rec["unit"])] = rec
    return done


# ---- checks -------------------------------------------------------------------------------------
def _config_from(fields: dict) -> PrepareConfig:
    known = {f.name: f for f in dataclasses.fields(PrepareConfig)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"prepare: unknown option(s) {unknown}; expected some of {sorted(known)}")
    missing = [n for n in ("inputs", "output") if n not in fields]
    if missing:
        raise ConfigError(f"prepare: {' and '.join(missing)} must be given")
    if isinstance(fields["inputs"], (str, os.PathLike)):
        fields = {**fields, "inputs": [fields["inputs"]]}  # one path is a list of one
    if isinstance(fields["inputs"], (list, tuple)):
        fields = {**fields, "inputs": [os.fspath(i) if isinstance(i, os.PathLike) else i for i in fields["inputs"]]}
    if isinstance(fields["output"], os.PathLike):
        fields = {**fields, "output": os.fspath(fields["output"])}
    # The same rules as the CLI's flags, strictly typed: "64" or 64.0 is not an integer here.
    validated(dict[str, typing.Any], fields, "prepare")
    for name, value in fields.items():
        validated(typing.get_type_hints(PrepareConfig)[name], value, f"prepare: {name}")
    return PrepareConfig(**fields)


def validate_config(cfg: PrepareConfig) -> None:
    """Every flag's rule, before any listing, Ray or output is touched."""
    if bool(cfg.prompt_field) != bool(cfg.response_field):
        raise ConfigError("--prompt-field and --response-field go together: give both for instruction data, or neither")
    if cfg.tokenizer not in ("byte", "bpe") and not Path(cfg.tokenizer).exists():
        raise ConfigError(f"--tokenizer {cfg.tokenizer!r}: expected 'byte', 'bpe', or the path of a tokenizer.json "
                          "or of a Hugging Face directory holding one")
    if cfg.tokenizer == "bpe" and not 257 <= cfg.vocab_size <= 1 << 20:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected 257..{1 << 20} for BPE")
    if cfg.vocab_size < 1:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected a positive integer")
    if not 2 <= cfg.seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"--seq-len {cfg.seq_len}: expected an integer in [2, {MAX_SEQ_LEN:_}]")
    if cfg.shard_tokens < cfg.seq_len + 1:
        raise ConfigError(f"--shard-tokens {cfg.shard_tokens}: expected at least one row of --seq-len + 1 = "
                          f"{cfg.seq_len + 1} tokens per shard")
    if cfg.shard_tokens > MAX_SHARD_TOKENS:
        raise ConfigError(f"--shard-tokens {cfg.shard_tokens}: expected at most {MAX_SHARD_TOKENS:_} tokens "
                          "per shard (a shard is read whole into memory)")
    if not 0 <= cfg.seed <= MAX_INT:
        raise ConfigError(f"--seed {cfg.seed}: expected an integer in [0, 2**53]")
    if cfg.on_binary not in ("error", "skip"):
        raise ConfigError(f"--on-binary {cfg.on_binary!r}: expected error or skip")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {cfg.val_fraction}: expected a number in (0, 1)")
    if cfg.if_exists not in ("error", "reuse", "overwrite"):
        raise ConfigError(f"--if-exists {cfg.if_exists!r}: expected error, reuse or overwrite")
    if cfg.on_bad_record not in ("error", "skip"):
        raise ConfigError(f"--on-bad-record {cfg.on_bad_record!r}: expected error or skip")
    if cfg.unit_bytes < 1 << 10:
        raise ConfigError(f"--unit-bytes {cfg.unit_bytes}: expected at least 1024 bytes of input per unit")
    if cfg.bpe_sample_bytes < 1:
        raise ConfigError(f"--bpe-sample-bytes {cfg.bpe_sample_bytes}: expected a positive number of bytes")


def _is_glob(raw: str) -> bool:
    """A glob's matches are files, which an output directory cannot be: only a file or folder
    input is checked against the output."""
    return any(c in raw for c in "*?[")


def _check_output(cfg: PrepareConfig, out: Location, key: str) -> dict | None:
    """The Kiln dataset already at `out` that `if_exists` allows to reuse or replace (None: the
    output is new or empty); refuse anything else before any work is done."""
    if cfg.if_exists == "overwrite":
        replace.refuse_protected(out)
    if not out.is_s3:
        guard.refuse_inputs(Path(out.path), [i for i in cfg.inputs if not _is_glob(i)], f"--output {cfg.output}", DataError)
    first = out.first_entry() if out.exists() else None
    if first is None:
        return None
    old = replace.kiln_manifest(out)
    if old is None and out.is_s3 and (out.join(UNITS_DIR, _spill_name(key)).exists() or _finished(out, key)):
        return None  # this same prepare, stopped before its manifest: resumed in place
    if old is None:  # found without listing the tree below: --output / must not walk the disk
        raise DataError(f"output {out.uri} already holds files that are not a Kiln dataset (such as "
                        f"{first}); Kiln never writes over them. Choose a new or empty --output")
    same = old.get("inputs_key") == key
    if same and cfg.if_exists == "reuse":
        return old
    if cfg.if_exists != "overwrite":
        raise DataError(
            f"output {out.uri} already holds {'this same dataset' if same else 'a different dataset'}; it "
            f"is never overwritten silently. Choose another --output, or pass --if-exists "
            f"{'reuse' if same else 'overwrite'}")
    return old


# ---- the run ------------------------------------------------------------------------------------
def prepare(cfg: PrepareConfig | None = None, /, *, executor: Executor | None = None, **fields) -> dict:
    """Build the dataset and return its manifest (or the existing one, with if_exists=reuse).
    Takes a `PrepareConfig`, or its fields as keywords (`kiln.data.prepare(inputs=[...],
    output=..., tokenizer="bpe")`). `executor` runs the units (`kiln.ray.prepare.on_ray`
    gives Ray's); by default they run in this process."""
    cfg = cfg if cfg is not None else _config_from(fields)
    validate_config(cfg)
    out = resolve(cfg.output, cfg.s3_endpoint)
    # The output is checked before the inputs are listed, which can take minutes: a read-only
    # or mistyped --output, or an unreachable S3 endpoint, fails in a second. The listing's
    # spill goes beside a local output (on its disk, from where it is placed), else to $TMPDIR.
    if out.is_s3:
        out.info()
        scratch = tempfile.gettempdir()
    else:
        scratch = str(replace.writable_ancestor(out))
    units = spill(cfg.inputs, cfg.s3_endpoint, cfg.unit_bytes, cfg.seed, scratch)
    try:
        key = _key(cfg, units.key)
        old = _check_output(cfg, out, key)
        if old is not None and cfg.if_exists == "reuse":
            log.info("%s already holds this dataset (fingerprint %s); reusing it", out.uri, old["fingerprint"])
            return old
        if old is not None and out.is_s3:
            replace.remove_dataset(out, old)  # no rename on S3: the new dataset is written in place
        staged = _staging(out, key)
        units = place(units, staged.join(UNITS_DIR, _spill_name(key)))
    finally:
        units.close()  # the scratch spill, where it was not placed (refused, reused, failed)
    try:
        manifest = _build(cfg, units, staged, key, executor or run_here)
        staged.join(MANIFEST).write_bytes(json.dumps(manifest, indent=2).encode())  # last: commit
        _drop_records(staged)
        replace.commit(staged, out, old)
    except (DataError, ConfigError):
        replace.discard(staged, staged.list_files())  # a bad input: nothing of this prepare stays
        raise
    except BaseException:
        log.warning("prepare stopped; the units it finished are kept in %s: run the same command again to "
                    "resume", staged.uri)
        raise
    tr, va, rate = manifest["splits"]["train"], manifest["splits"]["val"], manifest["throughput"]
    log.info("wrote %s: %d train / %d val rows of %d tokens, vocab %d, %.2f MB/s, %.0f tokens/s",
             out.uri, tr["rows"], va["rows"], cfg.seq_len + 1, manifest["tokenizer"]["vocab_size"],
             rate["mb_per_s"], rate["tokens_per_s"])
    return manifest


def _build(cfg: PrepareConfig, units: Units, staged: Location, key: str, executor: Executor) -> dict:
    """Run every unit not finished before; the manifest of them all."""
    opts = ReadOptions(cfg.text_field, cfg.prompt_field, cfg.response_field, cfg.val_fraction, cfg.seed,
                       cfg.on_binary, cfg.on_bad_record)
    tok = _tokenizer(cfg, units, opts, staged)
    if tok.to_json() and not staged.join(TOKENIZER_FILE).exists():  # before any unit: a resume reuses it,
        write_once(staged.join(TOKENIZER_FILE), tok.to_json().encode())  # so whole or not at all
    job = UnitJob("byte" if tok.kind == "byte" else tok.to_json(), tok.eot_id, cfg.seq_len,
                  _rows_per_shard(cfg), row_group_rows(cfg.seq_len), opts, staged.uri,
                  cfg.s3_endpoint, key)
    # A record's token counts (a vocab's worth of numbers) are summed as it arrives, not kept:
    # the driver's memory must not grow with units x vocab.
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    records = {u: _folded(rec, counts) for u, rec in _finished(staged, key).items()}
    if records:
        log.info("resuming: %d of %d units were finished before; preparing the other %d", len(records),
                 len(units), len(units) - len(records))
    todo = [i for i in range(len(units)) if i not in records]
    running = executor(job, [units.ref(i) for i in todo])  # starts Ray, where it runs there: not the pipeline's time
    began = ended = time.time()
    with _Progress(units, records) as bar:
        for rec in running:
            records[rec["unit"]] = _folded(rec, counts)
            bar.update(rec)
            ended = time.time()  # the last record back: Ray's shutdown after it is, like its start, not the pipeline's
    rate = _throughput([records[i] for i in todo], began, ended)
    return _manifest(cfg, tok, [records[i] for i in range(len(units))], counts, key, rate)


def _folded(rec: dict, counts: np.ndarray) -> dict:
    """The record without its token counts, which are added to `counts`."""
    counts += np.asarray(rec.pop("counts"), dtype=np.int64)
    return rec


def _rows_per_shard(cfg: PrepareConfig) -> int:
    """About shard_tokens, in whole row groups (so every shard starts on a group boundary)."""
    group = row_group_rows(cfg.seq_len)
    return max(group, cfg.shard_tokens // (cfg.seq_len + 1) // group * group)


def _drop_records(staged: Location) -> None:
    """The unit records are the prepare's, not the dataset's: gone once the manifest is."""
    records = staged.join(UNITS_DIR)
    for rel in records.list_files():
        delete_stored(staged.fs, records.join(rel).path, proof="this prepare's own unit records")
    if not staged.is_s3 and records.exists():
        delete_stored(staged.fs, records.path, proof="this prepare's own records folder", directory=True)


def _throughput(done: list[dict], began: float, ended: float) -> dict:
    """What this run prepared (a resume counts only its own units), per second of the span
    from the pipeline's start (`began`, unix time; the actors' start is in it) to the last
    record back (`ended`)."""
    mb = sum(r["bytes"] for r in done) / 1e6
    tokens = sum(r["splits"][s]["tokens"] for r in done for s in ("train", "val"))
    busy = sum(r["seconds"] for r in done)  # the workers' own time on the units
    seconds = ended - began
    # how long the first unit waited for a worker (an actor's start), and the last one's end
    # before the end (its record's way back); the rest of the idle time is the workers' uneven shares
    first = min((r["started"] for r in done if "started" in r), default=began) - began
    last = max((r["started"] + r["seconds"] for r in done if "started" in r), default=ended)
    return {"seconds": round(seconds, 3), "workers": len({r.get("pid") for r in done}),
            "nodes": len({r.get("node") for r in done}), "units": len(done), "mb": round(mb, 3),
            "mb_per_s": mb / max(seconds, 1e-9), "tokens_per_s": tokens / max(seconds, 1e-9),
            "busy_s": round(busy, 3), "mb_per_busy_s": mb / max(busy, 1e-9),
            "first_unit_after_s": round(max(0.0, first), 3), "after_last_unit_s": round(max(0.0, ended - last), 3)}


def _manifest(cfg: PrepareConfig, tok, records: list[dict], counts: np.ndarray, key: str, rate: dict) -> dict:
    """`counts`: the train tokens' counts over every unit."""
    stats = ReadStats()
    splits = {s: {"rows": 0, "tokens": 0, "shards": []} for s in ("train", "val")}
    for rec in records:
        stats.add(ReadStats(**rec["stats"]))
        for s, split in splits.items():
            split["rows"] += rec["splits"][s]["rows"]
            split["tokens"] += rec["splits"][s]["tokens"]
            split["shards"] += rec["splits"][s]["shards"]
    if stats.invalid_utf8_chars:
        log.warning("the corpus is not all UTF-8: %d invalid byte sequence(s) were replaced by U+FFFD",
                    stats.invalid_utf8_chars)
    if not sum(stats.documents.values()):
        raise DataError(f"the corpus is empty: {cfg.inputs} hold no non-blank text")
    for name, split in splits.items():
        if split["rows"] == 0:
            raise DataError(f"the corpus is too small for --seq-len {cfg.seq_len}: its {name} split "
                            f"({stats.documents[name]} documents) has fewer than {cfg.seq_len + 1} tokens")
    pretrained_path = {"pretrained": str(Path(cfg.tokenizer).absolute())} if cfg.tokenizer not in ("byte", "bpe") else {}
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint(settings(cfg, tok), (r["digest"] for r in records)),
        "inputs_key": key,
        "kiln_version": kiln.__version__,
        "created_unix": int(time.time()),
        "sources": [s if s.startswith("s3://") else str(Path(s).expanduser()) for s in cfg.inputs],
        "documents": stats.documents,
        "tokenizer": describe(tok) | ({"file": TOKENIZER_FILE} if tok.to_json() else {}) | pretrained_path,
        "seq_len": cfg.seq_len,
        "row_group_rows": row_group_rows(cfg.seq_len),
        "columns": {SAMPLE_ID: "int64", TOKENS: f"fixed_size_list<int32>[{cfg.seq_len + 1}]"},
        **({"loss_mask": {"scored": "response", "prompt_field": cfg.prompt_field, "response_field": cfg.response_field,
                          "encoding": "a prompt token is stored as -(id + 1): read, not scored"}}
           if cfg.prompt_field else {}),
        "unigram_entropy_bits": unigram_entropy_bits(counts),
        "input": {k: v for k, v in dataclasses.asdict(stats).items() if k != "documents"},
        "units": len(records),
        "throughput": rate,
        "splits": splits,
    }


class _Progress:
    """A bar over the input bytes with rows, tokens/s and the ETA (tqdm, where stderr is a
    terminal); elsewhere a log line at every tenth of the units."""

    def __init__(self, units: Units, done: dict[int, dict]):
        from tqdm.auto import tqdm

        self.units, self.seen, self.t0, self.tokens = len(units), len(done), time.perf_counter(), 0
        self.rows = sum(r["splits"][s]["rows"] for r in done.values() for s in ("train", "val"))
        self.bar = tqdm(total=int(units.sizes.sum()), initial=sum(r["bytes"] for r in done.values()),
                        unit="B", unit_scale=True, desc="prepare", disable=None, mininterval=1.0)

    def __enter__(self) -> _Progress:
        return self

    def update(self, rec: dict) -> None:
        self.seen += 1
        self.rows += sum(rec["splits"][s]["rows"] for s in ("train", "val"))
        self.tokens += sum(rec["splits"][s]["tokens"] for s in ("train", "val"))
        tok_s = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.rows:,} rows, {tok_s:,.0f} tok/s", refresh=False)
        self.bar.update(rec["bytes"])
        if self.bar.disable and self.seen * 10 // self.units > (self.seen - 1) * 10 // self.units:
            log.info("prepare: %d/%d units, %d rows, %.0f tokens/s", self.seen, self.units, self.rows, tok_s)

    def __exit__(self, *exc) -> None:
        self.bar.close()
