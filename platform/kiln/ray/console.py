"""A quiet console for a run on Ray: Kiln's own lines on the terminal, everything else in a file.

Ray forwards whatever its workers, actors and tasks print to the driver, which prints all of it
(`log_to_driver`): Ray Train's report dicts, Ray Data's notices, DeepSpeed's accelerator and op
build lines, a background thread's traceback. `WorkerLogRouter` takes the place of Ray's
printer while a run trains:
- every forwarded line goes to the run's `workers.log`, prefixed as Ray prefixes it;
- the console gets only Kiln's own lines that matter, from any worker: its warnings and errors,
  and the `kiln.console` lines (the run's start; progress where the driver draws no bar).

Ray has no public hook for this, so the router takes the place of the handler Ray registers on
its stdstream dispatcher (`ray_print_logs`). Ray's printer stays off after the run, so that no
late worker line follows the summary; `verbose` keeps it on throughout.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import threading
from collections.abc import Callable

from kiln.ray.private import stdstream_dispatcher
from kiln.redact import scrub
from kiln.ui.progress import CONSOLE_LOGGER

log = logging.getLogger(__name__)

RAY_HANDLER = "ray_print_logs"  # the name ray.init gives its printer of worker output
KILN_HANDLER = "kiln_worker_logs"
WORKER_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # what the router parses
_KILN_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) (?P<level>[A-Z]+) "
    r"(?P<name>kiln(?:\.[\w.]+)?): (?P<message>.*)$"
)
_SHOWN_LEVELS = {"WARNING", "ERROR", "CRITICAL"}
SEEN_LINES = 4096  # console lines remembered for the duplicate check


def console_line(line: str) -> str | None:
    """What the console shows for one line a worker printed, or None: Kiln's warnings and
    errors, and its `kiln.console` lines, in the driver's own log format."""
    m = _KILN_LINE.match(line)
    if m is None:
        return None
    level, name = m["level"], m["name"]
    if level in _SHOWN_LEVELS:
        return f"{m['time']} {name}: {level.lower()}: {m['message']}"
    if name == CONSOLE_LOGGER:
        return f"{m['time']} {name}: {m['message']}"
    return None


class WorkerLogRouter:
    """A context manager on the driver, entered after `ray.init` and left when the run is over
    (from then on, worker lines go nowhere: the summary is the last thing on the console)."""

    def __init__(self, path: str, show: Callable[[str], None] | None = None, verbose: bool = False):
        """`show`: writes console lines (each ending in a newline); stderr by default, or a
        progress bar's `print_above`."""
        self.path, self.verbose = path, verbose
        self._show = show or _to_stderr
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 - open while the run trains, closed in close()
        self._lock = threading.Lock()
        # Ray may forward one line more than once (two nodes' log monitors tailing one session
        # directory): the console shows a (node, process, line) once. Ray's printer dedups too.
        self._shown: collections.OrderedDict[tuple, None] = collections.OrderedDict()

    def __enter__(self) -> WorkerLogRouter:
        dispatcher = stdstream_dispatcher()
        if not self.verbose:
            dispatcher.remove_handler(RAY_HANDLER)
        dispatcher.add_handler(KILN_HANDLER, self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, data: dict) -> None:
        """One batch of lines from one process, as Ray's log monitor forwards it."""
        who = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({who + ' ' if who else ''}pid={data.get('pid')}, ip={data.get('ip')})"
        lines = [scrub(line) for line in data.get("lines", [])]
        with self._lock:
            if self._file.closed:
                return
            self._file.writelines(f"{prefix} {line}\n" for line in lines)
            self._file.flush()
        shown = [
            c for c in map(console_line, lines) if c is not None and self._first((data.get("ip"), data.get("pid"), c))
        ]
        if shown and not self.verbose:  # verbose: Ray's printer shows them already
            self._show("".join(c + "\n" for c in shown))

    def _first(self, key: tuple) -> bool:
        with self._lock:
            if key in self._shown:
                return False
            self._shown[key] = None
            if len(self._shown) > SEEN_LINES:
                self._shown.popitem(last=False)
            return True

    def close(self) -> None:
        stdstream_dispatcher().remove_handler(KILN_HANDLER)
        with self._lock:
            self._file.close()


def _to_stderr(lines: str) -> None:
    sys.stderr.write(lines)
    sys.stderr.flush()
