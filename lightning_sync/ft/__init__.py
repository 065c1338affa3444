"""Fault tolerance across replica groups, on torchft (the optional ``lightning-sync[ft]`` extra); importing this
package never needs torchft (the modules that talk to it import it when they build something)."""

from lightning_sync.ft.config import FaultTolerance, FaultToleranceUnavailable, check_lighthouse, require_torchft

__all__ = ["FaultTolerance", "FaultToleranceUnavailable", "check_lighthouse", "require_torchft"]
