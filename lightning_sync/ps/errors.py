"""Errors raised by the parameter server and its clients.

Every error that comes from a lost or silent peer names that peer as ``worker r (ps rank r)`` or
``server i (ps rank W+i)``, so a log line says which process to look at.
"""

from __future__ import annotations


class PSError(RuntimeError):
    """Base class of every parameter-server error; ``peer``: the PS rank of the peer it concerns, where known."""

    peer: int | None = None


class PSTimeoutError(PSError, TimeoutError):
    """A peer sent nothing (or took nothing) for ``timeout_s``: it is frozen, dead, or far too slow."""


class PSPeerLostError(PSError, ConnectionError):
    """A peer's connection closed: its process is gone (crashed, killed, or exited early)."""


class PSServerError(PSError):
    """A server refused a request (wrong settings, a request out of order, a failed step); the message is its own."""
