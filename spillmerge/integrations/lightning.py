"""``SpillPredictionWriter``: ``Trainer.predict`` on many processes → one merged Zarr store.

::

    from spillmerge.integrations.lightning import SpillPredictionWriter

    writer = SpillPredictionWriter("/shared/run1/spill", "/shared/run1/preds.zarr")
    trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp", callbacks=[writer])
    trainer.predict(model, dataloaders=loader, return_predictions=False)

Needs ``lightning`` (``pip install 'spillmerge[lightning]'``); for the older ``pytorch_lightning``
package use :mod:`spillmerge.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from ._prediction_writer import KeyFn, SpillPredictionWriterMixin, base_class, batch_keys

__all__ = ["KeyFn", "SpillPredictionWriter", "batch_keys"]
_Base = base_class("lightning.pytorch.callbacks", "lightning", __name__)


class SpillPredictionWriter(SpillPredictionWriterMixin, _Base):  # type: ignore[misc,valid-type]
    """A ``BasePredictionWriter`` that spills every prediction to ``root`` and merges into ``out``.

    Each rank writes the samples of each predicted batch to its own spill segment as the batch
    ends (nothing is kept in memory or gathered); when the predict epoch ends every rank commits
    and calls the barrier-free :meth:`spillmerge.SpillWriter.merge`: global rank 0 (``dst``) waits
    on storage for every rank's commit record and merges; the others return once every rank has
    committed (not after the merge). After
    ``predict``, ``writer.report`` is the :class:`~spillmerge.MergeReport` on that rank.

    Args:
        root: spill root every rank and the merging rank can reach (path or fsspec URL).
        out: merged output; ``None`` only spills (merge later with ``spillmerge merge``).
        key_fn: ``key_fn(batch, batch_idx, dataloader_idx, prediction)`` → iterable of
            ``(filename, frame_idx, value)``, written sample by sample. Default: the batch is a
            dict with a ``filename_key`` entry (one filename per sample) and optionally a
            ``frame_key`` entry (absent: every sample is frame 0, as for an image dataset); the
            prediction is written whole with :meth:`spillmerge.SpillWriter.write_batch` (item
            ``j`` of a tensor, list, or dict / TensorDict / dataclass of those belongs to sample
            ``j``), and a bad batch writes nothing of itself. With several predict dataloaders,
            which may yield the same filenames, each filename is written as
            ``"dataloader_{dataloader_idx}/{filename}"`` so that no dataloader's rows replace or
            collide with another's (a ``key_fn`` keeps them apart itself).
        storage_options: fsspec options for ``root`` (and ``out`` on the same protocol).
        writer_options: more :class:`~spillmerge.SpillWriter` arguments (``chunk_bytes``,
            ``on_duplicate`` ...).
        merge_options: more :func:`spillmerge.merge` arguments (``overwrite``, ``on_duplicate``,
            ``timeout`` (default 1800 s), ``dst`` ...).

    Pass ``return_predictions=False`` to ``predict`` so Lightning does not keep them all as well.
    """
