"""Every row of the bad-input table (cases.py), through the real CLI: the exit code, one
`kiln: error:` line naming the field or file, no traceback, nothing new or changed on disk
(beyond the traceback file the line names) in the case's directory, its HOME and any database
in them, no planted secret in anything printed or written, Ray never contacted, and each case
done within `MAX_SECONDS` and `MAX_PEAK_MB` of memory. One module fixture runs
all the rows in one process (harness.py)."""

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
MAX_SECONDS = 10  # refused within seconds: a bad input never costs minutes
MAX_PEAK_MB = 1024  # nor gigabytes (an alias bomb, a 50 MB file): the peak of the process running it


def _edit_json(name: str, change):
    """An edit of the JSON file `name` in a copied dataset or model: `change` mutates its object."""

    def edit(folder: Path) -> None:
        obj = json.loads((folder / name).read_text())
        change(obj)
        (folder / name).write_text(json.dumps(obj))

    return edit


def _edit_manifest(change):
    return _edit_json("manifest.json", change)


def _first_shard(ds: Path) -> Path:
    return ds / json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"][0]["path"]


def _truncate(ds: Path) -> None:
    shard = _first_shard(ds)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _corrupt(ds: Path) -> None:
    shard = _first_shard(ds)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3 : len(raw) // 3 + 512] = bytes(512)
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


def _truncate_weights(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _edit_hf_config(change):
    return _edit_json("config.json", change)


def _bin_only(model: Path) -> None:
    (model / "model.safetensors").rename(model / "pytorch_model.bin")


def _nan_weights(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("attn.c_attn.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


# What a row does to its copy of the tiny Hugging Face model before the command runs.
MODEL_EDITS = {
    "dry-run-init-truncated": _truncate_weights,
    "dry-run-init-wrong-shape": _edit_hf_config(lambda c: c.update(n_layer=3)),
    "dry-run-init-bin-only": _bin_only,
    "dry-run-init-heads": _edit_hf_config(lambda c: c.update(n_head=5)),
    "export-heads-not-dividing": _edit_hf_config(lambda c: c.update(n_head=5)),
    "generate-nan-weights": _nan_weights,
}


def _app_db(path: Path) -> bytes:
    """Another application's SQLite database: a table of its own, one row."""
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")
    db.close()
    return path.read_bytes()


def _int_parquet(path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    return path.read_bytes()


def _store(path: Path) -> bytes:
    """A real MLflow store holding the experiment `kiln` and one run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{path}")
    client.create_run(client.create_experiment("kiln"))
    return path.read_bytes()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, byte_dataset, corpus, tiny_hf):
    root = tmp_path_factory.mktemp("bad-inputs")
    specials = {
        "STORE": _store(root / "store.db"),
        "APPDB": _app_db(root / "app.db"),
        "PARQUET_INT": _int_parquet(root / "int.parquet"),
        "BIG": b"a: 1\n" * (10 << 20),
    }  # 50 MB
    sleeper = subprocess.Popen(["sleep", "600"])  # a live process a services file records as Kiln's
    todo, before = [], {}
    for case in CASES:
        ws = root / case.id
        for d in ("home", "tmp"):
            (ws / d).mkdir(parents=True)
        if case.model:
            shutil.copytree(tiny_hf, ws / "hf")
            MODEL_EDITS.get(case.id, lambda m: None)(ws / "hf")
        for rel, content in case.files.items():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            if content == "RUNNING":
                content = json.dumps(
                    [
                        {
                            "name": "mlflow",
                            "pid": sleeper.pid,
                            "url": "http://127.0.0.1:1",
                            "log": "l",
                            "started": psutil.Process(sleeper.pid).create_time(),
                        }
                    ]
                )
            if isinstance(content, str) and content.startswith("SYMLINK:"):
                (ws / rel).symlink_to(content.removeprefix("SYMLINK:"))
                continue
            content = specials.get(content, content) if isinstance(content, str) else content
            (ws / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
        if case.dataset:
            shutil.copytree(byte_dataset, ws / "ds")
            DATASET_EDITS.get(case.id, lambda ds: None)(ws / "ds")
        env = {
            "PATH": os.environ["PATH"],
            "LANG": "C.UTF-8",
            "HOME": str(ws / "home"),
            "TMPDIR": str(ws / "tmp"),
            "RAY_AUTH_MODE": "token",
            **ENV_SECRETS,
        }
        env.update(case.env)
        argv = [a.format(ws=ws, corpus=corpus[0], ds=ws / "ds", hf=ws / "hf", repo=REPO) for a in case.argv]
        before[case.id] = snapshot(ws)
        todo.append(
            {
                "id": case.id,
                "argv": argv,
                "cwd": str(ws),
                "env": env,
                "stdout": str(root / f"{case.id}.out"),
                "stderr": str(root / f"{case.id}.err"),
            }
        )
    (root / "cases.json").write_text(json.dumps(todo))
    try:
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).parent / "harness.py"),
                str(root / "cases.json"),
                str(root / "results.json"),
            ],
            check=True,
            timeout=1500,
            cwd=root,
        )
    finally:
        sleeper.kill()
    return root, before, json.loads((root / "results.json").read_text())


def test_the_table_covers_every_command_with_at_least_150_cases():
    commands = {
        " ".join(c.argv[:2])
        if c.argv[:1] in (["data"], ["lr"], ["runs"], ["cluster"], ["services"])
        else (c.argv[:1] or ["(none)"])[0]
        for c in CASES
    }
    assert len(CASES) >= 150
    assert {
        "data prepare",
        "data verify",
        "train",
        "sweep",
        "lr plot",
        "runs list",
        "runs compare",
        "plan",
        "cluster check",
        "services up",
        "services down",
        "services status",
        "config",
    } <= commands


def _verdict(case, root: Path, before: dict, results: dict) -> dict:
    """What one case did: its output, its error lines, and what it left, changed or removed on
    disk (the named traceback file aside), and which planted secrets got out."""
    ws, result = root / case.id, results[case.id]
    out = (root / f"{case.id}.out").read_text(errors="replace")
    err = (root / f"{case.id}.err").read_text(errors="replace")
    errors = [line for line in err.splitlines() if line.startswith("kiln: error:")]
    after = snapshot(ws)
    changed = {p for p, st in after.items() if before[case.id].get(p) != st}
    named = {p for p in changed if re.fullmatch(r"tmp/kiln-error-\w+\.log", p) and str(ws / p) in "".join(errors)}
    written = [out, err, *((ws / p).read_text(errors="replace") for p in named)]
    return {
        "result": result,
        "out": out,
        "err": err,
        "errors": errors,
        "added": sorted(set(after) - set(before[case.id]) - named),
        "changed": sorted(p for p in changed - named if p in before[case.id]),
        "removed": sorted(set(before[case.id]) - set(after)),
        "secrets": [s[:12] for s in [*ENV_SECRETS.values(), *case.secrets] if any(s in t for t in written)],
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, outcomes):
    v = _verdict(case, *outcomes)
    result, out, err, errors = v["result"], v["out"], v["err"], v["errors"]
    assert result["code"] == case.code, (result, err[-3000:], out[-1000:])
    assert result["seconds"] < MAX_SECONDS and result["peak_mb"] < MAX_PEAK_MB, result
    assert "Traceback" not in out + err, err[-3000:]
    assert RAY_CONTACTED not in err
    assert len(errors) == 1 and case.needle in errors[0], err[-3000:]
    assert v["added"] == [] and v["changed"] == [], f"left on disk: {v['added']}, changed: {v['changed']}"
    assert v["removed"] == [], f"removed: {v['removed']}"
    assert v["secrets"] == [], f"secrets printed or written: {v['secrets']}"


def test_the_table_s_counts(outcomes):
    """The counts a closing note reports, in one file beside the cases (counts.json): every one
    but the number of cases is zero."""
    root = outcomes[0]
    counts = dict.fromkeys(
        [
            "tracebacks",
            "internal errors",
            "partial outputs",
            "secrets",
            "data destroyed",
            "foreign stores changed",
            "over time or memory",
        ],
        0,
    )
    for case in CASES:
        v = _verdict(case, *outcomes)
        counts["tracebacks"] += "Traceback" in v["out"] + v["err"]
        counts["internal errors"] += "internal error" in v["err"]
        counts["partial outputs"] += bool(v["added"])
        counts["secrets"] += bool(v["secrets"])
        counts["data destroyed"] += bool(v["removed"] or [p for p in v["changed"] if not p.endswith(".db")])
        counts["foreign stores changed"] += any(p.endswith(".db") for p in v["changed"])
        r = v["result"]
        counts["over time or memory"] += not (r["seconds"] < MAX_SECONDS and r["peak_mb"] < MAX_PEAK_MB)
    slowest = max(CASES, key=lambda c: outcomes[2][c.id]["seconds"])
    largest = max(CASES, key=lambda c: outcomes[2][c.id]["peak_mb"])
    (root / "counts.json").write_text(
        json.dumps(
            {
                "cases": len(CASES),
                **counts,
                "slowest": [slowest.id, outcomes[2][slowest.id]["seconds"]],
                "largest_peak_mb": [largest.id, outcomes[2][largest.id]["peak_mb"]],
            },
            indent=2,
        )
    )
    assert counts == dict.fromkeys(counts, 0), counts
