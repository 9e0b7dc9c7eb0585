"""Every driver runs the one preflight: a bad storage path, a bad dataset and a run that the
memory plan refuses each stop `kiln train` on Ray, the local launcher and `kiln sweep` with the
same one-line error, before Ray, the process group or MLflow start."""

from pathlib import Path

import pytest
import yaml

from kiln.config import load_config
from kiln.errors import KilnError

REPO = Path(__file__).resolve().parents[3]
DEAD_S3 = "http://127.0.0.1:9"  # nothing listens: an S3 endpoint that cannot be reached

FAULTS = {
    # (run-config overrides, sweep-file fields, what the error must say for the Ray / local / sweep driver)
    "storage": (
        ["train.storage_path=s3://kiln-no-bucket/runs", f"data.s3_endpoint={DEAD_S3}"],
        {"storage_path": "s3://kiln-no-bucket/sweeps", "overrides": {"data.s3_endpoint": DEAD_S3}},
        {
            "ray": "train.storage_path: cannot reach s3://kiln-no-bucket/runs",
            "local": "train.storage_path = 's3://kiln-no-bucket/runs': the local launcher writes checkpoints",
            "sweep": "sweep.storage_path: cannot reach s3://kiln-no-bucket/sweeps",
        },
    ),
    "data": (
        ["data.path={tmp}/no-such-dataset"],
        {"overrides": {"data.path": "{tmp}/no-such-dataset"}},
        dict.fromkeys(("ray", "local", "sweep"), "no-such-dataset does not exist"),
    ),
    "memory plan": (
        ["parallel.device_memory_gib=0.001"],
        {"overrides": {"parallel.device_memory_gib": 0.001}},
        dict.fromkeys(("ray", "local", "sweep"), "the run needs an estimated"),
    ),
}


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting Ray or a training process group after a failed preflight is a test failure."""
    # Import every driver before patching: one imported while another's function is patched
    # would keep the patched function for good.
    import kiln.launch.local
    import kiln.sweep.run  # noqa: F401

    def started(*args, **kwargs):
        raise AssertionError("a driver went past a failed preflight")

    for target in (
        "kiln.launch.on_ray.connect_ray",
        "kiln.sweep.run.connect_ray",
        "kiln.launch.local._world_from_env",
        "kiln.launch.local.run_worker",
    ):
        monkeypatch.setattr(target, started)


def _run_config(byte_dataset, tmp_path, overrides):
    base = [
        f"data.path={byte_dataset}",
        f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"train.storage_path={tmp_path}/runs",
        "train.max_steps=2",
    ]
    return load_config(None, base + [o.format(tmp=tmp_path) for o in overrides])


def _sweep(byte_dataset, tmp_path, fields):
    overrides = {
        "data.path": str(byte_dataset),
        "logging.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "train.max_steps": 20,
    }
    overrides.update(
        {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in fields.get("overrides", {}).items()}
    )
    doc = {
        "name": "preflight",
        "base": str(REPO / "jobs/configs/debug.yaml"),
        "storage_path": fields.get("storage_path", str(tmp_path / "sweeps")),
        "space": {"optim.name": {"choice": ["adamw", "sgd"]}},
        "overrides": overrides,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    from kiln.sweep.config import load_sweep

    return load_sweep(path)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("driver", ["ray", "local", "sweep"])
def test_a_failed_check_stops_every_driver_before_it_starts(
    driver, fault, byte_dataset, tmp_path, clean_env, nothing_starts
):
    run_overrides, sweep_fields, expected = FAULTS[fault]
    with pytest.raises(KilnError) as e:
        if driver == "ray":
            from kiln.launch.on_ray import train

            train(_run_config(byte_dataset, tmp_path, run_overrides))
        elif driver == "local":
            from kiln.launch.local import run_local

            run_local(_run_config(byte_dataset, tmp_path, run_overrides))
        else:
            from kiln.sweep.run import run_sweep

            run_sweep(_sweep(byte_dataset, tmp_path, sweep_fields))
    assert expected[driver] in str(e.value)
    assert not (tmp_path / "mlflow.db").exists(), "MLflow was opened before the checks finished"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweeps").exists()


def test_resume_from_is_made_absolute_and_checked_on_the_driver(byte_dataset, tmp_path, clean_env, nothing_starts):
    from kiln.launch.on_ray import train
    from kiln.launch.preflight import preflight

    (tmp_path / "runs" / "old").mkdir(parents=True)
    with pytest.raises(KilnError, match=r"train.resume_from = '.*/runs/old': holds no complete Kiln checkpoint"):
        train(_run_config(byte_dataset, tmp_path, ["train.resume_from=runs/old"]))
    # A bare run name is that run under train.storage_path (here {tmp}/runs, not the cwd).
    with pytest.raises(KilnError, match=r"train.resume_from = '.*/runs/old': holds no complete Kiln checkpoint"):
        train(_run_config(byte_dataset, tmp_path, ["train.resume_from=old"]))
    # With a cluster address, a path this machine sees (a shared disk) is checked all the same ...
    with pytest.raises(KilnError, match="holds no complete Kiln checkpoint"):
        preflight(_run_config(byte_dataset, tmp_path, ["train.resume_from=runs/old"]), remote_cluster=True)
    # ... and one only the workers' disks hold cannot be checked here, but it is still absolute.
    checked = preflight(_run_config(byte_dataset, tmp_path, ["train.resume_from=runs/there"]), remote_cluster=True)
    assert checked.cfg.train.resume_from == str(tmp_path / "runs" / "there")


def test_a_sweep_that_cannot_reach_ray_leaves_nothing_behind(byte_dataset, tmp_path, clean_env, monkeypatch):
    import ray

    from kiln.sweep.run import run_sweep

    # This process may hold a connection from an earlier test; the sweep must try to join anew.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    with pytest.raises(KilnError, match="no Ray cluster answers at 127.0.0.1:9"):
        run_sweep(_sweep(byte_dataset, tmp_path, {}), address="127.0.0.1:9")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "sweeps").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_dry_run_prints_the_resolved_plan_and_starts_nothing(byte_dataset, tmp_path):
    import subprocess
    import sys

    kiln = [
        str(Path(sys.executable).parent / "kiln"),
        "train",
        "--dry-run",
        "--config",
        str(REPO / "jobs/configs/debug.yaml"),
    ]
    out = subprocess.run(
        [
            *kiln,
            "--set",
            f"data.path={byte_dataset}",
            "--set",
            "parallel.num_workers=4",
            "--set",
            "parallel.tensor_parallel=2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every pre-launch check passed; nothing was started" in out.stdout
    for line in (
        "  data         " + str(byte_dataset),
        "\n               whole rows\n",  # plain text: no document masks (data.document_mask = auto)
        "  model        debug: 2 layers",
        "ZeRO-2",
        "  parallel     4 worker(s) (2 data-parallel x 2 tensor-parallel)",
        "  memory       ",
        "  checkpoints  " + str(tmp_path / "runs"),
        "  MLflow       sqlite:///",
    ):
        assert line in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no runs/, no Ray session here
    bad = subprocess.run(
        [*kiln, "--set", f"data.path={tmp_path}/nope"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "kiln: error: dataset" in bad.stderr and "does not exist" in bad.stderr


def test_the_checkpoint_s_shape_is_read_once_before_launch_and_handed_to_the_workers(
    tiny_hf, corpus, tmp_path, monkeypatch
):
    """model.init_from's config.json is read once, by preflight; the shape it resolves travels
    with the config (Checked.model, the Ray workers' loop config), and no worker-side module reads
    the checkpoint's config again."""
    import ast

    import kiln
    from kiln import hf_checkpoint
    from kiln.launch.preflight import preflight

    kiln.data.prepare(
        inputs=[corpus[0]], output=str(tmp_path / "ds"), tokenizer=str(tiny_hf), seq_len=64, shard_tokens=1 << 16
    )
    reads = []
    real = hf_checkpoint.read_config
    monkeypatch.setattr(hf_checkpoint, "read_config", lambda d: reads.append(d) or real(d))
    cfg = load_config(
        None,
        [
            f"model.init_from={tiny_hf}",
            f"data.path={tmp_path / 'ds'}",
            "parallel.num_workers=1",
            f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"train.storage_path={tmp_path}/runs",
        ],
    )
    checked = preflight(cfg)
    assert len(reads) == 1
    assert (checked.model.n_layer, checked.model.d_model, checked.model.vocab_size) == (2, 32, 300)
    worker_side = [p for d in ("core", "parallel", "ray") for p in (REPO / "platform/kiln" / d).rglob("*.py")]
    callers = {
        str(p.relative_to(REPO))
        for p in worker_side
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Name) and node.id in ("read_config", "pretrained_shape")
    }
    assert callers == set()


def test_resume_from_auto_names_a_run_by_what_it_trains(byte_dataset, tmp_path, clean_env, monkeypatch):
    """`train.resume_from: auto` (a job's default: jobs/pretrain.py) names an unnamed run by its
    training settings and its data's content, so the same job submitted again finds its own
    checkpoints; where it runs, how it logs and where the files are do not change the name."""
    import shutil
    import subprocess
    import sys

    from kiln.launch.preflight import preflight

    def name(*more: str, data=byte_dataset) -> str:
        cfg = _run_config(data, tmp_path, ["train.resume_from=auto", *more])
        checked = preflight(cfg)
        assert checked.cfg.train.resume_from == ""  # resumed by name, not from a path
        return checked.cfg.logging.run_name

    first = name()
    assert first.startswith("debug-") and len(first) == len("debug-") + 10
    copy = tmp_path / "copy-of-data"  # the same shards elsewhere, as a job's fresh working-dir copy
    shutil.copytree(byte_dataset, copy)
    assert name(data=copy) == first
    assert name("parallel.num_workers=1", "logging.experiment=other", "data.read_task_cpus=0") == first
    assert name("optim.lr=1e-4") != first and name("train.max_steps=7") != first
    assert name("logging.run_name=mine") == "mine"
    # A job gets auto unless its command says otherwise; `kiln train` gets a new name each time.
    same = [f"--set={o}" for o in (f"data.path={byte_dataset}", "train.max_steps=2")]
    job = subprocess.run(
        [sys.executable, str(REPO / "jobs/pretrain.py"), "--dry-run", *same],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0 and f"  run          {first} " in job.stdout, job.stdout + job.stderr[-2000:]
    kiln = subprocess.run(
        [str(Path(sys.executable).parent / "kiln"), "train", "--dry-run", *same],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert kiln.returncode == 0 and "  run          debug-20" in kiln.stdout, kiln.stdout  # debug-<date>-<time>
    # The local launcher does not resume by name: auto is refused there, in one line.
    with pytest.raises(KilnError, match="train.resume_from = 'auto' resumes a run submitted again on Ray"):
        preflight(_run_config(byte_dataset, tmp_path, ["train.resume_from=auto"]), local_storage=True)
