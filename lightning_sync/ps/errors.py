"""Errors raised by the parameter server and its clients; one from a lost or silent peer names it (``worker r (ps
rank r)``, ``server i (ps rank W+i)``)."""

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
