"""What a clean install and a docker build get: every imported package declared, the image's ignore file
where Docker reads it."""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="the standard library reads TOML from Python 3.11")

REPO = Path(__file__).resolve().parents[1]
# Modules whose distribution is not installed in the test environment, so packages_distributions()
# cannot name it (optional extras); the module name is not the distribution name.
NOT_INSTALLED = {"pynvml": "nvidia-ml-py"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str], set[str]]:
    """(main dependencies, test extra, every extra), as normalised distribution names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda specs: {_normalise(re.match(r"[A-Za-z0-9_.-]+", spec)[0]) for spec in specs}  # noqa: E731
    extras = project["optional-dependencies"]
    return names(project["dependencies"]), names(extras["test"]), set().union(*map(names, extras.values()))


def _imports(folder: str) -> dict[str, tuple[bool, str]]:
    """Top-level package name -> (imported at module level somewhere, first file), third-party only."""
    local = {p.stem for p in (REPO / folder).rglob("*.py")} | {"laionkit"}
    if folder == "scripts":  # bench_learning.py puts tests/ on its path for the learning test's helpers
        local |= {p.stem for p in (REPO / "tests").glob("*.py")}
    found: dict[str, tuple[bool, str]] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local:
                    continue
                eager, where = found.get(top, (False, str(path.relative_to(REPO))))
                found[top] = (eager or id(node) in module_level, where)
    return found


_packages_distributions = functools.cache(importlib.metadata.packages_distributions)  # scans every install


def _distributions(module: str) -> set[str]:
    installed = _packages_distributions().get(module)
    return {_normalise(d) for d in installed or [NOT_INSTALLED.get(module, module)]}


def test_every_package_laionkit_imports_is_declared():
    """Imported at module level: a main dependency (a clean `pip install .` must import it). Imported
    inside a function (an optional feature): a main dependency or an extra."""
    main, _, extras = _declared()
    problems = []
    for module, (eager, where) in sorted(_imports("laionkit").items()):
        allowed = main if eager else main | extras
        if not _distributions(module) & allowed:
            problems.append(f"{module} ({where}) -> {sorted(_distributions(module))}")
    assert not problems, "imported but not declared in pyproject.toml: " + "; ".join(problems)


@pytest.mark.parametrize("folder", ["tests", "scripts"])
def test_every_package_tests_and_scripts_import_is_in_the_test_install(folder):
    """The tests import only what the test install has. A script does at module level (in the test install, every
    script imports and its --smoke runs on a CPU); inside a function, a benchmark row of an optional feature may
    import its extra (bench_lora_base's bitsandbytes ceiling: `ops`), as laionkit's own optional features do."""
    main, test, extras = _declared()
    missing = {m: where for m, (eager, where) in _imports(folder).items()
               if not _distributions(m) & (main | test if folder == "tests" or eager else main | test | extras)}
    assert not missing, f"imported but not in dependencies or the test extra: {missing}"


def _docker_ignores(patterns: list[str], path: str) -> bool:
    """Docker's rule, enough for these patterns: a path is excluded when it or a parent folder matches
    the last pattern that names it (a leading ``!`` re-includes); ``**/`` matches any parent folders."""
    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            prefixes += ["/".join(parts[j:i]) for i in range(1, len(parts) + 1) for j in range(1, i)]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            excluded = not negate
    return excluded


def test_the_dockerfile_has_its_ignore_file_where_docker_reads_it():
    """`docker build -f pipelines/docker/Dockerfile .` reads pipelines/docker/Dockerfile.dockerignore,
    else ./.dockerignore; a .dockerignore beside the Dockerfile is never read."""
    dockerfile = REPO / "pipelines/docker/Dockerfile"
    assert "docker build -f pipelines/docker/Dockerfile" in dockerfile.read_text() and " ." in dockerfile.read_text()
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not ignore_file.is_file():
        ignore_file = REPO / ".dockerignore"
    assert ignore_file.is_file(), "no ignore file Docker would read: .git and .venv would go into the image"
    assert not (dockerfile.parent / ".dockerignore").exists(), "a .dockerignore Docker never reads"
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".git/HEAD", ".venv/bin/python", "laionkit/__pycache__/cli.cpython-312.pyc", "runs/a/x.pt",
                 "laionkit.egg-info/PKG-INFO"):
        assert _docker_ignores(patterns, path), path
    copied = re.findall(r"^COPY (.+) \S+$", dockerfile.read_text(), flags=re.M)
    sources = [src for line in copied for src in line.split() if src != "."]
    for path in [*sources, "laionkit/cli/__init__.py", "laionkit/data"]:  # what the build copies stays in
        assert not _docker_ignores(patterns, path), path
