"""numpy → Arrow helpers the leaf views and the Arrow export share: pyarrow on demand, nulls,
nested fixed-size lists, a fixed-shape tensor array undone."""

from __future__ import annotations

from typing import Any

import numpy as np


def require_pyarrow(feature: str = "MergedStore.to_arrow()") -> Any:
    from .._errors import require

    return require("pyarrow", package="pyarrow", extra="arrow", feature=feature)


def with_nulls(arr: Any, valid: np.ndarray | None) -> Any:
    """``arr`` with nulls where ``valid`` is False."""
    if valid is None or valid.all():
        return arr
    import pyarrow.compute as pc

    pa = require_pyarrow()
    return pc.if_else(pa.array(valid), arr, pa.nulls(len(arr), arr.type))


def nest(flat: Any, shape: tuple[int, ...]) -> Any:
    """``flat`` (every element) as ``shape[0]`` rows of ``fixed_size_list`` one level per later
    dimension; a dimension of size 0 is a ``large_list`` of empty lists (Arrow refuses a
    ``fixed_size_list`` of size 0)."""
    pa = require_pyarrow()
    arr = flat
    for level in range(len(shape) - 1, 0, -1):
        d = int(shape[level])
        if d:
            arr = pa.FixedSizeListArray.from_arrays(arr, d)
        else:
            count = int(np.prod(shape[:level], dtype=np.int64))
            arr = pa.LargeListArray.from_arrays(pa.array(np.zeros(count + 1, np.int64)), arr)
    return arr


def untensor(arr: Any) -> Any:
    """An ``arrow.fixed_shape_tensor`` array as the nested ``fixed_size_list`` of its storage
    (what readers without the extension type, Parquet's among them, see with its shape)."""
    pa = require_pyarrow()
    if not isinstance(arr.type, pa.FixedShapeTensorType):
        return arr
    storage = arr.storage
    k = storage.type.list_size
    flat = storage.values.slice(storage.offset * k, len(storage) * k)
    valid = None if storage.null_count == 0 else storage.is_valid().to_numpy(zero_copy_only=False)
    return with_nulls(nest(flat, (len(storage), *arr.type.shape)), valid)
