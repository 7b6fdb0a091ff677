"""The docs name only what exists: every test a guarantee cites, every module, link and path, every
error class with its built-in base and its data, every CLI command and flag the README lists."""

from __future__ import annotations

import argparse
import builtins
import importlib
import re
from pathlib import Path

import spillmerge
from spillmerge import _errors, cli

REPO = Path(spillmerge.__file__).parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_every_test_a_doc_cites_exists() -> None:
    tests = {p.name: _text(p) for p in (REPO / "tests").rglob("test_*.py")}
    wrong = []
    for doc in DOCS:
        for file, name in re.findall(r"(test_\w+\.py)(?:::(test_\w+))?", _text(doc)):
            if file not in tests or (name and not re.search(rf"def {name}\(", tests[file])):
                wrong.append(f"{doc.name}: {file}::{name}")
    assert wrong == []


def test_every_module_link_and_path_a_doc_names_exists() -> None:
    wrong = []
    for doc in DOCS:
        text = _text(doc)
        for mod, attr in re.findall(r"`(_[a-z]+/[a-z_]+)(?:\.([A-Za-z_]\w*))?`", text):
            if attr == "py":  # `_merge/job.py`
                attr = ""
            module = f"spillmerge.{mod.replace('/', '.')}"
            try:
                if attr and not hasattr(importlib.import_module(module), attr):
                    wrong.append(f"{doc.name}: {mod}.{attr}")
            except ModuleNotFoundError:
                wrong.append(f"{doc.name}: {mod}")
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in link and not (doc.parent / link).exists():
                wrong.append(f"{doc.name}: link {link}")
        for path in re.findall(r"`((?:benchmarks|examples|configs|tests)/[\w./*-]+)`", text):
            if not list(REPO.glob(path.rstrip("/"))):
                wrong.append(f"{doc.name}: {path}")
    assert wrong == []


def _attrs(cls: type) -> set[str]:
    return {a for k in cls.__mro__ for a in getattr(k, "__annotations__", {})}


def test_the_errors_table_names_every_error_its_base_and_its_data() -> None:
    """A row ``A / B (Builtin)`` names B's built-in base; its data cell holds one list for all, or
    one per class separated by `` / ``."""
    table = _text(REPO / "docs" / "GUARANTEES.md").split("## Errors", 1)[1]
    named, wrong = set(), []
    for row in re.findall(r"^\| `(.*)$", table, flags=re.M):
        names_cell, _, data_cell = [c.strip() for c in ("`" + row).strip("|").split("|")][:3]
        names = re.findall(r"`(\w+)`", names_cell.split("(")[0])
        classes = [getattr(spillmerge, n) for n in names]
        named |= set(names)
        for base in re.findall(r"\(`(\w+)`", names_cell):
            if not issubclass(classes[-1], getattr(builtins, base, None) or getattr(spillmerge, base)):
                wrong.append(f"{names[-1]} is no {base}")
        parts = data_cell.split(" / ")
        for i, cls in enumerate(classes):
            data = re.findall(r"`\.(\w+)`", parts[i] if len(parts) == len(classes) else data_cell)
            wrong += [f"{cls.__name__} has no .{a}" for a in data if a not in _attrs(cls)]
    assert wrong == []
    assert named == set(_errors.__all__) - {"SpillMergeError"}


def test_the_readme_command_line_names_real_commands_and_flags() -> None:
    block = _text(REPO / "README.md").split("## Command line", 1)[1].split("```")[1]
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    wrong, listed = [], set()
    for line in block.strip().splitlines():
        command = line.split()[1]
        listed.add(command)
        flags = {s for a in sub.choices[command]._actions for s in a.option_strings}
        wrong += [f"{command} {f}" for f in re.findall(r"--[\w-]+", line.split("#")[0]) if f not in flags]
    assert wrong == []
    assert listed == set(sub.choices)
