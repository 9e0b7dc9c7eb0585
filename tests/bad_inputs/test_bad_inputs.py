"""Every row of the bad-input table (cases.py), through the real CLI: the exit code, one
`kiln: error:` line naming the field or file, no traceback, nothing new or changed on disk
(beyond the traceback file the line names), no planted secret in anything printed or written,
and Ray never contacted. One module fixture runs all the rows in one process (harness.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cases import CASES, ENV_SECRETS  # noqa: E402
from harness import RAY_CONTACTED, snapshot  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _edit_manifest(change):
    def edit(ds: Path) -> None:
        m = json.loads((ds / "manifest.json").read_text())
        change(m)
        (ds / "manifest.json").write_text(json.dumps(m))
    return edit


def _first_shard(ds: Path) -> Path:
    return ds / json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"][0]["path"]


def _truncate(ds: Path) -> None:
    shard = _first_shard(ds)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _corrupt(ds: Path) -> None:
    shard = _first_shard(ds)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3: len(raw) // 3 + 512] = bytes(512)
    shard.write_bytes(bytes(raw))


def _beside_with_seq_len_32(ds: Path) -> None:
    """A second dataset beside the first, whose manifest says seq_len 32: another kind of row."""
    other = ds.parent / f"{ds.name}32"
    shutil.copytree(ds, other)
    _edit_manifest(lambda m: m.update(seq_len=32))(other)


# What a row does to its copy of the valid dataset before the command runs.
DATASET_EDITS = {
    "train-mix-other-seq-len": _beside_with_seq_len_32,
    "verify-tokenizer-a-string": _edit_manifest(lambda m: m.update(tokenizer="byte")),
    "train-manifest-wrong-shape": _edit_manifest(lambda m: m.update(tokenizer="byte")),
    "verify-shard-without-bytes": _edit_manifest(lambda m: m["splits"]["train"]["shards"][0].pop("bytes")),
    "verify-seq-len-changed": _edit_manifest(lambda m: m.update(seq_len=32)),
    "verify-format-version": _edit_manifest(lambda m: m.update(format_version=99)),
    "verify-vocab-below-tokens": _edit_manifest(lambda m: m["tokenizer"].update(vocab_size=100)),
    "verify-shard-missing": lambda ds: _first_shard(ds).unlink(),
    "verify-shard-truncated": _truncate,
    "verify-shard-corrupted": _corrupt,
}


def _store(path: Path) -> bytes:
    """A real MLflow store holding the experiment `kiln` and one run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{path}")
    client.create_run(client.create_experiment("kiln"))
    return path.read_bytes()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, byte_dataset, corpus):
    root = tmp_path_factory.mktemp("bad-inputs")
    store = _store(root / "store.db")
    sleeper = subprocess.Popen(["sleep", "600"])  # a live process a services file records as Kiln's
    todo, before = [], {}
    for case in CASES:
        ws = root / case.id
        for d in ("home", "tmp"):
            (ws / d).mkdir(parents=True)
        for rel, content in case.files.items():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            if content == "RUNNING":
                content = json.dumps([{"name": "mlflow", "pid": sleeper.pid, "url": "http://127.0.0.1:1",
                                       "log": "l", "started": psutil.Process(sleeper.pid).create_time()}])
            content = store if content == "STORE" else content
            (ws / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
        if case.dataset:
            shutil.copytree(byte_dataset, ws / "ds")
            DATASET_EDITS.get(case.id, lambda ds: None)(ws / "ds")
        env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(ws / "home"), "TMPDIR": str(ws / "tmp"),
               "RAY_AUTH_MODE": "token", **ENV_SECRETS}
        argv = [a.format(ws=ws, corpus=corpus[0], ds=ws / "ds", repo=REPO) for a in case.argv]
        before[case.id] = snapshot(ws)
        todo.append({"id": case.id, "argv": argv, "cwd": str(ws), "env": env,
                     "stdout": str(root / f"{case.id}.out"), "stderr": str(root / f"{case.id}.err")})
    (root / "cases.json").write_text(json.dumps(todo))
    try:
        subprocess.run([sys.executable, str(Path(__file__).parent / "harness.py"), str(root / "cases.json"),
                        str(root / "results.json")], check=True, timeout=1500, cwd=root)
    finally:
        sleeper.kill()
    return root, before, json.loads((root / "results.json").read_text())


def test_the_table_covers_every_command_with_at_least_150_cases():
    commands = {" ".join(c.argv[:2]) if c.argv[:1] in (["data"], ["lr"], ["runs"], ["cluster"], ["services"])
                else (c.argv[:1] or ["(none)"])[0] for c in CASES}
    assert len(CASES) >= 150
    assert {"data prepare", "data verify", "train", "sweep", "lr plot", "runs list", "runs compare", "plan",
            "cluster check", "services up", "services down", "services status", "config"} <= commands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, outcomes):
    root, before, results = outcomes
    ws, result = root / case.id, results[case.id]
    out = (root / f"{case.id}.out").read_text(errors="replace")
    err = (root / f"{case.id}.err").read_text(errors="replace")
    assert result["code"] == case.code, (result, err[-3000:], out[-1000:])
    assert "Traceback" not in out + err, err[-3000:]
    assert RAY_CONTACTED not in err
    errors = [line for line in err.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and case.needle in errors[0], err[-3000:]

    after = snapshot(ws)
    changed = {p for p, st in after.items() if before[case.id].get(p) != st}
    named = {p for p in changed if re.fullmatch(r"tmp/kiln-error-\w+\.log", p) and str(ws / p) in errors[0]}
    assert changed - named == set(), f"left on disk: {sorted(changed - named)}"
    assert set(before[case.id]) <= set(after), f"removed: {sorted(set(before[case.id]) - set(after))}"

    written = [out, err, *((ws / p).read_text(errors="replace") for p in named)]
    for secret in [*ENV_SECRETS.values(), *case.secrets]:
        assert not any(secret in text for text in written), f"secret {secret[:12]}... printed or written"
