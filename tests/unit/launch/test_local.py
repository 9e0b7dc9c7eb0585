"""The training loop is a plain function: run it in this process with DeepSpeed, no Ray. The
same runs carry planted credentials, and nothing they log may contain one."""

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from mlflow_store import sqlite_store  # noqa: E402

from kiln.core import checkpoint
from kiln.launch.local import free_port

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[3]
# Credentials as users hand them over: in the environment, and inside a URL in the config.
PLANTED_ENV = {
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-0001",
    "AWS_SESSION_TOKEN": "planted-aws-session-0002",
    "MLFLOW_TRACKING_TOKEN": "planted-mlflow-token-0003",
    "RAY_AUTH_TOKEN": "planted-ray-token-0004",
}
PLANTED_ENDPOINT = "https://kiln:planted-endpoint-pw-0005@minio.invalid:9000"
PLANTED = [*PLANTED_ENV.values(), "planted-endpoint-pw-0005"]


def _run_local(byte_dataset, tmp_path, *overrides, ranks=1, tty=False, args=()):
    launcher = [sys.executable, "-m", "kiln.launch.local"]
    if ranks > 1:  # torchrun sets RANK/WORLD_SIZE/MASTER_* for each process
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--standalone",  # its rendezvous on a port the OS picks as it binds: none to lose
            "-m",
            "kiln.launch.local",
        ]
    cmd = [
        *launcher,
        "--config",
        str(REPO / "jobs/configs/debug.yaml"),
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        "train.max_steps=30",
        "--set",
        "train.eval_every=15",
        "--set",
        "train.eval_batches=8",  # the config's 0 is the whole split: 200 batches at each save
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        "train.micro_batch_size=8",
        "--set",
        f"logging.tracking_uri={sqlite_store(tmp_path)}",
        "--set",
        "logging.experiment=local",
        "--set",
        f"train.storage_path={tmp_path}/runs",
        "--set",
        f"data.s3_endpoint={PLANTED_ENDPOINT}",
        *[a for o in overrides for a in ("--set", o)],
        *args,
    ]
    env = dict(os.environ, **PLANTED_ENV, **shared_cache_in(tmp_path))
    env.pop("TORCH_EXTENSIONS_DIR", None)  # Kiln's choice of cache is what is tested
    if not tty:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    # stderr on a real pseudo-terminal, as when a user runs it in a shell; stdout stays a pipe.
    # The bar fits the terminal's width: give it one the whole line fits in.
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    env.pop("COLUMNS", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, cwd=tmp_path, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def pump():  # drain the terminal while the run writes to it, or it blocks on a full buffer
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=600)
    reader.join(timeout=10)
    os.close(master)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, b"".join(chunks).decode(errors="replace"))


def shared_cache_in(tmp_path) -> dict[str, str]:
    """The machine's shared caches, moved under `tmp_path`: torch's extension cache (where
    DeepSpeed would JIT-build its ops) starts empty; matplotlib's font cache stays where it is."""
    import matplotlib

    return {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache"), "MPLCONFIGDIR": matplotlib.get_cachedir()}


@pytest.mark.parametrize("zero_stage, ranks", [(3, 1), (2, 2)], ids=["single-process-zero3", "torchrun-2-ranks-zero2"])
def test_loop_trains_without_ray(byte_dataset, tmp_path, zero_stage, ranks):
    # The 2-rank run also saves by wall clock (every 6 ms: in effect after every step, so the
    # test does not hang on how fast this machine is), into one directory both ranks share.
    # It keeps only the newest two.
    # The single process saves every 10 steps and keeps the best one by validation loss (plus
    # the newest, which a resume needs).
    timed = (
        ["train.checkpoint_every_minutes=0.0001", "train.keep_checkpoints=2"]
        if ranks > 1
        else ["train.checkpoint_every=10", "train.keep_checkpoints=1", "train.keep_checkpoints_by=loss/val"]
    )
    # The single process has its stderr on a terminal: it draws the progress bar there.
    out = _run_local(byte_dataset, tmp_path, f"parallel.zero_stage={zero_stage}", *timed, ranks=ranks, tty=ranks == 1)
    assert out.returncode == 0, out.stderr[-3000:]
    frames = [f for f in out.stderr.split("\r\x1b[K") if f.startswith("[")]
    if ranks == 1:  # redrawn in place (carriage return, erase line), the last frame kept
        assert len(frames) >= 2 and "step 30/30" in frames[-1] and "eta 0s" in frames[-1], frames[-3:]
    else:  # no terminal: plain log lines every logging.progress_every steps, no escape codes
        assert not frames and "\x1b[K" not in out.stderr
        assert "step 20/30" in out.stderr and "step 30/30" in out.stderr
    assert "import ray" not in out.stderr
    # DeepSpeed's step spawns no process: ZeRO-3 on the CPU ran `numactl` at every reduce-scatter
    # until Kiln said how many ranks share the host, and each spawn reset Python's warning
    # registry, so one deprecation warning came back at every step.
    assert out.stderr.count("reduce_scatter_tensor` is deprecated") <= 1, out.stderr[-3000:]
    # DeepSpeed's ops came from the environment's cache, built at install: nothing was compiled
    # into the machine's shared one (which an empty or another venv's cache made take 29 s).
    assert not (tmp_path / "xdg-cache" / "torch_extensions").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("local").experiment_id])[0]
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert run.data.params["parallel.zero_stage"] == str(zero_stage)
    assert run.data.tags["kiln.launcher"] == "local"
    # The summary's figures and text are in the run too (no workers.log without Ray).
    assert run.data.metrics["time/first_step_s"] > 0 and run.data.metrics["data/unigram_entropy_bits"] > 0
    assert [f.path for f in client.list_artifacts(run.info.run_id) if f.path == "summary.txt"] == ["summary.txt"]
    # MLflow's own run metadata: who, from what, which commit; the dataset as a dataset input.
    assert run.data.tags["mlflow.user"] and run.data.tags["mlflow.source.type"] == "LOCAL"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    (used,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    manifest = json.loads((Path(run.data.params["data.path"]) / "manifest.json").read_text())
    assert (used.dataset.name, used.dataset.digest) == (
        Path(run.data.params["data.path"]).name,
        manifest["fingerprint"],
    )
    assert [(t.key, t.value) for t in used.tags] == [("mlflow.data.context", "training")]
    assert run.data.params["parallel.num_workers"] == str(ranks)  # the world size torchrun gave
    root = tmp_path / "runs" / run.info.run_name
    assert (root / "step_00000030" / "latest").is_file()
    saved = sorted(p.name for p in root.iterdir() if p.name != "kiln-run.json")  # its MLflow run, for forks
    assert json.loads((root / "kiln-run.json").read_text())["mlflow_run_id"] == run.info.run_id
    assert all(checkpoint.is_complete(str(root / name)) for name in saved), saved  # none partial
    if ranks == 1:  # every save was evaluated; the best of them and the newest survive
        val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/val")}
        assert {10, 20, 30} <= set(val), val
        best = min((10, 20, 30), key=val.get)
        assert saved == sorted({f"step_{best:08d}", "step_00000030"}), (saved, val)
        marker = json.loads((root / saved[0] / checkpoint.MARKER.format(rank=0)).read_text())
        assert marker[checkpoint.SCORE] == val[int(saved[0][5:])], (marker, val)
    if ranks > 1:
        # timed saves happened before the last step's, and all but the newest two were pruned
        assert len(saved) == 2 and saved[-1] == "step_00000030", saved
        assert (root / saved[0] / checkpoint.MARKER.format(rank=1)).is_file()
    assert "val loss" in out.stdout and "unigram entropy" in out.stdout
    _assert_no_planted_secret(client, run, out, tmp_path)


def _assert_no_planted_secret(client, run, out, tmp_path) -> None:
    """Search everything the run logged: params, tags, metric names, every artifact, the console."""
    assert run.data.params["data.s3_endpoint"] == "https://kiln:***@minio.invalid:9000"  # logged, masked
    logged = [
        out.stdout,
        out.stderr,
        *run.data.params,
        *run.data.params.values(),
        *run.data.tags,
        *run.data.tags.values(),
        *run.data.metrics,
    ]
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    files = [p for p in artifacts.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files), files
    logged += [p.read_bytes().decode("latin-1") for p in files]
    for secret in PLANTED:
        assert not any(secret in text for text in logged), f"{secret} reached what the run logged"


def _name_as_rank(rank: int, tmp: str) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from kiln.config import load_config
    from kiln.core.process import WorldInfo
    from kiln.launch.local import agree_on_run_name

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    cfg = load_config(str(REPO / "jobs/configs/debug.yaml"))
    # As if the ranks had read their clocks either side of a second.
    cfg = dataclasses.replace(
        cfg,
        logging=dataclasses.replace(cfg.logging, run_name=f"debug-2026112{rank}"),
        train=dataclasses.replace(cfg.train, storage_path=f"{tmp}/runs{rank}"),
    )
    agreed = agree_on_run_name(cfg, WorldInfo(rank=rank, world_size=2, device=torch.device("cpu")))
    Path(tmp, f"rank{rank}").write_text(f"{agreed.logging.run_name} {agreed.train.storage_path}")
    dist.destroy_process_group()


def test_torchrun_ranks_agree_on_rank0s_run_name(tmp_path):
    # Each torchrun rank names the run by its own clock; they must all use rank 0's name, or
    # their checkpoint shards land in different directories and no checkpoint is complete.
    import torch.multiprocessing as mp

    mp.spawn(_name_as_rank, args=(str(tmp_path),), nprocs=2)
    said = {(tmp_path / f"rank{r}").read_text() for r in (0, 1)}
    assert said == {f"debug-20261120 {tmp_path}/runs0"}


def test_summary_json_never_replaces_a_file_that_is_not_a_run_summary(tmp_path):
    """Checked before anything starts, as `kiln train --summary-json` is: a typo must not cost
    a user their file after the run."""
    mine = tmp_path / "notes.json"
    mine.write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.launch.local", "--config", str(REPO / "jobs/configs/debug.yaml")]
        + ["--summary-json", str(mine)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and f"--summary-json {mine}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]  # no run was started


def test_a_run_resumed_from_a_checkpoint_matches_the_uninterrupted_run(
    byte_dataset, prose_dataset, tmp_path, checkpoint_tensors
):
    """fp32 on CPU: run A trains 16 steps and saves at 8 and 16; run B resumes from A's step 8
    and trains on to 16. B's losses equal A's step for step, and its final weights and
    optimizer state are bitwise A's: the resume restored everything and read the same data.
    Dropout makes the RNG state matter, and a micro-batch the health guard leaves out at step 5
    makes the data position differ from steps x micro-batches. The data is a mixture of two
    datasets, reshuffled each epoch, so the resume also finds its place in a mixture's order;
    both runs log the same realised mix. Then a fork of A (`--fork`) trains 4 steps more with
    another LR, weight decay and schedule: from A's step, with its own settings, tagged with A."""
    import torch
    from mlflow.tracking import MlflowClient

    from kiln.core.schedule import ScheduleConfig, lr_multiplier

    common = [
        "train.max_steps=16",
        "train.checkpoint_every=8",
        "train.eval_every=0",
        "parallel.zero_stage=2",
        "model.dropout=0.1",
        "train.health.policy=skip",
        "train.health.inject=nan@5",
        "data.reshuffle=true",
        f"data.mix=[{{path: {byte_dataset}, name: code}}, {{path: {prose_dataset}, weight: 2}}]",
    ]
    a = _run_local(byte_dataset, tmp_path, *common, "logging.run_name=uninterrupted")
    assert a.returncode == 0, a.stderr[-3000:]
    runs = tmp_path / "runs"
    b = _run_local(
        byte_dataset,
        tmp_path,
        *common,
        "logging.run_name=resumed",
        f"train.resume_from={runs / 'uninterrupted' / 'step_00000008'}",
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed from" in b.stderr and "at step 8" in b.stderr

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("local").experiment_id
    by_name = {r.info.run_name: r for r in client.search_runs([exp])}
    history = {
        name: {m.step: m.value for m in client.get_metric_history(r.info.run_id, "loss/train")}
        for name, r in by_name.items()
    }
    assert sorted(history["resumed"]) == list(range(9, 17))
    for step in range(9, 17):
        want, got = history["uninterrupted"][step], history["resumed"][step]
        assert abs(got - want) <= 1e-6 * abs(want), (step, want, got)
    mix = {
        name: {m.step: m.value for m in client.get_metric_history(r.info.run_id, "data/mix/prose_frac")}
        for name, r in by_name.items()
    }
    # a few blocks of 64 rows so far: the share is the order's, far from 2/3 yet (test_mixture
    # checks it against the weights over epochs)
    assert mix["resumed"][16] == mix["uninterrupted"][16] and 0 < mix["resumed"][16] <= 1, mix
    params = by_name["resumed"].data.params
    assert (params["data.mix.code.weight"], params["data.mix.prose.weight"]) == ("1.0", "2.0")
    assert params["data.path"] == str(byte_dataset)
    assert {d.dataset.name for d in client.get_run(by_name["resumed"].info.run_id).inputs.dataset_inputs} == {
        "bytes",
        "prose",
    }

    want = checkpoint_tensors(runs / "uninterrupted" / "step_00000016")
    got = checkpoint_tensors(runs / "resumed" / "step_00000016")
    assert want.keys() == got.keys() and any("module" in k for k in want), sorted(want)[:10]
    assert any(k.startswith("kiln_rng.rank0.pt") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ[:10]

    parent = sorted(p.name for p in (runs / "uninterrupted").iterdir())
    c = _run_local(
        byte_dataset,
        tmp_path,
        *common,
        "logging.run_name=forked",
        "train.max_steps=20",
        "optim.lr=0.02",
        "optim.weight_decay=0.0",
        "schedule.name=constant",
        args=["--fork", "uninterrupted"],
    )
    assert c.returncode == 0, c.stderr[-3000:]
    assert sorted(p.name for p in (runs / "uninterrupted").iterdir()) == parent  # the parent is left as it was
    fork = client.search_runs([exp], "attributes.run_name = 'forked'")[0]
    assert fork.data.tags["kiln.parent.run"] == "uninterrupted" and fork.data.tags["kiln.parent.step"] == "16"
    assert fork.data.tags["kiln.parent.mlflow_run_id"] == by_name["uninterrupted"].info.run_id
    assert fork.data.tags["kiln.parent.checkpoint"] == str(runs / "uninterrupted" / "step_00000016")
    lrs = {m.step: m.value for m in client.get_metric_history(fork.info.run_id, "lr")}
    assert sorted(lrs) == [17, 18, 19, 20]  # from the parent's step on
    constant = ScheduleConfig(name="constant", warmup_steps=5)
    assert lrs[17] == pytest.approx(0.02 * lr_multiplier(16, constant, 20), rel=1e-6) == 0.02, lrs
    parent_lr = {m.step: m.value for m in client.get_metric_history(by_name["uninterrupted"].info.run_id, "lr")}
    assert parent_lr[16] < 0.01  # the debug config's cosine from 3e-3: the fork's LR is its own
    assert (runs / "forked" / "step_00000020").is_dir()
    _fork_from_s3(byte_dataset, tmp_path, common, client, exp, by_name["uninterrupted"].info.run_id)


def _fork_from_s3(byte_dataset, tmp_path, common, client, exp, parent_id):
    """The same fork, of the parent's run directory copied to S3 (moto_server on loopback):
    it finds the newest complete checkpoint there by its markers, trains exactly as the local
    fork did, names its parent by s3:// URI, and leaves no local copy behind. A bucket prefix
    that holds no checkpoint is refused in one line."""
    import glob
    import tempfile

    import boto3
    import pyarrow.fs as pafs

    keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="kiln-fork")
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        s3 = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1")
        pafs.copy_files(
            str(tmp_path / "runs" / "uninterrupted"),
            "kiln-fork/runs/uninterrupted",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=s3,
        )
        copies = set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-ckpt-*")))
        d = _run_local(
            byte_dataset,
            tmp_path,
            *common,
            "logging.run_name=forked-s3",
            "train.max_steps=20",
            "optim.lr=0.02",
            "optim.weight_decay=0.0",
            "schedule.name=constant",
            f"data.s3_endpoint={endpoint}",
            args=["--fork", "s3://kiln-fork/runs/uninterrupted"],
        )
        assert d.returncode == 0, d.stderr[-3000:]
        bad = _run_local(
            byte_dataset, tmp_path, f"data.s3_endpoint={endpoint}", args=["--fork", "s3://kiln-fork/runs/nothing-here"]
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    tags = client.search_runs([exp], "attributes.run_name = 'forked-s3'")[0].data.tags
    assert tags["kiln.parent.checkpoint"] == "s3://kiln-fork/runs/uninterrupted/step_00000016"
    assert (tags["kiln.parent.step"], tags["kiln.parent.run"], tags["kiln.parent.mlflow_run_id"]) == (
        "16",
        "uninterrupted",
        parent_id,
    )
    losses = {
        name: [
            (m.step, m.value)
            for m in sorted(
                client.get_metric_history(
                    client.search_runs([exp], f"attributes.run_name = '{name}'")[0].info.run_id, "loss/train"
                ),
                key=lambda m: m.step,
            )
        ]
        for name in ("forked", "forked-s3")
    }
    assert losses["forked-s3"] == losses["forked"] and len(losses["forked"]) == 4, losses
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-ckpt-*"))) <= copies  # its copy is gone
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "kiln: error: train.resume_from = 's3://kiln-fork/runs/nothing-here': no such directory in storage "
        "(or it is empty)"
    ), bad.stderr[-2000:]


def test_a_compiled_run_checkpoints_and_resumes_like_an_eager_one(byte_dataset, tmp_path, checkpoint_tensors):
    """train.compile on CPU (inductor): it trains, says what compiling cost, and saves the state
    dict under the eager names, so an eager run resumes from it and follows the compiled run's
    losses (to float tolerance: fused kernels round differently)."""
    from mlflow.tracking import MlflowClient

    common = ["train.max_steps=8", "train.checkpoint_every=4", "train.eval_every=0", "parallel.zero_stage=1"]
    a = _run_local(byte_dataset, tmp_path, *common, "train.compile=true", "logging.run_name=compiled")
    assert a.returncode == 0, a.stderr[-3000:]
    assert "compile " in a.stdout and "(the first step, less a steady one)" in a.stdout, a.stdout
    runs = tmp_path / "runs"
    b = _run_local(
        byte_dataset,
        tmp_path,
        *common,
        "logging.run_name=eager",
        f"train.resume_from={runs / 'compiled' / 'step_00000004'}",
    )
    assert b.returncode == 0, b.stderr[-3000:]
    saved = checkpoint_tensors(runs / "compiled" / "step_00000008")
    assert saved.keys() == checkpoint_tensors(runs / "eager" / "step_00000008").keys()
    assert not [k for k in saved if "_orig_mod" in k]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs_by_name = {
        r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("local").experiment_id])
    }
    history = {
        n: {m.step: m.value for m in client.get_metric_history(r.info.run_id, "loss/train")}
        for n, r in runs_by_name.items()
    }
    compile_s = float(re.search(r"compile\s+([\d.]+) s", a.stdout).group(1))
    assert compile_s > 1.0, a.stdout  # inductor takes seconds even for this model
    for step in range(5, 9):
        want, got = history["compiled"][step], history["eager"][step]
        assert abs(got - want) <= 1e-3 * abs(want), (step, want, got)
