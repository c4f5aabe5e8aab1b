"""Test-wide settings.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here,
before any kernel module is imported: every Triton kernel in the tests runs in
Triton's interpreter on CPU tensors and is compared with the torch path.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
