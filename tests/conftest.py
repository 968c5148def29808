"""Shared fixtures: the real files in ../shared/realdata and the laionkit entry point."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

# One intra-op thread per process (torch / OpenMP), inherited by every subprocess the tests start: the
# models here are tiny, so a second thread buys nothing, while torchrun ranks, DataLoader workers and
# other processes on a 2-core machine oversubscribing OpenMP's spinning thread pools made single train
# steps take seconds instead of a tenth of one. Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
# The real files the tests read (LAION metadata rows, photos, aesthetic heads): ../shared/realdata beside the
# clone, or the folder LAIONKIT_REALDATA names.
REALDATA = Path(os.environ.get("LAIONKIT_REALDATA") or REPO.parent / "shared" / "realdata")
REALDATA_MISSING = (
    f"real test data not found at {REALDATA} (set LAIONKIT_REALDATA to use another folder): it holds "
    "laion-sample/test_1000.parquet (img2dataset's tests/test_files/), images/ (the photos of img2dataset's "
    "tests/resize_test_image/ and tests/blur_test_files/, github.com/rom1504/img2dataset) and "
    "aesthetic/sac+logos+ava1-l14-linearMSE.pth, aesthetic/sa_0_4_vit_l_14_linear.pth (LAION's aesthetic "
    "predictors, github.com/christophschuhmann/improved-aesthetic-predictor, LAION-AI/aesthetic-predictor)")


def pytest_report_header(config) -> str:
    """Said once, at the top, rather than only in every failing test's setup."""
    return f"realdata: {REALDATA}" if REALDATA.is_dir() else f"realdata: MISSING: {REALDATA_MISSING}"


def pytest_collection_modifyitems(config, items) -> None:
    """The proof-of-learning tests first (a stable sort: the rest keep their order). They are the suite's
    longest, a minute or more each on 2 cores; collected in file order, one of them could start last and run
    alone while the other xdist worker idles. Started first, the short tests fill in around them."""
    items.sort(key=lambda item: item.path.name != "test_learning.py")


@pytest.fixture(scope="session")
def realdata() -> Path:
    if not REALDATA.is_dir():
        pytest.fail(REALDATA_MISSING, pytrace=False)
    return REALDATA


def run_cli(*args: str, check: bool = True, env: dict | None = None, timeout: float = 600):
    """Run the real `laionkit` entry point (laionkit.cli.main) as a user would, in this process: the same
    argument parsing, exit status and stdout / stderr, without paying for a fresh interpreter importing
    torch and diffusers on every call (seconds each). An ``env`` runs it in a subprocess (run_cli_process);
    tests where the process boundary itself matters (signals, launchers, kill -9) use subprocesses."""
    if env is not None:
        return run_cli_process(*args, check=check, env=env, timeout=timeout)
    result = _run_in_process([str(arg) for arg in args])
    if check and result.returncode != 0:
        raise AssertionError(f"laionkit {' '.join(map(str, args))} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def run_cli_process(*args: str, check: bool = True, env: dict | None = None, timeout: float = 600):
    """Run the real `laionkit` entry point in a subprocess."""
    result = subprocess.run(
        [sys.executable, "-m", "laionkit.cli", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"laionkit {' '.join(map(str, args))} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def run_script_in_process(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` in this process, as _run_in_process runs the CLI."""
    import runpy

    return _run_in_process([str(script), *map(str, args)], lambda: runpy.run_path(str(script), run_name="__main__"))


def _run_in_process(args: list[str], entry=None) -> subprocess.CompletedProcess:
    """``python -m laionkit.cli ARGS`` (or ``entry`` with sys.argv[1:] = ARGS[1:]) in this process: exit
    status as the interpreter would set it (an uncaught exception prints its traceback and gives 1),
    process-wide state put back afterwards."""
    if entry is None:
        from laionkit.cli import main as entry
        args = ["laionkit", *args]

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, saved_environ, saved_cwd = sys.argv, dict(os.environ), os.getcwd()
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    sys.argv = list(args)
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                entry()
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = exit_.code or 0
                else:  # sys.exit("message"): printed to stderr, status 1
                    print(exit_.code, file=sys.stderr)
                    code = 1
            except Exception:  # what the interpreter does with an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        _reset_accelerate()
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(autouse=True)
def _fresh_accelerate_after_each_test():
    """A test that calls laionkit's Python API in this process (trainer.loop.run) leaves accelerate's
    singletons set as a run_cli call would not: reset them after every test, as a fresh process has none (a
    bf16 run after such a test failed with 'AcceleratorState has already been initialized')."""
    yield
    _reset_accelerate()


def _reset_accelerate() -> None:
    """accelerate keeps its process state in singletons (mixed precision, device, gradient accumulation);
    a fresh process starts without them, and so does the next in-process command."""
    if "accelerate" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# Session fixtures other stages reuse: tiny_models, image_shards, latent_shards, flow_latents, flux_run, sharp_models, score_models
# (see tests/fixtures.py).
from fixtures import (  # noqa: E402,F401
    bucket_latents,
    flow_latents,
    flux_run,
    image_shards,
    latent_shards,
    score_models,
    sharp_models,
    tiny_models,
)

# s3_endpoint (a moto S3 server for the session) and s3 (a fresh bucket per test): tests/s3server.py.
from s3server import s3, s3_endpoint  # noqa: E402,F401
