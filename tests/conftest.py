"""Test-wide setup: one OpenMP thread per process, set before torch is imported.

With the ``fork`` start method, a child deadlocks in libgomp if the parent ran a multi-threaded torch op first.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
