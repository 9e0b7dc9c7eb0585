"""The layout rules that, if broken, break every Ray worker: `platform/` is a plain folder, so
the stdlib's `platform` module wins and `kiln` is imported from `platform/kiln`.

What import-linter can say (the model imports only torch, the core loop no Ray/MLflow/
DeepSpeed, layers, no cycles) is in pyproject.toml's [tool.importlinter] and runs in `make
lint`; ruff's T20 keeps `print` out of the library. This file keeps what neither can say."""

import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_platform_dir_is_not_a_package():
    assert (REPO / "platform" / "kiln" / "__init__.py").is_file()
    assert not (REPO / "platform" / "__init__.py").exists()


def test_stdlib_platform_wins_even_with_repo_first_on_path():
    # Ray puts the working dir first on every worker's sys.path; stdlib platform must still win.
    code = "import platform, sys; print(platform.__file__); print(platform.system())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO)},
        check=True,
    ).stdout.splitlines()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out[0]).resolve() == stdlib / "platform.py"
    assert out[1] == "Linux"
    assert Path(platform.__file__).resolve() == stdlib / "platform.py"


def test_kiln_is_imported_from_platform_dir():
    import kiln

    assert Path(kiln.__file__).resolve() == REPO / "platform" / "kiln" / "__init__.py"


def test_modules_stay_small_and_the_config_does_no_io():
    """No module of the package over 500 lines, no function over 80; the config's modules
    (the composition, its language and the sections' homes that are config only) under 400 and
    free of I/O: the model's shape is read by preflight, never by the config."""
    import ast

    kiln = REPO / "platform" / "kiln"
    too_long = [
        f"{p.relative_to(kiln)}: {n}" for p in kiln.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    ]
    assert too_long == []
    functions = [
        f"{p.relative_to(kiln)}:{node.name}"
        for p in kiln.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80
    ]
    assert functions == []
    io = {
        "open",
        "read_text",
        "read_bytes",
        "write_text",
        "write_bytes",
        "exists",
        "listdir",
        "local_copy",
        "read_config",
        "pretrained_shape",
        "init_from_dir",
        "resolve",
        "urlopen",
    }
    for name in ("config.py", "knobs.py", "topology.py", "model_config.py", "core/config.py", "data/config.py"):
        source = (kiln / name).read_text()
        assert len(source.splitlines()) <= 400, name
        calls = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call)
        }
        assert calls & io == set(), (name, calls & io)


def test_the_repository_holds_a_licence_and_no_binary_files():
    """Apache-2.0, said in LICENSE and the package metadata; no wheel, archive, checkpoint or
    dataset among the tracked files (a NUL byte in a file's first 8 KiB marks it binary), and
    .gitignore keeps such files out."""
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    paths = [p for p in tracked.decode().split("\0") if p and (REPO / p).is_file()]
    binary = {p for p in paths if b"\0" in (REPO / p).read_bytes()[:8192]}
    assert not binary, sorted(binary)
    ignored = subprocess.run(
        [
            "git",
            "check-ignore",
            "--no-index",
            "x.whl",
            "a/b.tar.gz",
            "m.safetensors",
            "s/part-0.parquet",
            "c/model.pt",
            "o/lib.so",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(ignored) == 6, ignored
