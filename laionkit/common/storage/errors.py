"""Storage failures (botocore, aiohttp, gcsfs, OS errors) as one-line LaionkitErrors naming the URL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from laionkit.common.errors import LaionkitError


def one_line(error: BaseException) -> str:
    """An exception's message folded onto one line and cut at 400 characters, for one-line errors."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:400]


@contextmanager
def one_line_errors(what: str, location: object) -> Iterator[None]:
    """Storage failures as one-line LaionkitErrors naming the URL (missing bucket, credentials, object)."""
    try:
        yield
    except LaionkitError:
        raise
    except FileNotFoundError as error:
        raise LaionkitError(f"{what} {location}: not found ({one_line(error)})") from None
    except PermissionError as error:
        raise LaionkitError(f"{what} {location}: permission denied; check credentials "
                            f"(AWS_* variables, ~/.aws, --storage-options) ({one_line(error)})") from None
    except Exception as error:  # botocore/aiohttp/gcsfs each have their own exception trees
        name = type(error).__name__
        if "Credential" in name or "credential" in str(error).lower():
            raise LaionkitError(f"{what} {location}: no usable credentials; set AWS_ACCESS_KEY_ID / "
                                f"AWS_SECRET_ACCESS_KEY, a profile, or --storage-options ({name})") from None
        if isinstance(error, OSError | ValueError) or "botocore" in type(error).__module__ \
                or "aiohttp" in type(error).__module__:
            raise LaionkitError(f"{what} {location}: {name}: {one_line(error)}") from None
        raise
