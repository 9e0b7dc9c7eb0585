"""The Python API a notebook uses: prepare, train (with its tqdm bar), read the runs back, and a
mistake raised as one KilnError. Run as a user's script would, in a process of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
import os
import mlflow
import kiln
from kiln.errors import ConfigError

fluent_before = mlflow.get_tracking_uri()  # the notebook's own MLflow default

mistakes = []
for call in (lambda: kiln.data.prepare(inputz=["x"], output="ds"),
             lambda: kiln.load_config({"optim": {"lrr": 0.1}}),
             lambda: kiln.load_config(None, ["parallel.zero_stage=4"])):
    try:
        call()
    except ConfigError as e:
        mistakes.append(str(e))
manifest = kiln.data.prepare(inputs=CORPUS, output="ds", tokenizer="byte", seq_len=64, shard_tokens=1 << 16)
summary = kiln.train(CONFIG, overrides=["data.path=ds", "train.max_steps=20", "train.eval_every=10",
                                        "train.eval_batches=4", "logging.experiment=api",
                                        "logging.progress_every=1000"])
rows = kiln.runs("api", sort="loss/val")
# After the notebook imported the training loop's package and trained once, `kiln.train` is still
# the function (it was once shadowed by a subpackage of that name after the first import).
import kiln.core.loop  # noqa: F401
import kiln.api  # noqa: F401
again = [kiln.train is kiln.api.train, callable(kiln.train)]
# The embedded Ray, still up, started no preemption watcher (a dead actor is listed too).
import ray.util.state
actors = ray.util.state.list_actors(detail=True, limit=10000)
watchers = [a.actor_id for a in actors if a.class_name == "PreemptionWatcher"]
# Ray Data's coordinator and stats actor: one each, started by the driver (the job's empty runtime
# env), not later by the Train controller (whose runtime env its children inherit).
helpers = sorted((a.class_name, a.state, "RAY_WARN_BLOCKING" in (a.serialized_runtime_env or ""))
                 for a in actors if a.class_name in ("_AutoscalingCoordinatorActor", "_StatsActor"))
# Ray Train's actors: its controller, and no dataset-sharding actor (Kiln's workers read their own rows).
train_actors = sorted({a.class_name for a in actors if a.class_name in ("TrainController", "DatasetManager")})
print(json.dumps({"env_uri": os.environ.get("MLFLOW_TRACKING_URI"),
                  "fluent_kept": mlflow.get_tracking_uri() == fluent_before,
                  "fingerprint": manifest["fingerprint"], "val": summary.metrics["loss/val"],
                  "run_id": summary.run_id, "rows": rows, "again": again, "watchers": watchers, "helpers": helpers, "train_actors": train_actors, "mistakes": mistakes, "rendered": summary.render()}))
"""


def test_prepare_train_and_read_runs_from_python(corpus, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    script = SCRIPT.replace("CORPUS", repr([corpus[0]])).replace("CONFIG", repr(str(REPO / "jobs/configs/debug.yaml")))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    said = json.loads(out.stdout.splitlines()[-1])
    assert said["mistakes"] == [
        "prepare: unknown option(s) ['inputz']; expected some of " + said["mistakes"][0].split("expected some of ")[1],
        "unknown config key 'optim.lrr'; did you mean 'lr'?",
        "parallel.zero_stage = 4 is out of range: expected one of 0, 1, 2, 3",
    ]
    assert json.loads((tmp_path / "ds/manifest.json").read_text())["fingerprint"] == said["fingerprint"]
    (row,) = said["rows"]
    assert row["run_id"] == said["run_id"] and row["status"] == "FINISHED"
    assert row["metrics"]["loss/val"] == said["val"] and row["params"]["train.max_steps"] == "20"
    assert said["rendered"].startswith("Kiln run '") and "finished: 20 steps" in said["rendered"]
    assert said["again"] == [True, True]  # the API is still the function after a run
    assert said["watchers"] == []  # an embedded Ray is lean: no preemption watcher (nothing drains it)
    # ... and the driver started Ray's helper actors early, which Ray Train and Ray Data then used
    assert said["helpers"] == [["_AutoscalingCoordinatorActor", "ALIVE", False], ["_StatsActor", "ALIVE", False]]
    assert said["train_actors"] == ["TrainController"]  # and no DatasetManager (KilnTrainer)
    # The tqdm bar reached the end (a text bar here; a widget in Jupyter), with the run's numbers.
    assert "20/20" in out.stderr and "tok/s" in out.stderr, out.stderr[-3000:]
    assert "TrainingReport(" not in out.stderr  # the quiet console holds in the API too
    # The notebook's own MLflow settings are as they were: Kiln addressed its store by client only.
    assert said["env_uri"] is None and said["fluent_kept"]


def test_api_arguments_of_the_wrong_type_are_one_config_error_and_leave_nothing(tmp_path, monkeypatch, corpus):
    import pytest

    import kiln
    from kiln.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    calls = {
        "seq_len as text": lambda: kiln.data.prepare(inputs=[corpus[0]], output="out", seq_len="64"),
        "seq_len as float": lambda: kiln.data.prepare(inputs=[corpus[0]], output="out", seq_len=64.0),
        "inputs None": lambda: kiln.data.prepare(inputs=None, output="out"),
        "output None": lambda: kiln.data.prepare(inputs=[corpus[0]], output=None),
        "limit as text": lambda: kiln.runs("kiln", limit="5"),
    }
    said = {}
    for name, call in calls.items():
        with pytest.raises(ConfigError) as e:
            call()
        said[name] = str(e.value)
    assert said == {
        "seq_len as text": "prepare: seq_len: expected an integer",
        "seq_len as float": "prepare: seq_len: expected an integer",
        "inputs None": "prepare: inputs: expected a list",
        "output None": "prepare: output: expected a string",
        "limit as text": "runs: limit: expected an integer",
    }
    assert list(tmp_path.iterdir()) == []  # no .out.partial-*, no mlflow.db
