"""The logged MLflow model serves without Kiln installed: its code travels with it
(`code_paths`), and its requirements cover every module it imports."""

import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement

import kiln
from kiln.tracking.model import SERVING_DISTRIBUTIONS, save_pyfunc

CHECKOUT_KILN = str(Path(kiln.__file__).resolve().parent)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hidden_imports import HIDE  # noqa: E402

# Loads the model and generates greedily with the checkout's `kiln` (module and distribution)
# unfindable, as in an environment built from the model's requirements alone.
SERVE = (
    HIDE
    + """
import json
CHECKOUT = sys.argv[1]
hide(lambda name, spec: (spec.origin or "").startswith(CHECKOUT), ["kiln"])
try:
    import kiln
    raise SystemExit("the checkout's kiln is still importable")
except ImportError:
    pass
import mlflow, mlflow.pyfunc
mlflows = {m.split(".")[0] for m in sys.modules}  # MLflow's own imports, optional ones included
model = mlflow.pyfunc.load_model(sys.argv[2])
text = model.predict(["def "], params={"max_new_tokens": 12, "temperature": 0.0})
added = {m.split(".")[0] for m in sys.modules} - mlflows
# A server's choice: the decode step compiled (after the count above: torch.compile's own imports).
compiled = model.predict(["def "], params={"max_new_tokens": 12, "temperature": 0.0, "compile": True})
print(json.dumps({
    "text": text,
    "compiled": compiled,
    "kiln": sys.modules["kiln"].__file__,
    "third_party": sorted(
        m for m in added
        if m not in sys.stdlib_module_names and not m.startswith(("_", "code_model_")) and m != "cython_runtime"
    ),
}))
"""
)


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` need, transitively, as installed here (extras left out)."""
    seen: set[str] = set()
    todo = [_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_name(r.name))
    return seen


def test_the_logged_model_serves_with_its_own_code_and_requirements_alone(tiny_hf, tmp_path):
    save_pyfunc(tiny_hf, tmp_path / "model")
    assert (tmp_path / "model" / "code" / "kiln" / "model.py").is_file()
    assert not list((tmp_path / "model" / "code").rglob("__pycache__"))
    pins = (tmp_path / "model" / "requirements.txt").read_text().split()
    named = [Requirement(p).name for p in pins]
    assert set(SERVING_DISTRIBUTIONS) <= set(named) and "mlflow" in named, pins
    assert all(str(Requirement(p).specifier).startswith("==") for p in pins), pins

    out = subprocess.run(
        [sys.executable, "-c", SERVE, CHECKOUT_KILN, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kiln"].startswith(str(tmp_path / "model")), got["kiln"]  # the model's own copy

    # Every module the model's code imported, beyond MLflow's, comes with a distribution its
    # requirements bring (MLflow's models-from-code module and Cython's runtime are no distributions).
    assert "torch" in got["third_party"] and "kiln" in got["third_party"], got["third_party"]
    allowed = _closure(named)
    dists = packages_distributions()
    unexplained = {
        m: dists.get(m)
        for m in got["third_party"]
        if m != "kiln" and not any(_name(d) in allowed for d in dists.get(m, []))
    }
    assert not unexplained, unexplained

    # The same greedy text as `kiln generate` from the export.
    cli = subprocess.run(
        [
            str(Path(sys.executable).with_name("kiln")),
            "generate",
            "--model",
            str(tiny_hf),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout == "def " + got["text"][0] + "\n", (cli.stdout, got["text"])
    assert got["compiled"] == got["text"]
