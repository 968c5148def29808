"""`laionkit configs copy DIR`: the launcher configs (train/*.yaml, train/*.json) and the pipeline files
(pipelines/: Slurm, Kubernetes, torchrun, Docker, recipes) out of the installed package.

A wheel has no repository next to it, so these ship as package data under laionkit/data/configs (links to
the repository's train/ and pipelines/, which the build follows), and this copies them out of the
installed package, never from a checkout's paths.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from laionkit.common import LaionkitError

FOLDERS = ("train", "pipelines")
SKIPPED = ("__pycache__",)


def shipped() -> dict[str, bytes]:
    """Every shipped config file by its path under DIR (``train/ddp.yaml``, ``pipelines/slurm/...``)."""
    root = resources.files("laionkit") / "data" / "configs"
    found: dict[str, bytes] = {}

    def walk(node, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.name in SKIPPED or child.name.startswith("."):
                continue
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            else:
                found[f"{prefix}{child.name}"] = child.read_bytes()

    for folder in FOLDERS:
        node = root / folder
        if not node.is_dir():
            raise LaionkitError(f"this laionkit install ships no {folder}/ configs (laionkit/data/configs/{folder})")
        walk(node, f"{folder}/")
    return found


def copy(output: str | Path, overwrite: bool = False) -> list[str]:
    """Write the shipped configs under ``output``; an existing file is refused unless ``overwrite``, a
    file as ``output`` always, and a place that cannot be written (read-only, full, under a file) is
    one line naming ``output``."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise LaionkitError(f"configs copy: {output} is a file, not a folder; choose a folder")
    files = shipped()
    if not overwrite:
        taken = [name for name in files if (output / name).exists()]
        if taken:
            raise LaionkitError(f"configs copy: {output} already holds {', '.join(taken[:3])}"
                                f"{' ...' if len(taken) > 3 else ''}; choose another folder, or --overwrite")
    try:
        for name, data in files.items():
            _write(output / name, data, executable=name.endswith(".sh"))
    except OSError as error:
        raise LaionkitError(f"configs copy: cannot write {output} ({error.strerror or error}: "
                            f"{error.filename})") from None
    return sorted(files)


def _write(target: Path, data: bytes, executable: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial")
    tmp.write_bytes(data)
    if executable:
        tmp.chmod(0o755)
    tmp.replace(target)
