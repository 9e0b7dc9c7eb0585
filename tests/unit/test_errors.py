"""A user mistake found on a Ray worker reaches the driver as one KilnError, not Ray's dump."""

import pickle

from ray.train import WorkerGroupError
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

from kiln.core.loop import TrainingUnhealthy
from kiln.errors import DataError, KilnError, user_error_in


def _as_ray_reports_it(failures: dict) -> WorkerGroupError:
    """Wrapped as Ray Train wraps a worker's exception, and pickled across processes as it is."""
    wrapped = {
        rank: UserExceptionWithTraceback(e, traceback_str=f"Traceback ...\n{e!r}") for rank, e in failures.items()
    }
    return pickle.loads(pickle.dumps(WorkerGroupError("worker errors", wrapped)))


def test_the_kiln_error_of_a_worker_is_found():
    err = _as_ray_reports_it(
        {1: RuntimeError("gloo: connection reset"), 0: TrainingUnhealthy("step 15: loss is nan on 1 of 2 rank(s)")}
    )
    found = user_error_in(err)
    assert isinstance(found, TrainingUnhealthy) and "step 15: loss is nan" in str(found)


def test_a_chained_cause_is_found_and_a_bug_is_not_taken_for_a_user_error():
    try:
        try:
            raise DataError("shard train/00003.parquet is truncated")
        except DataError as e:
            raise RuntimeError("read task failed") from e
    except RuntimeError as chained:
        assert isinstance(user_error_in(chained), DataError)
    assert user_error_in(_as_ray_reports_it({0: ZeroDivisionError("a bug")})) is None
    assert isinstance(user_error_in(KilnError("plain")), KilnError)


def test_a_failed_read_on_a_ray_worker_names_the_corrupt_shard(tmp_path, byte_dataset):
    """What a Ray worker raises when a read task hits a bad shard: Ray's error for the task
    (an OSError subclass, as Ray Data re-raises it), explained by a checksum pass."""
    import json
    import shutil

    from ray.exceptions import RayTaskError

    from kiln.data.manifest import load_manifest, read_failure
    from kiln.data.sources import READ_ERRORS
    from kiln.storage import resolve

    ds = tmp_path / "ds"
    shutil.copytree(byte_dataset, ds)
    shard = ds / json.loads((ds / "manifest.json").read_text())["splits"]["val"]["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    raised = RayTaskError("ReadParquet", "Traceback ...", OSError("Unexpected end of stream")).as_instanceof_cause()
    assert isinstance(raised, READ_ERRORS)
    err = read_failure(load_manifest(resolve(str(ds))), "val", raised)
    assert isinstance(err, DataError)
    assert str(err).startswith("reading the val split failed (OSError: Unexpected end of stream); shard ")
    assert f"shard {shard} does not match the SHA-256" in str(err)
    clean = read_failure(load_manifest(resolve(str(byte_dataset))), "val", raised)
    assert "every shard still matches its manifest" in str(clean)
    # A mixture: the bad shard is in the second dataset, after one whose shards all match.
    mixed = read_failure([load_manifest(resolve(str(d))) for d in (byte_dataset, ds)], "val", raised)
    assert f"shard {shard} does not match the SHA-256" in str(mixed)
