"""Checks shared by the tests of examples/: every example uses torchrun_infer.py's fake model and
data, whose predictions are exact, so a merged store can be compared bit for bit."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from _helpers import bits

import spillmerge

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@cache
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchrun_infer", EXAMPLES / "torchrun_infer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_every_prediction(res: spillmerge.MergedStore) -> None:
    """``res`` holds exactly the example's frames, each value bit-identical to the model's."""
    ex = example()
    keys = ex.dataset_keys()
    names = sorted({name for name, _ in keys})
    assert res.filenames == names
    assert res.header["n_frames"] == len(keys)
    for name in names:
        frames = res.frames(name).tolist()
        assert frames == sorted(f for n, f in keys if n == name)
        stored = {leaf: arr.to_torch() for leaf, arr in res[name].items()}
        assert sorted(stored) == ["boxes", "label", "mask", "score"]
        for row, f in enumerate(frames):
            for leaf, t in ex.expected_prediction(name, f).items():
                got = stored[leaf][row]
                assert got.dtype == t.dtype and got.shape == t.shape, (name, f, leaf)
                assert torch.equal(bits(got), bits(t)), (name, f, leaf)
