"""A trained model as an MLflow model: logged with its run, registered, loaded and served.

The model is a pyfunc (`KilnTextModel`) whose one artifact is the Hugging Face export
(`kiln export`'s directory), so `mlflow.pyfunc.load_model(...).predict(["def "])` and
`mlflow models serve` generate text, and the same files load in transformers. It is logged as an
MLflow 3 LoggedModel through `MlflowClient` (Kiln never sets MLflow's process-wide tracking
URI): created with the run as its source, its files uploaded, marked READY, listed among the
run's outputs, and the run's final metrics logged against it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow

from kiln.errors import ConfigError
from kiln.guard import discard, temp_dir
from kiln.infer.generate import Sampling

if TYPE_CHECKING:
    from kiln.infer.evaluate import EvalResult

log = logging.getLogger(__name__)
EXPORT = "model"  # the artifact key (and folder) of the Hugging Face export inside the MLflow model
PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
MODEL_METRICS = "model"  # the namespace of the logged model's own copies of the run's final metrics
PARAMS = {
    "max_new_tokens": 64,
    "temperature": 0.8,
    "top_k": 0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "seed": 0,
    "chat": False,  # each prompt a user turn in the model's chat template, as `kiln generate --chat`
    "compile": False,  # the decode step under torch.compile, as `kiln generate --compile`: a server's choice
}


class KilnTextModel(mlflow.pyfunc.PythonModel):
    """Prompts in (a list of strings; MLflow hands a one-column DataFrame as one), completions
    out; the sampling controls are the predict params (`PARAMS`)."""

    def load_context(self, context) -> None:
        from kiln.infer.load import load_model

        self.loaded = load_model(context.artifacts[EXPORT])
        self.model = self.loaded.build()


def _predict(self, context, model_input, params=None) -> list[str]:
    from kiln.infer.commands import chat_encoder
    from kiln.infer.generate import generate

    prompts = [str(p) for p in (model_input.iloc[:, 0] if hasattr(model_input, "iloc") else model_input)]
    params = PARAMS | (params or {})
    chat, compile = bool(params.pop("chat")), bool(params.pop("compile"))
    s = Sampling(**params)
    tok = self.loaded.tokenizer
    stops: tuple[int, ...] = ()
    if chat:
        encode, stops = chat_encoder(tok)
        ids = [encode(p) for p in prompts]
    else:
        ids = [list(map(int, row)) for row in tok.encode_batch(prompts)]
    out = generate(self.model, ids, s, tok.eot_id, self.loaded.vocab_size, stop_ids=stops, compile=compile)
    return [tok.decode(t) for t in out.tokens]


# Set after the class is made: MLflow inspects a `predict` written in the class body for type
# hints and warns on every import where there are none. Hints would replace the signature's
# params schema (the sampling controls) with one of their own, so there are none.
KilnTextModel.predict = _predict


def signature():
    """Strings in, strings out, `PARAMS` as the params: the signature `infer_signature(["def "],
    ["main():"], params=PARAMS)` infers, written out because inferring a schema imports scipy,
    which mlflow-skinny leaves out (without it MLflow logs a warning and types both sides Any)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    kinds = {int: DataType.long, float: DataType.double, bool: DataType.boolean}
    params = ParamSchema([ParamSpec(name, kinds[type(v)], v) for name, v in PARAMS.items()])
    return ModelSignature(Schema([ColSpec(DataType.string)]), Schema([ColSpec(DataType.string)]), params)


# What the model's code imports beyond MLflow and the standard library, as distributions: measured
# by loading a logged model where only its own files give `kiln` (tests/unit/tracking/test_model_serving.py).
SERVING_DISTRIBUTIONS = ("torch", "safetensors", "tokenizers", "numpy")


def pip_requirements() -> list[str]:
    """`SERVING_DISTRIBUTIONS` pinned at this environment's versions (a local label such as
    +cpu dropped, so that another build of the same release fits)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in SERVING_DISTRIBUTIONS]


def save_pyfunc(export_dir: Path, path: Path) -> None:
    """The MLflow model of a Hugging Face export. Kiln's own code travels with it (`code_paths`:
    the `kiln` package, a few hundred KB of Python) and its requirements are its imports, so it
    loads and serves wherever MLflow builds an environment from those alone (`mlflow models
    serve`, `build-docker`), with no Kiln installed. The alternative, MLflow's transformers
    flavour, would tie serving to transformers' generation rather than Kiln's, and make every
    logging rank import transformers."""
    package = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="kiln-code-") as staged, _quiet():
        # The package's sources only: this Python's bytecode is of no use elsewhere.
        code = shutil.copytree(package, Path(staged) / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
        mlflow.pyfunc.save_model(
            path=str(path),
            python_model=str(Path(__file__).with_name("pyfunc_entry.py")),
            artifacts={EXPORT: str(export_dir)},
            signature=signature(),
            code_paths=[str(code)],
            pip_requirements=pip_requirements(),
        )


@contextlib.contextmanager
def _quiet():
    """MLflow's progress bars off, and its warnings to the debug log, for the time of a call.
    It warns (that no input example was given: one would make it run the model at save time)
    through a filter of its own that outer filters cannot silence, so `showwarning` is swapped."""
    show, bar = warnings.showwarning, os.environ.get(PROGRESS_BAR)
    warnings.showwarning = _to_debug_log
    os.environ[PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        warnings.showwarning = show
        if bar is None:
            os.environ.pop(PROGRESS_BAR, None)
        else:
            os.environ[PROGRESS_BAR] = bar


def _to_debug_log(message, category, filename, lineno, file=None, line=None) -> None:
    log.debug("%s: %s", category.__name__, message)


def log_model(
    client, run_id: str, checkpoint: str, metrics: dict[str, float], step: int, register_as: str = ""
) -> tuple[str, int | None]:
    """Log `checkpoint` as the run's model; (model id, registered version or None)."""
    from mlflow.entities import LoggedModelOutput, Metric

    from kiln.infer.commands import export

    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory(prefix="kiln-model-") as tmp:
        loaded, _ = export(checkpoint, str(Path(tmp) / "export"))
        save_pyfunc(Path(tmp) / "export", Path(tmp) / "pyfunc")
        model = client.create_logged_model(
            run.info.experiment_id,
            name="model",
            source_run_id=run_id,
            model_type="text-generation",
            params={
                "arch": loaded.cfg.arch,
                "n_layer": str(loaded.cfg.n_layer),
                "d_model": str(loaded.cfg.d_model),
                "vocab_size": str(loaded.vocab_size),
            },
            tags={"kiln.checkpoint": checkpoint},
        )
        client.log_model_artifacts(model.model_id, str(Path(tmp) / "pyfunc"))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    # MLflow links a metric to a model by logging it on the run with the model's id. Under the
    # run's own keys that would be a second point at the last step of the training curves, so the
    # model's copies carry the model/ namespace.
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric(f"{MODEL_METRICS}/{k}", float(v), now, step, model_id=model.model_id)
            for k, v in metrics.items()
            if "/" in k and k.split("/")[0] in ("loss", "throughput")
        ],
    )
    version = None
    if register_as:
        from mlflow.exceptions import MlflowException

        try:
            client.create_registered_model(register_as)
        except MlflowException as e:  # it exists: a new version of it
            if "already exists" not in str(e).lower():
                raise
        # The source is the model's own location: a models:/ source would be resolved through
        # MLflow's process-wide tracking URI, which Kiln leaves alone.
        location = client.get_logged_model(model.model_id).artifact_location
        version = int(
            client.create_model_version(register_as, location, run_id=run_id, model_id=model.model_id).version
        )
    return model.model_id, version


@contextlib.contextmanager
def downloaded(uri: str, tracking_uri: str) -> Iterator[str]:
    """The Hugging Face export inside an MLflow model (`models:/NAME/VERSION`, `models:/NAME@ALIAS`,
    `models:/MODEL_ID`, `runs:/RUN_ID/PATH`), downloaded into a temp directory that is removed
    when the block ends: its local directory. Resolved through a client of `tracking_uri`:
    MLflow's own models:/ resolution reads the process-wide registry URI."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    into = temp_dir(None, "model")
    try:
        try:
            location = _registered(client, uri)[0] if uri.startswith("models:/") else uri
            with _quiet():
                local = mlflow.artifacts.download_artifacts(
                    artifact_uri=location, tracking_uri=tracking_uri, dst_path=str(into)
                )
        except MlflowException as e:
            raise ConfigError(f"--model {uri}: not found in the MLflow store {tracking_uri} ({e.message})") from None
        found = sorted(Path(local).rglob("config.json"))
        if not found:
            raise ConfigError(f"--model {uri}: not a Kiln model (it holds no Hugging Face export)")
        yield str(found[0].parent)
    finally:
        discard(into)


def source_run_of(uri: str, tracking_uri: str) -> str | None:
    """The run that logged the model `uri` (models:/NAME/VERSION, models:/MODEL_ID, runs:/RUN/...)."""
    from mlflow import MlflowClient

    if uri.startswith("runs:/"):
        return uri[len("runs:/") :].split("/")[0]
    return _registered(MlflowClient(tracking_uri), uri)[1]


def _registered(client, uri: str) -> tuple[str, str | None]:
    """A models:/NAME/VERSION or models:/MODEL_ID URI's (artifact location, source run id)."""
    parts = uri[len("models:/") :].strip("/").split("/")
    if len(parts) == 1 and "@" in parts[0]:  # models:/NAME@ALIAS
        name, alias = parts[0].split("@", 1)
        parts = [name, client.get_model_version_by_alias(name, alias).version]
    if len(parts) == 2:
        version = client.get_model_version(parts[0], parts[1])
        location = client.get_logged_model(version.model_id).artifact_location if version.model_id else version.source
        return location, version.run_id
    logged = client.get_logged_model(parts[0])
    return logged.artifact_location, logged.source_run_id


# ---- `kiln eval` of a model, logged to its run ----------------------------------------------
def evaluate_model(
    spec: str,
    data: str,
    split: str,
    batch_size: int,
    max_batches: int,
    s3_endpoint: str = "",
    tracking_uri: str = "",
    run_id: str = "",
) -> tuple[EvalResult, str | None]:
    """`kiln eval`: the figures, and the MLflow run they were logged to (the model's source run
    for a models:/ spec, else --run-id; None when neither). `tracking_uri` is resolved already."""
    from kiln.data.manifest import load_manifest
    from kiln.infer.evaluate import evaluate
    from kiln.infer.load import load_model
    from kiln.storage import is_mlflow_model, resolve
    from kiln.tracking.client import log_metrics

    uri = tracking_uri
    source_run: str | None = run_id
    manifest = load_manifest(resolve(data, s3_endpoint))
    with downloaded(spec, uri) if is_mlflow_model(spec) else contextlib.nullcontext(spec) as local:
        if is_mlflow_model(spec):
            source_run = run_id or source_run_of(spec, uri)
        result = evaluate(load_model(local), manifest, split, batch_size, max_batches)
    if source_run:
        log_metrics(uri, source_run, result.metrics())
    return result, source_run or None
