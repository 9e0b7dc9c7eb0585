"""Kiln depends on mlflow-skinny; MLflow's server and UI are the `server` extra. These tests hold
that split: the tracking and model-logging path runs without what only full `mlflow` brings, and
what needs the server says which extra to install."""

import json
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from kiln.errors import KilnError
from kiln.tracking import services
from kiln.tracking.model import PARAMS, signature
from kiln.tracking.server import ui_command

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from hidden_imports import HIDE  # noqa: E402

# The modules of the packages full `mlflow` adds to mlflow-skinny and Kiln's own dependencies
# (measured: a fresh `cluster/install.sh` without extras lacks exactly these distributions).
ONLY_FULL_MLFLOW = {
    "docker": "docker",
    "flask": "Flask",
    "flask_cors": "Flask-CORS",
    "graphene": "graphene",
    "gunicorn": "gunicorn",
    "huey": "huey",
    "sklearn": "scikit-learn",
    "scipy": "scipy",
    "skops": "skops",
}

# Runs with the modules above unimportable: a sqlite store written in-process, a run's metrics,
# and a model saved as Kiln saves it, logged, loaded back and asked for text.
SKINNY_RUN = (
    HIDE
    + """
import json
HIDDEN = json.loads(sys.argv[1])  # module: distribution
BLOCKED = set(HIDDEN)
hide(lambda name, spec: name.split(".")[0] in BLOCKED, [*HIDDEN.values(), "mlflow"])
from pathlib import Path
import mlflow
from mlflow import MlflowClient
from kiln.tracking.model import save_pyfunc
from kiln.tracking.server import ui_command

hf, tmp = Path(sys.argv[2]), Path(sys.argv[3])
client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
run = client.create_run(client.create_experiment("skinny"))
client.log_metric(run.info.run_id, "loss/train", 4.5, step=1)
save_pyfunc(hf, tmp / "pyfunc")
model = client.create_logged_model(run.info.experiment_id, name="model", source_run_id=run.info.run_id)
client.log_model_artifacts(model.model_id, str(tmp / "pyfunc"))
client.finalize_logged_model(model.model_id, "READY")
loaded = mlflow.pyfunc.load_model(client.get_logged_model(model.model_id).artifact_location)
text = loaded.predict(["def "], params={"max_new_tokens": 3, "temperature": 0.0})
print(json.dumps({
    "signature": loaded.metadata.signature.to_dict(),
    "text": text,
    "loss": client.get_run(run.info.run_id).data.metrics["loss/train"],
    "ui": ui_command(f"sqlite:///{tmp}/mlflow.db"),
    "blocked_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
    "skinny": mlflow.version.IS_MLFLOW_SKINNY,
}))
"""
)


def test_the_modules_blocked_are_what_full_mlflow_adds_to_kilns_dependencies():
    """The list above is the measured difference; it must still be one: every blocked
    distribution is a requirement of full mlflow, none of Kiln's base requirements."""
    full = {Requirement(r).name.lower() for r in requires("mlflow") or [] if "extra ==" not in r}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name.lower() for r in project["dependencies"]}
    assert "mlflow-skinny" in base and "mlflow" not in base
    assert project["optional-dependencies"]["server"] == ["mlflow>=3.17,<3.19"]
    for dist in ONLY_FULL_MLFLOW.values():
        assert dist.lower() in full and dist.lower() not in base, dist


def test_training_tracking_and_model_logging_need_no_module_of_full_mlflow(tiny_hf, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SKINNY_RUN, json.dumps(ONLY_FULL_MLFLOW), str(tiny_hf), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["blocked_loaded"] == [] and got["skinny"] is True  # MLflow sees itself as mlflow-skinny
    assert got["loss"] == 4.5
    assert len(got["text"]) == 1 and isinstance(got["text"][0], str)
    # The signature is the one MLflow infers with scipy present, not the Any it falls back to.
    assert got["signature"] == signature().to_dict()
    assert json.loads(got["signature"]["inputs"]) == [{"type": "string", "required": True}]
    assert "Failed to infer schema" not in out.stderr
    assert got["ui"].endswith("(after pip install 'kiln[server]')"), got["ui"]


def test_the_written_out_signature_is_the_one_mlflow_infers():
    from mlflow.models import infer_signature

    assert signature() == infer_signature(["def "], ["main():"], params=PARAMS)


def test_services_up_without_the_server_extra_names_it_and_creates_nothing(tmp_path, monkeypatch):
    assert "(after" not in ui_command("sqlite:////a/b.db")  # the test environment has the server
    monkeypatch.setitem(sys.modules, "flask", None)  # `import flask` now fails, as without the extra
    with pytest.raises(KilnError, match=r"needs flask, which this environment lacks: pip install 'kiln\[server\]'"):
        services.up(tmp_path / "svc", port=1)
    assert not (tmp_path / "svc").exists()
    assert ui_command("sqlite:////a/b.db").endswith("(after pip install 'kiln[server]')")
