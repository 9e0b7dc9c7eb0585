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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

import kiln
from kiln import guard
from kiln.data import listing as listing_rules
from kiln.data import replace
from kiln.data.inputs import ReadOptions, ReadStats, read_unit
from kiln.data.listing import UnitRef, Units, place, spill
from kiln.data.manifest import COLUMNS, FORMAT_VERSION, MANIFEST, SAMPLE_ID, STARTS, TOKENIZER_FILE, TOKENS
from kiln.data.prepare_config import PrepareConfig, config_from, validate_config
from kiln.data.prepare_progress import Progress, throughput
from kiln.data.shards import UNITS_DIR, UnitJob, UnitWorker, row_group_rows
from kiln.data.tokenizer import BPETokenizer, ByteTokenizer, describe, pretrained, unigram_entropy_bits
from kiln.errors import ConfigError, DataError
from kiln.guard import delete_stored
from kiln.storage import Location, durable, resolve, write_once

log = logging.getLogger(__name__)


# Runs the units' jobs and yields each unit's record as it finishes, in any order.
Executor = Callable[[UnitJob, list[UnitRef]], Iterator[dict]]


def run_here(job: UnitJob, units: list[UnitRef]) -> Iterator[dict]:
    """The default executor: every unit in this process, one after another (no Ray)."""
    worker = UnitWorker(job)
    for ref in units:
        yield worker(ref.load()) | {"pid": os.getpid(), "node": "local"}


# ---- identity, tokenizer, staging ---------------------------------------------------------------
def settings(cfg: PrepareConfig, tok) -> dict:
    """Everything besides the text that decides the dataset's bytes."""
    tokenizer = cfg.tokenizer
    if cfg.tokenizer not in ("byte", "bpe"):  # the tokenizer's content, wherever its file lies
        tokenizer = "sha256:" + hashlib.sha256(tok.to_json().encode()).hexdigest()
    out = dict(
        tokenizer=tokenizer,
        vocab_size=tok.vocab_size,
        seq_len=cfg.seq_len,
        val_fraction=cfg.val_fraction,
        seed=cfg.seed,
        format=FORMAT_VERSION,
        columns=list(COLUMNS),  # a dataset without document starts is another one
        unit_bytes=cfg.unit_bytes,
        shard_tokens=cfg.shard_tokens,
    )
    if cfg.tokenizer == "bpe":
        out["bpe_sample_bytes"] = cfg.bpe_sample_bytes
    if cfg.prompt_field:  # the same records packed with a loss mask are another dataset
        out["loss_mask"] = [cfg.prompt_field, cfg.response_field]
    if cfg.chat_field:
        out["loss_mask"] = ["chat", cfg.chat_field, hashlib.sha256(_chat(cfg, tok)[0].encode()).hexdigest()]
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
    fields = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("inputs", "output", "if_exists", "s3_endpoint")
    }
    fields["cut"] = [listing_rules.CUT_RULE, listing_rules.WINDOW_FILES]  # read at call time
    fields["columns"] = list(COLUMNS)  # a dataset of older shards (no starts) is not this one
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
    log.info(
        "training a %d-token BPE on %d documents (%.1f MB)", cfg.vocab_size, len(texts), sum(map(len, texts)) / 1e6
    )
    return BPETokenizer.train(texts, cfg.vocab_size)


def _chat(cfg: PrepareConfig, tok) -> tuple[str, dict[str, str]]:
    """(the chat template, the tokenizer's companion files) of chat data; ('', {}) otherwise."""
    if not cfg.chat_field:
        return "", {}
    from kiln.data.chat import template_of

    companions = getattr(tok, "companions", {})
    template = Path(cfg.chat_template).read_text() if cfg.chat_template else template_of(companions)
    if tok.kind == "byte":
        raise ConfigError(
            f"--chat-field {cfg.chat_field}: the byte tokenizer has no special tokens for chat turns; "
            "prepare chat data with --tokenizer bpe or a pretrained tokenizer"
        )
    if not template:
        raise ConfigError(
            f"--chat-field {cfg.chat_field}: the tokenizer {cfg.tokenizer!r} has no chat template; "
            "prepare with a pretrained tokenizer that has one (--tokenizer DIR), or give one with "
            "--chat-template FILE"
        )
    return template, companions


def _bpe_sample(units: Units, opts: ReadOptions, budget: int) -> Iterator[str]:
    held = 0
    for unit in units:
        for split, doc in read_unit(unit, opts, ReadStats()):
            if split != "train":
                continue
            text = (
                doc
                if isinstance(doc, str)
                else doc[0] + doc[1]
                if isinstance(doc, tuple)
                else " ".join(m["content"] for m in doc)
            )
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
        guard.refuse_inputs(
            Path(out.path), [i for i in cfg.inputs if not _is_glob(i)], f"--output {cfg.output}", DataError
        )
    first = out.first_entry() if out.exists() else None
    if first is None:
        return None
    old = replace.kiln_manifest(out)
    if old is None and out.is_s3 and (out.join(UNITS_DIR, _spill_name(key)).exists() or _finished(out, key)):
        return None  # this same prepare, stopped before its manifest: resumed in place
    if old is None:  # found without listing the tree below: --output / must not walk the disk
        raise DataError(
            f"output {out.uri} already holds files that are not a Kiln dataset (such as "
            f"{first}); Kiln never writes over them. Choose a new or empty --output"
        )
    same = old.get("inputs_key") == key
    if same and cfg.if_exists == "reuse":
        return old
    if cfg.if_exists != "overwrite":
        raise DataError(
            f"output {out.uri} already holds {'this same dataset' if same else 'a different dataset'}; it "
            f"is never overwritten silently. Choose another --output, or pass --if-exists "
            f"{'reuse' if same else 'overwrite'}"
        )
    return old


# ---- the run ------------------------------------------------------------------------------------
def prepare(cfg: PrepareConfig | None = None, /, *, executor: Executor | None = None, **fields) -> dict:
    """Build the dataset and return its manifest (or the existing one, with if_exists=reuse).
    Takes a `PrepareConfig`, or its fields as keywords (`kiln.data.prepare(inputs=[...],
    output=..., tokenizer="bpe")`). `executor` runs the units (`kiln.ray.prepare.on_ray`
    gives Ray's); by default they run in this process."""
    cfg = cfg if cfg is not None else config_from(fields)
    validate_config(cfg)
    cfg = dataclasses.replace(cfg, output=durable(cfg.output, "--output"))
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
        log.warning(
            "prepare stopped; the units it finished are kept in %s: run the same command again to resume", staged.uri
        )
        raise
    tr, va, rate = manifest["splits"]["train"], manifest["splits"]["val"], manifest["throughput"]
    log.info(
        "wrote %s: %d train / %d val rows of %d tokens, vocab %d, %.2f MB/s, %.0f tokens/s",
        out.uri,
        tr["rows"],
        va["rows"],
        cfg.seq_len + 1,
        manifest["tokenizer"]["vocab_size"],
        rate["mb_per_s"],
        rate["tokens_per_s"],
    )
    return manifest


def _build(cfg: PrepareConfig, units: Units, staged: Location, key: str, executor: Executor) -> dict:
    """Run every unit not finished before; the manifest of them all."""
    opts = ReadOptions(
        cfg.text_field,
        cfg.prompt_field,
        cfg.response_field,
        cfg.chat_field,
        cfg.val_fraction,
        cfg.seed,
        cfg.on_binary,
        cfg.on_bad_record,
    )
    tok = _tokenizer(cfg, units, opts, staged)
    if tok.to_json() and not staged.join(TOKENIZER_FILE).exists():  # before any unit: a resume reuses it,
        write_once(staged.join(TOKENIZER_FILE), tok.to_json().encode())  # so whole or not at all
    for name, text in getattr(tok, "companions", {}).items():
        if not staged.join(name).exists():
            write_once(staged.join(name), text.encode())
    job = UnitJob(
        "byte" if tok.kind == "byte" else tok.to_json(),
        tok.eot_id,
        cfg.seq_len,
        _rows_per_shard(cfg),
        row_group_rows(cfg.seq_len),
        opts,
        staged.uri,
        cfg.s3_endpoint,
        key,
        *_chat(cfg, tok),
    )
    # A record's token counts (a vocab's worth of numbers) are summed as it arrives, not kept:
    # the driver's memory must not grow with units x vocab.
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    records = {u: _folded(rec, counts) for u, rec in _finished(staged, key).items()}
    if records:
        log.info(
            "resuming: %d of %d units were finished before; preparing the other %d",
            len(records),
            len(units),
            len(units) - len(records),
        )
    todo = [i for i in range(len(units)) if i not in records]
    running = executor(job, [units.ref(i) for i in todo])  # starts Ray, where it runs there: not the pipeline's time
    began = ended = time.time()
    with Progress(units, records) as bar:
        for rec in running:
            records[rec["unit"]] = _folded(rec, counts)
            bar.update(rec)
            ended = time.time()  # the last record back: Ray's shutdown after it is, like its start, not the pipeline's
    rate = throughput([records[i] for i in todo], began, ended)
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
        log.warning(
            "the corpus is not all UTF-8: %d invalid byte sequence(s) were replaced by U+FFFD", stats.invalid_utf8_chars
        )
    if not sum(stats.documents.values()):
        raise DataError(f"the corpus is empty: {cfg.inputs} hold no non-blank text")
    for name, split in splits.items():
        if split["rows"] == 0:
            raise DataError(
                f"the corpus is too small for --seq-len {cfg.seq_len}: its {name} split "
                f"({stats.documents[name]} documents) has fewer than {cfg.seq_len + 1} tokens"
            )
    pretrained_path = (
        {"pretrained": str(Path(cfg.tokenizer).absolute())} if cfg.tokenizer not in ("byte", "bpe") else {}
    )
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint(settings(cfg, tok), (r["digest"] for r in records)),
        "inputs_key": key,
        "kiln_version": kiln.__version__,
        "created_unix": int(time.time()),
        "sources": [s if s.startswith("s3://") else str(Path(s).expanduser()) for s in cfg.inputs],
        "documents": stats.documents,
        "tokenizer": describe(tok)
        | ({"file": TOKENIZER_FILE} if tok.to_json() else {})
        | pretrained_path
        | ({"companions": sorted(tok.companions)} if getattr(tok, "companions", None) else {}),
        "seq_len": cfg.seq_len,
        "row_group_rows": row_group_rows(cfg.seq_len),
        "columns": {SAMPLE_ID: "int64", TOKENS: f"fixed_size_list<int32>[{cfg.seq_len + 1}]", STARTS: "list<int32>"},
        **(
            {
                "loss_mask": {
                    "scored": "response",
                    "prompt_field": cfg.prompt_field,
                    "response_field": cfg.response_field,
                    "encoding": "a prompt token is stored as -(id + 1): read, not scored",
                }
            }
            if cfg.prompt_field
            else {}
        ),
        **(
            {
                "loss_mask": {
                    "scored": "assistant",
                    "chat_field": cfg.chat_field,
                    "encoding": "the chat template's text; all but the assistant turns stored as -(id + 1)",
                }
            }
            if cfg.chat_field
            else {}
        ),
        "unigram_entropy_bits": unigram_entropy_bits(counts),
        "input": {k: v for k, v in dataclasses.asdict(stats).items() if k != "documents"},
        "units": len(records),
        "throughput": rate,
        "splits": splits,
    }
