"""The architecture contracts (pyproject.toml's import-linter section, run by `make lint`) can
fail: a copy of the package with one planted violation per contract breaks every one of them,
each naming its planted module. And Ray's private modules are imported in one wrapper only."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
KILN = REPO / "platform" / "kiln"
LINT = Path(sys.executable).parent / "lint-imports"

# contract id -> (planted module, its source)
PLANTS = {
    "core-loop": ("core/_planted_ray.py", "import ray\n"),
    "model": ("model.py", None),  # model.py itself gets `import numpy` (its contract names the module)
    "lora": ("lora.py", None),  # and lora.py `import numpy`
    "generation": ("infer/generate.py", None),  # and generate.py `import mlflow`
    "mlflow-owner": ("launch/_planted_mlflow.py", "import mlflow\n"),
    "deepspeed-owner": ("infer/_planted_deepspeed.py", "import deepspeed\n"),
    "fsdp2-torch-only": ("parallel/fsdp2_engine.py", None),  # and the FSDP2 engine `import deepspeed`
    "ray-owner": ("plan/_planted_ray.py", "import ray\n"),
    "layers": ("data/_planted_layer.py", "import kiln.launch.preflight\n"),
    "acyclic": ("ui/_planted_a.py", "import kiln.ui._planted_b\n"),
}
APPENDED = {
    "model.py": "import numpy\n",
    "lora.py": "import numpy\n",
    "infer/generate.py": "import mlflow\n",
    "parallel/fsdp2_engine.py": "import deepspeed\n",
}


def _plant(root: Path) -> None:
    for rel, source in PLANTS.values():
        path = root / rel
        if source is None:
            path.write_text(path.read_text() + APPENDED[rel])
        else:
            path.write_text(source)
    (root / "ui/_planted_b.py").write_text("import kiln.ui._planted_a\n")


def test_every_contract_fails_on_a_planted_violation(tmp_path):
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert sorted(c["id"] for c in contracts) == sorted(PLANTS), "a contract without a planted violation"
    shutil.copytree(KILN, tmp_path / "platform" / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    _plant(tmp_path / "platform" / "kiln")
    env = os.environ | {"PYTHONPATH": str(tmp_path / "platform")}  # the copy, ahead of the installed package
    out = subprocess.run(
        [str(LINT), "--no-logo", "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    report = out.stdout
    assert out.returncode != 0, report
    assert f"Contracts: 0 kept, {len(contracts)} broken." in report, report
    for c in contracts:
        assert f"{c['name']} BROKEN" in " ".join(report.split()), (c["id"], report)
        planted = "kiln." + PLANTS[c["id"]][0].removesuffix(".py").replace("/", ".")
        section = report.split(c["name"], 2)[-1]  # the contract's own section of the report
        # (the cycle report names modules relative to their package)
        assert planted in section or f".{planted.rsplit('.', 1)[-1]} " in section, (c["id"], section[:2000])


def _private_imports(source: str) -> list[str]:
    """What a source imports from Ray's private packages (`_private`, `_internal`), and the
    private names (`_name`) it imports from Ray's public modules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        else:
            continue
        found += [n for n in names if n.split(".")[0] == "ray" and any(_private_name(part) for part in n.split("."))]
    return found


def _private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")  # `__version__` is public


def test_ray_private_apis_are_reached_through_one_wrapper():
    users = {str(p.relative_to(KILN)) for p in KILN.rglob("*.py") if _private_imports(p.read_text())}
    assert users == {"ray/private.py"}, users
    # The detector itself finds both spellings, both kinds of private package, and a private name
    # from a public module; it passes others' private names and Ray's dunders.
    assert _private_imports(
        "from ray._private.ray_logging import x\nimport ray.autoscaler._private.util\nfrom ray.data._internal import y\n"
        "from ray.train.torch.config import TorchConfig, _shutdown_torch\nfrom kiln import _x\nfrom ray import __version__\n"
        "from ray import _private\n"
    ) == [
        "ray._private.ray_logging",
        "ray.autoscaler._private.util",
        "ray.data._internal",
        "ray.train.torch.config._shutdown_torch",
        "ray._private",
    ]
