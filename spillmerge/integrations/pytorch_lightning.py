"""``SpillPredictionWriter`` for the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

The same callback as :mod:`spillmerge.integrations.lightning`, built on ``pytorch_lightning``'s
base class, because each package's ``Trainer`` accepts only its own callbacks. Needs
``pytorch_lightning`` (``pip install 'spillmerge[lightning]'`` installs it along with ``lightning``).
"""

from __future__ import annotations

from .._errors import require
from ._prediction_writer import KeyFn, SpillPredictionWriterMixin, batch_keys

_callbacks = require(
    "pytorch_lightning.callbacks",
    package="pytorch_lightning",
    extra="lightning",
    feature="spillmerge.integrations.pytorch_lightning",
)

__all__ = ["KeyFn", "SpillPredictionWriter", "batch_keys"]


class SpillPredictionWriter(SpillPredictionWriterMixin, _callbacks.BasePredictionWriter):  # type: ignore[misc,name-defined]
    """For ``pytorch_lightning.Trainer``; arguments and behaviour as
    :class:`spillmerge.integrations.lightning.SpillPredictionWriter`."""
