"""The package's module graph: every module imports on its own, and no import circle exists —
counting imports inside functions too (an import moved into a function hides a circle, it does
not remove it)."""

from __future__ import annotations

import ast
import functools
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


def _typing_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports only annotations use)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


@functools.cache  # read-only for the tests; each parse of the package costs ~0.5 s
def _graph(*, at_runtime: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative imports, at any depth of the file);
    ``at_runtime``: without the imports under ``if TYPE_CHECKING:``."""
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        tree = ast.parse(f.read_text(encoding="utf-8"))
        skip = _typing_only(tree) if at_runtime else set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                named = {f"{target}.{a.name}" for a in node.names} & mods.keys()
                if named:  # from . import _format, from .._util import poll: the modules
                    deps.update(named)
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
    assert len(edges) > 20 and "spillmerge._merge.job" in edges["spillmerge._dist.round"]  # the graph is real
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
    assert "spillmerge._dist.round" in edges["spillmerge._write.lifecycle"]  # SpillWriter.merge
    assert "spillmerge._merge.job" not in edges["spillmerge._write.writer"] | edges["spillmerge._write.lifecycle"]
    assert {"spillmerge._merge.job", "spillmerge._dist.transfer", "spillmerge._dist.store"} <= edges["spillmerge._dist.round"]
    assert "spillmerge._dist.store" in edges["spillmerge._dist.transfer"]
    assert not {"spillmerge._merge.job", "spillmerge._dist.round", "spillmerge._write.writer"} & edges["spillmerge._dist.transfer"]
    assert edges["spillmerge._dist.store"] <= {"spillmerge._errors", "spillmerge._util.poll"}


# Stages of the pipeline: the folders the package's modules will move into (a module not named
# here is in "api", which may import anything). A module's stage is its first name below
# ``spillmerge``, so ``_storage._local`` is in "storage".
# The stages are the package's folders (spillmerge/_write/ is "write"); the top-level modules are the
# public surface ("api"), except _errors, which every stage may import.
STAGE_FOLDERS = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file() and p.name.startswith("_")}


# Stage -> the other stages its modules may import at run time (every stage may import "errors").
# Data flows one way: the writer reaches the merge only through dist's collective round, and
# neither the writer nor the reader imports anything of the merge.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "util": {"format", "storage"},
    "format": set(),
    "storage": {"format"},
    "write": {"util", "format", "storage", "spill", "dist"},
    "spill": {"util", "format", "storage"},
    "merge": {"util", "format", "storage", "spill"},
    "dist": {"util", "format", "storage", "write", "spill", "merge", "read"},
    "read": {"util", "format", "storage"},
    "inspect": {"util", "format", "storage", "spill", "merge", "read"},
}


def _stage(module: str) -> str:
    parts = module.split(".")
    if parts[1:] == ["_errors"]:
        return "errors"
    return parts[1].lstrip("_") if len(parts) > 1 and parts[1] in STAGE_FOLDERS else "api"


def _stage_crossings(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a stage into one it may not import (``MAY_IMPORT``)."""
    out = []
    for mod, deps in edges.items():
        here = _stage(mod)
        if here == "api":
            continue
        allowed = MAY_IMPORT[here] | {here, "errors"}
        out += [f"{mod} ({here}) -> {dep} ({_stage(dep)})" for dep in sorted(deps) if _stage(dep) not in allowed]
    return sorted(out)


def test_every_module_has_a_stage_and_imports_only_the_stages_below_it():
    mods = _modules()
    unstaged = {m for m in mods if _stage(m) == "api"}
    assert unstaged == {
        "spillmerge", "spillmerge.cli", "spillmerge._demo", "spillmerge.integrations",
        "spillmerge.integrations._prediction_writer", "spillmerge.integrations.lightning",
        "spillmerge.integrations.pytorch_lightning",
    }  # fmt: skip
    assert {_stage(m) for m in mods} == set(MAY_IMPORT) | {"api"}  # every folder is a stage
    assert _stage_crossings(_graph(at_runtime=True)) == []


def test_the_stage_check_finds_a_crossing_and_ignores_annotation_imports():
    edges = {"spillmerge._write.writer": {"spillmerge._merge.job"}, "spillmerge._read.store": {"spillmerge._format.common"}}
    assert _stage_crossings(edges) == ["spillmerge._write.writer (write) -> spillmerge._merge.job (merge)"]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._report import MergeReport\nimport os\n"
    tree = ast.parse(src)
    skipped = [n for n in ast.walk(tree) if id(n) in _typing_only(tree) and isinstance(n, ast.ImportFrom)]
    assert [n.module for n in skipped] == ["_report"]
    assert "spillmerge._merge.report" in _graph()["spillmerge._write.lifecycle"]  # counted for circles, not for stages
    assert "spillmerge._merge.report" not in _graph(at_runtime=True)["spillmerge._write.lifecycle"]


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in edges[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_merge_path_does_not_import_the_inspection_tools():
    """The inspection tools read the merge's report and frame arithmetic, not the reverse: a
    merge (and the writer that calls it) never loads the coverage, inspect or reader modules."""
    edges = _graph()
    tools = {m for m in edges if m.startswith(("spillmerge._inspect.", "spillmerge._read."))}
    assert {"spillmerge._inspect.coverage", "spillmerge._read.store", "spillmerge._read.views"} <= tools
    for start in ("spillmerge._merge.job", "spillmerge._merge.report", "spillmerge._write.writer"):
        assert start in edges and _reach(edges, start) & tools == set(), start
    assert "spillmerge._util.frames" in _reach(edges, "spillmerge._inspect.coverage")  # the tools use the shared low module


# Private names that still cross a module boundary, as (module, "expression"). Empty: a crossing
# found below fails the test until the owning module gives the name a public one.
CROSSINGS_ALLOWED: set[tuple[str, str]] = set()


def _defined_in(tree: ast.Module) -> set[str]:
    """Names a module defines itself: functions, classes, assigned names and attributes (``x._n = ...``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def _private_crossings(source: str, package_modules: set[str]) -> list[str]:
    """Where a module reaches a private name of another one: ``from .m import _x`` (``_x`` not a
    module), ``M._x`` on a spillmerge module ``M``, or ``obj._x`` where this module defines no
    ``_x`` itself (so it belongs to another module's object). ``self._x`` / ``cls._x`` and
    dunders are its own; private names of other packages (torch ...) are not checked here."""
    tree = ast.parse(source)
    own = _defined_in(tree)
    ours: set[str] = set()  # local names bound to spillmerge modules
    foreign: set[str] = set()  # local names bound to other packages' modules or objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                local = a.asname or a.name
                if node.level and (node.module is None or a.name in package_modules):
                    ours.add(local)
                elif node.level and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"from {'.' * node.level}{node.module} import {a.name}")
                elif not node.level:
                    foreign.add(local)
        elif isinstance(node, ast.Import):
            for a in node.names:
                (ours if a.name.startswith("spillmerge") else foreign).add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else None
        root = base
        while isinstance(root, ast.Attribute):  # ``torch._C._x``: the chain starts at a foreign module
            root = root.value
        if isinstance(root, ast.Name) and root.id in foreign and root.id not in ours:
            continue
        if name in ("self", "cls"):
            continue
        if name in ours or node.attr not in own:
            found.append(ast.unparse(node))
    return found


def test_the_private_name_finder_finds_crossings():
    mods = {"_format", "_storage"}
    src = (
        "from . import _format as F\nfrom ._storage import Storage, _why\nfrom torch import distributed\n"
        "class A:\n    def f(self, s):\n        self._mine = 1\n        distributed._store()\n"
        "        distributed._C._raw(0)\n"
        "        return F._private, s._errors(), self._mine, s._mine, F.__name__\n"
    )
    assert sorted(_private_crossings(src, mods)) == ["F._private", "from ._storage import _why", "s._errors"]


def test_no_private_name_crosses_a_module_boundary():
    """Modules talk through public names; only a module's own objects use its ``_names``."""
    mods = _modules()
    package_modules = {name.rsplit(".", 1)[-1] for name in mods}
    found = {
        (name, hit)
        for name, f in mods.items()
        for hit in _private_crossings(f.read_text(encoding="utf-8"), package_modules)
    }
    assert found - CROSSINGS_ALLOWED == set()
    assert CROSSINGS_ALLOWED - found == set()  # an entry no longer needed is removed


def test_every_name_in_all_resolves_and_star_import_works():
    """``from spillmerge import *`` raised once (MergeFailedError and MergeTimeout were listed in
    ``__all__`` but never imported); every public name is importable, the errors derive from
    SpillMergeError, and LeafView is the one leaf view exported."""
    namespace: dict[str, object] = {}
    exec("from spillmerge import *", namespace)  # noqa: S102 - the statement users write
    missing = [name for name in spillmerge.__all__ if name not in namespace]
    assert missing == [] and len(set(spillmerge.__all__)) == len(spillmerge.__all__)
    assert issubclass(spillmerge.MergeFailedError, spillmerge.RankFailedError)
    assert issubclass(spillmerge.MergeTimeout, (spillmerge.SpillMergeError, TimeoutError))
    assert "LeafView" in spillmerge.__all__ and "LeafArray" not in spillmerge.__all__
    errors = importlib.import_module("spillmerge._errors")
    public_errors = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    assert public_errors <= set(spillmerge.__all__)  # every error class a user may catch is exported
