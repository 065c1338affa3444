"""One communication meter for every sync mode.

Every collective that lightning_sync issues goes through a :class:`CommMeter`, which calls torch.distributed itself:
the bytes it counts are those of the tensors that really go to the process group (a compressed payload's).

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

An ``all_reduce`` runs as a ring (a reduce-scatter, then an all-gather) on gloo and NCCL; a broadcast is booked as
the mean per rank. With one rank nothing is counted. ``seconds`` is the time collectives are in flight (launch to
completion), so overlapped ones count in full. A collective that fails because another rank is frozen or gone
raises a :class:`~lightning_sync.comm.peer_errors.PeerError` naming that rank. Strategies call
:meth:`CommMeter.step` once per optimizer step and log the returned :class:`CommStats`.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from lightning_sync.comm.peer_errors import Peers, naming_peer

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; older releases have only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def control_device(group: ProcessGroup | None = None) -> torch.device:
    """Where a small control tensor (sizes, flags, timings) must be for a collective on ``group``: the CPU, unless
    the group's only backend is NCCL, which refuses CPU tensors (then the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class CommStats:
    """Communication counted over some interval, for one rank.

    Example::

        >>> CommStats(bytes_sent=1000.0, calls=2).as_metrics()["comm/bytes_sent"]
        1000.0
    """

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


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` on ``world_size`` ranks."""
    return 2.0 * (world_size - 1) / world_size * nbytes


class TimedWork:
    """The handle of an asynchronous collective: books its time in flight once, and restates a failure a peer caused
    (:mod:`~lightning_sync.comm.peer_errors`).

    Args:
        work: the torch.distributed work.
        meter: books the seconds from ``started`` (``time.perf_counter()`` at launch) until the work completed.
        op: a collective's name: its failure names the peer (point-to-point errors are the caller's).
        group: the collective's process group (only its :class:`~lightning_sync.comm.peer_errors.Peers` are kept).
    """

    def __init__(self, work: Any, meter: CommMeter, started: float, op: str | None, group: Any) -> None:
        self._work = work
        self._meter = meter
        self._started = started
        self._op = op
        self._peers = Peers.of(group) if op is not None else None
        self._booked = False
        try:
            self._future: torch.futures.Future | None = work.get_future().then(self._on_done)
        except RuntimeError:  # gloo's point-to-point works have no future: book the time at wait()
            self._future = None

    def _on_done(self, fut: torch.futures.Future) -> Any:
        self._book()
        with naming_peer(self._op, self._peers, self._meter.timeout_s):
            return fut.value()

    def _book(self) -> None:
        if not self._booked:  # the future's callback, or wait() where there is no future: never both
            self._booked = True
            self._meter.record(0.0, 0.0, time.perf_counter() - self._started, calls=0)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the work is done; ``timeout`` (seconds) bounds the wait of a point-to-point work."""
        if self._future is not None:
            self._future.wait()
        elif timeout is None:
            self._work.wait()
        else:
            self._work.wait(datetime.timedelta(seconds=timeout))
        self._book()
        return True

    def get_future(self) -> torch.futures.Future:
        """A future that completes after the collective and after its time is booked (collectives only)."""
        assert self._future is not None, "a point-to-point work has no future; call wait()"
        return self._future


class CommMeter:
    """Issues collectives through torch.distributed and counts what each one puts on the wire.

    Args:
        group: the process group to use when a call names none (``None``: the default group).
        timeout_s: the process groups' timeout, named in a :class:`PeerError` (``None``: as the backend says).

    Example::

        >>> meter = CommMeter(timeout_s=60)  # in a process that has joined a process group
        >>> meter.step()  # what was counted since the last step: nothing yet
        CommStats(bytes_sent=0.0, bytes_recv=0.0, calls=0, seconds=0.0)
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
        """Everything counted since the meter was made."""
        with self._lock:
            return CommStats(**vars(self._total))

    def step(self) -> CommStats:
        """Closes one optimizer step: returns what was counted since the previous call."""
        now = self.total
        delta, self._last_step = now - self._last_step, now
        return delta

    def record(self, bytes_sent: float, bytes_recv: float, seconds: float = 0.0, calls: int = 1) -> None:
        """Books traffic that did not go through the meter's own calls (e.g. a third-party collective)."""
        with self._lock:
            self._total = self._total + CommStats(bytes_sent, bytes_recv, calls, seconds)

    def world_size(self, group: ProcessGroup | None = None) -> int:
        return dist.get_world_size(group if group is not None else self.group)

    def control_device(self, group: ProcessGroup | None = None) -> torch.device:
        """:func:`control_device` of ``group`` (``None``: the meter's group)."""
        return control_device(group if group is not None else self.group)

    def _run(
        self, sent: float, recv: float, async_op: bool, launch: Any, op: str | None = None, group: Any = None
    ) -> TimedWork:
        """Launches the work (``launch``: asynchronous), waits for it unless ``async_op``, and returns its handle."""
        started = time.perf_counter()
        with naming_peer(op, group, self.timeout_s):
            work = launch()
            if not async_op:
                work.wait()
        self.record(sent, recv)  # the seconds at completion
        return TimedWork(work, self, started, op, group)

    def _collective(
        self, name: str, tensor: torch.Tensor, group: ProcessGroup | None, per_byte: Callable[[int], float],
        async_op: bool, launch: Callable[[ProcessGroup | None], Any],
    ) -> TimedWork:  # fmt: skip
        """Runs ``launch(group)``, counted as ``per_byte(n)`` wire bytes sent and received per byte of ``tensor``."""
        group = group if group is not None else self.group
        wire = per_byte(self.world_size(group)) * tensor.numel() * tensor.element_size()
        return self._run(wire, wire, async_op, lambda: launch(group), name, group)

    # ------------------------------------------------------------------ collectives
    # Each returns the work's handle (:class:`TimedWork`); with ``async_op=False`` the work is done on return.
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> TimedWork:  # fmt: skip
        """``dist.all_reduce`` in place, counted as a ring all-reduce."""
        return self._collective(
            "all_reduce", tensor, group, lambda n: ring_all_reduce_bytes(1, n), async_op,
            lambda g: dist.all_reduce(tensor, op=op, group=g, async_op=True),
        )  # fmt: skip

    def all_gather_into_tensor(
        self, output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
    ) -> TimedWork:
        """``dist.all_gather_into_tensor``: each rank's ``tensor`` is concatenated, rank order, into ``output``."""
        return self._collective(
            "all_gather", tensor, group, lambda n: n - 1.0, async_op,
            lambda g: _all_gather_single(output, tensor, group=g, async_op=True),
        )  # fmt: skip

    def all_to_all_single(
        self, output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
    ) -> TimedWork:
        """``dist.all_to_all_single`` with equal splits: block ``j`` of ``tensor`` goes to rank ``j``, block ``j`` of
        ``output`` comes from rank ``j``."""
        return self._collective(
            "all_to_all", tensor, group, lambda n: (n - 1) / n, async_op,
            lambda g: dist.all_to_all_single(output, tensor, group=g, async_op=True),
        )  # fmt: skip

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False
    ) -> TimedWork:
        """``dist.broadcast`` from global rank ``src``, counted at the per-rank mean of ``(n-1)/n * S``."""
        return self._collective(
            "broadcast", tensor, group, lambda n: (n - 1) / n, async_op,
            lambda g: dist.broadcast(tensor, src=src, group=g, async_op=True),
        )  # fmt: skip

    # Point-to-point takes a group object called directly, with ranks of that group: c10d's ``isend``/``irecv``
    # go through its group registry, which rejects a group built outside it (``ProcessGroupGloo(store, rank,
    # size)``, as the parameter server does so that one process can hold several members of the same group).
    def send_to(self, tensor: torch.Tensor, group_dst: int, group: Any = None, tag: int = 0) -> TimedWork:
        """Asynchronous send of ``tensor`` (untouched until the work is waited for) to rank ``group_dst`` of
        ``group`` (its own rank, not a global one), counted as ``S`` bytes sent when launched."""
        group = group if group is not None else self.group
        nbytes = float(tensor.numel() * tensor.element_size())
        return self._run(nbytes, 0.0, True, lambda: group.send([tensor], int(group_dst), int(tag)))

    def recv_from(self, tensor: torch.Tensor, group_src: int, group: Any = None, tag: int = 0) -> TimedWork:
        """Asynchronous receive into ``tensor`` from rank ``group_src`` of ``group``, counted as ``S`` bytes received
        when launched."""
        group = group if group is not None else self.group
        nbytes = float(tensor.numel() * tensor.element_size())
        return self._run(0.0, nbytes, True, lambda: group.recv([tensor], int(group_src), int(tag)))
