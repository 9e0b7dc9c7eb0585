"""A `train.resume_from` in object storage (`s3://bucket/runs/<run>`, or one checkpoint in it).

Which checkpoint it names is decided as for a local one (`kiln.core.checkpoint.find_checkpoint`:
the newest complete), on a shadow: a local tree holding only each candidate's markers and card,
a few small files, so the driver checks the resume before launch without downloading shards.
Each worker then copies the chosen checkpoint whole to its own temporary directory (a ZeRO load
reads every rank's shard), loads it, and removes the copy. Hand-written: pyarrow moves the
files; what a complete Kiln checkpoint is, is Kiln's.
"""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass

import pyarrow.fs as pafs

from kiln.core.checkpoint import CARD, MARKER, RAY_DIR, STEP_DIR, TAG, find_checkpoint
from kiln.errors import ConfigError
from kiln.storage import Location, resolve

log = logging.getLogger(__name__)

SMALL = (CARD, MARKER.split("{", 1)[0])  # the card, and every rank's marker (kiln_complete.rank*)


@dataclass(frozen=True)
class Located:
    """The checkpoint a remote `train.resume_from` names."""

    uri: str
    """Its directory in storage."""
    shadow: str
    """A local directory with its markers and card only (what a resume is checked by)."""


def locate(uri: str, endpoint: str, region: str, shadow_root: str) -> Located:
    """The checkpoint `uri` names: itself, or the newest complete one of the run it names."""
    loc = resolve(uri, endpoint, region)
    entries = _entries(loc)
    if not entries:
        raise ConfigError(f"train.resume_from = {uri!r}: no such directory in storage (or it is empty)")
    if any(n.startswith(SMALL[1]) for n in entries.get("", [])):  # a checkpoint itself
        _copy_small(loc, entries[""], os.path.join(shadow_root, "checkpoint"))
        root = os.path.join(shadow_root, "checkpoint")
    else:
        root = os.path.join(shadow_root, "run")
        os.makedirs(root, exist_ok=True)
        for name, files in entries.items():
            if STEP_DIR.match(name) or RAY_DIR.match(name):
                _copy_small(loc.join(name), files, os.path.join(root, name))
    try:
        directory, _ = find_checkpoint(root)
    except ConfigError as e:
        raise ConfigError(str(e).replace(repr(root), repr(uri)).replace(root, uri)) from None
    name = os.path.relpath(directory, root)
    return Located(loc.uri if name == "." else posixpath.join(loc.uri, name), directory)


def copy_to(uri: str, into: str, endpoint: str = "", region: str = "us-east-1") -> str:
    """The checkpoint `uri` names, copied whole into `into` (an empty directory); its local path."""
    loc = resolve(locate(uri, endpoint, region, os.path.join(into, "shadow")).uri, endpoint, region)
    target = os.path.join(into, posixpath.basename(loc.path.rstrip("/")))
    log.info("copying %s to %s", loc.uri, target)
    pafs.copy_files(loc.path, target, source_filesystem=loc.fs, destination_filesystem=pafs.LocalFileSystem())
    return target


def _entries(loc: Location) -> dict[str, list[str]]:
    """{subdirectory ('' for the top): the small files directly in it}, from one listing of
    everything below `loc` (object stores list keys, not directories)."""
    files = loc.list_files()
    found: dict[str, list[str]] = {}
    for f in files:
        head, _, rest = f.partition("/")
        sub, name = ("", head) if not rest else (head, rest)
        if "/" not in name and name.startswith(SMALL):
            found.setdefault(sub, []).append(name)
        else:
            found.setdefault(sub, [])
    return found


def _copy_small(loc: Location, names: list[str], into: str) -> None:
    """A checkpoint's markers and card into `into`, beside an empty shard directory (a
    marker's check looks for it)."""
    os.makedirs(os.path.join(into, TAG), exist_ok=True)
    for name in names:
        with open(os.path.join(into, name), "wb") as f:
            f.write(loc.join(name).read_bytes())
