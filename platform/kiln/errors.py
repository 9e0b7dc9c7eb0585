"""User-facing errors.

Anything a user can cause (a config typo, a bad path, a corrupt shard, an unreachable endpoint)
raises a `KilnError` with a message that names the field or file and what was expected. The CLI
prints that message without a traceback and exits with the error's `exit_code`:

- 2: the command as given is wrong (argparse's usage errors, and `ConfigError`: a config field,
  an override or a flag's value). Fix the command and run it again.
- 1: the command was well formed but failed while it ran (a missing or corrupt file, an
  unreachable server, an unhealthy run). Anything else is a bug: it keeps its traceback, in a
  file, and exits 1 too.
"""


class KilnError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""

    exit_code = 1  # a runtime failure unless a subclass says otherwise


class ConfigError(KilnError):
    """A config file, an override or a command-line flag is invalid."""

    exit_code = 2  # argparse's code for usage errors: the command, not the world, is wrong


class DataError(KilnError):
    """A corpus, dataset or shard is missing, corrupt, or does not match the run."""


class StorageError(KilnError):
    """A local path or S3 endpoint cannot be read or written."""


def failure_chain(failure: BaseException) -> list[BaseException]:
    """`failure` and every exception behind it, nearest first.

    Ray reports a failure from elsewhere wrapped: Ray Train keeps each worker's exception in
    `WorkerGroupError.worker_failures`, inside a wrapper that holds it as `_base_exc`; Tune and
    Ray tasks chain theirs as `cause` or `__cause__`."""
    todo: list[BaseException | None] = [failure]
    seen: dict[int, BaseException] = {}
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen[id(e)] = e
        failures = getattr(e, "worker_failures", None) or {}
        todo.extend(failures[rank] for rank in sorted(failures))  # rank 0's first
        todo.extend(getattr(e, name, None) for name in ("_base_exc", "cause", "controller_failure"))
        todo.append(e.__cause__)
    return list(seen.values())


def user_error_in(failure: BaseException) -> KilnError | None:
    """The KilnError behind a failure that Ray reports from elsewhere, if there is one: a
    worker's (a shard found corrupt mid-run, the health guard stopping the run), so that the CLI
    can say it in one line."""
    return next((e for e in failure_chain(failure) if isinstance(e, KilnError)), None)
