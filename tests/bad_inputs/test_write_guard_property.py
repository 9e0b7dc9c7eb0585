"""A property of every command that writes: whatever sequence of `kiln data prepare`,
`kiln export`, `kiln lr plot` and `kiln services up|down` a user runs, aimed at any of their own
files and folders (or `.`, `~`, `..`, a symbolic link, or a new path among them), no file Kiln
did not create is removed or changed. The commands run through the real CLI, in this process."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.cli import main

USER_FILES = {
    "notes.txt": "mine",
    "todo.md": "- [ ] ship",
    ".ssh/id_ed25519": "PRIVATE KEY",
    "proj/train.py": "print(1)",
    "proj/data/x.txt": "some text\n" * 20,
    "proj/lr.png": "\x89PNG not Kiln's",
    "cfg.yaml": "train:\n  max_steps: 20\n",
    "hub-model/config.json": '{"model_type": "gpt2"}',
    "hub-model/model.safetensors": "w",
    "hub-model/README.md": "# card",
    "ds/manifest.json": "{}",
    "ds/notes.md": "keep",
    "svc/services.json": "[]",
}
TARGETS = [
    ".",
    "~",
    "..",
    "notes.txt",
    "proj",
    "proj/train.py",
    "proj/lr.png",
    "cfg.yaml",
    "hub-model",
    "ds",
    "svc",
    ".ssh",
    "link",
    "proj/new-out",
    "new-out",
    "new-out/inner",
]


def _fingerprint(root: Path, skip: set[Path]) -> dict[str, str]:
    """The user's own files (Kiln's outputs excluded) and a hash of each."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if (d / n) not in skip]
        for name in filenames:
            p = d / name
            if p not in skip:
                out[str(p.relative_to(root))] = "link" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _argv(command: str, target: str, flag: str, model: str, corpus: str) -> list[str]:
    if command == "export":
        return ["export", model, "--output", target, *(["--overwrite"] if flag else [])]
    if command == "lr":
        return ["lr", "plot", "--out", target, *(["--config", "cfg.yaml"] if flag else [])]
    if command == "prepare":
        return [
            "data",
            "prepare",
            "--input",
            corpus,
            "--output",
            target,
            "--tokenizer",
            "byte",
            "--seq-len",
            "16",
            "--workers",
            "0",
            "--if-exists",
            "overwrite" if flag else "error",
        ]
    return ["services", command.split("-")[1], "--dir", target]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_hf) -> str:
    """A Kiln export to export again (the source of every `kiln export` here)."""
    out = tmp_path_factory.mktemp("model") / "export"
    assert main(["export", str(tiny_hf), "--output", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(Path(shutil.__file__).read_text()[:20000])
    return str(d)


COMMANDS = st.lists(
    st.tuples(
        st.sampled_from(["export", "lr", "prepare", "services-down", "services-up"]),
        st.sampled_from(TARGETS),
        st.booleans(),
    ),
    min_size=2,
    max_size=5,
)


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(commands=COMMANDS)
def test_writes_never_touch_what_kiln_did_not_create(commands, tmp_path_factory, model, small_corpus):
    root = tmp_path_factory.mktemp("user")
    home, work = root / "home", root / "home" / "work"
    for rel, text in USER_FILES.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    (home / ".bashrc").write_text("export PS1='$ '")
    (work / "link").symlink_to(work / "hub-model")
    before = _fingerprint(root, set())
    saved_cwd, saved_home = os.getcwd(), os.environ["HOME"]
    os.chdir(work)
    os.environ["HOME"] = str(home)
    created: set[Path] = set()
    started: list[str] = []
    try:
        for command, target, flag in commands:
            path = Path(os.path.abspath(os.path.expanduser(target)))  # as the command reads it, in work/
            existed = path.exists() or path.is_symlink()
            if command == "services-up" and not existed:
                continue  # it would start a real server there: a new directory is Kiln's to fill
            code = main(_argv(command, target, flag, model, small_corpus))
            if command == "services-up" and code == 0:
                started.append(target)
            assert not started, f"services up took {target}, which is not Kiln's"  # no target here is a services dir
            if code == 0 and not existed and path.exists():
                created.add(path)
            after = _fingerprint(root, created)
            assert {k: v for k, v in before.items() if k not in after or after[k] != v} == {}, (command, target)
    finally:
        for target in started:  # a server this test must not leave running, whatever it found
            main(["services", "down", "--dir", target])
        os.chdir(saved_cwd)
        os.environ["HOME"] = saved_home
