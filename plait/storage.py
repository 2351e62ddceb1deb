"""Where a run's files live: a local path, or a URL of any filesystem fsspec serves (s3://, gs://,
az://, file://, memory://, with its package installed: `pip install "plait[s3]"` for S3).

A URL becomes a `upath.UPath`, which has pathlib's methods, so the code that reads and writes a
checkpoint or a tokenized folder is one code for both. What differs is said here:
- an object store has no rename: a file written in one request appears whole or not at all, so
  the manifests that mark a checkpoint (or a tokenized folder) complete are written in one request,
  last, instead of renamed into place;
- a folder is a prefix: removing one removes every object under it;
- listings are not cached (`use_listings_cache=False`): ranks write files another rank waits for,
  and a cached listing would never show them.
Credentials come only from the filesystem's standard environment (AWS_* variables and profiles for
S3, AWS_ENDPOINT_URL for a server of one's own); plait never reads, prints or records them.
Below everything else in plait but config.py's ConfigError.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path

from plait.config import ConfigError, JobConfig

URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "hf": "huggingface_hub"}  # (file://, memory:// and the like are fsspec's own)


def is_url(place: str | os.PathLike) -> bool:
    return isinstance(place, str) and URL.match(place) is not None


def location(place: str | os.PathLike, option: str = ""):
    """`place` as a path: a local one as pathlib.Path, a URL as a UPath of its filesystem. A URL
    whose scheme fsspec does not know, or whose package is not installed: one line naming `option`."""
    if not isinstance(place, str):
        return place  # a path already (pathlib's, or a URL's)
    if not is_url(place):
        return Path(place)
    scheme, rest = URL.match(place).groups()
    import fsspec
    from fsspec.registry import known_implementations

    scheme = scheme.lower()
    if scheme == "file":
        return Path("/" + rest.lstrip("/"))
    if scheme not in known_implementations and scheme not in fsspec.available_protocols():
        raise ConfigError(f"{option}: {place!r} is a URL of {scheme}://, which no fsspec filesystem serves; a local "
                          "path, or a URL of one of: s3, gs, az, file, memory (and the rest fsspec lists)")
    package = PACKAGES.get(scheme)
    if package and importlib.util.find_spec(package) is None:
        extra = ' (pip install "plait[s3]")' if package == "s3fs" else ""
        raise ConfigError(f"{option}: {place} needs the package {package} for {scheme}://, which is not installed"
                          f"{extra}")
    if not rest.strip("/"):
        raise ConfigError(f"{option}: {place!r} names no bucket or folder")
    from upath import UPath

    return UPath(place, use_listings_cache=False) if package else UPath(place)


def is_remote(path) -> bool:
    """Whether `path` (from `location`) is a URL's, not this machine's (file:// is a local path)."""
    return not isinstance(path, Path)


def check_reachable(place: str, option: str) -> None:
    """At start-up, before any process group: a URL's bucket (or root) can be listed with the
    credentials the environment gives. One line naming `option` if not; nothing is created."""
    if not is_url(place):
        return
    path = location(place, option)
    if not is_remote(path):
        return
    bucket = path.path.strip("/").split("/")[0]
    try:
        path.fs.ls(bucket, detail=False)
    except FileNotFoundError:
        raise ConfigError(f"{option}: {place}: the bucket {bucket!r} does not exist (plait creates folders in a "
                          "bucket, never the bucket)") from None
    except PermissionError as e:
        raise ConfigError(f"{option}: {place}: access denied with the credentials of this environment "
                          f"({first_line(e)})") from None
    except Exception as e:  # no credentials, no server, a malformed endpoint: each library has its own classes
        raise ConfigError(f"{option}: {place} is unreachable: {type(e).__name__}: {first_line(e)}") from None


class Retries(logging.Handler):
    """The requests this process's object-store clients retried (a 5xx, a connection reset): botocore
    and s3fs retry with backoff on their own and say each retry at DEBUG, which this counts."""
    LOGGERS = ("botocore.retryhandler", "botocore.retries.standard", "s3fs")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(("Retry needed, action", "Retry needed, retrying", "Retryable error")):
            self.count += 1


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def write_atomically(path, data: str | bytes) -> None:
    """`path` holds `data` whole or not at all, for anyone who reads it: a local file is written
    beside and renamed into place; an object is written in one request, which an object store
    makes visible whole (it has no rename to do it with)."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def remove_tree(path) -> None:
    """A folder and all it holds (under a URL: every object under its prefix); absent is fine."""
    if is_remote(path):
        if path.exists():
            path.fs.rm(path.path, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def upload(local: Path, remote, last: str = "") -> None:
    """Every file of the folder `local` into the folder `remote`, the file named `last` after the
    others (what marks the folder complete)."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    for path in sorted(files, key=lambda p: p.name == last):
        remote.fs.put_file(str(path), (remote / path.relative_to(local).as_posix()).path)


def job_folder(cfg: JobConfig) -> Path:
    """Where a run writes what it finds out about itself (plait/nonfinite.py, plait/collectives.py),
    files torch and plait write as local files: its checkpoint.folder, else the folder of its
    metrics.jsonl, else the one it runs in; a URL is passed over."""
    if cfg.checkpoint.folder and not is_url(cfg.checkpoint.folder):
        return Path(cfg.checkpoint.folder)
    return Path(cfg.metrics.jsonl).parent if cfg.metrics.jsonl and not is_url(cfg.metrics.jsonl) else Path(".")


def free_bytes(path) -> int | None:
    """Free space where `path` is, or None where the filesystem has no such limit to ask about."""
    if is_remote(path):
        return None
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
