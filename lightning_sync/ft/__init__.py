"""Fault tolerance across replica groups, on torchft (the optional ``lightning-sync[ft]`` extra).

:mod:`lightning_sync.ft.config` holds the settings and their checks and imports nothing heavy; the modules that
talk to torchft (:mod:`~lightning_sync.ft.replica`, :mod:`~lightning_sync.ft.averager`) import it when they build
something, so importing this package never needs torchft.
"""

from lightning_sync.ft.config import FaultTolerance, FaultToleranceUnavailable, check_lighthouse, require_torchft

__all__ = ["FaultTolerance", "FaultToleranceUnavailable", "check_lighthouse", "require_torchft"]
