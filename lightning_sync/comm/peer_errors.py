"""Errors of collectives that another rank caused, restated to name that rank.

A collective that fails because another rank is frozen or gone raises a :class:`PeerError` naming that rank, e.g.
``all_reduce on rank 0 failed: rank 1 did not answer within 8 s``, read off the backend's (gloo's) error strings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def rendezvous_timeout_s(timeout_s: float) -> float:
    """How long ranks (or a ps group's members) have to meet: ``timeout_s``, and at least 60 s (ranks started
    together reach the rendezvous seconds apart, each first importing torch and Lightning, so a short ``timeout_s``
    chosen to notice a lost peer quickly would fail the start)."""
    return max(float(timeout_s), 60.0)


class PeerError(RuntimeError):
    """A collective failed because another rank of its group did not answer within the group's timeout (a frozen
    or stalled process) or closed its connection (its process is gone). The message names the rank."""


# What gloo says of a silent peer and of a lost one; any other error (a shape mismatch, a bad argument) is not
# restated. A torch future wraps an error raised in a ``then`` callback in "Got the following error ...: <type>: ".
_SILENT = ("timed out", "timeout")
_WAITED_MS = re.compile(r"waiting (\d+) ?ms")
_GONE = ("connection closed", "closed by peer", "connection reset", "broken pipe", "connection refused")
_CALLBACK_PREFIX = re.compile(r"^(?:Got the following error when running the callback: \w+(?:\.\w+)*: )+")
_DID_NOT_ANSWER = "did not answer"  # how a PeerError says its peer is silent (not gone)
_RESTATED = re.compile(r"^[\w ]+ on rank \d+ failed: ")  # a PeerError's message, seen through such wrapping


@dataclass(frozen=True)
class Peers:
    """The ranks a failed collective's error names, read off its group when the collective is issued.

    A work callback keeps this instead of the group: a callback holding the last reference to a destroyed group
    would free it on the backend's own thread, which joins itself (``Resource deadlock avoided``, and an abort).
    """

    me: int  # this process's global rank
    others: str  # ``"rank 1"``, or ``"one of ranks 1, 2, 3"`` (global ranks)

    @classmethod
    def of(cls, group: ProcessGroup | None) -> Peers:
        """The peers of ``group`` (``None``: the default group), as seen from this rank."""
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        others = [r for r in ranks if r != me]
        text = f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))
        return cls(me, text)


def peer_error(
    op: str, group: ProcessGroup | Peers | None, error: BaseException, timeout_s: float | None = None
) -> PeerError | None:
    """``error`` of collective ``op`` restated as a :class:`PeerError` naming the peer (on more than 2 ranks, the
    others), if a peer caused it; an error that wraps a :class:`PeerError` message is returned unwrapped.

    Args:
        op: what was running (``"all_reduce"``).
        group: its process group (``None``: default), or its :class:`Peers`.
        error: what the backend raised.
        timeout_s: the group's timeout, for the message (``None``: as the backend's message says, if it does).

    Returns:
        The restated error, or ``None`` when ``error`` does not come from a silent or lost peer.
    """
    text = _CALLBACK_PREFIX.sub("", str(error).strip())
    first = text.splitlines()[0] if text else type(error).__name__
    if _RESTATED.match(first):
        return PeerError(first)
    lowered = first.lower()
    if any(marker in lowered for marker in _GONE):
        what = "closed its connection (its process is gone)"
    elif any(marker in lowered for marker in _SILENT):
        waited = _WAITED_MS.search(first)
        if timeout_s is None and waited is not None:
            timeout_s = int(waited.group(1)) / 1000
        what = _DID_NOT_ANSWER + ("" if timeout_s is None else f" within {timeout_s:g} s")
    else:
        return None
    try:
        peers = group if isinstance(group, Peers) else Peers.of(group)
    except (RuntimeError, ValueError):  # the group is already gone
        return None
    return PeerError(f"{op} on rank {peers.me} failed: {peers.others} {what} (backend: {first})")


def names_a_silent_peer(error: PeerError) -> bool:
    """Whether ``error`` says its peer did not answer in time (frozen or stalled), rather than that it is gone."""
    return _DID_NOT_ANSWER in str(error)


def wait_future(future: torch.futures.Future, op: str, group: ProcessGroup | None = None) -> Any:
    """``future.wait()`` (a future built on the meter's), where a failure a silent or lost peer caused is raised as
    a :class:`PeerError` naming that peer and ``op``, what was running on ``group``."""
    with naming_peer(op, group):
        return future.wait()


@contextmanager
def naming_peer(op: str | None, group: ProcessGroup | Peers | None, timeout_s: float | None = None) -> Iterator[None]:
    """Raises an error of the block that a silent or lost peer caused as :func:`peer_error` (``op=None``: as it is)."""
    try:
        yield
    except RuntimeError as error:
        restated = None if op is None else peer_error(op, group, error, timeout_s)
        if restated is None:
            raise
        raise restated from error
