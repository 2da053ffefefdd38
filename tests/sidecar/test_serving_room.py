"""The serving room stays typed and its façade stays thin (issue 40).

``kvshard_sidecar.serving`` is the request path: every value on it has a precise type (Protocols,
TypedDicts, dataclasses, ``torch.Tensor``), so no module there names ``typing.Any``. And
:class:`~kvshard_sidecar.serving.service.SidecarService` only composes collaborators with one job
each (model host, catalog state, blend in force, answerer, block warmer): a few public methods, the
rest of its surface read-only properties that say which collaborator holds what. Both are read from
the source (an AST walk), so the check needs no model.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVING = Path(__file__).resolve().parents[2] / "sidecar" / "kvshard_sidecar" / "serving"
MAX_PUBLIC_METHODS = 12


def _any_uses(tree: ast.AST) -> list[str]:
    """Where a module names ``typing.Any``: imported from typing (also aliased), or read as ``typing.Any``
    / ``t.Any`` after ``import typing as t``."""
    typing_names = {"typing"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            typing_names |= {alias.asname or alias.name for alias in node.names if alias.name == "typing"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
            found += [f"line {node.lineno}: from {node.module} import Any" for alias in node.names
                      if alias.name == "Any"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name) \
                and node.value.id in typing_names:
            found.append(f"line {node.lineno}: {node.value.id}.Any")
    return found


@pytest.mark.parametrize("module", sorted(SERVING.glob("*.py")), ids=lambda path: path.name)
def test_no_serving_module_uses_typing_any(module: Path) -> None:
    assert _any_uses(ast.parse(module.read_text(), str(module))) == []


def test_the_check_finds_any_however_it_is_spelled() -> None:
    source = "from typing import Any as A\nimport typing as t\nx: t.Any\ny: typing.Any\n"
    assert len(_any_uses(ast.parse(source))) == 3


def test_the_service_is_a_thin_facade() -> None:
    tree = ast.parse((SERVING / "service.py").read_text())
    service = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SidecarService")
    public = [node.name for node in service.body
              if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_")
              and not any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)]
    assert public and len(public) <= MAX_PUBLIC_METHODS, public
