"""Test session setup: without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before ringattn is
imported; conftest.py is imported before any test module, and spawned ranks inherit it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
