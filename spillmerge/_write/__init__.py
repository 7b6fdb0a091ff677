"""Writing on every rank: values to leaves, staging, flush workers, SpillWriter."""
