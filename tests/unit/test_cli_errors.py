"""Every user mistake: a non-zero exit, one clear line, no traceback, nothing half-written.

The mistakes that need no more than their one error line are rows of the bad-input table
(tests/bad_inputs/cases.py), which runs them forked from one process; the tests here check more
than the line (files, help text, a second command), or need a fresh interpreter."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KILN = [str(Path(sys.executable).parent / "kiln")]


def kiln(*args, cwd, env=None, timeout=120):
    return subprocess.run([*KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_clean_error(out, needle, code=2):
    """`code`: 2 where the command or config is wrong, 1 where it failed while running
    (`kiln.errors`)."""
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]


def test_missing_corpus(tmp_path):
    out = kiln("data", "prepare", "--input", "nope", "--output", "ds", "--tokenizer", "byte", cwd=tmp_path)
    assert_clean_error(out, "input 'nope' does not exist", code=1)
    assert not (tmp_path / "ds").exists()


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    out = kiln("data", "prepare", "--input", "empty", "--output", "ds", "--tokenizer", "byte", cwd=tmp_path)
    assert_clean_error(out, "the corpus is empty", code=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_output_holding_a_different_dataset(tmp_path, byte_dataset, corpus):
    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    before = (ds / "manifest.json").read_bytes()
    out = kiln(
        "data",
        "prepare",
        "--input",
        corpus[0],
        "--output",
        str(ds),
        "--tokenizer",
        "byte",
        "--seq-len",
        "32",
        cwd=tmp_path,
    )
    assert_clean_error(out, "already holds a different dataset", code=1)
    assert (ds / "manifest.json").read_bytes() == before


def test_config_typo(tmp_path, byte_dataset):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", "optim.lrr=0.1", cwd=tmp_path)
    assert_clean_error(out, "unknown config key 'optim.lrr'; did you mean 'lr'?")


def test_bad_value_names_field_and_range(tmp_path):
    out = kiln("train", "--set", "parallel.zero_stage=4", cwd=tmp_path)
    assert_clean_error(out, "parallel.zero_stage = 4 is out of range: expected one of 0, 1, 2, 3")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.seq_len=32", "model.seq_len = 32 does not match the seq_len of"),
        ("model.vocab_size=128", "model.vocab_size = 128 is smaller than the vocab of"),
    ],
)
def test_model_data_mismatch(tmp_path, byte_dataset, override, needle):
    out = kiln("train", "--set", f"data.path={byte_dataset}", "--set", override, cwd=tmp_path)
    assert_clean_error(out, needle)
    assert not (tmp_path / "mlflow.db").exists()  # refused before any run was opened


def test_corrupt_parquet_shard_is_named(tmp_path, byte_dataset):
    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    shard = ds / json.loads((ds / "manifest.json").read_text())["splits"]["val"]["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[-8:-4] = b"\x00\x00\x00\x7f"
    shard.write_bytes(bytes(raw))
    out = kiln("train", "--set", f"data.path={ds}", cwd=tmp_path)
    assert_clean_error(out, f"shard {shard} is not a readable Parquet file", code=1)


def test_a_shard_corrupted_inside_is_named_by_its_checksum(tmp_path, byte_dataset):
    """Footer and size intact, so the launch check passes; the bytes in the middle are not. The
    read fails at run time (here the local launcher's; Ray workers use the same explanation) and
    the error names the shard; `kiln data verify` finds it too."""
    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    entry = json.loads((ds / "manifest.json").read_text())["splits"]["train"]["shards"][0]  # read first
    shard = ds / entry["path"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3 : len(raw) // 3 + 4096] = bytes(4096)
    shard.write_bytes(bytes(raw))
    verify = kiln("data", "verify", str(ds), cwd=tmp_path)
    assert_clean_error(verify, f"1 bad shard(s) in {ds}: shard {shard} does not match the SHA-256", code=1)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.launch.local",
            "--set",
            f"data.path={ds}",
            "--set",
            f"logging.tracking_uri=sqlite:///{tmp_path}/m.db",
            "--set",
            "train.max_steps=2",
            "--set",
            f"train.storage_path={tmp_path}/runs",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_clean_error(out, "reading the train split failed (", code=1)
    assert f"shard {shard} does not match the SHA-256 in its manifest" in out.stderr
    intact = kiln("data", "verify", str(byte_dataset), cwd=tmp_path)
    assert intact.returncode == 0 and "shards match their manifest" in intact.stdout, intact.stderr


def test_the_local_launcher_refuses_bad_input_in_one_line(tmp_path):
    """The local launcher checks before DeepSpeed loads: nothing of DeepSpeed's (its accelerator
    notice) comes before the error, and the error is all there is."""
    out = subprocess.run(
        [sys.executable, "-m", "kiln.launch.local", "--set", "data.path=nope"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_clean_error(out, f"dataset {tmp_path / 'nope'} does not exist", code=1)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""  # DeepSpeed writes its notices to stdout


def test_unreachable_s3_endpoint(tmp_path, corpus):
    out = kiln(
        "data",
        "prepare",
        "--input",
        corpus[0],
        "--output",
        "s3://bucket/ds",
        "--tokenizer",
        "byte",
        "--s3-endpoint",
        "http://127.0.0.1:9",
        cwd=tmp_path,
        timeout=120,
    )
    assert_clean_error(out, "(S3 endpoint http://127.0.0.1:9)", code=1)
    out = kiln(
        "train", "--set", "data.path=s3://bucket/ds", "--set", "data.s3_endpoint=http://127.0.0.1:9", cwd=tmp_path
    )
    assert_clean_error(out, "cannot access s3://bucket/ds", code=1)


def test_unreachable_mlflow_server(tmp_path, byte_dataset):
    out = kiln(
        "train", "--set", f"data.path={byte_dataset}", "--set", "logging.tracking_uri=http://127.0.0.1:9", cwd=tmp_path
    )
    assert_clean_error(out, "MLflow tracking server http://127.0.0.1:9 is unreachable", code=1)


def test_nvme_offload_without_its_op_is_refused_before_launch(tmp_path, byte_dataset):
    from kiln.parallel.engine import op_unavailable

    if op_unavailable("async_io") is None:
        pytest.skip("DeepSpeed's async_io op can be built here (libaio present)")
    out = kiln(
        "train",
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        "parallel.zero_stage=3",
        "--set",
        "parallel.offload_optimizer=nvme",
        "--set",
        f"parallel.nvme_path={tmp_path}",
        "--set",
        f"logging.tracking_uri=sqlite:///{tmp_path}/m.db",
        cwd=tmp_path,
    )
    assert_clean_error(out, "needs DeepSpeed's 'async_io' op, which cannot be built here")
    assert not (tmp_path / "m.db").exists()  # refused before MLflow or Ray started


def test_run_too_big_for_the_device_is_refused_with_the_option_that_fits(tmp_path, byte_dataset):
    out = kiln(
        "train",
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        "parallel.zero_stage=0",
        "--set",
        "parallel.device_memory_gib=0.025",
        "--set",
        "train.micro_batch_size=16",
        "--set",
        f"logging.tracking_uri=sqlite:///{tmp_path}/m.db",
        cwd=tmp_path,
    )
    assert_clean_error(out, "MiB over; the first option that fits: parallel.zero_stage=")
    assert "parallel.device_memory_gib gives 25.6 MiB" in out.stderr
    assert "model.activation_checkpointing=true" in out.stderr
    assert not (tmp_path / "m.db").exists()


def test_plan_prints_options_and_a_table(tmp_path):
    helptext = kiln("plan", "--help", cwd=tmp_path)
    assert helptext.returncode == 0
    for flag in (
        "--model",
        "--world-size",
        "--device-memory-gib",
        "--micro-batch",
        "--seq-len",
        "--zero-stage",
        "--offload",
        "--activation-checkpointing",
        "--precision",
        "--pipeline-stages",
    ):
        assert flag in helptext.stdout, flag
    out = kiln(
        "plan",
        "--model",
        "13b",
        "--world-size",
        "64",
        "--device-memory-gib",
        "80",
        "--micro-batch",
        "1",
        "--precision",
        "bf16",
        "--zero-stage",
        "0",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "does NOT fit in 80 GiB" in out.stdout and "recommended (cheapest that fits): zero_stage=" in out.stdout
    bad = kiln("plan", "--model", "huge", cwd=tmp_path)
    assert_clean_error(bad, "--model 'huge' is not a flavour")


def test_kiln_config_prints_no_secret(tmp_path):
    out = kiln(
        "config",
        "--set",
        "logging.tracking_uri=http://kiln:hunter22@127.0.0.1:5000",
        "--set",
        "parallel.deepspeed.aws_secret_access_key=wJalrXUtnFEMIK7MDENG",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "hunter22" not in out.stdout and "wJalrXUtnFEMIK7MDENG" not in out.stdout
    assert "http://kiln:***@127.0.0.1:5000" in out.stdout and "aws_secret_access_key: '***'" in out.stdout


def test_an_mlflow_store_it_cannot_open_is_one_line_without_the_password(tmp_path):
    out = kiln("runs", "list", "--tracking-uri", "htpp://user:hunter22@127.0.0.1:9", cwd=tmp_path)
    assert_clean_error(out, "--tracking-uri = 'htpp://user:***@127.0.0.1:9': MLflow has no store for 'htpp://'")
    assert "hunter22" not in out.stderr


@pytest.mark.parametrize(
    "args, needle, code",
    [
        (
            ["plan", "--model", "debug", "--device-memory-gib", "nan"],
            "--device-memory-gib = nan: expected a number in [0, 100000]",
            2,
        ),
        (
            ["plan", "--model", "debug", "--device-memory-gib", "inf"],
            "--device-memory-gib = inf: expected a number in [0, 100000]",
            2,
        ),
        (["plan", "--model", "debug", "--seq-len", "-5"], "--seq-len = -5: expected an integer in [0, 1e7]", 2),
        (["lr", "plot", "--out", "no-such-dir/lr.png"], "--out no-such-dir/lr.png: its parent directory must exist", 2),
        (["runs", "list"], "no MLflow store at sqlite:///", 1),
    ],
    ids=["plan-nan", "plan-inf", "plan-negative-seq", "lr-bad-out", "runs-in-an-empty-dir"],
)
def test_bad_values_for_plan_lr_and_runs_leave_nothing_behind(tmp_path, args, needle, code):
    import os

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the default store, here
    out = kiln(*args, cwd=tmp_path, env=env)
    assert_clean_error(out, needle, code=code)
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no half-written PNG


def test_a_billion_step_schedule_plots_at_once(tmp_path):
    out = kiln("lr", "plot", "--set", "train.max_steps=1000000000", "--out", "lr.png", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr.png"]


def test_every_option_says_what_it_does_and_kiln_has_a_version():
    import argparse

    import kiln
    from kiln.cli_args import build_parser

    silent = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*prefix, name])
            elif not action.help:
                silent.append(" ".join([*prefix, *(action.option_strings or [action.dest])]))

    walk(build_parser(), ["kiln"])
    assert silent == []
    out = subprocess.run([*KILN, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"kiln {kiln.__version__}"
