"""Deliver a run's metrics and artifacts to MLflow from a background thread, through outages.

MLflow's synchronous client retries a dead server for about four minutes and then raises, and
its async logging drops what it cannot send: the first stalls training, the second loses data.
So rank 0 hands each batch to this sender and goes on training. The sender delivers in order,
keeps whatever failed at the head of its queue, tries again with backoff, and warns once per
outage, naming the server. A run that ends while the server is still away waits a bounded time
for it, then leaves the metrics it still holds in a JSON-lines file and names that file.

That file is a `Journal` kept from the start: metrics are appended as they are handed over, so
a SIGKILL of the process loses none of them, and a restarted worker group on the same node
delivers what its predecessor could not.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field

from kiln.guard import discard, move, remove_file, temp_dir
from kiln.redact import scrub
from kiln.tracking.server import server_address

log = logging.getLogger(__name__)

STALL_WARN_S = 10.0  # a call that has not returned in this long is an outage, not a slow server
BATCH_METRICS = 1000  # MLflow's most metrics in one log_batch (mlflow.utils.validation)
MAX_BACKOFF_S = 10.0  # between attempts while the server is away: a return is noticed this fast


class Journal:
    """Metrics handed over but not yet delivered, on disk before they are queued.

    One JSON object per line: a metric (`key`, `value`, `timestamp`, `step`), or a marker
    `{"delivered": n}` saying the file's first n metrics reached MLflow. Delivery is in order,
    so the metrics after the last marker are the undelivered ones. The file is emptied whenever
    everything is delivered, and removed at a clean end. Writes are flushed to the OS, which
    keeps them when the process is killed (a machine crash needs fsync, which each step would
    pay for). Hand-written: MLflow's own async logging keeps its queue in memory only."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.recovered = undelivered(path) if os.path.exists(path) else []
        if self.recovered:
            _write_atomically(path, self.recovered)  # markers dropped: the file is just those
        self._f = open(path, "a")  # noqa: SIM115 - open for the run's life, closed in close()
        self._written, self._delivered = len(self.recovered), 0
        self._lock = threading.Lock()

    def append(self, metrics: list) -> int:
        """Write metrics down; the count written so far, which `delivered` is later told."""
        lines = "".join(json.dumps(_as_dict(m)) + "\n" for m in metrics)
        with self._lock:
            self._f.write(lines)
            self._f.flush()
            self._written += len(metrics)
            return self._written

    def delivered(self, through: int) -> None:
        with self._lock:
            self._delivered = max(self._delivered, through)
            if self._delivered == self._written:  # nothing outstanding: start an empty file
                self._f.seek(0)
                self._f.truncate()
                self._written = self._delivered = 0
            else:
                self._f.write(json.dumps({"delivered": self._delivered}) + "\n")
                self._f.flush()

    def outstanding(self) -> int:
        with self._lock:
            return self._written - self._delivered

    def close(self) -> None:
        """Remove the file if everything was delivered; else leave only the undelivered metrics."""
        with self._lock:
            if self._f.closed:
                return
            self._f.close()
            if self._written == self._delivered:
                remove_file(self.path, proof="this run's own metrics journal, every metric delivered")
            else:
                _write_atomically(self.path, undelivered(self.path))


def undelivered(path: str) -> list[dict]:
    """The metrics of a journal (or of an end-of-run spill file) that never reached MLflow."""
    metrics, done = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill: it was never handed over whole
            if "delivered" in item:
                done = max(done, int(item["delivered"]))
            else:
                metrics.append(item)
    return metrics[done:]


def _as_dict(m) -> dict:
    return {"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}


def _write_atomically(path: str, metrics: list[dict]) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
    move(tmp, path)


@dataclass
class _Batch:
    metrics: list = field(default_factory=list)  # mlflow.entities.Metric
    tags: list = field(default_factory=list)  # mlflow.entities.RunTag
    artifacts: tuple[str, str] | None = None  # (a private copy of the directory, artifact path)
    journaled: int = 0  # the journal's count once these metrics are delivered (0: not journaled)


class Sender:
    """An ordered queue of MLflow writes for one run, drained by a daemon thread."""

    def __init__(
        self, client, run_id: str, uri: str, stall_warn_s: float = STALL_WARN_S, journal: Journal | None = None
    ):
        self._client, self._run_id, self._uri = client, run_id, scrub(uri)
        self._journal = journal
        self._address = server_address(uri)  # None for a local store: nothing to probe
        self._stall_warn_s = stall_warn_s
        self._queue: collections.deque[_Batch] = collections.deque()
        self._cv = threading.Condition()
        self._busy_since: float | None = None  # when the call in flight started
        self._outage_since: float | None = None  # set once an outage has been announced
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kiln-mlflow-sender", daemon=True)
        self._thread.start()

    # -- the training thread's side: never blocks on the server -------------------------------

    def send_metrics(self, metrics: list, journaled: int = 0) -> None:
        """Queue metrics; `journaled`: the journal's count once they are delivered, if the
        caller wrote them down already (`Journal.append`)."""
        if metrics:
            self._put(_Batch(metrics=list(metrics), journaled=journaled))

    def send_tags(self, tags: list) -> None:
        if tags:
            self._put(_Batch(tags=list(tags)))

    def send_artifacts(self, local_dir: str, artifact_path: str) -> None:
        # The caller may delete its directory as soon as this returns: send a copy.
        copy = temp_dir(None, "artifacts") / "files"  # the marked temp dir is its parent
        shutil.copytree(local_dir, copy)
        self._put(_Batch(artifacts=(str(copy), artifact_path)))

    def pending_metrics(self) -> int:
        with self._cv:
            return self._pending_locked()

    def _pending_locked(self) -> int:
        return sum(len(b.metrics) for b in self._queue)

    @property
    def in_outage(self) -> bool:
        self._check_stall()
        return self._outage_since is not None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything queued is delivered; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 1.0))
                self._check_stall_locked()
        return True

    def close(self, timeout: float, spill_path: str) -> None:
        """Deliver what is left, waiting at most `timeout` for a server that is away; then leave
        the undelivered metrics in `spill_path` (the journal's file, if there is one) and say so."""
        if self.in_outage and self._queue:
            log.warning(
                "waiting up to %.0f s for MLflow at %s to come back: %d metrics are not delivered yet",
                timeout,
                self._uri,
                self.pending_metrics(),
            )
        delivered = self.wait_idle(timeout)
        with self._cv:
            self._closing = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if delivered:
            self._thread.join(timeout=5)
        if self._journal is not None:
            self._journal.close()
        if delivered:
            return
        # The thread may still be inside MLflow's own retries; it is a daemon and dies with us.
        metrics = [m for b in left for m in b.metrics]
        if self._journal is None:
            os.makedirs(os.path.dirname(os.path.abspath(spill_path)), exist_ok=True)
            _write_atomically(spill_path, [_as_dict(m) for m in metrics])
        lost_artifacts = [b.artifacts[1] for b in left if b.artifacts]
        lost_tags = [t.key for b in left for t in b.tags]
        log.error(
            "MLflow at %s did not come back within %.0f s: %d metrics of run %s are in %s "
            "(one JSON object per line: key, value, timestamp, step)%s",
            self._uri,
            timeout,
            len(metrics),
            self._run_id,
            spill_path,
            f"; not logged: artifacts {lost_artifacts}, tags {lost_tags}" if lost_artifacts or lost_tags else "",
        )
        for b in left:
            if b.artifacts:
                discard(os.path.dirname(b.artifacts[0]))

    def _put(self, batch: _Batch) -> None:
        with self._cv:
            self._queue.append(batch)
            self._cv.notify_all()
            self._check_stall_locked()

    def _check_stall(self) -> None:
        with self._cv:
            self._check_stall_locked()

    def _check_stall_locked(self) -> None:
        busy = self._busy_since
        if busy is not None and self._outage_since is None and time.monotonic() - busy > self._stall_warn_s:
            self._outage_since = busy
            log.warning(
                "MLflow at %s has not answered for %.0f s: training goes on, and its metrics are kept "
                "(%d queued) and delivered when the server answers again",
                self._uri,
                time.monotonic() - busy,
                self._pending_locked(),
            )

    # -- the sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 1.0
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                batch, taken = self._head_locked()
                self._busy_since = time.monotonic()
            try:
                self._probe()
                self._deliver(batch)
            except Exception as e:  # noqa: BLE001 - any failure is retried; the queue keeps the batch
                with self._cv:
                    self._busy_since = None
                    if self._outage_since is None:
                        self._outage_since = time.monotonic()
                        log.warning(
                            "MLflow at %s failed (%s): training goes on, and its metrics are kept "
                            "and delivered when the server answers again",
                            self._uri,
                            scrub(str(e))[:300],
                        )
                    # Wakes early when closing or when more is queued: the probe is cheap.
                    self._cv.wait(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            if batch.journaled and self._journal is not None:
                self._journal.delivered(batch.journaled)
            with self._cv:
                for _ in range(taken):
                    self._queue.popleft()
                self._busy_since = None
                if self._outage_since is not None:
                    log.warning(
                        "MLflow at %s answers again after %.0f s; the buffered metrics are being delivered",
                        self._uri,
                        time.monotonic() - self._outage_since,
                    )
                    self._outage_since = None
                self._cv.notify_all()
            backoff = 1.0

    def _head_locked(self) -> tuple[_Batch, int]:
        """What to deliver next, and how many queued batches it is: the head, and with a head
        of metrics alone the metrics-only batches queued after it, in order, in one call of up
        to `BATCH_METRICS` metrics. One log_batch of 25 metrics to a SQLite store took 5.3 ms of
        this thread's Python on this VM, 250 in one call 15.8 ms: a run that logs every short
        step keeps the sender busy, and its GIL away from training, unless a behind sender
        catches up in fewer calls."""
        head = self._queue[0]
        if head.tags or head.artifacts:
            return head, 1
        merged, taken = _Batch(metrics=list(head.metrics), journaled=head.journaled), 1
        for more in itertools.islice(self._queue, 1, None):
            if more.tags or more.artifacts or len(merged.metrics) + len(more.metrics) > BATCH_METRICS:
                break
            merged.metrics += more.metrics
            merged.journaled = more.journaled or merged.journaled
            taken += 1
        return merged, taken

    def _probe(self) -> None:
        """Connect first: MLflow's client would spend minutes retrying a server that is not
        listening, and a server that comes back would then wait out its backoff."""
        if self._address is not None:
            socket.create_connection(self._address, timeout=5).close()

    def _deliver(self, batch: _Batch) -> None:
        if batch.metrics or batch.tags:
            self._client.log_batch(self._run_id, metrics=batch.metrics, tags=batch.tags)
        if batch.artifacts:
            local_dir, artifact_path = batch.artifacts
            self._client.log_artifacts(self._run_id, local_dir, artifact_path)
            discard(os.path.dirname(local_dir))
