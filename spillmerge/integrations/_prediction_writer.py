"""The framework-independent part of the Lightning prediction writers."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import SpillValueError
from .._report import MergeReport
from .._storage import Storage
from .._writer import SpillWriter

REPORT_NAME = "spillmerge-report.json"
"""In the spill root: the merging rank's :class:`MergeReport`, for a launching process that ran
no hook itself (``ddp_spawn``)."""

KeyFn = Callable[[Any, int, int, Any], Iterable[tuple[str, int, Any]]]
"""``key_fn(batch, batch_idx, dataloader_idx, prediction) -> iterable of (filename, frame_idx, value)``."""


def batch_keys(filename_key: str = "filename", frame_key: str = "frame_idx") -> KeyFn:
    """The default mapping: ``batch[filename_key]`` and ``batch[frame_key]`` hold one filename and
    one frame index per sample, and row ``j`` of the prediction (a tensor, array, list, or a
    dict / TensorDict / dataclass of those, batch dimension first) is the value of sample ``j``."""

    def key_fn(batch: Any, batch_idx: int, dataloader_idx: int, prediction: Any) -> Iterator[tuple[str, int, Any]]:
        if not isinstance(batch, Mapping) or filename_key not in batch or frame_key not in batch:
            raise SpillValueError(
                f"SpillPredictionWriter: batch {batch_idx} is not a dict with keys {filename_key!r} and "
                f"{frame_key!r} (got {type(batch).__name__}); return them from your Dataset, or pass "
                "key_fn=lambda batch, batch_idx, dataloader_idx, prediction: [(filename, frame_idx, value), ...]"
            )
        names, frames = batch[filename_key], batch[frame_key]
        if isinstance(frames, torch.Tensor):
            frames = frames.tolist()
        if len(names) != len(frames):
            raise SpillValueError(
                f"SpillPredictionWriter: batch {batch_idx} has {len(names)} filenames but {len(frames)} frame indices"
            )
        for j, (name, frame) in enumerate(zip(names, frames, strict=True)):
            yield name, frame, _row(prediction, j, len(names), batch_idx)

    return key_fn


def _row(pred: Any, j: int, n: int, batch_idx: int) -> Any:
    """Sample ``j`` of a batched prediction."""
    if isinstance(pred, (torch.Tensor, np.ndarray, Sequence)) and not isinstance(pred, (str, bytes)):
        if getattr(pred, "ndim", 1) == 0 or len(pred) != n:
            raise SpillValueError(
                f"SpillPredictionWriter: the prediction of batch {batch_idx} has "
                f"{len(pred) if getattr(pred, 'ndim', 1) else 0} rows for {n} "
                "samples; return one row per sample, or pass key_fn=... to split it yourself"
            )
        return pred[j]
    if isinstance(pred, Mapping):  # dict or TensorDict (nested ones included)
        return {k: _row(v, j, n, batch_idx) for k, v in pred.items()}
    if dataclasses.is_dataclass(pred) and not isinstance(pred, type):
        return {f.name: _row(getattr(pred, f.name), j, n, batch_idx) for f in dataclasses.fields(pred)}
    raise SpillValueError(
        f"SpillPredictionWriter: cannot split a {type(pred).__name__} prediction of batch {batch_idx} into "
        "samples; pass key_fn=... returning (filename, frame_idx, value) per sample"
    )


class SpillPredictionWriterMixin:
    """Everything but the Lightning base class (see ``spillmerge.integrations.lightning``).

    Who calls what, on every rank: ``on_predict_start`` opens a :class:`~spillmerge.SpillWriter`
    for (``trainer.global_rank``, ``trainer.world_size``); ``on_predict_batch_end`` writes each
    sample of the batch; ``on_predict_epoch_end`` commits, then calls the barrier-free
    ``SpillWriter.merge`` (the merging rank waits on storage for every commit record and merges;
    the others return once every rank has committed); ``on_exception`` records the failure so the merge names the rank.
    """

    def __init__(
        self,
        root: str,
        out: str | None = None,
        *,
        key_fn: KeyFn | None = None,
        filename_key: str = "filename",
        frame_key: str = "frame_idx",
        storage_options: dict[str, Any] | None = None,
        writer_options: dict[str, Any] | None = None,
        merge_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__("batch")  # type: ignore[call-arg]
        self.root = root
        self.out = out
        self.key_fn: KeyFn = key_fn or batch_keys(filename_key, frame_key)
        self._default_keys = None if key_fn is not None else (filename_key, frame_key)
        self.storage_options = storage_options
        self.writer_options = dict(writer_options or {})
        self.merge_options = dict(merge_options or {})
        self.writer: SpillWriter | None = None
        self._report: MergeReport | None = None
        self._created = time.time()  # a report file older than this callback is an earlier run's

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callback into every rank: the default key_fn is a closure, which
        # does not pickle; it is rebuilt from its key names on the other side.
        state = dict(self.__dict__)
        if self._default_keys is not None:
            state["key_fn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._default_keys is not None:
            self.key_fn = batch_keys(*self._default_keys)

    @property
    def report(self) -> MergeReport | None:
        """The :class:`~spillmerge.MergeReport` after ``predict`` on the merging rank (global rank
        0 by default), and in the process that launched the ranks when it ran no prediction itself
        (``ddp_spawn``): there it is read from ``ROOT/spillmerge-report.json``, which the merging
        rank writes. None on the other ranks, and before a merge of this callback's run."""
        if self._report is None and self.writer is None and self.out is not None:
            self._report = self._report_from_root()
        return self._report

    @report.setter
    def report(self, value: MergeReport | None) -> None:
        self._report = value

    def _report_from_root(self) -> MergeReport | None:
        raw = Storage(self.root, self.storage_options).get_or_none(REPORT_NAME)
        if raw is None:
            return None
        try:
            obj = json.loads(raw)
            if float(obj["written"]) < self._created:
                return None
            return MergeReport.from_json(json.dumps(obj["report"]))
        except (ValueError, KeyError, TypeError):  # a torn or foreign file: no report, not a crash
            return None

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self.report = None
        self.writer = SpillWriter(
            self.root, trainer.global_rank, trainer.world_size, self.storage_options, **self.writer_options
        )
        self.writer.open()

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if self.writer is None:
            raise SpillValueError("SpillPredictionWriter only works with Trainer.predict")
        for filename, frame_idx, value in self.key_fn(batch, batch_idx, dataloader_idx, prediction):
            self.writer.write(filename, frame_idx, value)

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        w = self.writer
        if w is None:
            return
        w.close()  # the commit record: this rank is done
        if self.out is not None:
            self.report = w.merge(self.out, **self.merge_options)
            if self.report is not None:  # for a launching process that ran no hook (ddp_spawn)
                doc = {"written": time.time(), "report": json.loads(self.report.to_json())}
                w.storage.put_atomic(REPORT_NAME, json.dumps(doc).encode())

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        w = self.writer
        if w is not None and w.state == "open":
            w.abort(exception)  # failed.json: the merging rank fails at once, naming this rank
