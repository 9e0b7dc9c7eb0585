"""A command front end's console: when the process started, and errors as one clean line.

A user mistake (KilnError) prints `kiln: error: ...` (secrets masked) and exits with its
`exit_code` (`kiln.errors`: 2 for a wrong command or config, 1 for a failure while running). An
error the user's input or environment causes that Kiln did not name itself (a file that cannot
be read or written, bytes that are not text, YAML that does not parse, a store MLflow refuses,
a Ray cluster that failed under the run) prints the same line and exits 1, with its traceback
saved to a file named on that line.
Anything else is a bug in Kiln: it says so, exits 1, and names the file holding the traceback.
A signal that stops it exits 128 + its number, as a shell, Kubernetes and Slurm expect: Ctrl-C
130, SIGTERM 143. Nothing on the console or in the file escapes redaction. `kiln` and `python -m kiln.launch.local` share it.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable

from kiln.errors import KilnError
from kiln.ray.failures import cluster_failure_in
from kiln.redact import scrub


def run_reporting_errors(command: Callable[[], int]) -> int:
    """Run a command front end: every failure is one `kiln:` line and an exit code. SIGTERM
    (`ray job stop`, a scheduler's preemption) stops it like Ctrl-C, so runs end KILLED."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return command()
    except KilnError as e:
        print(f"kiln: error: {scrub(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(
            "kiln: interrupted" + ("" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"),
            file=sys.stderr,
        )
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into a line
        where = _save_traceback()
        cluster = cluster_failure_in(e)
        if cluster is not None:
            print(f"kiln: error: {cluster[1]} ({_first_line(cluster[0])}; traceback in {where})", file=sys.stderr)
            return 1
        what = _first_line(e)
        if isinstance(e, _environment_errors()):
            print(f"kiln: error: {what} (traceback in {where})", file=sys.stderr)
            return 1
        print(
            f"kiln: internal error: {what}. This is a bug in Kiln: please report it with the traceback in {where}",
            file=sys.stderr,
        )
        return 1


class Stopped(KeyboardInterrupt):
    """A signal other than Ctrl-C that stops a command as Ctrl-C does (what catches
    KeyboardInterrupt marks the run KILLED), keeping its number for the exit code."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Stopped(signum)


def _first_line(e: BaseException) -> str:
    """An exception's class and the first line of its message, secrets masked."""
    return scrub(f"{type(e).__name__}: {e}".strip().splitlines()[0])


def _environment_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a user's input or environment causes, not Kiln's code."""
    import yaml

    # ImportError: an optional driver that is not installed (a postgresql:// store without psycopg2).
    from kiln.tracking.client import errors

    return (OSError, UnicodeError, ImportError, yaml.YAMLError, *errors())


def _save_traceback() -> str:
    """The current exception's traceback, redacted, in a private file of its own; its path."""
    fd, path = tempfile.mkstemp(prefix="kiln-error-", suffix=".log")  # 0600
    with os.fdopen(fd, "w") as f:
        f.write(scrub(traceback.format_exc()))
    return path
