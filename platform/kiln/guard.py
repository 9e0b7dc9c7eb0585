"""The write guard: the one place Kiln creates, replaces or removes a user's files.

Rule: Kiln removes or replaces only what the same kind of Kiln command created, and it knows
that from a marker it wrote itself, never from what the files look like. A directory Kiln
writes holds `.kiln-output` (its kind, e.g. `kiln-output:export`); a file Kiln writes carries
`kiln-output:KIND` in its first bytes (a JSON key, a PNG text chunk). A checkpoint's proof is
its completion markers, a dataset's its Kiln manifest (`data.replace`).

Before any work, `check_dir_target` / `check_file_target` refuse `.`, `~`, `/` and any folder
above them, a repository root, a symbolic link, the command's own inputs, and anything that
exists without the marker. A replacement happens only after every check has passed, and is
atomic: the new directory is exchanged with the old in one `renameat2(RENAME_EXCHANGE)` where
the kernel has it, so nothing is ever renamed aside first.

Every `rmtree`, `unlink`, `rename` and `replace` in `platform/kiln` is in this module (a test
greps for them). Hand-written: no library guards paths this way.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path

from kiln.errors import ConfigError, KilnError

MARKER = ".kiln-output"
TEMP_TAG = ".kiln-tmp-"  # in the name of every temp file or directory Kiln writes beside an output
_HEAD = 4096  # a file's marker must be in its first bytes: read no more than this to judge it


def tag(kind: str) -> str:
    """The text that marks an output of `kind` as Kiln's."""
    return f"kiln-output:{kind}"


# ---- judging a place -----------------------------------------------------------------------------
def local_path(path: str | os.PathLike) -> Path:
    """A local output path as the user meant it: `~` expanded, made absolute (not resolved, so
    a symbolic link is still seen as one)."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def protected_reason(path: str | os.PathLike) -> str | None:
    """Why `path` may never be replaced or removed by any command, or None."""
    p = local_path(path)
    if p.is_symlink():
        return "is a symbolic link: Kiln never replaces one; name the directory itself"
    real = p.resolve()
    for place, what in (
        (Path("/"), "the filesystem root"),
        (Path.home(), "your home directory"),
        (Path.cwd(), "the current directory"),
    ):
        place = place.resolve()
        if real == place or real in place.parents:
            return (
                f"is {what}"
                + ("" if real == place else " or a folder above it")
                + ": Kiln never overwrites it; choose a directory of its own"
            )
    if (real / ".git").exists():
        return "is the root of a repository: Kiln never overwrites it; choose a directory of its own"
    return None


def owns_dir(path: str | os.PathLike, kind: str) -> bool:
    """Whether `path` is a directory Kiln wrote as `kind` (its marker says so)."""
    marker = Path(path) / MARKER
    try:
        return not marker.is_symlink() and marker.read_bytes()[:_HEAD].strip() == tag(kind).encode()
    except OSError:
        return False


def owns_file(path: str | os.PathLike, kind: str) -> bool:
    """Whether `path` is a regular file Kiln wrote as `kind` (its first bytes carry the marker)."""
    p = Path(path)
    if p.is_symlink() or not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return tag(kind).encode() in f.read(_HEAD)
    except OSError:
        return False


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def refuse_inputs(out: Path, inputs: Iterable[str | os.PathLike], named: str, error: type[KilnError]) -> None:
    """Refuse an output that is, holds or lies inside one of the command's local inputs."""
    for given in inputs:
        if given and "://" not in str(given) and _overlaps(out.resolve(), local_path(given).resolve()):
            raise error(
                f"{named}: is, holds or lies inside the command's own input {str(given)!r}; "
                "Kiln never writes over its input"
            )


def writable_ancestor(path: str | os.PathLike, named: str, error: type[KilnError] = ConfigError) -> Path:
    """The nearest existing directory at or above `path`, proved writable: where a command that
    creates `path` (and any folders missing above it) will write first. Checked before the work,
    so a read-only or mistyped output fails in a second, not after it."""
    place = local_path(path)
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise error(f"{named}: {place} is a file, not a directory")
    if not writable_dir(place):
        raise error(f"{named}: cannot write in {place} (permission denied or a read-only filesystem)")
    return place


def _check_parent(out: Path, named: str, error: type[KilnError], make_parents: bool = False) -> None:
    if not make_parents and not out.parent.is_dir():
        raise error(f"{named}: its parent directory must exist ({out.parent} does not, or is a file)")
    writable_ancestor(out.parent, named, error)


def check_dir_target(
    path: str | os.PathLike,
    kind: str,
    named: str,
    *,
    inputs: Iterable = (),
    replace: bool = False,
    error: type[KilnError] = ConfigError,
    make_parents: bool = False,
) -> bool:
    """Before any work: whether a directory output `path` may be written. True when it exists
    and is an earlier output of `kind` that `replace` lets this command replace; False when
    it is absent or empty. Anything else is refused with one line that starts with `named`."""
    out = local_path(path)
    reason = protected_reason(out)
    if reason:
        raise error(f"{named}: {reason}")
    refuse_inputs(out, inputs, named, error)
    _check_parent(out, named, error, make_parents)
    if not out.exists():
        return False
    if not out.is_dir():
        raise error(f"{named}: is a file; expected a directory to create")
    if not any(out.iterdir()):
        return False
    if not owns_dir(out, kind):
        raise error(
            f"{named}: exists and has no {MARKER} marker of a Kiln {kind}, so Kiln did not write it "
            "and never overwrites it: choose a new directory"
        )
    if not replace:
        raise error(f"{named}: already holds an earlier {kind}; pass --overwrite to replace it")
    return True


def check_file_target(
    path: str | os.PathLike, kind: str, named: str, *, inputs: Iterable = (), error: type[KilnError] = ConfigError
) -> None:
    """Before any work: a file output `path` may be written: absent, or an earlier `kind` Kiln wrote."""
    out = local_path(path)
    if out.is_symlink():
        raise error(f"{named}: is a symbolic link; Kiln never replaces one")
    if out.is_dir():
        raise error(f"{named}: is a directory; expected a file path")
    refuse_inputs(out, inputs, named, error)
    _check_parent(out, named, error)
    if out.exists() and not owns_file(out, kind):
        raise error(f"{named}: exists and is not a {kind} Kiln wrote; it is never overwritten: choose a new path")


def writable_dir(path: str | os.PathLike[str]) -> bool:
    """Whether this process can create files in the directory `path`. Tried, not inferred from
    mode bits (root ignores them; a read-only mount does not show in them): an unnamed temp file
    (O_TMPFILE on Linux) that leaves nothing behind."""
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


# ---- writing -------------------------------------------------------------------------------------
def marked_json(kind: str, data: dict) -> str:
    """`data` as the JSON of a Kiln output of `kind`: its marker is the first key."""
    return json.dumps({"kiln_output": tag(kind), **data}, indent=2, default=str)


def mark(directory: str | os.PathLike, kind: str) -> None:
    """Write `directory`'s marker: from now on it is Kiln's `kind`."""
    (Path(directory) / MARKER).write_text(tag(kind) + "\n")


def temp_dir(parent: str | os.PathLike | None, name: str, kind: str = "temp") -> Path:
    """A new, marked directory for work in progress: hidden beside the output in `parent`, or
    in the system's temp directory (parent None)."""
    made = Path(
        tempfile.mkdtemp(
            prefix=f".{name}{TEMP_TAG}" if parent else f"kiln-{name}-",
            dir=None if parent is None else os.fspath(parent),
        )
    )
    mark(made, kind)
    return made


def write_file(path: str | os.PathLike, data: str | bytes, mode: int = 0o644, kind: str | None = None) -> None:
    """Write a local file whole or not at all: a temp file beside it, then a rename. With a
    `kind`, an existing file is replaced only if it is that kind of Kiln output."""
    path = local_path(path)
    if kind is not None:  # checked again: the file may have appeared during the work
        check_file_target(path, kind, str(path))
    tmp = path.with_name(f".{path.name}{TEMP_TAG}{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_dir(staged: str | os.PathLike, out: str | os.PathLike, kind: str, replace: bool = False) -> None:
    """Make the complete directory `staged` the output `out`, marked as `kind`. The target is
    checked again first (it may have changed during the work); an existing one is swapped in
    one atomic exchange, then the old one, now at `staged`'s path, is removed."""
    staged, out = Path(staged), local_path(out)
    existed = check_dir_target(out, kind, str(out), replace=replace)
    mark(staged, kind)
    if not existed:
        if out.is_dir():
            out.rmdir()  # empty: os.rename would take it too, but not on every filesystem
        os.rename(staged, out)
        return
    if not _exchange(staged, out):
        raise KilnError(
            f"{out}: this filesystem cannot swap directories atomically; remove the old {kind} yourself and run again"
        )
    remove_tree(staged, kind)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the
    kernel or filesystem has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename Kiln's own staged file or directory `src` to `dst`, where nothing is (checked by
    the caller's target checks); a file `dst` is replaced atomically."""
    os.replace(src, dst)


# ---- removing ------------------------------------------------------------------------------------
def remove_tree(path: str | os.PathLike, kinds: str | tuple[str, ...], proofs: Iterable[str] = ()) -> None:
    """Remove a directory Kiln wrote as one of `kinds`: its marker says so, or one of `proofs`
    (names of files only Kiln writes, like a checkpoint's completion marker) is in it. An empty
    directory goes too; anything else is refused, never removed."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        return
    if p.is_symlink() or not p.is_dir():
        raise KilnError(f"{p}: not removed: not a directory Kiln wrote")
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    if not (any(owns_dir(p, k) for k in kinds) or any((p / name).is_file() for name in proofs) or not any(p.iterdir())):
        raise KilnError(f"{p}: not removed: it has no {MARKER} marker of a Kiln {' or '.join(kinds)}")
    shutil.rmtree(p)


def discard(path: str | os.PathLike, kinds: str | tuple[str, ...] = "temp", proofs: Iterable[str] = ()) -> None:
    """`remove_tree` after a failure or for clean-up: a refusal or error is swallowed, since the
    error being reported matters more than a leftover."""
    with contextlib.suppress(OSError, KilnError):
        remove_tree(path, kinds, proofs)


def remove_file(path: str | os.PathLike, kind: str | None = None, proof: str = "") -> None:
    """Remove one file Kiln wrote: of `kind` (its marker), a temp file (its name), or one whose
    `proof` the caller read (a Kiln manifest or record that lists it; said in words)."""
    p = Path(path)
    if not (proof or TEMP_TAG in p.name or (kind is not None and owns_file(p, kind))):
        raise KilnError(f"{p}: not removed: not a file Kiln wrote")
    with contextlib.suppress(FileNotFoundError):
        p.unlink()


def delete_stored(fs, path: str, proof: str, directory: bool = False) -> None:
    """Delete a file (or an emptied directory) in a pyarrow filesystem, S3 or local, that a Kiln
    marker or manifest the caller read proves Kiln's (`proof`, in words)."""
    if not proof:
        raise KilnError(f"{path}: not deleted: nothing proves Kiln wrote it")
    if directory:
        fs.delete_dir(path)
    else:
        fs.delete_file(path)
