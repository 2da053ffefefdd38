"""No module of kvshard reads or writes the environment except the settings helper.

Every variable kvshard reads is a documented field of a settings dataclass — a component's
``KVSHARD_<COMPONENT>_*`` settings or :class:`kvshard.settings.Environment` — read through
:mod:`kvshard.settings`, so the list of variables is in one place. This scans every module of the seven
packages (an AST walk, imports inside functions included) for ``os.environ[...]`` reads, writes and
deletions, ``os.environ.get(...)`` and its relatives, ``os.getenv``/``os.putenv`` and ``from os import
environ``. Handing a copy of the environment to a child process is not a read and stays allowed:
``{**os.environ, ...}``, ``dict(os.environ, ...)``, ``os.environ.copy()``, also as one branch of a
conditional (``dict(os.environ if env is None else env)``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kvshard": REPO / "kvshard",
    "kvshard_operator": REPO / "operator" / "kvshard_operator",
    "kvshard_sidecar": REPO / "sidecar" / "kvshard_sidecar",
    "kvshard_router": REPO / "router" / "kvshard_router",
    "kvshard_local": REPO / "local" / "kvshard_local",
    "kvshard_training": REPO / "training" / "kvshard_training",
    "kvshard_bench": REPO / "bench" / "kvshard_bench",
}
HELPER = "kvshard/settings.py"
"""The one module that reads the environment."""

_FUNCTIONS = {"getenv", "getenvb", "putenv", "unsetenv"}
_MAPPINGS = {"environ", "environb"}


def _copy(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether this ``os.environ`` is only copied: ``**os.environ`` in a dict display, the first argument
    of ``dict(...)``, ``os.environ.copy()`` — possibly as a branch of ``a if c else b``."""
    parent = parents.get(node)
    while isinstance(parent, ast.IfExp) and node is not parent.test:
        node, parent = parent, parents.get(parent)
    if isinstance(parent, ast.Dict):
        return any(key is None and value is node for key, value in zip(parent.keys, parent.values, strict=True))
    if isinstance(parent, ast.Call):
        return (isinstance(parent.func, ast.Name) and parent.func.id == "dict" and bool(parent.args)
                and parent.args[0] is node)
    if isinstance(parent, ast.Attribute) and parent.attr == "copy":
        return isinstance(parents.get(parent), ast.Call)
    return False


def _describe(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    parent = parents.get(node)
    if isinstance(parent, ast.Subscript):
        return {ast.Load: "read", ast.Store: "write", ast.Del: "deletion"}[type(parent.ctx)] + " os.environ[...]"
    if isinstance(parent, ast.Attribute):
        return f"os.environ.{parent.attr}(...)"
    if isinstance(parent, ast.Compare):
        return "a test on os.environ (in / not in)"
    return "os.environ used other than as a copy"


def environment_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every environment read or write in ``source``; copies for children are not listed."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    os_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name == "os"}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and node.level == 0:
            found += [(node.lineno, f"from os import {alias.name}") for alias in node.names
                      if alias.name in _FUNCTIONS | _MAPPINGS]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in os_names:
            if node.attr in _FUNCTIONS:
                found.append((node.lineno, f"os.{node.attr}(...)"))
            elif node.attr in _MAPPINGS and not _copy(node, parents):
                found.append((node.lineno, _describe(node, parents)))
    return sorted(found)


def _modules() -> list[Path]:
    files = [path for folder in PACKAGES.values() for path in folder.rglob("*.py")]
    assert len(files) > 100, f"only {len(files)} modules found: the package folders moved?"
    return sorted(files)


@functools.cache
def _uses_by_file() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in _modules():
        uses = environment_uses(path.read_text(encoding="utf-8"))
        if uses:
            out[path.relative_to(REPO).as_posix()] = uses
    return out


def test_only_the_settings_helper_reads_the_environment() -> None:
    offending = {file: uses for file, uses in _uses_by_file().items() if file != HELPER}
    assert not offending, "read the environment through kvshard.settings (a settings dataclass field) instead:\n" + \
        "\n".join(f"  {file}:{line}: {what}" for file, uses in offending.items() for line, what in uses)


def test_the_scan_sees_the_settings_helper_read_the_environment() -> None:
    assert HELPER in _uses_by_file(), "the scan no longer sees the one module that reads the environment"


@pytest.mark.parametrize(("source", "expected"), [
    ("import os\nx = os.environ.get('A')", [(2, "os.environ.get(...)")]),
    ("import os\nx = os.environ['A']", [(2, "read os.environ[...]")]),
    ("import os\nos.environ['A'] = '1'", [(2, "write os.environ[...]")]),
    ("import os\ndel os.environ['A']", [(2, "deletion os.environ[...]")]),
    ("import os\nos.environ.setdefault('A', '1')", [(2, "os.environ.setdefault(...)")]),
    ("import os\nx = 'A' in os.environ", [(2, "a test on os.environ (in / not in)")]),
    ("import os\nx = os.getenv('A')", [(2, "os.getenv(...)")]),
    ("import os as o\nx = o.environ.get('A')", [(2, "os.environ.get(...)")]),
    ("from os import environ", [(1, "from os import environ")]),
    ("def f():\n    import os\n    return os.environ['A']", [(3, "read os.environ[...]")]),
    ("import os\nenv = os.environ", [(2, "os.environ used other than as a copy")]),
    ("import os\nx = {**os.environ, 'A': '1'}", []),
    ("import os\nx = dict(os.environ, A='1')", []),
    ("import os\nx = os.environ.copy()", []),
    ("import os\nx = dict(os.environ if e is None else e)", []),
    ("import os\nx = {**(os.environ if e is None else e), 'A': '1'}", []),
    ("import os\nx = dict(os.environ, A=os.environ.get('A', ''))", [(2, "os.environ.get(...)")]),
])
def test_the_scan_tells_reads_from_copies(source: str, expected: list[tuple[int, str]]) -> None:
    assert environment_uses(source) == expected


def test_process_wide_variables_come_through_the_helper(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvshard import crd, paths
    from kvshard.settings import Environment, environment
    from kvshard_operator import embedding

    assert environment({}) == Environment()
    read = environment({"KVSHARD_CACHE_DIR": "", "XDG_CACHE_HOME": "/xdg", "JOB_COMPLETION_INDEX": "3"})
    assert (read.kvshard_cache_dir, read.xdg_cache_home, read.job_completion_index) == (None, Path("/xdg"), 3)

    monkeypatch.delenv("KVSHARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "kvshard"
    monkeypatch.setenv("KVSHARD_CACHE_DIR", str(tmp_path / "explicit"))
    assert paths.cache_dir() == tmp_path / "explicit"

    copied = tmp_path / "crd.yaml"
    copied.write_text("kind: CustomResourceDefinition\n")
    monkeypatch.setenv("KVSHARD_CRD_PATH", str(copied))
    assert crd.crd_path() == copied
    monkeypatch.setenv("KVSHARD_EMBEDDING_MODEL_DIR", str(tmp_path / "minilm"))
    assert embedding.model_dir() == tmp_path / "minilm"


def test_the_embedding_worker_takes_its_index_from_the_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvshard_operator import embed_worker

    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    with pytest.raises(SystemExit) as exited:
        embed_worker.main(["--root", str(tmp_path), "--plan", "p"])
    assert exited.value.code == 2  # argparse's usage error, naming the variable, not a KeyError
