"""Whatever a command raises ends as one `kiln:` line and an exit code: a user's mistake or
environment exits 2, a bug exits 1 and says so; the traceback goes to a private file, redacted."""

import logging
import os
import re
import stat
from pathlib import Path

import pytest
import yaml

from kiln.errors import ConfigError, DataError
from kiln.launch.console import run_reporting_errors


def _run(capsys, exc: BaseException) -> tuple[int, str]:
    def command() -> int:
        raise exc

    code = run_reporting_errors(command)
    return code, capsys.readouterr().err


def _traceback_file(err: str) -> str:
    match = re.search(r"traceback in (\S+?)\)?$", err.strip())
    assert match, err
    return match.group(1)


def test_a_kiln_error_is_one_line_with_its_class_exit_code(capsys):
    code, err = _run(capsys, ConfigError("optim.lr = 0 is out of range"))
    assert (code, err) == (2, "kiln: error: optim.lr = 0 is out of range\n")  # the command is wrong
    code, err = _run(capsys, DataError("shard x.parquet is not a readable Parquet file"))
    assert (code, err) == (1, "kiln: error: shard x.parquet is not a readable Parquet file\n")  # it failed running


def test_an_environment_error_is_one_line_exit_1_with_its_traceback_saved(capsys):
    for exc in (
        PermissionError(13, "Permission denied", "/data/out"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
        yaml.YAMLError("mapping values are not allowed"),
    ):
        code, err = _run(capsys, exc)
        lines = err.splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("kiln: error: "), err
        assert type(exc).__name__ in lines[0] and "Traceback" not in err
        path = _traceback_file(err)
        assert "Traceback" in Path(path).read_text()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.unlink(path)


def test_a_bug_says_so_exits_1_and_keeps_no_secret(capsys):
    code, err = _run(capsys, KeyError("postgresql://mlflow:hunter22@db/mlflow"))
    assert code == 1 and err.startswith("kiln: internal error: KeyError") and "This is a bug in Kiln" in err
    path = _traceback_file(err)
    saved = Path(path).read_text()
    os.unlink(path)
    assert "hunter22" not in err + saved and "mlflow:***@db" in saved


@pytest.mark.slow  # starts a Ray
def test_a_ray_cluster_failure_says_what_failed_and_where_its_log_is(capsys):
    """A real RuntimeEnvSetupError (a task whose runtime environment names a conda env this
    machine lacks), wrapped as Ray Train and Tune wrap a worker's failure: one line that says the
    cluster could not set up a process's environment and where Ray logs why, not "a bug in Kiln"."""
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:

        @ray.remote
        def task() -> int:
            return 1

        def command() -> int:
            try:
                ray.get(task.options(runtime_env={"conda": "kiln-no-such-env"}).remote(), timeout=120)
            except Exception as e:
                raise RuntimeError("Training failed due to worker errors") from e
            return 0

        code = run_reporting_errors(command)
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("kiln: error: Ray could not set up the runtime"), err
    assert "runtime_env_setup-*.log" in err and "RuntimeEnvSetupError: Failed to set up runtime environment." in err
    assert "bug in Kiln" not in err
    path = _traceback_file(err)
    assert "kiln-no-such-env" in Path(path).read_text()
    os.unlink(path)
