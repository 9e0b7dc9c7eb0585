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
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO)}, check=True).stdout.splitlines()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out[0]).resolve() == stdlib / "platform.py"
    assert out[1] == "Linux"
    assert Path(platform.__file__).resolve() == stdlib / "platform.py"


def test_kiln_is_imported_from_platform_dir():
    import kiln

    assert Path(kiln.__file__).resolve() == REPO / "platform" / "kiln" / "__init__.py"
