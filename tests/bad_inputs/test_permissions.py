"""Paths this user cannot read or write, met as an unprivileged user meets them. Root reads and
writes anything, so under root the commands run as `nobody` (setpriv), in a directory of their
own that nobody can enter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

KILN = str(Path(sys.executable).parent / "kiln")
NOBODY = 65534


@pytest.fixture
def unprivileged():
    """(workspace, run): a world-writable directory, and a runner of `kiln` as an ordinary user."""
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("root without setpriv: cannot act as an ordinary user")
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    if drop:
        _skip_unless_reachable(drop)
    ws = Path(tempfile.mkdtemp(prefix="kiln-perm-"))
    ws.chmod(0o777)

    def run(*args):
        env = {"PATH": os.environ["PATH"], "HOME": str(ws), "TMPDIR": str(ws), "LANG": "C.UTF-8"}
        return subprocess.run([*drop, KILN, *args], cwd=ws, env=env, capture_output=True, text=True, timeout=120)

    yield ws, run
    for d in ws.rglob("*"):
        if d.is_dir():
            d.chmod(0o755)
    shutil.rmtree(ws)


def _skip_unless_reachable(drop: list[str]) -> None:
    """A clone inside a directory only its owner may enter (`mktemp -d`, root's home) holds a
    .venv that `nobody` cannot reach: nothing the test could prepare short of a second
    environment, so it says so and skips."""
    probe = subprocess.run(
        [*drop, KILN, "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ["PATH"], "HOME": "/", "LANG": "C.UTF-8"},
        cwd="/",
    )
    if probe.returncode != 0 and "Permission denied" in probe.stderr:
        pytest.skip(
            f"user nobody cannot run {KILN} (a directory above it admits its owner only), "
            "so the commands cannot be tried as an ordinary user; clone into a world-readable directory"
        )


def _error_line(out) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_unreadable_input_directory_and_read_only_output_are_named(unprivileged, byte_dataset):
    ws, run = unprivileged
    dataset = shutil.copytree(byte_dataset, ws / "bytes")  # readable by the ordinary user
    corpus = ws / "corpus"
    (corpus / "private").mkdir(parents=True)
    (corpus / "a.txt").write_text("some text to tokenize\n" * 50)
    (corpus / "private").chmod(0o000)
    (ws / "ro").mkdir()
    (ws / "ro").chmod(0o555)
    (ws / "text.txt").write_text("some text to tokenize\n" * 50)
    before = sorted(p.relative_to(ws) for p in ws.rglob("*"))

    out = run("data", "prepare", "--input", "corpus", "--output", "ds", "--tokenizer", "byte", "--seq-len", "8")
    assert out.returncode == 1
    assert "input 'corpus': its directory" in _error_line(out) and "cannot be read" in _error_line(out)

    (corpus / "private").chmod(0o755)
    corpus.chmod(0o000)
    out = run("data", "prepare", "--input", "corpus", "--output", "ds", "--tokenizer", "byte", "--seq-len", "8")
    assert out.returncode == 1 and "input directory 'corpus' cannot be read" in _error_line(out)
    corpus.chmod(0o755)

    # A read-only output is found before any tokenizing, and nothing is left in or beside it.
    out = run(
        "data", "prepare", "--input", "text.txt", "--output", "ro/ds/deeper", "--tokenizer", "byte", "--seq-len", "8"
    )
    assert out.returncode == 1 and f"cannot write in {ws / 'ro'}" in _error_line(out)
    out = run("lr", "plot", "--out", "ro/lr.png")
    assert out.returncode == 2 and "--out ro/lr.png" in _error_line(out)
    # A read-only storage path fails the dry run, not the first checkpoint minutes in.
    out = run("train", "--dry-run", "--set", f"data.path={dataset}", "--set", "train.storage_path=ro/runs")
    assert out.returncode == 1 and "train.storage_path" in _error_line(out) and "cannot write in" in _error_line(out)
    out = run("export", str(ws / "nowhere"), "--output", "ro/export")
    assert out.returncode == 2 and "--output ro/export: cannot write in" in _error_line(out)
    after = sorted(p.relative_to(ws) for p in ws.rglob("*"))
    assert after == before, "something was left on disk"
