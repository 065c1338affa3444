"""Every number in :mod:`lightning_sync.comm` that was chosen by measurement or convention, named once.

Each docstring says why the number is what it is.
"""

MIB = 1024 * 1024
"""Bytes in a MiB: every ``*_mb`` knob is in MiB."""

ROUNDING_SLACK = 1e-9
"""Float noise ignored before a ``ceil`` (``ceil(3.0000000000000004)`` must stay 3): top-k's ``k`` and the adaptive
period."""

LAUNCH_WARMUP_ROUNDS = 3
"""``bucketing=auto``: sync rounds left out before the trials (allocator and gloo warm-up)."""
LAUNCH_TRIAL_ROUNDS = 8
"""``bucketing=auto``: timed rounds per launch point."""
LAUNCH_MARGIN = 0.10
"""``bucketing=auto``: the relative lead a launch point needs to overrule the device prior (above the trial-to-trial
noise of step times on a shared CPU machine)."""

PARALLEL_CHUNKS = 2
"""Uncompressed and cast all-reduces: a large payload goes as this many concurrent slices (gloo runs concurrent
collectives on two worker threads by default)."""
MIN_CHUNK_MB = 4.0
"""The smallest such slice, in MiB: the all-reduce buckets (4 MiB by default) go whole, as several of them are in
flight at once already."""

ADAPTIVE_SMOOTHING = 0.5
"""``sync_every=auto``: weight of the newest measurement in the moving averages of compute and comm time."""
