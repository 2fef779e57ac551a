"""Checkpoints in and out: the litkv checkpoint format, conversion from transformers and GGUF, downloads,
the quantised-weights store and the run-time (device, dtype) settings."""
