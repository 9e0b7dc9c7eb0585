"""The developer tools agree with each other and can fail: pre-commit runs `make lint`'s tools at
the test extra's versions; the type check fails on a planted error, and on an untyped function in
a module held to more; constraints.txt pins every dependency inside pyproject's ranges, at the
versions this environment runs; and `make install` and the container image install through one
script."""

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
MYPY = Path(sys.executable).parent / "mypy"


def _test_extra() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    return {r.name: r for r in reqs}


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = Version(version)
    return pins


def test_pre_commit_runs_the_lint_tools_at_the_test_extras_versions():
    hooks = [
        h for repo in yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"] for h in repo["hooks"]
    ]
    extra = _test_extra()
    for hook in hooks:
        for dep in hook.get("additional_dependencies", []):
            req = Requirement(dep)
            assert str(req.specifier) == str(extra[req.name].specifier), (hook["id"], dep, str(extra[req.name]))
    # the same commands as `make lint`
    lint = (REPO / "Makefile").read_text().split("\nlint:")[1].split("\n\n")[0]
    for hook, command in {"ruff-check": "ruff check", "ruff-format": "ruff format --check", "mypy": "mypy"}.items():
        assert hook in {h["id"] for h in hooks} and command in lint, (hook, command)
    assert "lint-imports" in lint and any("lint-imports" in h["entry"] for h in hooks)


def _mypy(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MYPY), "--no-incremental"], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_type_check_passes_and_fails_on_a_planted_error(tmp_path):
    shutil.copytree(
        REPO / "platform" / "kiln", tmp_path / "platform" / "kiln", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    clean = _mypy(tmp_path)
    assert clean.returncode == 0, clean.stdout
    kiln = tmp_path / "platform" / "kiln"
    # An untyped function passes in an ordinary module, and fails in one held to more (topology).
    untyped = "\n\ndef planted_untyped(x):\n    return x\n"
    (kiln / "launch" / "console.py").write_text((kiln / "launch" / "console.py").read_text() + untyped)
    assert _mypy(tmp_path).returncode == 0
    (kiln / "topology.py").write_text((kiln / "topology.py").read_text() + untyped)
    # A wrong type anywhere fails.
    (kiln / "core" / "loop.py").write_text((kiln / "core" / "loop.py").read_text() + '\n\nPLANTED: int = "one"\n')
    out = _mypy(tmp_path)
    assert out.returncode == 1
    assert re.search(r"kiln/topology\.py:\d+: error: Function is missing a type annotation", out.stdout), out.stdout
    assert re.search(r"kiln/core/loop\.py:\d+: error: Incompatible types in assignment", out.stdout), out.stdout
    assert "console.py" not in out.stdout


def test_constraints_pin_every_dependency_inside_its_range_at_what_runs_here():
    pins = _constraints()
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    reqs += [r for r in _test_extra().values() if r.name != "kiln"]
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        assert req.name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[req.name], prereleases=True), (req.name, str(req.specifier), pins[req.name])
        installed = Version(importlib.metadata.version(req.name))
        # torch's CPU wheel carries a local label (2.13.0+cpu); the pin has none, so a CUDA build fits too
        assert installed.public == str(pins[req.name]), (req.name, str(installed), str(pins[req.name]))
    assert not [name for name, v in pins.items() if v.local], "a pin with a local label (+cpu) fits one build only"
    # Ray is a range now (patch releases), checked against what ray/private.py names
    ray = next(r for r in reqs if r.name == "ray")
    assert ray.specifier.contains("2.60.9") and not ray.specifier.contains("2.61.0")
    assert "Checked against Ray 2.60." in (REPO / "platform/kiln/ray/private.py").read_text()


def test_make_install_and_the_image_install_through_one_script():
    makefile = (REPO / "Makefile").read_text()
    # Both with MLflow's server (the `server` extra): `mlflow ui` here, `mlflow server` on a cluster's head.
    assert "EXTRAS=server sh cluster/install.sh $(VENV) editable" in makefile
    dockerfile = (REPO / "cluster" / "Dockerfile").read_text()
    assert re.search(r"^ARG EXTRAS=server$", dockerfile, re.M), "the image installs the server extra"
    assert "--build-arg EXTRAS=server,gpu" in makefile  # the CUDA image: NVML for GPU system metrics
    assert '$PIP -e "$KILN"' in (REPO / "cluster" / "install.sh").read_text()
    runs = re.findall(r"^RUN (.+)$", dockerfile, re.M)
    assert any(r.startswith("sh cluster/install.sh /opt/kiln/venv") for r in runs), runs
    # The image's build context holds what the script and the package need, and no more.
    copied = {src for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for src in line.split()[:-1]}
    for src in copied:
        assert (REPO / src).exists(), f"cluster/Dockerfile copies {src}, which is not in the repository"
    assert {"pyproject.toml", "constraints.txt", "cluster/install.sh", "platform", "jobs"} <= copied, copied


def test_the_images_system_packages_exist_in_its_debian_release():
    """No container engine runs here, so the image's apt step is checked against this machine's
    Debian (the CPU image's base is Debian bookworm, python:3.11-slim-bookworm)."""
    dockerfile = (REPO / "cluster" / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim-bookworm" in dockerfile
    step = re.search(r"apt-get install -y --no-install-recommends \\\n\s+(.+?) \$\{APT_PYTHON\}", dockerfile).group(1)
    packages = step.split()
    assert {"build-essential", "libaio-dev", "git"} <= set(packages), packages
    release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    if shutil.which("apt-cache") is None or "bookworm" not in release:
        import pytest

        pytest.skip("needs Debian bookworm's apt-cache to look the packages up")
    out = subprocess.run(["apt-cache", "show", "--no-all-versions", *packages], capture_output=True, text=True)
    found = set(re.findall(r"^Package: (\S+)$", out.stdout, re.M))
    assert found == set(packages), set(packages) - found
