"""Local and S3 paths behind one pyarrow FileSystem.

`s3://bucket/prefix` works against AWS or any S3-compatible store (MinIO, moto) via an endpoint
from the config or $AWS_ENDPOINT_URL. Credentials come from the usual AWS environment variables
and are never passed through Kiln's config, so they cannot leak into logged params.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from kiln.errors import ConfigError, StorageError
from kiln.guard import move, write_file

log = logging.getLogger(__name__)
T = TypeVar("T")

# S3 errors that pass: throttling, a dropped connection, a 5xx. Every shard read retries them in
# `retry_transient`, in the local launcher and in Kiln's Ray Data read tasks alike.
TRANSIENT_ERRORS = (
    "AWS Error INTERNAL_FAILURE",
    "AWS Error NETWORK_CONNECTION",
    "AWS Error SLOW_DOWN",
    "AWS Error UNKNOWN (HTTP status 500)",
    "AWS Error UNKNOWN (HTTP status 502)",
    "AWS Error UNKNOWN (HTTP status 503)",
    "AWS Error SERVICE_UNAVAILABLE",
)


def is_url(path: str) -> bool:
    """Whether a configured path names a store by URL (s3://, gs://, ...), not a local path."""
    return "://" in path


def is_mlflow_model(spec: str) -> bool:
    """Whether a model is named by an MLflow URI (models:/..., runs:/...), not a path."""
    return spec.startswith(("models:/", "runs:/"))


def absolute(path: str) -> str:
    """A local path made absolute (Ray workers and Tune trials run in other directories); a URL
    as it is."""
    return path if is_url(path) else os.path.abspath(path)


# Set by Ray's job supervisor for the driver of a `ray job submit` job: its JobConfig, runtime env
# included. A job with a working_dir runs in Ray's copy of it under the session's temp dir,
# which Ray deletes with the session.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def job_working_copy() -> bool:
    """Whether this process is a Ray job's driver running in Ray's temporary copy of its
    working_dir: a relative path written there is lost when the Ray session ends."""
    raw = os.environ.get(RAY_JOB_CONFIG_ENV)
    if not raw:
        return False
    try:
        return bool((json.loads(raw).get("runtime_env") or {}).get("working_dir"))
    except (ValueError, AttributeError):
        return False


def durable_home() -> str:
    """Where a submitted job keeps what it writes to relative paths: $KILN_HOME, else ~/kiln on
    the node that runs the job's driver (the head, for `ray job submit`)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("KILN_HOME") or "~/kiln"))


def durable(path: str, field: str, env: str = "") -> str:
    """An output path (`field` names its setting; `env`, a variable that also sets it) that
    outlives the process: as it is, except a relative local path in a submitted job's temporary
    working copy, which goes under `durable_home()` instead, saying so. The one place for every
    output a job has (checkpoints, the default MLflow store, exports, prepared data)."""
    if is_url(path) or os.path.isabs(os.path.expanduser(path)) or not job_working_copy():
        return path
    moved = os.path.join(durable_home(), path)
    log.warning(
        "%s = %r is relative, and this job runs in Ray's temporary copy of its working dir, which "
        "Ray deletes with the session: writing to %s instead (set %s%s to an absolute or s3:// path, "
        "or KILN_HOME, to choose)",
        field,
        path,
        moved,
        field,
        f" or ${env}" if env else "",
    )
    return moved


def write_once(loc: Location, data: bytes) -> None:
    """Write a file whole or not at all: locally through a temp name and a rename (a kill
    mid-write leaves no truncated file (a shard, a record) that a reader would take for done); an S3 put is atomic."""
    if loc.is_s3:
        loc.write_bytes(data)
        return
    folder, name = os.path.split(loc.path)
    tmp = resolve(os.path.join(folder, f".{name}.tmp"))
    tmp.write_bytes(data)
    move(tmp.path, loc.path)


def write_private(path: str | os.PathLike, text: str, kind: str | None = None) -> None:
    """Write a local file that may hold connection settings: readable by its owner only (0600),
    and whole or not at all; with a `kind`, over nothing but an earlier such Kiln output."""
    write_whole(path, text, 0o600, kind)


def write_whole(path: str | os.PathLike, text: str, mode: int = 0o644, kind: str | None = None) -> None:
    """Write a local file whole or not at all (`guard.write_file`): with a `kind`, an existing
    file is replaced only if it is that kind of Kiln output."""
    write_file(path, text, mode, kind)


@dataclass(frozen=True)
class Location:
    """A resolved path: the filesystem, the path inside it, and the URI the user gave."""

    fs: pafs.FileSystem
    path: str
    uri: str
    endpoint: str = ""

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")

    def join(self, *parts: str) -> Location:
        path = posixpath.join(self.path, *parts)
        uri = posixpath.join(self.uri, *parts)
        return Location(self.fs, path, uri, self.endpoint)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def info(self) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path)
        except OSError as e:
            raise _storage_error(self, e) from None

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.path) as f:
                return f.read()
        except FileNotFoundError:
            raise StorageError(f"{self.uri}: no such file") from None
        except OSError as e:
            raise _storage_error(self, e) from None

    def write_bytes(self, data: bytes) -> None:
        try:
            if not self.is_s3:  # S3 has no directories to create
                self.fs.create_dir(posixpath.dirname(self.path), recursive=True)
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)
        except OSError as e:
            raise _storage_error(self, e) from None

    def first_entry(self) -> str | None:
        """The name of one entry directly below this location (None: empty), without walking
        the tree under it."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=False))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _storage_error(self, e) from None
        return min((posixpath.basename(i.path.rstrip("/")) for i in infos), default=None)

    def list_files(self) -> list[str]:
        """Paths (relative to this location) of all files below it, sorted."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _storage_error(self, e) from None
        base = self.path.rstrip("/") + "/"
        return sorted(i.path[len(base) :] for i in infos if i.type == pafs.FileType.File)


def without_userinfo(url: str) -> str:
    """`url` without its `user:password@`, whatever the password holds (up to the last `@`
    before the path; urllib stops at a `#` or `?` inside one and misreads the rest)."""
    scheme, sep, rest = url.rpartition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority or "@" not in rest or ":" not in authority or re.fullmatch(r"[^:]*:\d+", authority):
        return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}"
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"  # `user:pa/ss@host`: a password holding '/''


def s3_endpoint(explicit: str = "") -> str:
    return explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")


def s3_filesystem(endpoint: str = "", region: str = "us-east-1") -> pafs.S3FileSystem:
    """An S3FileSystem that fails fast: a few seconds against a dead endpoint, not minutes."""
    kwargs: dict = dict(
        region=region,
        connect_timeout=3,
        request_timeout=20,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2),
    )
    endpoint = s3_endpoint(endpoint)
    if endpoint:
        # S3 signs with AWS keys, never with a URL's userinfo: drop any, so it reaches neither
        # pyarrow nor its error messages.
        parsed = urlparse(without_userinfo(endpoint if is_url(endpoint) else f"https://{endpoint}"))
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme or "https"
    return pafs.S3FileSystem(**kwargs)


def resolve(uri: str, s3_endpoint_url: str = "", region: str = "us-east-1") -> Location:
    """A Location for a local path or s3:// URI. Local paths are made absolute."""
    if uri.startswith("s3://"):
        bucket_path = uri[len("s3://") :].rstrip("/")
        if not bucket_path:
            raise ConfigError(f"{uri!r}: expected s3://bucket/prefix")
        if "@" in bucket_path.split("/", 1)[0]:  # the console masks the userinfo in this line
            raise ConfigError(
                f"{uri!r}: credentials never go in an s3:// path; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment and name just s3://bucket/prefix"
            )
        endpoint = s3_endpoint(s3_endpoint_url)
        return Location(s3_filesystem(endpoint, region), bucket_path, uri.rstrip("/"), endpoint)
    if is_url(uri):
        raise ConfigError(f"{uri!r}: unsupported scheme; expected a local path or s3://bucket/prefix")
    path = os.path.abspath(os.path.expanduser(uri))
    return Location(pafs.LocalFileSystem(), path, path)


def _storage_error(loc: Location, err: OSError) -> StorageError:
    if loc.is_s3:
        endpoint = loc.endpoint or "AWS"
        return StorageError(f"cannot access {loc.uri} (S3 endpoint {endpoint}): {err}")
    return StorageError(f"cannot access {loc.uri}: {err}")


def is_transient(error: BaseException) -> bool:
    return isinstance(error, OSError) and any(marker in str(error) for marker in TRANSIENT_ERRORS)


def retry_transient(
    read: Callable[[], T], what: str, attempts: int = 6, first_wait_s: float = 1.0, max_wait_s: float = 16.0
) -> T:
    """`read()`, again after 1, 2, 4, ... s (at most `max_wait_s`) while it fails with a transient
    S3 error; any other error, or the last attempt's, is raised at once."""
    wait = first_wait_s
    for attempt in range(1, attempts):
        try:
            return read()
        except OSError as e:
            if not is_transient(e):
                raise
            log.warning(
                "%s failed (attempt %d of %d), retrying in %.1f s: %s",
                what,
                attempt,
                attempts,
                wait,
                str(e).splitlines()[0],
            )
            time.sleep(wait)
            wait = min(2 * wait, max_wait_s)
    return read()  # the last attempt: whatever it raises is raised
