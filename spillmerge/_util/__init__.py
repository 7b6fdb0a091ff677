"""Small helpers shared by every stage: sizes, polling, progress, frame runs, CRC-32C combine."""
