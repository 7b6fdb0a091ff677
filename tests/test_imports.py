"""The package's module graph: every module imports on its own, and no import circle exists —
counting imports inside functions too (an import moved into a function hides a circle, it does
not remove it)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import spillmerge

PKG = Path(spillmerge.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative imports, at any depth of the file)."""
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import _format
                    deps.update(f"{target}.{a.name}" for a in node.names)
                else:
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("spillmerge"))
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_spillmerge_modules():
    edges = _graph()
    assert len(edges) > 20 and "spillmerge._merge" in edges["spillmerge._round"]  # the graph is real
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_on_its_own():
    for name in _modules():
        importlib.import_module(name)


def test_architecture_module_table_names_every_module_once():
    doc = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Modules") : doc.index("## Framework integrations")]
    named = [re.sub(r"^spillmerge/", "", n) for n in re.findall(r"^\| `([^`]+)`", table, re.M)]
    files = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))
    assert sorted(named) == files


def test_the_merge_round_sits_between_the_writer_and_the_merge():
    """ARCHITECTURE's "writer → storage → merger": the writer reaches the merge and the shard
    transfer only through the round (``_round``), and the run-store signalling sits below both."""
    edges = _graph()
    assert "spillmerge._round" in edges["spillmerge._writer"]
    assert "spillmerge._merge" not in edges["spillmerge._writer"]
    assert {"spillmerge._merge", "spillmerge._transfer", "spillmerge._runstore"} <= edges["spillmerge._round"]
    assert "spillmerge._runstore" in edges["spillmerge._transfer"]
    assert not {"spillmerge._merge", "spillmerge._round", "spillmerge._writer"} & edges["spillmerge._transfer"]
    assert edges["spillmerge._runstore"] <= {"spillmerge._errors", "spillmerge._poll"}
