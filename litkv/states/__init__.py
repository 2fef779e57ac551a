"""Cache state as a value: snapshots, state files and their checks, the on-disk state store, undo,
the prefix cache and the block store."""
