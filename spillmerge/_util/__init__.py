"""Small helpers shared by every stage: sizes, polling, progress, frame runs."""
