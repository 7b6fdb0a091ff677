"""The on-disk contract, both halves: spill format, output format, their checks."""
