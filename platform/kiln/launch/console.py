"""A command front end's console: when the process started, and errors as one clean line.

A user mistake (KilnError) prints `kiln: error: ...` (secrets masked) and exits 2; Ctrl-C
exits 130; only bugs keep their traceback. `kiln` and `python -m kiln.launch.local` share it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from kiln.errors import KilnError
from kiln.tracking.redact import scrub


def process_start() -> float:
    """When this process started (interpreter start-up and imports included)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()


def run_reporting_errors(command: Callable[[], int]) -> int:
    """Run a command front end: a user mistake is one `kiln: error:` line and exit 2."""
    try:
        return command()
    except KilnError as e:
        print(f"kiln: error: {scrub(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
