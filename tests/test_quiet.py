"""Quiet by default (issue 60): a command's stderr holds laionkit's lines, not the libraries' deprecation and
import-time messages (laionkit/cli/quiet.py)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

# What third-party noise looks like on stderr: a Python warning, torch's and DeepSpeed's log prefixes, and the
# import-time messages laionkit/cli/quiet.py drops.
NOISE = re.compile(r"\w+Warning\b|^[WE]\d{4} \d\d:|\[WARNING\]|Unable to import `torchao`|Failed to load CPU")

# Commands run one after another in one fresh process, as `laionkit CMD` runs each: the libraries' import-time
# messages come once per process, so one process shows them all, for the import cost of one command.
IN_SEQUENCE = """
import sys
from laionkit.cli import main
for argv in ARGVS:
    print("== laionkit", argv[0], file=sys.stderr, flush=True)
    sys.argv = ["laionkit", *argv]
    try:
        main()
    except SystemExit as exit_:
        if exit_.code:
            raise
"""


def test_commands_print_no_third_party_warnings(tmp_path, image_shards, tiny_models, latent_shards):
    """encode and train import diffusers (and with it torchao and bitsandbytes), transformers and accelerate
    (DeepSpeed); filter reads the shipped LAION sample. Their stderr holds laionkit's lines only."""
    argvs = [
        ["encode", str(image_shards), "--model", str(tiny_models), "--output", str(tmp_path / "latents"),
         "--resolution", "64", "--workers", "0", "--batch-size", "8", "--quiet"],
        ["train", str(latent_shards), "--output", str(tmp_path / "run"), "--unet-config", "tiny", "--max-steps", "1",
         "--batch-size", "2", "--workers", "0", "--export", "none", "--quiet"],
        ["filter", str(REPO / "laionkit" / "data" / "laion-sample.parquet"), "--preset", "laion-safe", "--output",
         str(tmp_path / "filtered"), "--quiet"],
    ]
    result = subprocess.run([sys.executable, "-c", f"ARGVS = {argvs!r}\n{IN_SEQUENCE}"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("== laionkit") == 3
    assert [line for line in result.stderr.splitlines() if NOISE.search(line)] == []


def test_eval_loads_pipelines_without_deprecated_arguments(tiny_models):
    """`laionkit eval` loads the exported pipeline with diffusers' current keywords (dtype, not torch_dtype)."""
    import warnings

    import torch

    from laionkit.evaluate import load_pipeline

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_pipeline(tiny_models, torch.device("cpu"))
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
