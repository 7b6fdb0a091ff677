"""Error messages name the real situation and the next step, in plain words (no numpy reprs);
the CLI's --help describes the format the merge writes. Through the public API and the console
script."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import assert_one_line_error
from test_cli import cli_run as run

import spillmerge

_NUMPY_REPR = re.compile(r"\bnp\.[a-z]+\d*\(|array\(\[|dtype\('")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("msgs")
    spill, out = d / "spill", d / "out.zarr"
    with spillmerge.SpillWriter(str(spill)) as w:
        w.write("a.png", 0, {"boxes": torch.ones(4, 4), "meta": {"score": 0.5, "label": "cat"}})
        w.write("a.png", 1, {"boxes": torch.ones(4, 5), "meta": {"score": 0.7, "label": "dog"}})
    spillmerge.merge(str(spill), str(out))
    (d / "plain.txt").write_text("not a store")
    (d / "empty").mkdir()
    return {"spill": spill, "out": out, "missing": d / "nope", "file": d / "plain.txt", "empty": d / "empty"}


def _raised(fn) -> BaseException:
    with pytest.raises(spillmerge.SpillMergeError) as ei:
        fn()
    return ei.value


def _plain(exc: BaseException) -> str:
    msg = str(exc)
    assert not _NUMPY_REPR.search(msg), f"numpy repr in {type(exc).__name__}: {msg}"
    return msg


@pytest.mark.parametrize(
    ("what", "kind", "needles"),
    [
        ("spill", "spill", ["is a spill root, not a merged output", "spillmerge merge", "--out OUT"]),
        ("missing", "missing", ["does not exist"]),
        ("file", "file", ["is a file, not a spillmerge output (a folder)"]),
        ("empty", "other", ["not a spillmerge output", "nor a spill root"]),
    ],
)
def test_opening_what_is_not_an_output_says_what_it_is(outputs, what, kind, needles):
    exc = _raised(lambda: spillmerge.open(str(outputs[what])))
    assert isinstance(exc, spillmerge.NotAnOutputError) and isinstance(exc, ValueError)
    assert exc.kind == kind and exc.path == str(outputs[what])
    msg = _plain(exc)
    for n in needles:
        assert n in msg, msg
    if what == "spill":  # the command to run names this very root
        assert f"spillmerge merge {outputs['spill']} --out OUT" in msg


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize(
    ("what", "needle"), [("missing", "does not exist"), ("file", "is a file, not a spillmerge output")]
)
def test_cli_inspect_and_verify_say_what_the_path_is(outputs, command, what, needle):
    assert_one_line_error(run(command, str(outputs[what])), needle, str(outputs[what]))


def test_a_writer_used_without_with_says_how_to_open_it(tmp_path):
    w = spillmerge.SpillWriter(str(tmp_path / "spill"))
    msg = _plain(_raised(lambda: w.write("a.png", 0, torch.ones(2))))
    assert "call `open()`" in msg and "with SpillWriter(...) as w" in msg, msg
    with w:
        w.write("a.png", 0, torch.ones(2))
    assert isinstance(_raised(lambda: w.write("a.png", 1, torch.ones(2))), spillmerge.WriterClosedError)


def test_a_missing_leaf_names_the_file_the_leaf_and_the_leaves_it_has(outputs):
    value = spillmerge.open(str(outputs["out"]))["a.png"]
    exc = _raised(lambda: value["nope"])
    assert isinstance(exc, spillmerge.UnknownLeafError) and isinstance(exc, KeyError)
    assert (exc.filename, exc.leaf, exc.known) == ("a.png", "nope", ["boxes", "meta"])
    msg = _plain(exc)
    assert msg == "'a.png' has no leaf 'nope'; its leaves: 'boxes', 'meta'", msg
    nested = _raised(lambda: value["meta"]["scroe"])
    assert nested.known == ["meta/label", "meta/score"] and "'meta/scroe'" in _plain(nested)
    # still a dict: `in` and .get work as on any mapping
    assert "nope" not in value and value.get("nope") is None and set(value) == {"boxes", "meta"}
    assert value["meta"]["score"][:].tolist() == [0.5, 0.7]


def test_ragged_rows_that_do_not_stack_print_plain_shapes(outputs):
    boxes = spillmerge.open(str(outputs["out"]))["a.png"]["boxes"]
    exc = _raised(lambda: boxes[:])
    assert isinstance(exc, spillmerge.RaggedShapeError)
    assert "have shapes (4, 4) and (4, 5)" in _plain(exc)
    assert [a.shape for a in boxes.to_list()] == [(4, 4), (4, 5)]


def test_no_message_of_these_paths_holds_a_numpy_repr(outputs, tmp_path):
    res = spillmerge.open(str(outputs["out"]))
    w = spillmerge.SpillWriter(str(tmp_path / "s"))
    cases = [
        lambda: res["b.png"],
        lambda: res.column("nope"),
        lambda: res["a.png"]["boxes"][np.int64(0) : np.int64(2)],
        lambda: res["a.png"]["nope"],
        lambda: w.write("a.png", np.int64(0), torch.ones(1)),
        lambda: spillmerge.open(str(outputs["spill"])),
    ]
    for case in cases:
        _plain(_raised(case))


# Terms of format 2 (README / docs/FORMAT.md) and the format-1 words they replaced.
_FORMAT2_TERMS = ("leaf column", "(filename, frame) row")
_FORMAT1_WORDS = ("one array per filename", "one array per file ")


def test_every_help_describes_format_2():
    docs = (Path(__file__).parents[2] / "README.md").read_text() + (
        Path(__file__).parents[2] / "docs" / "FORMAT.md"
    ).read_text()
    assert "one array per leaf column across every" in docs  # the docs' wording the help follows
    for cmd in ([], ["merge"], ["inspect"], ["verify"], ["demo"]):
        p = run(*cmd, "--help")
        assert p.returncode == 0, (cmd, p.stderr)
        text = " ".join(p.stdout.split())  # argparse wraps lines
        for word in _FORMAT1_WORDS:
            assert word not in text, (cmd, word)
        if cmd == ["merge"]:
            for term in _FORMAT2_TERMS:
                assert term in text, (cmd, term)


@pytest.mark.parametrize(("what", "needle"), [("spill", "is a spill root"), ("file", "is a file")])
def test_cli_merge_out_says_what_is_there(outputs, tmp_path, what, needle):
    out = outputs["file"]
    if what == "spill":  # another job's spill root given as --out
        out = tmp_path / "other-spill"
        with spillmerge.SpillWriter(str(out)) as w:
            w.write("x.png", 0, torch.ones(1))
    p = run("merge", str(outputs["spill"]), "--out", str(out))
    assert_one_line_error(p, needle, "not a spillmerge output", "(--out)")
