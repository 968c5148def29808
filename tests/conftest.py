"""Shared fixtures: the real files in ../shared/realdata and the laionkit entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REALDATA = REPO.parent / "shared" / "realdata"


@pytest.fixture(scope="session")
def realdata() -> Path:
    if not REALDATA.is_dir():
        pytest.fail(f"real test data not found at {REALDATA} (see DEVELOPERS.md: ../shared/realdata)")
    return REALDATA


def run_cli(*args: str, check: bool = True, env: dict | None = None, timeout: float = 600):
    """Run the real `laionkit` entry point in a subprocess, as a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "laionkit.cli", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"laionkit {' '.join(map(str, args))} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


# Session fixtures other stages reuse: tiny_models, image_shards, latent_shards (see tests/fixtures.py).
from fixtures import image_shards, latent_shards, tiny_models  # noqa: E402,F401

# s3_endpoint (a moto S3 server for the session) and s3 (a fresh bucket per test): tests/s3server.py.
from s3server import s3, s3_endpoint  # noqa: E402,F401
