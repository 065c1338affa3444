"""One rank's link to the other replica groups (:class:`ReplicaGroupLink`, on a torchft ``Manager``), and the
``allreduce`` strategy's per-step gradient sync across groups (:func:`average_gradients_across`). The quorum and the
healing are torchft's; nothing here re-implements them.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from lightning_sync.comm.compression import Compressor, FlatBucket
from lightning_sync.comm.nonfinite import drop_grads
from lightning_sync.ft.config import FaultTolerance, check_lighthouse, lighthouse_url, require_torchft

log = logging.getLogger("lightning_sync.ft")


class _QuorumCollectives:
    """The collectives a codec issues (as on a :class:`~lightning_sync.comm.meter.CommMeter`), on torchft's process
    group, so that any codec that can ride ``across_groups`` averages over the quorum's groups. Each call waits for
    its work (torchft bounds it by its timeout and reports a failure to the vote)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def world_size(self, group: Any = None) -> int:
        return int(self.pg.size())

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, **_: Any) -> Any:
        return _waited(self.pg.alltoall_base(output, tensor, [], [], AllToAllOptions()))

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, **_: Any) -> Any:
        return _waited(self.pg.allgather([list(output.view(self.world_size(), -1))], [tensor], AllgatherOptions()))


def _waited(work: Any) -> Any:
    work.wait()
    return work


class QuorumError(RuntimeError):
    """No quorum formed within the quorum timeout (too few groups alive, or the lighthouse is gone)."""


@dataclass
class FaultToleranceStats:
    """What the link has seen so far (all counts since start)."""

    quorums: int = 0
    quorum_size: int = 0
    participants: list[int] = field(default_factory=list)
    commits: int = 0
    failed_commits: int = 0
    heals: int = 0
    heal_seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        """The counters (but ``quorums`` and ``participants``) as ``ft/*`` metrics."""
        return {f"ft/{k}": float(v) for k, v in vars(self).items() if k not in ("quorums", "participants")}


class ReplicaGroupLink:
    """A torchft ``Manager`` for this rank of this replica group (rank ``r`` of a group meets rank ``r`` of every
    other group), and what it counts (:attr:`stats`). Each cross-group sync is :meth:`start`, :meth:`average_`,
    then :meth:`commit`.

    Args:
        config: the fault-tolerance settings (checked at construction).
        group_rank: this rank inside its group.
        group_world_size: ranks in the group.
        hostname: the name other groups reach this host by (default: ``socket.gethostname()``).

    Raises:
        FaultToleranceUnavailable: torchft is not installed (names the ``lightning-sync[ft]`` extra).
        ConfigError: no lighthouse answers at ``config.lighthouse`` within ``config.timeout_s``.
    """

    def __init__(
        self,
        config: FaultTolerance,
        group_rank: int = 0,
        group_world_size: int = 1,
        hostname: str | None = None,
    ) -> None:
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        self.config = config
        self.stats = FaultToleranceStats()
        collective_timeout, quorum_timeout = config.timeouts()
        host = hostname or socket.gethostname()
        if group_rank == 0:
            check_lighthouse(config)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if group_rank == 0 else None
        address: list[Any] = [host, self._store.port if self._store is not None else 0]
        if group_world_size > 1:  # the group's store lives on its rank 0: every rank takes rank 0's host and port
            dist.broadcast_object_list(address, src=0)
        store_host, port = str(address[0]), int(address[1])
        self._pg = ProcessGroupGloo(timeout=collective_timeout)  # torchft reconfigures it at every quorum
        self.manager = Manager(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,
            timeout=collective_timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=timedelta(seconds=config.timeout_s),
            rank=group_rank,
            world_size=group_world_size,
            store_addr=store_host,
            store_port=port,
            lighthouse_addr=lighthouse_url(config.lighthouse),
            replica_id=config.replica_id,
            hostname=host,
            init_sync=False,  # every group starts from the same seed; a late one heals from a live one
        )

    # ------------------------------------------------------------------ state for healing
    def register_state(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Adds ``key`` to the state a healing group pulls from a live one (torchft's checkpoint transport)."""
        self.manager.register_state_dict_fn(key, load, save)

    # ------------------------------------------------------------------ one sync
    def start(self) -> bool:
        """Joins the next quorum (waits at most the quorum timeout), healing this group if it is behind, and learns
        which groups take part (one small all-reduce).

        Returns:
            Whether this group healed: its registered state is now a live group's, as of that group's quorum.
        """
        before, started = self.manager.current_step(), time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception as error:  # torchft raises TimeoutError (or a gRPC error) when no quorum forms in time
            raise QuorumError(
                f"replica group {self.config.replica_group}: no quorum of at least min_replicas="
                f"{self.config.min_replicas} groups formed within quorum_timeout_s="
                f"{self.config.timeouts()[1].total_seconds():g} s at the lighthouse {self.config.lighthouse!r} "
                f"({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}); the other "
                "groups are gone or finished"
            ) from None
        self.stats.quorums += 1
        healed = self.manager.current_step() > before
        if healed:
            seconds = time.perf_counter() - started
            self.stats.heals += 1
            self.stats.heal_seconds += seconds
            log.warning(
                "replica group %d healed from a live group: step %d -> %d in %.2f s",
                self.config.replica_group, before, self.manager.current_step(), seconds,
            )  # fmt: skip
        self.stats.quorum_size = self.manager.num_participants()
        members = torch.zeros(self.config.num_replica_groups, dtype=torch.float32)
        members[self.config.replica_group] = 1.0
        self.manager.allreduce(members, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is None:
            self._note_members([i for i, v in enumerate(members.tolist()) if v > 0.5])
        return healed

    def _note_members(self, members: list[int]) -> None:
        before, self.stats.participants = self.stats.participants, members
        lost, joined = sorted(set(before) - set(members)), sorted(set(members) - set(before))
        if before and lost:
            log.warning("replica group(s) %s lost from the quorum; training on with %s", lost, members)
        if before and joined:
            log.warning("replica group(s) %s joined the quorum; now %s", joined, members)

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replaces ``tensors`` by their mean over the quorum's groups (on error they hold garbage, and
        :meth:`commit` says ``False``)."""
        for work in [self.manager.allreduce(t) for t in tensors if t.numel()]:
            work.wait()

    def average_coded_(self, buckets: Sequence[FlatBucket], codec: Compressor) -> None:
        """As :meth:`average_`, with each bucket on the wire as ``codec`` sends it (a codec that can ride
        ``across_groups``), over torchft's process group. A group that does not take part in this sync sends zeros,
        and the mean is over the participants, as torchft's ``allreduce`` does. A failed collective is reported to
        the Manager, so :meth:`commit` says ``False``; the buckets then hold garbage."""
        if self.manager.errored() is not None:
            return
        self.manager.wait_quorum()
        participants, taking_part = self.manager.num_participants(), self.manager.is_participating()
        collectives: Any = _QuorumCollectives(self._pg)
        try:
            for bucket in buckets:
                if bucket.buffer.numel():
                    if not taking_part:
                        bucket.buffer.zero_()
                    bucket.participants = participants
                    codec.average(bucket, collectives).wait()
        except Exception as error:  # noqa: BLE001 - torchft's vote carries it (commit() is False)
            self.manager.report_error(error)

    def commit(self) -> bool:
        """torchft's vote on this sync: ``True`` when every collective since :meth:`start` succeeded on every rank
        of the group and the quorum had at least ``min_replicas`` groups."""
        ok = bool(self.manager.should_commit())
        if ok:
            self.stats.commits += 1
            log.info(
                "replica group %d: sync committed (step %d, commit %d, groups %s)",
                self.config.replica_group, self.manager.current_step(), self.stats.commits, self.stats.participants,
            )  # fmt: skip
        else:
            self.stats.failed_commits += 1
            log.warning(
                "replica group %d: sync not committed (quorum of %d, error: %s)",
                self.config.replica_group, self.stats.quorum_size, self.manager.errored(),
            )  # fmt: skip
        return ok

    def close(self) -> None:
        """Stops the Manager (does not wait for its threads)."""
        self.manager.shutdown(wait=False)
        self._store = None


def average_gradients_across(link: ReplicaGroupLink, params: Sequence[nn.Parameter]) -> bool:
    """One torchft step of the ``allreduce`` strategy, before its optimizer step: a quorum (a group behind heals
    here), the gradients (averaged inside the group; a missing one counts as zeros) averaged over the quorum's groups
    in one flat buffer, and torchft's vote. Not committed: the gradients are dropped, so the optimizer step leaves
    the parameters and its state alone.

    Returns:
        Whether the step is committed.
    """
    link.start()
    trainable = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
    flat = torch.cat([g.detach().reshape(-1) for g in grads]) if grads else torch.zeros(0)
    link.average_([flat])
    committed = link.commit()
    if not committed:
        drop_grads(trainable)
        return False
    with torch.no_grad():
        for p, g, averaged in zip(trainable, grads, flat.split([g.numel() for g in grads])):
            p.grad = averaged.view_as(g).to(g.dtype)
    return True
