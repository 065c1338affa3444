"""One communication meter for every sync mode.

Every collective that lightning_sync issues goes through a :class:`CommMeter`. The meter calls torch.distributed
itself, so the bytes it counts are the bytes of the tensors that really go to the process group: a compressed
payload (fp16, a low-rank factor, top-k values and indices) counts at its compressed size.

What is counted, per rank, for a payload of ``S`` bytes on a group of ``n`` ranks:

============================  ============================  ============================
collective                     bytes sent                    bytes received
============================  ============================  ============================
``all_reduce``                 ``2 (n-1)/n * S``             ``2 (n-1)/n * S``
``all_gather`` (S per rank)    ``(n-1) * S``                 ``(n-1) * S``
``all_to_all`` (S in all)      ``(n-1)/n * S``               ``(n-1)/n * S``
``broadcast``                  ``(n-1)/n * S`` (mean)        ``(n-1)/n * S`` (mean)
``send_to`` / ``recv_from``    ``S`` / ``0``                 ``0`` / ``S``
============================  ============================  ============================

Gloo (CPU) and NCCL (GPU) both run a dense ``all_reduce`` as a ring: a reduce-scatter of ``n`` chunks followed by
an all-gather of the reduced chunks, so each rank sends ``n-1`` chunks of ``S/n`` bytes in each phase. An
``all_gather`` ring forwards every other rank's block once. A broadcast moves ``n-1`` copies of ``S`` over the
whole group whatever its tree shape; the meter books the mean per rank. With one rank nothing is counted.

``seconds`` is the time collectives are in flight: for a blocking call the time spent in it, for an asynchronous
one the time from launch until its future completes. Overlapped collectives therefore count in full, even when
backward hid them.

A collective that fails because another rank is frozen (it did not answer within the group's timeout) or gone
(its connection closed) raises a :class:`PeerError` naming that rank, e.g. ``all_reduce on rank 0 failed: rank 1 did not
answer within 8 s``; :func:`wait_future` gives the same error for a chain of futures built on the meter's.

The meter knows nothing of Lightning: strategies call :meth:`CommMeter.step` once per optimizer step and log the
returned :class:`CommStats`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; older releases have only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """Communication counted over some interval, for one rank."""

    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    calls: int = 0
    seconds: float = 0.0

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """The stats as ``{"comm/bytes_sent": ..., ...}``, ready for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


class PeerError(RuntimeError):
    """A collective failed because another rank of its group did not answer within the group's timeout (a frozen
    or stalled process) or closed its connection (its process is gone). The message names the rank."""


# What gloo says of a silent peer and of a lost one; any other error (a shape mismatch, a bad argument) is not
# restated. A torch future wraps an error raised in a ``then`` callback in "Got the following error ...: <type>: ".
_SILENT = ("timed out", "timeout")
_WAITED_MS = re.compile(r"waiting (\d+) ?ms")
_GONE = ("connection closed", "closed by peer", "connection reset", "broken pipe", "connection refused")
_CALLBACK_PREFIX = re.compile(r"^(?:Got the following error when running the callback: \w+(?:\.\w+)*: )+")
_RESTATED = re.compile(r"^[\w ]+ on rank \d+ failed: ")  # a PeerError's message, seen through such wrapping


def _peers(group: ProcessGroup | None) -> str:
    """The other ranks of ``group`` (global ranks): ``"rank 1"``, or ``"one of ranks 1, 2, 3"``."""
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    others = [r for r in ranks if r != me]
    return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))


def peer_error(
    op: str, group: ProcessGroup | None, error: BaseException, timeout_s: float | None = None
) -> PeerError | None:
    """``error`` of collective ``op`` restated as a :class:`PeerError` naming the peer, if a peer caused it.

    On 2 ranks the peer is named exactly; on more the backend does not say which rank failed to answer, so the
    others are listed. An error that already is (or wraps) a :class:`PeerError` message is returned unwrapped.

    Args:
        op: what was running (``"all_reduce"``).
        group: its process group (``None``: default).
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
        what = "did not answer" + ("" if timeout_s is None else f" within {timeout_s:g} s")
    else:
        return None
    try:
        who, me = _peers(group), dist.get_rank()
    except (RuntimeError, ValueError):  # the group is already gone
        return None
    return PeerError(f"{op} on rank {me} failed: {who} {what} (backend: {first})")


def wait_future(future: torch.futures.Future, op: str, group: ProcessGroup | None = None) -> Any:
    """``future.wait()``, where a failure that a silent or lost peer caused is raised as a :class:`PeerError`
    naming that peer (the wait takes as long as the backend takes: gloo fails a collective after the group's
    timeout).

    Args:
        future: a future built on the meter's (e.g. a compressor's ``average``).
        op: what it was, for the message.
        group: the collective's process group (``None``: default).
    """
    with _naming_peer(op, group):
        return future.wait()


@contextmanager
def _naming_peer(op: str | None, group: Any, timeout_s: float | None = None) -> Iterator[None]:
    """Raises an error of the block that a silent or lost peer caused as :func:`peer_error` (``op=None``: as it is)."""
    try:
        yield
    except RuntimeError as error:
        restated = None if op is None else peer_error(op, group, error, timeout_s)
        if restated is None:
            raise
        raise restated from error


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` on ``world_size`` ranks."""
    return 2.0 * (world_size - 1) / world_size * nbytes


class _TimedWork:
    """An async work handle whose completion time is booked on the meter exactly once."""

    def __init__(self, work: Any, meter: CommMeter, started: float, op: str | None = None, group: Any = None) -> None:
        self._work = work
        self._meter = meter
        self._started = started
        self._op = op  # a collective's name: its failure names the peer (point-to-point errors are the caller's)
        self._group = group
        self._booked = False
        try:
            self._future: torch.futures.Future | None = work.get_future().then(self._on_done)
        except RuntimeError:  # some backends' point-to-point works have no future: book the time at wait()
            self._future = None

    def _on_done(self, fut: torch.futures.Future) -> Any:
        self._book()
        with _naming_peer(self._op, self._group, self._meter.timeout_s):
            return fut.value()

    def _book(self) -> None:
        with self._meter._lock:
            if not self._booked:
                self._booked = True
                self._meter._total.seconds += time.perf_counter() - self._started

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the collective is done; ``timeout`` (seconds) bounds the wait on the work itself."""
        if self._future is None:
            if timeout is None:
                self._work.wait()
            else:
                import datetime

                self._work.wait(datetime.timedelta(seconds=timeout))
            self._book()
        elif timeout is None:
            self._future.wait()
        else:
            deadline = time.monotonic() + timeout
            while not self._future.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"collective not done after {timeout} s")
                time.sleep(0.0005)
            self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """A future that completes after the collective and after its time is booked."""
        if self._future is None:
            raise RuntimeError("this work handle has no future; call wait()")
        return self._future

    def source_rank(self) -> int:
        """The group rank that a completed receive from any source (``CommMeter.recv_from(..., None)``) came from."""
        return int(self._work._source_rank())


class CommMeter:
    """Issues collectives through torch.distributed and counts what each one puts on the wire.

    Args:
        group: the process group to use when a call names none (``None``: the default group).
        timeout_s: the process groups' timeout, named in a :class:`PeerError` (``None``: as the backend says).
    """

    def __init__(self, group: ProcessGroup | None = None, timeout_s: float | None = None) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._total = CommStats()
        self._last_step = CommStats()

    # ------------------------------------------------------------------ accounting
    @property
    def total(self) -> CommStats:
        """Everything counted since the meter was made (or last reset)."""
        with self._lock:
            return CommStats(**vars(self._total))

    def step(self) -> CommStats:
        """Closes one optimizer step: returns what was counted since the previous call."""
        now = self.total
        delta, self._last_step = now - self._last_step, now
        return delta

    def reset(self) -> None:
        with self._lock:
            self._total = CommStats()
            self._last_step = CommStats()

    def record(self, bytes_sent: float, bytes_recv: float, seconds: float = 0.0, calls: int = 1) -> None:
        """Books traffic that did not go through the meter's own calls (e.g. a third-party collective)."""
        with self._lock:
            self._total.bytes_sent += bytes_sent
            self._total.bytes_recv += bytes_recv
            self._total.calls += calls
            self._total.seconds += seconds

    def world_size(self, group: ProcessGroup | None = None) -> int:
        return dist.get_world_size(group if group is not None else self.group)

    def _run(
        self, sent: float, recv: float, async_op: bool, launch: Any, op: str | None = None, group: Any = None
    ) -> Any:
        started = time.perf_counter()
        with _naming_peer(op, group, self.timeout_s):
            work = launch()
        self.record(sent, recv, calls=1)
        if async_op:
            return _TimedWork(work, self, started, op, group)
        self.record(0.0, 0.0, seconds=time.perf_counter() - started, calls=0)
        return None

    # ------------------------------------------------------------------ collectives
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ...,
        group: ProcessGroup | None = ...,
        *,
        async_op: Literal[True],
    ) -> _TimedWork: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ...,
        group: ProcessGroup | None = ...,
        async_op: Literal[False] = ...,
    ) -> None: ...

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ...,
        group: ProcessGroup | None = ...,
        async_op: bool = ...,
    ) -> _TimedWork | None: ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp.RedOpType = ReduceOp.SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> _TimedWork | None:
        """``dist.all_reduce`` in place, counted as a ring all-reduce."""
        group = group if group is not None else self.group
        n = self.world_size(group)
        wire = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), n)
        return self._run(
            wire,
            wire,
            async_op,
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
            "all_reduce",
            group,
        )

    @overload
    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        *,
        async_op: Literal[True],
    ) -> _TimedWork: ...

    @overload
    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        async_op: Literal[False] = ...,
    ) -> None: ...

    @overload
    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        async_op: bool = ...,
    ) -> _TimedWork | None: ...

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> _TimedWork | None:
        """``dist.all_gather_into_tensor``: each rank's ``tensor`` is concatenated, rank order, into ``output``."""
        group = group if group is not None else self.group
        n = self.world_size(group)
        wire = float((n - 1) * tensor.numel() * tensor.element_size())
        return self._run(
            wire,
            wire,
            async_op,
            lambda: _all_gather_single(output, tensor, group=group, async_op=async_op),
            "all_gather",
            group,
        )

    @overload
    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        *,
        async_op: Literal[True],
    ) -> _TimedWork: ...

    @overload
    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        async_op: Literal[False] = ...,
    ) -> None: ...

    @overload
    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = ...,
        async_op: bool = ...,
    ) -> _TimedWork | None: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> _TimedWork | None:
        """``dist.all_to_all_single`` with equal splits: block ``j`` of ``tensor`` goes to rank ``j``, and block
        ``j`` of ``output`` comes from rank ``j``; counted as ``(n-1)/n * S`` sent and received (a rank keeps its
        own block)."""
        group = group if group is not None else self.group
        n = self.world_size(group)
        wire = (n - 1) / n * tensor.numel() * tensor.element_size()
        return self._run(
            wire,
            wire,
            async_op,
            lambda: dist.all_to_all_single(output, tensor, group=group, async_op=async_op),
            "all_to_all",
            group,
        )

    @overload
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int = ...,
        group: ProcessGroup | None = ...,
        *,
        async_op: Literal[True],
    ) -> _TimedWork: ...

    @overload
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int = ...,
        group: ProcessGroup | None = ...,
        async_op: Literal[False] = ...,
    ) -> None: ...

    @overload
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int = ...,
        group: ProcessGroup | None = ...,
        async_op: bool = ...,
    ) -> _TimedWork | None: ...

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int = 0,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> _TimedWork | None:
        """``dist.broadcast`` from global rank ``src``, counted at the per-rank mean of ``(n-1)/n * S``."""
        group = group if group is not None else self.group
        n = self.world_size(group)
        wire = (n - 1) / n * tensor.numel() * tensor.element_size()
        return self._run(
            wire,
            wire,
            async_op,
            lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
            "broadcast",
            group,
        )

    # Point-to-point takes a group object called directly, with ranks of that group: c10d's ``isend``/``irecv``
    # go through its group registry, which rejects a group built outside it (``ProcessGroupGloo(store, rank,
    # size)``, as the parameter server does so that one process can hold several members of the same group).
    def send_to(self, tensor: torch.Tensor, group_dst: int, group: Any = None, tag: int = 0) -> _TimedWork:
        """Asynchronous send of ``tensor`` to rank ``group_dst`` of ``group`` (its own rank, not a global one).

        Counted as ``S`` bytes sent when launched. ``tensor`` must stay untouched until the work is waited for.
        """
        group = group if group is not None else self.group
        nbytes = float(tensor.numel() * tensor.element_size())
        return self._run(nbytes, 0.0, True, lambda: group.send([tensor], int(group_dst), int(tag)))

    def recv_from(self, tensor: torch.Tensor, group_src: int | None, group: Any = None, tag: int = 0) -> _TimedWork:
        """Asynchronous receive into ``tensor`` from rank ``group_src`` of ``group``, or from any rank if ``None``.

        Counted as ``S`` bytes received when launched. After a receive from any rank completes,
        :meth:`_TimedWork.source_rank` names the sender.
        """
        group = group if group is not None else self.group
        nbytes = float(tensor.numel() * tensor.element_size())
        if group_src is None:
            return self._run(0.0, nbytes, True, lambda: group.recv_anysource([tensor], int(tag)))
        return self._run(0.0, nbytes, True, lambda: group.recv([tensor], int(group_src), int(tag)))
