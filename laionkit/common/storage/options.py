"""Which fsspec filesystem a URL is read and written through: ``--storage-options``, the options a
train run sets for every path it parses, credentials and endpoints from the environment, and one
filesystem instance per process, protocol and options."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from laionkit.common.errors import LaionkitError

# Protocols users name and the extra that installs each one, for the "cannot open" message.
EXTRAS = {"s3": "s3fs (pip install 'laionkit[s3]')", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub",
          "az": "adlfs", "abfs": "adlfs", "http": "aiohttp", "https": "aiohttp"}


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """The JSON of ``--storage-options``: one object, either flat (for every remote URL of the run) or
    keyed by protocol (``{"s3": {...}, "hf": {...}}``) when inputs and outputs live in different stores."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise LaionkitError(f"--storage-options is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise LaionkitError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


# What Location.parse uses when its caller passes no storage options: set for the length of a train run
# (``default_options``), whose latents, run folder and DataLoader workers (forked, so they inherit it)
# parse paths in many places.
_DEFAULT_OPTIONS: dict[str, Any] = {}


@contextmanager
def default_options(options: dict[str, Any]) -> Iterator[None]:
    """``--storage-options`` for every path parsed without options of its own, until the block ends."""
    global _DEFAULT_OPTIONS
    previous, _DEFAULT_OPTIONS = _DEFAULT_OPTIONS, dict(options)
    try:
        yield
    finally:
        _DEFAULT_OPTIONS = previous


def options_for(protocol: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The options of ``protocol`` in ``--storage-options`` (flat, or keyed by protocol); ``None``: those
    ``default_options`` set."""
    from fsspec.registry import known_implementations

    if options is None:
        options = _DEFAULT_OPTIONS
    known = set(known_implementations) | {"s3", "gs", "hf"}
    if options and all(key in known and isinstance(value, dict) for key, value in options.items()):
        return dict(options.get(protocol, {}))
    return dict(options)


def _s3_environment(options: dict[str, Any]) -> dict[str, Any]:
    """Credentials must exist unless ``anon`` is asked for: s3fs otherwise falls back to anonymous
    requests, and a private bucket then answers with a puzzling 403 or "not found". An
    ``AWS_ENDPOINT_URL(_S3)`` from the environment is passed on for s3fs/aiobotocore versions that
    ignore it (MinIO, Ceph and moto users set only that)."""
    if not options.get("anon") and not (options.get("key") or options.get("token") or options.get("profile")):
        import botocore.session

        if botocore.session.Session().get_credentials() is None:
            raise LaionkitError("s3:// needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                "AWS_PROFILE, or --storage-options '{\"anon\": true}' for a public bucket")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
        options = {**options, "endpoint_url": endpoint}
    return options


_FILESYSTEMS: dict[tuple[int, str, str], Any] = {}
_FS_LOCK = threading.Lock()


def filesystem(protocol: str, options: dict[str, Any]):
    """The fsspec filesystem of ``protocol`` with ``options``, one per process; a missing implementation or
    options it does not take are one-line LaionkitErrors."""
    if protocol == "s3":
        options = _s3_environment(options)
    # Per process: a forked DataLoader worker must not reuse its parent's instance, whose event loop
    # thread does not exist in the child (every request would wait forever).
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=str))
    with _FS_LOCK:
        if key not in _FILESYSTEMS:
            import fsspec

            try:
                _FILESYSTEMS[key] = fsspec.filesystem(protocol, **options)
            except ImportError as error:
                need = EXTRAS.get(protocol, f"the fsspec implementation of {protocol}://")
                raise LaionkitError(f"{protocol}:// URLs need {need}: {error}") from None
            except ValueError as error:
                raise LaionkitError(f"unknown storage protocol {protocol}:// ({error})") from None
            except TypeError as error:
                raise LaionkitError(f"--storage-options do not fit {protocol}://: {error}") from None
    return _FILESYSTEMS[key]
