"""Test session setup: without a GPU, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton decorates the kernels, i.e. before ringattn is
imported; conftest.py is imported before any test module, and spawned ranks inherit it.

A process's first call of a torch.library custom op (ringattn's launchers and ring) imports torch._dynamo, once
(1 to 2 s); it is imported here (after TRITON_INTERPRET: it imports triton), so that the ranks forked from this
process time their calls, not that import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch._dynamo  # noqa: E402, F401
