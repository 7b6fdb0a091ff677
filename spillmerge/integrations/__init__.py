"""Integrations with training / inference frameworks. Each submodule imports its framework lazily
and raises :class:`~spillmerge.MissingDependencyError` with the install hint when it is missing:

- :mod:`spillmerge.integrations.lightning`: ``SpillPredictionWriter`` for ``lightning.pytorch``.
- :mod:`spillmerge.integrations.pytorch_lightning`: the same for the ``pytorch_lightning`` package.

accelerate needs no integration: ``SpillWriter`` takes its rank and world size from the process
group that ``accelerate.PartialState`` / ``Accelerator`` initialise (README, "accelerate").
"""
