"""Writing a dataset where one may already be: Kiln deletes only what is its own.

A dataset's own files are its manifest, the tokenizer and the shards the manifest lists; an
output that holds anything without a Kiln manifest is never written over, and `.`, `~`, `/`, a
repository root and a whole bucket are never overwritten at all. Replacing a dataset removes
the old manifest first (the dataset disappears for readers), then the old dataset's own files,
and writes the new manifest last, so a reader sees the old dataset, none, or the new one, never
a mix. Files beside the dataset (notes, other datasets below it) are left where they are.

Locally a new dataset is written in a hidden sibling directory and moved in; on S3, where
there is no rename, it is written in place and made visible by its manifest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kiln import guard
from kiln.data.manifest import MANIFEST, TOKENIZER_FILE, is_kiln_manifest
from kiln.errors import DataError
from kiln.storage import Location

log = logging.getLogger(__name__)
DATASET = "dataset"  # the write guard's kind for a dataset's staging directory


def kiln_manifest(out: Location) -> dict | None:
    """The manifest at `out` when it is one `kiln data prepare` wrote, else None."""
    mloc = out.join(MANIFEST)
    if not mloc.info().is_file:
        return None
    try:
        raw = json.loads(mloc.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if is_kiln_manifest(raw) else None


def owned_files(manifest: dict) -> list[str]:
    """The files a Kiln manifest makes its own, relative to the dataset: shards, tokenizer, manifest."""
    shards = [s["path"] for split in manifest["splits"].values() for s in split["shards"]]
    return [*shards, TOKENIZER_FILE, *manifest.get("tokenizer", {}).get("companions", []), MANIFEST]


def refuse_protected(out: Location) -> None:
    """Never overwrite a place whose loss would be more than a dataset's."""
    if out.is_s3:
        if "/" not in out.path.strip("/"):
            raise DataError(
                f"--output {out.uri} is a whole bucket: Kiln never overwrites one; choose a prefix inside it"
            )
        return
    reason = guard.protected_reason(out.path)
    if reason:
        raise DataError(f"--output {out.uri} {reason}")


def writable_ancestor(out: Location) -> Path:
    """The nearest existing directory at or above a local output's parent, proved writable
    (`guard.writable_ancestor`) before any tokenizing."""
    return guard.writable_ancestor(Path(out.path).parent, f"--output {out.uri}", DataError)


def remove_dataset(out: Location, manifest: dict) -> None:
    """Delete an old dataset's own files, its manifest first, and nothing else."""
    files = set(out.list_files())
    for rel in [MANIFEST, *owned_files(manifest)[:-1]]:
        if rel in files:
            guard.delete_stored(out.fs, out.join(rel).path, proof="listed by the old dataset's Kiln manifest")


def commit(staged: Location, out: Location, old: dict | None) -> None:
    """Make the staged dataset the one at `out`, replacing `old` (a Kiln manifest) if given.
    On S3 the files are in place already; the caller wrote the manifest last."""
    if out.is_s3:
        return
    target = Path(out.path)
    if old is None and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        guard.remove_file(Path(staged.path) / guard.MARKER, proof="the staging marker, not the dataset's")
        guard.move(staged.path, target)  # atomic: the whole dataset appears at once
        return
    if old is not None:
        remove_dataset(out, old)
    source = Path(staged.path)
    moved = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file() and p.name != guard.MARKER)
    for rel in sorted(moved, key=lambda r: str(r) == MANIFEST):  # the manifest last
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        guard.move(source / rel, target / rel)
    guard.discard(source, DATASET)


def discard(staged: Location, written: list[str]) -> None:
    """After a failure: remove what this write produced, and only that."""
    try:
        if staged.is_s3:
            for rel in sorted(written, key=lambda r: r != MANIFEST):  # the manifest first
                guard.delete_stored(staged.fs, staged.join(rel).path, proof="written by this prepare")
        else:
            guard.discard(staged.path, DATASET)
    except Exception as e:  # the original error matters more than a failed clean-up
        log.warning("could not remove the partial output at %s: %s", staged.uri, e)
