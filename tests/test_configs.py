"""`laionkit configs copy DIR` from an installed (non-editable) wheel: the configs come out of the package's
data, not from a checkout next to it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def repo_files(*folders: str) -> dict[str, bytes]:
    return {str(p.relative_to(REPO)): p.read_bytes() for folder in folders for p in sorted((REPO / folder).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_configs_copy_from_an_installed_wheel_writes_train_and_pipelines(tmp_path: Path):
    source = tmp_path / "src"  # a copy, so the build writes nothing into the checkout
    for name in ("laionkit", "train", "pipelines"):
        shutil.copytree(REPO / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # --no-build-isolation: the build backend comes from this environment (the test extra's setuptools), offline
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("laionkit-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    shutil.rmtree(source)  # nothing but the installed package is left to copy from
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import laionkit; print(laionkit.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))
    out = tmp_path / "mine"
    result = subprocess.run([sys.executable, "-m", "laionkit.cli", "configs", "copy", str(out)], env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    copied = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert copied == repo_files("train", "pipelines")
    assert {"train/ddp.yaml", "train/deepspeed-zero2.json", "pipelines/slurm/train.sbatch"} <= set(copied)
    assert os.access(out / "pipelines" / "torchrun" / "train-multinode.sh", os.X_OK)
    again = subprocess.run([sys.executable, "-m", "laionkit.cli", "configs", "copy", str(out)], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    assert again.returncode == 2 and "already holds" in again.stderr and "--overwrite" in again.stderr


def test_the_docker_image_installs_the_s3_and_ops_extras():
    extras = re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text(), flags=re.M)
    dockerfile = (REPO / "pipelines" / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    installs = re.findall(r"^RUN pip install (.+)$", dockerfile, flags=re.M)
    wanted = [set(found.split(",")) for line in installs for found in re.findall(r"\.\[([\w,-]+)\]", line)]
    assert any({"s3", "ops"} <= chosen for chosen in wanted), installs
    assert {"s3", "ops"} <= set(extras)


def test_configs_copy_onto_a_file_or_where_it_cannot_write_is_one_line(tmp_path: Path):
    """A file as DIR, and a DIR under a regular file (unwritable even for root): tracebacks before."""
    from conftest import run_cli

    (tmp_path / "file").write_text("mine")
    for target, message in [(tmp_path / "file", f"configs copy: {tmp_path / 'file'} is a file, not a folder"),
                            (tmp_path / "file" / "configs", f"configs copy: cannot write {tmp_path / 'file'}")]:
        result = run_cli("configs", "copy", target, check=False)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr.replace("\n", "") and "Traceback" not in result.stderr, result.stderr
        assert (tmp_path / "file").read_text() == "mine"
    for overwrite in ((), ("--overwrite",)):
        result = run_cli("configs", "copy", tmp_path / "file", *overwrite, check=False)
        assert result.returncode == 2 and "is a file, not a folder" in result.stderr, result.stderr


LAUNCH_CONFIGS = ("ddp", "fsdp", "hsdp", "deepspeed-zero2", "deepspeed-zero3", "deepspeed-zero3-offload")


def _launch_args(config: str, *flags: str):
    """What `accelerate launch --config_file train/CONFIG.yaml FLAGS -m laionkit.cli train` resolves to, by
    accelerate's own parser and config loader (its _validate_launch_command), without launching anything."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "train" / f"{config}.yaml"), *flags, "-m", "laionkit.cli", "train"])
    return _validate_launch_command(args)[0]


def test_launch_configs_take_the_process_count_from_the_command_line():
    """No train/ config fixes a process count (ddp.yaml and fsdp.yaml said 8, which fails on a machine of fewer
    GPUs): a 2-process launch gets 2 processes under the config's strategy, and a launch without
    --num_processes is refused by accelerate naming the flag, never run at a count the machine may not have."""
    import pytest

    strategy = {"ddp": "multi_gpu", "fsdp": "use_fsdp", "hsdp": "use_fsdp", "deepspeed-zero2": "use_deepspeed",
                "deepspeed-zero3": "use_deepspeed", "deepspeed-zero3-offload": "use_deepspeed"}
    for config in LAUNCH_CONFIGS:
        # hsdp.yaml is a 2-node recipe: on one machine, its mesh (replicas x shards) is sized on the command line too
        mesh = ("--num_machines", "1", "--parallelism_config_dp_replicate_size", "1",
                "--parallelism_config_dp_shard_size", "2") if config == "hsdp" else ()
        args = _launch_args(config, "--num_processes", "2", *mesh)
        assert args.num_processes == 2 and args.num_machines == 1 and getattr(args, strategy[config]), config
        with pytest.raises(ValueError, match="--num_processes"):
            _launch_args(config)
