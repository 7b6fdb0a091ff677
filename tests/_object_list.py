"""torch's own object-collective test list, read from the INSTALLED torch (never copied here):
``create_collectives_object_test_list`` and what it uses (``Foo``, ``f``) are extracted with
``ast`` from ``torch/testing/_internal/distributed/distributed_test.py`` and run in this module,
so the list is what that torch's tests send through ``gather_object`` / ``all_gather_object``.
Importing that module itself would set up its whole test machinery; its source is only parsed.
``Foo`` lives in this module afterwards, so spawned ranks unpickle it by importing this module."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

_WANTED_DEFS = {"Foo", "create_collectives_object_test_list"}
_WANTED_NAMES = {"f"}


def _source() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "testing" / "_internal" / "distributed" / "distributed_test.py"


def _load() -> dict[str, Any]:
    tree = ast.parse(_source().read_text(encoding="utf-8"))
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in _WANTED_DEFS:
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in _WANTED_NAMES for t in node.targets
        ):
            keep.append(node)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Attribute)
            and isinstance(node.targets[0].value, ast.Name)
            and node.targets[0].value.id in _WANTED_NAMES
        ):
            keep.append(node)  # f.bar = 1
    found = {n.name for n in keep if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert found == _WANTED_DEFS, f"{_source()} no longer defines {sorted(_WANTED_DEFS - found)}"
    import torch

    namespace: dict[str, Any] = {"torch": torch, "__name__": __name__}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(_source()), "exec"), namespace)  # noqa: S102
    return namespace


_ns = _load()
Foo = _ns["Foo"]
f = _ns["f"]
create_collectives_object_test_list = _ns["create_collectives_object_test_list"]
