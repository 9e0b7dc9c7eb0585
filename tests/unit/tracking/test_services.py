"""`kiln services down` signals only the processes `up` started: a pid is checked against the
start time recorded with it, so a pid reused by another process (after the server exited, or a
reboot) is left alone."""

import json
import signal
import subprocess

import psutil

from kiln import guard
from kiln.storage import write_private
from kiln.tracking import services


def _record(root, procs_and_starts):
    guard.mark(root, services.SERVICES)  # as `up` marks its directory
    write_private(
        root / services.STATE,
        json.dumps(
            [
                {"name": f"svc{i}", "pid": p.pid, "url": "http://127.0.0.1:1", "log": "l", "started": started}
                for i, (p, started) in enumerate(procs_and_starts)
            ]
        ),
    )


def test_down_stops_what_up_started_and_leaves_a_reused_pid_alone(tmp_path):
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        # `stranger` has the pid the file records, but started an hour after the recorded start.
        _record(
            tmp_path,
            [
                (ours, psutil.Process(ours.pid).create_time()),
                (stranger, psutil.Process(stranger.pid).create_time() - 3600),
            ],
        )
        assert [alive for _, alive in services.status(tmp_path)] == [True, False]
        stopped = services.down(tmp_path)
        assert [s.pid for s in stopped] == [ours.pid, stranger.pid]  # what the file listed
        # Stopped by down: wait() times out otherwise. Its code is -SIGTERM, or 0 where down's own
        # liveness check reaped the zombie first (this test is the process's parent).
        assert ours.wait(timeout=30) in (0, -signal.SIGTERM)
        assert stranger.poll() is None  # never signalled
        assert not (tmp_path / services.STATE).exists()
        # A directory Kiln's marker does not claim keeps its file: it may be someone else's.
        (tmp_path / guard.MARKER).unlink()
        (tmp_path / services.STATE).write_text("[]")
        assert services.down(tmp_path) == [] and (tmp_path / services.STATE).read_text() == "[]"
    finally:
        for p in (ours, stranger):
            p.kill()
            p.wait()
