"""A trial's attempts in a real MLflow store: the number of a new attempt counts every start of
the trial, gone-on ones too, and an earlier attempt goes on only where its Train run left a
checkpoint. The going on itself, from a real checkpoint under Ray, is in
tests/integration/test_sweep_on_ray.py (the ASHA test)."""

import dataclasses

from mlflow.tracking import MlflowClient
from mlflow_store import sqlite_store

from kiln.config import RunConfig
from kiln.launch.resume import record_run
from kiln.sweep.attempts import ATTEMPT_TAG, TRAIN_RUN_TAG, interrupted, retire_earlier
from kiln.sweep.summary import SEGMENT_TAG, TRIAL_TAG


def _store(tmp_path):
    uri = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("sweep-attempts")
    parent = client.create_run(exp, run_name="sweep").info.run_id
    return uri, client, exp, parent


def _attempt(client, exp, parent, trial: str, attempt: int, train_run: str | None = None) -> str:
    tags = {"mlflow.parentRunId": parent, TRIAL_TAG: trial, SEGMENT_TAG: "start", ATTEMPT_TAG: str(attempt)}
    if train_run:
        tags[TRAIN_RUN_TAG] = train_run
    return client.create_run(exp, run_name=f"sw-{trial}", tags=tags).info.run_id


def test_a_new_attempt_is_numbered_after_every_earlier_one_and_retires_their_runs(tmp_path):
    uri, client, exp, parent = _store(tmp_path)
    assert retire_earlier(uri, "sweep-attempts", parent, "t1", "start") == 1  # the first start
    went_on = _attempt(client, exp, parent, "t1", 2)  # attempt 1's run, gone on once
    other = _attempt(client, exp, parent, "t2", 1)
    assert retire_earlier(uri, "sweep-attempts", parent, "t1", "start") == 3
    assert client.get_run(went_on).info.lifecycle_stage == "deleted"
    assert client.get_run(other).info.lifecycle_stage == "active"  # another trial's run stays


def test_an_earlier_attempt_goes_on_only_from_a_checkpoint_of_its_own_train_run(tmp_path):
    uri, client, exp, parent = _store(tmp_path)
    base = RunConfig()
    cfg = dataclasses.replace(
        base, logging=dataclasses.replace(base.logging, experiment="sweep-attempts", run_name="sw-t1")
    )
    storage = str(tmp_path / "train")
    assert interrupted(cfg, uri, parent, "t1", storage) is None  # never started
    _attempt(client, exp, parent, "t1", 1)
    assert interrupted(cfg, uri, parent, "t1", storage) is None  # no Train run named (an older Kiln's)
    run_id = _attempt(client, exp, parent, "t2", 1, train_run="sw-t2-a1")
    t2 = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_name="sw-t2-a1"))
    record_run(dataclasses.replace(t2, train=dataclasses.replace(t2.train, storage_path=storage)), run_id, uri)
    assert interrupted(cfg, uri, parent, "t2", storage) is None  # its Train run holds no checkpoint
