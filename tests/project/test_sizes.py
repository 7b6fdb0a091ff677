"""The house stays readable: the README a newcomer reads in minutes, each doc in one sitting, no
module longer than one can hold in mind, a package of at most 15,000 lines of code."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import spillmerge

REPO = Path(spillmerge.__file__).parent.parent


def test_the_readme_and_each_doc_stay_short() -> None:
    docs = sorted((REPO / "docs").glob("*.md"))
    sizes = {p.name: len(p.read_text(encoding="utf-8")) for p in docs}
    assert len((REPO / "README.md").read_text(encoding="utf-8")) <= 10_000
    assert {name: n for name, n in sizes.items() if n > 25_000} == {}
    assert sum(sizes.values()) <= 100_000


def test_no_module_is_longer_than_600_lines() -> None:
    lengths = {
        str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines())
        for p in REPO.glob("spillmerge/**/*.py")
    }
    assert {p: n for p, n in lengths.items() if n > 600} == {}


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a string statement (a
    docstring of a module, class or function, or of an attribute)."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def test_code_lines_are_counted_without_docs_comments_or_blank_lines() -> None:
    source = '''"""Module doc."""

X = 1  # a comment
"""X's doc."""


def f(a,
      b):
    """f's doc,
    two lines."""
    # only a comment
    return "not a docstring"
'''
    assert code_lines(source) == 4  # X = 1; def f(a, / b):; return


def test_the_package_holds_at_most_15000_lines_of_code() -> None:
    total = sum(code_lines(p.read_text(encoding="utf-8")) for p in REPO.glob("spillmerge/**/*.py"))
    assert total <= 15_000, total
