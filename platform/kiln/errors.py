"""User-facing errors.

Anything a user can cause (a config typo, a bad path, a corrupt shard, an unreachable endpoint)
raises a `KilnError` with a message that names the field or file and what was expected. The CLI
prints that message and exits non-zero without a traceback; anything else is a bug and keeps its
traceback.
"""


class KilnError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""


class ConfigError(KilnError):
    """A config file or override is invalid."""


class DataError(KilnError):
    """A corpus, dataset or shard is missing, corrupt, or does not match the run."""


class StorageError(KilnError):
    """A local path or S3 endpoint cannot be read or written."""
