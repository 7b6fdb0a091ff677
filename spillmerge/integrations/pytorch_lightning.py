"""``SpillPredictionWriter`` for the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

The same callback as :mod:`spillmerge.integrations.lightning`, built on ``pytorch_lightning``'s
base class, because each package's ``Trainer`` accepts only its own callbacks. Needs
``pytorch_lightning`` (``pip install 'spillmerge[lightning]'`` installs it along with ``lightning``).
"""

from __future__ import annotations

from ._prediction_writer import KeyFn, SpillPredictionWriterMixin, base_class, batch_keys

__all__ = ["KeyFn", "SpillPredictionWriter", "batch_keys"]
_Base = base_class("pytorch_lightning.callbacks", "pytorch_lightning", __name__)


class SpillPredictionWriter(SpillPredictionWriterMixin, _Base):  # type: ignore[misc,valid-type]
    """For ``pytorch_lightning.Trainer``; arguments and behaviour as
    :class:`spillmerge.integrations.lightning.SpillPredictionWriter`."""
