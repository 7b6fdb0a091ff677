"""Every ``zarr.json`` of a merged output is what zarr's own metadata classes write for it (the
merge normalises each kind of array once per process and reuses that for other shapes)."""

from __future__ import annotations

import json

import numpy as np
import torch


def test_every_array_document_is_zarrs_own_form_across_merges_of_other_shapes(tmp_path):
    from zarr.core.metadata import ArrayV3Metadata

    import spillmerge
    from spillmerge._merge.documents import json_doc

    for n in (3, 700, 41):  # the same kinds of array, other shapes, in one process
        root, out = tmp_path / f"spill{n}", tmp_path / f"out{n}.zarr"
        with spillmerge.SpillWriter(str(root), 0, 1, fsync=False) as w:
            for i in range(n):
                value = {
                    "logits": torch.arange(i % 5 + 1, dtype=torch.float32),
                    "label": f"x{i}",
                    "boxes": np.ones((i % 3, 4), dtype=np.float16),
                    "ok": bool(i % 2),
                    "ids": list(range(i % 4)),
                }
                w.write(f"f{i % 7}", i, value)
        w.merge(str(out), progress=False)
        docs = [p for p in out.rglob("zarr.json") if json.loads(p.read_bytes()).get("node_type") == "array"]
        assert len(docs) > 10
        for path in docs:
            raw = path.read_bytes()
            assert raw == json_doc(ArrayV3Metadata.from_dict(json.loads(raw)).to_dict()), path
        assert spillmerge.open(str(out)).value("f1", 1)["label"] == "x1"
