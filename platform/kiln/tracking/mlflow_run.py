"""MLflow runs: the driver's `Run` handle and rank 0's `MLflowLogger`.

The driver creates the run (params, tags, artifacts) so it knows the run id before training;
rank 0 alone then logs per-step metrics into it, buffered and sent in batches. Secrets never
reach MLflow: params and tags pass through `redact`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kiln
from kiln.clock import RESTART
from kiln.core.sinks import NullLogger
from kiln.data.mixture import Dataset
from kiln.errors import KilnError
from kiln.knobs import flatten
from kiln.redact import redact, redact_tree, scrub
from kiln.tracking.client import count_event
from kiln.tracking.plots import PLOTTED, training_plots
from kiln.tracking.sender import Journal, Sender
from kiln.tracking.source import UNKNOWN, git_commit

if TYPE_CHECKING:  # tracking sits below the config that composes its section
    from kiln.config import RunConfig

log = logging.getLogger(__name__)


class MLflowLogger:
    """Per-step metrics into an existing MLflow run, buffered and sent with log_batch.

    One round trip per `flush_every` steps instead of one per metric, made by a background
    sender (kiln.tracking.sender) so that neither a slow nor a dead tracking server stalls a
    training step; what the server misses is delivered when it answers again.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        flush_every: int = 20,
        flush_secs: float = 10.0,
        system_metrics: bool = True,
        spill_dir: str = ".",
        outage_wait_s: float = 300.0,
        skip_through: int = 0,
    ):
        """`skip_through`: steps up to this one are in the run already (a restarted worker group
        trains them again from its checkpoint); they are not logged twice."""
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri)
        self._monitor = None
        if system_metrics:  # CPU, memory, disk, network (and GPU if pynvml is there) every 10 s
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=10, tracking_uri=tracking_uri)
            self._monitor.start()
        self._run_id = run_id
        self._spill_path = os.path.join(spill_dir, f"undelivered-metrics-{run_id}.jsonl")
        self._journal = Journal(self._spill_path)  # every metric on disk until MLflow has it
        self._sender = Sender(self._client, run_id, tracking_uri, journal=self._journal)
        recovered = self._journal.recovered  # a killed predecessor's, on this node: sent first
        if recovered:
            log.warning(
                "delivering %d metrics that run %s handed over before it was killed (from %s)",
                len(recovered),
                run_id,
                self._spill_path,
            )
            self._sender.send_metrics(
                [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in recovered], journaled=len(recovered)
            )
            skip_through = max(skip_through, max(m["step"] for m in recovered))
        self._outage_wait_s = outage_wait_s
        self._flush_every, self._flush_secs = flush_every, flush_secs
        self._buffer: list = []
        self._journaled = len(recovered)  # the journal's count after the last metric logged
        self._last_flush = time.monotonic()
        self._steps = 0
        self._skip_through = skip_through
        self._history: dict[str, list[tuple[int, float]]] = {}  # what the end-of-run plots need

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self._skip_through:  # the old group logged this step; only a restart logs RESTART's
            metrics = {k: v for k, v in metrics.items() if k.startswith(RESTART)}
            if not metrics:
                return
        now = int(time.time() * 1000)
        new = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._journaled = self._journal.append(new)  # on disk now; sent with the next batch
        self._buffer.extend(new)
        for k in PLOTTED.intersection(metrics):
            self._history.setdefault(k, []).append((step, float(metrics[k])))
        self._steps += 1
        if self._steps % self._flush_every == 0 or time.monotonic() - self._last_flush > self._flush_secs:
            self._hand_over()

    def set_tag(self, key: str, value: str) -> None:
        from mlflow.entities import RunTag

        self._hand_over()  # keeps the order: the metrics logged before the tag go first
        self._sender.send_tags([RunTag(key, scrub(str(value))[:5000])])

    def _hand_over(self) -> None:
        # log_batch takes at most 1000 metrics per call.
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self._sender.send_metrics(chunk, journaled=self._journaled - len(self._buffer))
        self._last_flush = time.monotonic()

    def flush(self, timeout: float = 30.0) -> None:
        """Deliver what is buffered before going on (a Tune scheduler may stop this run once it
        sees the next report). While the server is away this does not wait: the sender keeps it."""
        self._hand_over()
        if not self._sender.in_outage:
            self._sender.wait_idle(timeout)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self._sender.send_artifacts(local_dir, artifact_path)

    def close(self) -> None:
        self._hand_over()
        if self._history:
            with tempfile.TemporaryDirectory(prefix="kiln-plots-") as tmp:
                try:
                    if training_plots(self._history, tmp):
                        self.log_artifacts(tmp, "plots")
                except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
                    log.warning("end-of-run plots not logged: %s", scrub(str(e)))
            self._history = {}
        self._sender.close(self._outage_wait_s, self._spill_path)
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None


class ArtifactLogger(NullLogger):
    """For a rank other than 0 that has files to hand in (a profile): artifacts, no metrics."""

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self._client, self._run_id = MlflowClient(tracking_uri), run_id

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self._client.log_artifacts(self._run_id, local_dir, artifact_path)


class Run:
    """The driver's handle on one MLflow run."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        parent_run_id: str | None = None,
        tags: dict | None = None,
        run_id: str | None = None,
    ):
        """A new run, or (run_id given) a handle on an existing one. A child run (parent_run_id)
        nests under its parent in the MLflow UI."""
        from mlflow.tracking import MlflowClient

        # Through a client only, never mlflow.set_tracking_uri: that would also set the process's
        # $MLFLOW_TRACKING_URI, changing the store of a notebook's (or a test's) later runs.
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        try:
            if run_id:
                self.run_id, exp_id = run_id, self.client.get_run(run_id).info.experiment_id
            else:
                exp_id = experiment_id(self.client, experiment)
                all_tags = _context_tags() | {k: str(v) for k, v in redact(tags or {}).items()}
                if parent_run_id:
                    all_tags["mlflow.parentRunId"] = parent_run_id
                self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id
        except Exception as e:  # the store's own errors are many and unhelpful
            raise KilnError(f"cannot create an MLflow run at {tracking_uri}: {e}") from None
        self.experiment_id = exp_id

    def log_dataset(self, uri: str, digest: str, context: str = "training") -> None:
        """The dataset as an MLflow dataset input (the run page's Datasets column): its location,
        its name (the last part of the path) and its fingerprint as the digest."""
        import warnings

        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(scrub(uri))
        dataset = MetaDataset(source=source, name=uri.rstrip("/").rsplit("/", 1)[-1], digest=digest)
        entry = DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
        try:
            self.client.log_inputs(self.run_id, datasets=[entry])
        except Exception as e:  # noqa: BLE001 (the store's errors have no common type)
            # Runs of one experiment that log the same dataset at once (a sweep's trials) race
            # in MLflow's SQL store: each finds no row for it and inserts one, and all but the
            # first fail on the unique key. Once one has written it, another try finds it.
            log.info("logging dataset %s again after: %s", dataset.name, str(e).splitlines()[0])
            time.sleep(0.5)
            self.client.log_inputs(self.run_id, datasets=[entry])

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in redact(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in redact(tags).items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, scrub(text), artifact_file)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, ok: bool, status: str | None = None) -> None:
        """End the run, unless another process has ended it already: the first verdict stands.
        A sweep's driver marks a trial that ASHA stopped KILLED while the trial's own process may
        still be being torn down, and that process's FAILED, coming after, would overwrite it."""
        try:
            if self.client.get_run(self.run_id).info.status != "RUNNING":
                return
        except Exception:  # noqa: BLE001 - the store's errors are many; ending the run matters more
            pass
        self.client.set_terminated(self.run_id, status or ("FINISHED" if ok else "FAILED"))

    @contextlib.contextmanager
    def finishing(self, stopped_by: tuple[type[BaseException], ...] = (), stopping: Callable[[], bool] | None = None):
        """End the run with its block: FINISHED, KILLED when its process was stopped (Ctrl-C, or
        SIGTERM from `ray job stop` or a scheduler: `kiln.launch.console` makes it an interrupt,
        Ray's driver handler an exit, or one of `stopped_by`), else FAILED. `stopping`: a
        function saying whether the block was asked to stop (a Tune trial that its scheduler
        stopped): whatever the block then raises, as its trainer is torn down, is a stop too.
        Without it, a stopped trial's FAILED could land between the sweep driver's KILLED and
        `finish`'s look at the status (CI: one ASHA trial of six ended FAILED)."""
        stops: tuple[type[BaseException], ...] = (KeyboardInterrupt, SystemExit, *stopped_by)
        try:
            yield self
        except stops:
            self.finish(False, "KILLED")
            raise
        except BaseException:
            self.finish(False, "KILLED" if stopping is not None and stopping() else None)
            raise
        self.finish(True)


def _context_tags() -> dict[str, str]:
    """MLflow's own run context: who (mlflow.user), from what (mlflow.source.name, .type) and,
    where MLflow finds no repository around the entry point, Kiln's git commit."""
    from mlflow.tracking.context import registry
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT

    tags = registry.resolve_tags()
    if MLFLOW_GIT_COMMIT not in tags:
        commit = git_commit(os.path.dirname(kiln.__file__))
        if commit != UNKNOWN:
            tags[MLFLOW_GIT_COMMIT] = commit
    return tags


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created if missing (and safe against a concurrent create)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        exp = client.get_experiment_by_name(name)  # another trial created it first
        if exp is None:
            raise
        return exp.experiment_id


def open_run(
    cfg: RunConfig,
    datasets: list[Dataset],
    tracking_uri: str,
    cluster: dict,
    parent_run_id: str | None = None,
    tags: dict | None = None,
) -> Run:
    """Create the MLflow run with params (redacted), tags and artifacts; return its handle.

    A sweep's trial passes its parent and trial tags; its params carry the same names as a
    single run's, so trials and runs compare side by side."""
    run = Run(tracking_uri, cfg.logging.experiment, cfg.logging.run_name, parent_run_id=parent_run_id, tags=tags)
    manifest = datasets[0].manifest
    run.log_params(
        flatten(cfg.to_dict())
        | {
            "data.fingerprint": manifest.fingerprint,
            "data.tokenizer": manifest.raw["tokenizer"]["type"],
            "data.train_tokens": sum(d.manifest.split("train")["tokens"] for d in datasets),
        }
        | (
            {}
            if len(datasets) == 1
            else {
                f"data.mix.{d.name}.{k}": v
                for d in datasets
                for k, v in (
                    ("weight", d.weight),
                    ("fingerprint", d.manifest.fingerprint),
                    ("train_tokens", d.manifest.split("train")["tokens"]),
                )
            }
        )
    )
    run.set_tags(
        {
            "kiln.version": kiln.__version__,
            "kiln.git_commit": git_commit(os.path.dirname(kiln.__file__)),
            "kiln.num_workers": cfg.parallel.num_workers,
            **{f"kiln.{k}": v for k, v in cluster.items()},
        }
    )
    for d in datasets:
        run.log_dataset(d.manifest.location.uri, d.manifest.fingerprint)
    run.log_text(config_yaml(cfg), "config.yaml")
    for d in datasets:
        run.log_text(
            json.dumps(d.manifest.raw, indent=2),
            "data/manifest.json" if len(datasets) == 1 else f"data/{d.name}/manifest.json",
        )
    log_schedule_plot(run, cfg)
    return run


def reopen_run(cfg: RunConfig, tracking_uri: str, run_id: str, checkpoint: str) -> Run:
    """The MLflow run of a named run that is submitted again, running again. Its params stay
    the first submission's (MLflow keeps a param's first value); the config it resumes with is
    logged beside them as `config.resume-<n>.yaml`, and the run is tagged `kiln.resumes` and
    `kiln.resume.<n>` (the checkpoint it resumed from)."""
    run = Run(tracking_uri, cfg.logging.experiment, cfg.logging.run_name, run_id=run_id)
    try:
        run.client.update_run(run_id, status="RUNNING")
        n = count_event(run.client, run_id, "resume", checkpoint)
    except Exception as e:  # the store's own errors are many and unhelpful
        raise KilnError(f"cannot reopen MLflow run {run_id} at {tracking_uri}: {e}") from None
    run.log_text(config_yaml(cfg), f"config.resume-{n}.yaml")
    return run


def config_yaml(cfg: RunConfig) -> str:
    """The run's config as YAML, secrets redacted: what a run logs as its config artifact."""
    import yaml

    return yaml.safe_dump(redact_tree(cfg.to_dict()), sort_keys=False)


def log_schedule_plot(run: Run, cfg: RunConfig) -> None:
    """The LR schedule this run will follow, as a PNG artifact (schedule/lr.png)."""
    from kiln.core.schedule import plot_schedule

    with tempfile.TemporaryDirectory(prefix="kiln-lr-") as tmp:
        path = plot_schedule(
            cfg.schedule,
            cfg.optim.lr,
            cfg.train.max_steps,
            f"{tmp}/lr.png",
            title=f"{cfg.logging.run_name}: {cfg.schedule.name}, peak lr {cfg.optim.lr:g}",
        )
        run.log_file(path, "schedule")
