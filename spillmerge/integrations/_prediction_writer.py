"""The framework-independent part of the Lightning prediction writers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .._errors import ConfigError, SpillValueError, require
from .._format.common import RECORD_MAX_BYTES
from .._format.output import json_or_none
from .._merge.report import MergeReport
from .._storage import Storage
from .._write import batch as _batch
from .._write.writer import SpillWriter

REPORT_NAME = "spillmerge-report.json"
"""In the spill root: the merging rank's :class:`MergeReport`, for a launching process that ran
no hook itself (``ddp_spawn``); not written where ``remove_spill`` took the root away."""

KeyFn = Callable[[Any, int, int, Any], Iterable[tuple[str, int, Any]]]
"""``key_fn(batch, batch_idx, dataloader_idx, prediction) -> iterable of (filename, frame_idx, value)``."""


def base_class(module: str, package: str, feature: str) -> Any:
    """``module``'s ``BasePredictionWriter``; :class:`~spillmerge.MissingDependencyError` naming
    ``feature`` and the install hint when ``package`` is not installed."""
    return require(module, package=package, extra="lightning", feature=feature).BasePredictionWriter


def batch_names(batch: Any, batch_idx: int, filename_key: str, frame_key: str) -> tuple[Any, Any]:
    """The filenames (``batch[filename_key]``) and frame indices (``batch[frame_key]``, or None
    when the batch has none: an image needs no frame index, each sample is frame 0) of a batch."""
    if not isinstance(batch, Mapping):
        raise SpillValueError(
            f"SpillPredictionWriter: batch {batch_idx} is a {type(batch).__name__}, not a dict with a "
            f"{filename_key!r} entry (and optionally {frame_key!r}); return them from your Dataset, or pass "
            "key_fn=lambda batch, batch_idx, dataloader_idx, prediction: [(filename, frame_idx, value), ...]"
        )
    if filename_key not in batch:
        keys = ", ".join(repr(k) for k in list(batch)[:8])
        raise SpillValueError(
            f"SpillPredictionWriter: batch {batch_idx} has no {filename_key!r} entry (its keys: {keys}); return "
            f"one filename per sample under {filename_key!r} from your Dataset, pass filename_key=..., or pass "
            "key_fn=lambda batch, batch_idx, dataloader_idx, prediction: [(filename, frame_idx, value), ...]"
        )
    return batch[filename_key], batch.get(frame_key)


def batch_keys(filename_key: str = "filename", frame_key: str = "frame_idx") -> KeyFn:
    """A per-sample key function (for code that wraps it): ``batch[filename_key]`` and
    ``batch[frame_key]`` (absent: frame 0) hold one filename and one frame index per sample, and
    item ``j`` of the prediction (a tensor, array, list, or a dict / TensorDict / dataclass of
    those, batch dimension first) is the value of sample ``j``. The callback's default does the
    same through ``SpillWriter.write_batch``, a batch at a time."""

    def key_fn(batch: Any, batch_idx: int, dataloader_idx: int, prediction: Any) -> Iterator[tuple[str, int, Any]]:
        names, frames = batch_names(batch, batch_idx, filename_key, frame_key)
        try:
            names, frames = _batch.batch_keys(names, frames)
            items = _batch.split_batch(prediction, names)
        except SpillValueError as exc:
            raise exc.prefixed(f"SpillPredictionWriter: batch {batch_idx}") from None
        yield from zip(names, frames, items, strict=True)

    return key_fn


class SpillPredictionWriterMixin:
    """Everything but the Lightning base class (see ``spillmerge.integrations.lightning``).

    Who calls what, on every rank: ``on_predict_start`` opens a :class:`~spillmerge.SpillWriter`
    for (``trainer.global_rank``, ``trainer.world_size``); ``on_predict_batch_end`` writes the
    batch (``SpillWriter.write_batch``; with a ``key_fn``, sample by sample); ``on_predict_epoch_end`` commits, then calls the barrier-free
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
        self.key_fn: KeyFn | None = key_fn
        self.filename_key, self.frame_key = filename_key, frame_key
        self.storage_options = storage_options
        self.writer_options = dict(writer_options or {})
        self.merge_options = dict(merge_options or {})
        self.writer: SpillWriter | None = None
        self._report: MergeReport | None = None
        self._created = time.time()  # a report file older than this callback is an earlier run's

    @property
    def report(self) -> MergeReport | None:
        """The :class:`~spillmerge.MergeReport` after ``predict`` on the merging rank (global rank
        0 by default), and in the process that launched the ranks when it ran no prediction itself
        (``ddp_spawn``): there it is read from ``ROOT/spillmerge-report.json``, which the merging
        rank writes (unless ``remove_spill`` left no spill root to write it in). None on the
        other ranks, and before a merge of this callback's run."""
        if self._report is not None or self.writer is not None or self.out is None:
            return self._report
        obj = json_or_none(Storage(self.root, self.storage_options), REPORT_NAME, RECORD_MAX_BYTES)
        try:
            if obj is not None and float(obj["written"]) >= self._created:
                self._report = MergeReport.from_json(json.dumps(obj["report"]))
        except (ValueError, KeyError, TypeError):  # a torn or foreign file: no report, not a crash
            pass
        return self._report

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        if self.writer is not None and self.writer.state == "committed":
            # every rank's callback has the same history: each refuses, none waits for the others
            raise ConfigError(
                f"this SpillPredictionWriter already committed a predict run to {self.root}: a second "
                "trainer.predict would merge both runs' predictions into one output. Pass a new "
                "SpillPredictionWriter with another root for each predict call",
                key="root",
            )
        self._report = None
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
        if self.key_fn is not None:
            for filename, frame_idx, value in self.key_fn(batch, batch_idx, dataloader_idx, prediction):
                self.writer.write(filename, frame_idx, value)
            return
        names, frames = batch_names(batch, batch_idx, self.filename_key, self.frame_key)
        if len(trainer.num_predict_batches) > 1 and isinstance(names, (list, tuple)):
            # several dataloaders may yield one name: each keeps its own rows (a str is checked below)
            names = [f"dataloader_{dataloader_idx}/{n}" if isinstance(n, str) else n for n in names]
        try:
            self.writer.write_batch(names, prediction, frames)  # checked whole: a bad batch writes nothing
        except SpillValueError as exc:
            raise exc.prefixed(f"SpillPredictionWriter: batch {batch_idx}") from None

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        w = self.writer
        if w is None:
            return
        w.close()  # the commit record: this rank is done
        if self.out is not None:
            self._report = w.merge(self.out, **self.merge_options)
            # For a launching process that ran no hook (ddp_spawn); never re-creating a spill root
            # that remove_spill deleted.
            if self._report is not None and w.storage.exists(""):
                doc = {"written": time.time(), "report": json.loads(self._report.to_json())}
                w.storage.put_atomic(REPORT_NAME, json.dumps(doc).encode())

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        w = self.writer
        if w is not None and w.state == "open":
            w.abort(exception)  # failed.json: the merging rank fails at once, naming this rank
