"""Local and S3 paths behind one pyarrow FileSystem.

`s3://bucket/prefix` works against AWS or any S3-compatible store (MinIO, moto) via an endpoint
from the config or $AWS_ENDPOINT_URL. Credentials come from the usual AWS environment variables
and are never passed through Kiln's config, so they cannot leak into logged params.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow.fs as pafs

from kiln.errors import StorageError


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
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme or "https"
    return pafs.S3FileSystem(**kwargs)


def resolve(uri: str, s3_endpoint_url: str = "", region: str = "us-east-1") -> Location:
    """A Location for a local path or s3:// URI. Local paths are made absolute."""
    if uri.startswith("s3://"):
        bucket_path = uri[len("s3://") :].rstrip("/")
        if not bucket_path:
            raise StorageError(f"{uri!r}: expected s3://bucket/prefix")
        endpoint = s3_endpoint(s3_endpoint_url)
        return Location(s3_filesystem(endpoint, region), bucket_path, uri.rstrip("/"), endpoint)
    if "://" in uri:
        raise StorageError(f"{uri!r}: unsupported scheme; expected a local path or s3://bucket/prefix")
    path = os.path.abspath(os.path.expanduser(uri))
    return Location(pafs.LocalFileSystem(), path, path)


def _storage_error(loc: Location, err: OSError) -> StorageError:
    if loc.is_s3:
        endpoint = loc.endpoint or "AWS"
        return StorageError(f"cannot access {loc.uri} (S3 endpoint {endpoint}): {err}")
    return StorageError(f"cannot access {loc.uri}: {err}")
