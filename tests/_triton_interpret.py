"""Imported first by conftest.py: without a CUDA GPU, litkv's Triton kernels run in Triton's interpreter on the CPU
(`TRITON_INTERPRET=1`; triton reads it when it and each kernel are imported, so it is set before anything imports
triton: litgpt and `torch._dynamo` do). With a GPU the kernels compile as users run them."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
