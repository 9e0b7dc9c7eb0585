"""The write guard (`kiln.guard`): Kiln removes or replaces only what it wrote, proven by its
marker; the places it never touches; atomic replacement; and that no other module in the
package removes, renames or replaces a path itself."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from kiln import guard
from kiln.errors import ConfigError, KilnError

PACKAGE = Path(guard.__file__).parent

# Calls that remove, rename or replace a path: module functions, and methods of Path and of
# pyarrow filesystems. `.replace(x)` with one argument is Path.replace (str.replace takes two,
# dataclasses.replace takes keywords).
FUNCTIONS = {
    ("shutil", "rmtree"),
    ("shutil", "move"),
    ("os", "remove"),
    ("os", "unlink"),
    ("os", "rename"),
    ("os", "replace"),
    ("os", "rmdir"),
    ("os", "removedirs"),
    ("os", "renames"),
}
METHODS = {"rmtree", "unlink", "rename", "rmdir", "delete_file", "delete_dir", "delete_dir_contents", "move"}


def destructive_calls(source: str) -> list[str]:
    """`name (line N)` for each call in `source` that removes, renames or replaces a path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, owner = node.func.attr, node.func.value
        if isinstance(owner, ast.Name) and (owner.id, attr) in FUNCTIONS:
            found.append(f"{owner.id}.{attr} (line {node.lineno})")
        elif isinstance(owner, ast.Name) and owner.id in ("guard", "os", "shutil"):
            continue  # the guard's own functions, os.path and friends
        elif attr in METHODS or (attr == "replace" and len(node.args) == 1 and not node.keywords):
            found.append(f".{attr} (line {node.lineno})")
    return found


def test_the_detector_finds_every_kind_of_destructive_call():
    planted = (
        "import os, shutil\nshutil.rmtree(p)\nos.replace(a, b)\nPath(p).unlink()\nq.rename(r)\n"
        "fs.delete_file(x)\np.replace(q)\ns.replace('a', 'b')\ndataclasses.replace(c, x=1)\n"
    )
    assert len(destructive_calls(planted)) == 6


def test_only_the_write_guard_removes_renames_or_replaces_paths():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "guard.py" and path.parent == PACKAGE:
            assert destructive_calls(path.read_text())  # the guard does them, so the detector sees them
            continue
        calls = destructive_calls(path.read_text())
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert offenders == {}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home directory and a current directory of the test's own."""
    h = tmp_path / "home"
    (h / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.chdir(h / "work")
    return h


@pytest.mark.parametrize(
    "target,why",
    [
        ("~", "your home directory"),
        (".", "the current directory"),
        ("..", "your home directory"),
        ("../..", "your home directory or a folder above"),
        ("/", "the filesystem root"),
        ("repo", "root of a repository"),
        ("link", "symbolic link"),
    ],
)
def test_places_never_written_over(home, target, why):
    (home / "work" / "repo" / ".git").mkdir(parents=True)
    (home / "work" / "real").mkdir()
    (home / "work" / "link").symlink_to(home / "work" / "real")
    with pytest.raises(ConfigError, match=why):
        guard.check_dir_target(target, "export", f"--output {target}", replace=True)


def test_a_directory_is_replaced_only_when_its_marker_says_it_is_that_kind(home):
    out = home / "work" / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("w")  # looks like an export; nothing proves it is one
    with pytest.raises(ConfigError, match="no .kiln-output marker"):
        guard.check_dir_target(out, "export", "--output out", replace=True)
    guard.mark(out, "dataset")  # Kiln's, but another kind
    with pytest.raises(ConfigError, match="no .kiln-output marker"):
        guard.check_dir_target(out, "export", "--output out", replace=True)
    guard.mark(out, "export")
    with pytest.raises(ConfigError, match="--overwrite"):
        guard.check_dir_target(out, "export", "--output out")
    assert guard.check_dir_target(out, "export", "--output out", replace=True) is True


def test_replacing_swaps_atomically_and_removes_only_the_old_output(home):
    out = home / "work" / "out"
    first = guard.temp_dir(out.parent, out.name)
    (first / "a.txt").write_text("1")
    guard.replace_dir(first, out, "export")
    assert (out / "a.txt").read_text() == "1" and guard.owns_dir(out, "export") and not first.exists()
    second = guard.temp_dir(out.parent, out.name)
    (second / "b.txt").write_text("2")
    inode = out.stat().st_ino
    guard.replace_dir(second, out, "export", replace=True)
    assert sorted(p.name for p in out.iterdir()) == [guard.MARKER, "b.txt"]
    assert out.stat().st_ino != inode and not second.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temp or trash left beside it


def test_a_file_output_is_replaced_only_when_kiln_wrote_it(home):
    target = home / "work" / "summary.json"
    target.write_text('{"mine": true}')
    with pytest.raises(ConfigError, match="not a run-summary Kiln wrote"):
        guard.check_file_target(target, "run-summary", "--summary-json summary.json")
    with pytest.raises(ConfigError):
        guard.write_file(target, guard.marked_json("run-summary", {}), kind="run-summary")
    assert target.read_text() == '{"mine": true}'
    target.unlink()
    guard.write_file(target, guard.marked_json("run-summary", {"step": 1}), kind="run-summary")
    guard.check_file_target(target, "run-summary", "--summary-json summary.json")  # its own: may be replaced
    guard.write_file(target, guard.marked_json("run-summary", {"step": 2}), kind="run-summary")
    assert '"step": 2' in target.read_text()


def test_an_output_inside_or_around_an_input_is_refused(home):
    model = home / "work" / "model"
    model.mkdir()
    for out in (model, model / "export", home / "work"):
        with pytest.raises(ConfigError):
            guard.check_dir_target(out, "export", "--output x", inputs=[str(model)])


def test_removal_needs_proof(home):
    theirs = home / "work" / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    with pytest.raises(KilnError, match="not removed"):
        guard.remove_tree(theirs, "checkpoint")
    guard.discard(theirs, "checkpoint")  # swallowed, and still nothing removed
    assert (theirs / "notes.txt").read_text() == "keep"
    with pytest.raises(KilnError, match="not removed"):
        guard.remove_file(theirs / "notes.txt")
    with pytest.raises(KilnError, match="nothing proves"):
        guard.delete_stored(None, str(theirs / "notes.txt"), proof="")
    (theirs / "kiln_complete.rank0.json").write_text("{}")  # a proof the caller names
    guard.remove_tree(theirs, "checkpoint", proofs=("kiln_complete.rank0.json",))
    assert not theirs.exists()


def test_write_file_leaves_nothing_behind_when_it_fails(home):
    target = home / "work" / "no-such-dir" / "x.json"
    with pytest.raises(OSError):
        guard.write_file(target, "{}")
    assert os.listdir(home / "work") == []
