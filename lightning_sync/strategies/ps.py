"""The ``ps`` sync mode: a parameter server. Workers push gradients; servers hold the parameters and step."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sync.algorithms import ps_settings
from lightning_sync.callbacks.straggler import StragglerCallback
from lightning_sync.comm.averaging import OptimizerCallable
from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.peer_errors import PeerError, names_a_silent_peer, rendezvous_timeout_s
from lightning_sync.config import ParameterServerConfig
from lightning_sync.errors import ConfigError
from lightning_sync.ps import (
    CLIP_ALGORITHMS,
    Clip,
    PSClient,
    PSGroup,
    ServerStepOptimizer,
    claim_spare_slot,
    connect_store,
    current_lrs,
    optimizer_spec,
    start_servers,
)
from lightning_sync.ps.elastic import servers_at_end
from lightning_sync.ps.outer import LocalSteps
from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies._lightning import (
    insert_callback_first,
    restore_clip_gradients,
    route_clip_gradients,
    set_global_step,
    set_max_epochs,
)

_FIT_KEY = "lightning_sync/ps/fit"  # "<prefix> <worker ranks> <spare slots> <servers>" of the latest fit, for join
_FITS = itertools.count()  # this process's ps fits: the job's ranks run the same fits, so fit N's key is FIT_KEY/N


class ParameterServerStrategy(SyncStrategyBase):
    """Parameter server over torch.distributed point-to-point: workers push gradients, servers step and reply.

    The Lightning ranks are the workers. The servers, each holding a byte-balanced shard of the parameters and its
    optimizer state, run as processes on node 0 (``dedicated``) or threads of the first workers (``colocated``), on a
    process group of their own. The LightningModule's optimizer is rebuilt on the servers; each push carries the
    worker's learning rates, so LR schedulers on the workers take effect there.

    ``sync`` keeps the workers in lockstep. In ``async`` and ``ssp`` the servers' version counts the steps
    (``max_steps=N``: N pushes; ``max_epochs=E``: E epochs' worth of samples) and the workers never wait for each
    other: each is a world of its own (:attr:`own_world`), tied to the others by the PS group alone. Logged: ``ps/*``
    (see :meth:`step_metrics`).

    Example::

        >>> import lightning.pytorch as pl
        >>> strategy = ParameterServerStrategy(mode="ssp", max_staleness=2, num_servers=1)
        >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> pl.Trainer(strategy="sync_ps", accelerator="cpu", devices=2, logger=False).strategy.config.mode
        'sync'
    """

    config_class = ParameterServerConfig
    strategy_name = "sync_ps"

    def __init__(
        self,
        *,
        mode: str = ParameterServerConfig.mode,
        max_staleness: int = ParameterServerConfig.max_staleness,
        num_servers: int = ParameterServerConfig.num_servers,
        placement: str = ParameterServerConfig.placement,
        compression: str | Compressor = ParameterServerConfig.compression,
        slow_worker: int = ParameterServerConfig.slow_worker,
        slowdown: float = ParameterServerConfig.slowdown,
        push_scale: float | str = ParameterServerConfig.push_scale,
        local_steps: int | str = ParameterServerConfig.local_steps,
        max_local_steps: int = ParameterServerConfig.max_local_steps,
        outer_optimizer: OptimizerCallable | None = ParameterServerConfig.outer_optimizer,
        elastic: bool = ParameterServerConfig.elastic,
        spare_workers: int = ParameterServerConfig.spare_workers,
        join: bool = ParameterServerConfig.join,
        start_method: str = ParameterServerConfig.start_method,
        timeout_s: float = ParameterServerConfig.timeout_s,
        check_consistency_every: int = ParameterServerConfig.check_consistency_every,
        on_mismatch: str = ParameterServerConfig.on_mismatch,
        skip_nonfinite: bool = ParameterServerConfig.skip_nonfinite,
        freeze_gc: bool = ParameterServerConfig.freeze_gc,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(locals())
        self.client: PSClient | None = None
        self.servers: Any | None = None  # the handle of the servers this rank started, if any
        self.last_reply: Any = None
        self.final_server_states: list[dict[str, Any]] | None = None
        self._group: PSGroup | None = None
        self._store: dist.TCPStore | None = None  # the job's store: rank 0 hosts it where each worker is a world
        self._resume_state: dict[str, Any] = {}
        self._clips: dict[int, Clip] = {}  # by id(optimizer): the clipping its next push asks the servers for
        self._local: LocalSteps | None = None  # local_steps > 1: the worker's side of async local SGD
        self._epoch_limit: tuple[pl.Trainer, int | None] | None = None  # own world: the fit's max_epochs, lifted
        self._fitting = False
        self.membership = Membership(elastic=self.tolerates_lost_ranks)
        self._logged: tuple[int, tuple[int, ...]] | None = None  # version and servers' ingress at the last ps/* log

    @override
    def _check_algorithm_knobs(self) -> None:
        """Builds the servers' settings (``max_updates`` is added once training starts)."""
        self._settings = ps_settings(self.config)

    @property
    def tolerates_lost_ranks(self) -> bool:
        """Whether losing a worker rank other than 0 leaves the job running (``async``, ``ssp``, elastic ``sync``).
        Losing rank 0 (the store, dedicated servers) or a server always ends the job."""
        return self.config.mode != "sync" or self.config.elastic

    @property
    def own_world(self) -> bool:
        """Whether this worker is a world of its own, as each replica group is in torchft: in the modes that
        tolerate a lost rank, and for a worker added with ``join``. Its default process group has this one member
        from the start, so Lightning's collectives (``self.log(sync_dist=True)``, torchmetrics, EarlyStopping,
        ModelCheckpoint) act on it alone and no worker waits for another; the PS group ties the workers together."""
        return self.tolerates_lost_ranks or self.config.join

    @property
    def lost_workers(self) -> dict[int, str]:
        """Elastic modes, after the fit: the workers the servers dropped, and why."""
        return self.membership.lost

    @property
    def added_workers(self) -> list[int]:
        """After the fit: the workers added to it in a spare slot (their ranks)."""
        return self.membership.added

    # ------------------------------------------------------------------ launch and setup
    @override
    def configure_launcher(self) -> None:
        """Checks the placement and ``slow_worker`` against the number of ranks (before any rank starts). A worker
        added to a running job (``join``) launches nothing: it is one process, which needs the job's address."""
        world, cfg = self.num_processes * self.num_nodes, self.config
        if cfg.join:
            missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
            if missing:
                raise ConfigError(
                    f"strategy.join=true needs {' and '.join(missing)} in the environment: the address and port of "
                    "the running job's rank 0 (start that job with MASTER_PORT set, and give this process the same)"
                )
            return
        if cfg.placement == "colocated" and cfg.num_servers > world:
            raise ConfigError(
                f"strategy.num_servers={cfg.num_servers} is not allowed with placement='colocated' and {world} "
                f"ranks; colocated servers live in the first ranks, so at most {world}"
            )
        if cfg.slow_worker >= world:
            raise ConfigError(f"strategy.slow_worker={cfg.slow_worker} is not allowed; the ranks are 0..{world - 1}")
        super().configure_launcher()

    @override
    def setup_distributed(self) -> None:
        """Joins the process group as the base does, or, for a worker that is a world of its own
        (:attr:`own_world`), makes a default process group of this one member.

        Raises:
            ConfigError: this process is already in a larger default process group (an earlier fit of another mode).
        """
        if self.own_world and not dist.is_initialized():
            backend = self.process_group_backend or dist.get_default_backend_for_device(self.root_device)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        elif self.own_world and dist.get_world_size() != 1:
            raise ConfigError(
                f"strategy.mode={self.config.mode!r} makes each worker a world of its own, but this process is "
                f"already in a process group of {dist.get_world_size()} ranks (an earlier fit of another mode); "
                "run it in a fresh process"
            )
        super().setup_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """For ``fit``: checks what a server can run, starts the servers and joins their group; in async/ssp,
        lets the servers' version end the run and keeps validation metrics local to each worker."""
        fitting = self._fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
                raise ConfigError(
                    "strategy=ps does not support precision='16-mixed': each worker's GradScaler would "
                    "never see the servers' steps; use 32 or bf16-mixed"
                )
            if self.tolerates_lost_ranks:  # the servers' version ends the run (should_stop), not the worker's epochs
                self._epoch_limit = (trainer, trainer.max_epochs)
                set_max_epochs(trainer, -1)
        super().setup(trainer)
        if fitting:
            self._join_servers()
            if self.own_world and not self.config.join:
                self._share_checkpoint_dirs(trainer)
            slow = self.membership.ps_rank == self.config.slow_worker  # experiments: this worker's batches take
            if slow and not any(isinstance(cb, StragglerCallback) for cb in trainer.callbacks):  # type: ignore[attr-defined]
                insert_callback_first(trainer, StragglerCallback(slowdown=self.config.slowdown))  # slowdown x as long
            if self._settings.local_steps == 1:  # the servers clip (_record_clip); teardown puts the plugin's own
                self._clips = {}  # back. With local steps the workers' own optimizers step, and clip
                route_clip_gradients(self.precision_plugin, self._record_clip)

    def _join_servers(self) -> None:
        """Agrees on a store prefix for this fit, starts this rank's servers, and joins the PS group (worker ranks:
        the job's ranks, then ``spare_workers`` slots; a worker added with ``join`` takes a free one)."""
        cfg, env = self.config, self.cluster_environment
        assert env is not None and self.meter is not None
        host, port = env.main_address, env.main_port
        # rank 0 hosts the store: through its default process group's, or, where each worker is a world of its own,
        # as its own (kept by the strategy for the job)
        hosts = self.global_rank == 0 and self.own_world and not cfg.join
        store = self._store = connect_store(host, port, is_host=hosts, timeout_s=rendezvous_timeout_s(cfg.timeout_s))
        members = self.membership
        members.ps_rank = self.global_rank
        key = _FIT_KEY if cfg.join else f"{_FIT_KEY}/{next(_FITS)}"
        if self.global_rank == 0 and not cfg.join:
            workers, spares = self.num_ranks + cfg.spare_workers, cfg.spare_workers
            fit = f"lightning_sync/ps/{uuid.uuid4().hex} {workers} {spares} {cfg.num_servers}"
            store.set(key, fit)
        else:  # a worker added with join: the running fit's (its servers are up); the others: rank 0's for this fit
            fit = store.get(key).decode()  # (waits for rank 0 as long as the ranks' rendezvous)
        prefix, *counts = fit.split()
        workers, spares, servers = map(int, counts)
        store.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))
        if cfg.join:
            members.ps_rank = claim_spare_slot(store, workers, spares, prefix)
        else:
            self.servers = start_servers(
                cfg.placement, self.global_rank, host, port, workers, servers, timeout_s=cfg.timeout_s,
                prefix=prefix, spare_workers=spares,
            )  # fmt: skip
            if self.global_rank == 0:  # for the workers that take part late
                store.set(_FIT_KEY, fit)
        members.first_workers = workers - spares
        self._group = PSGroup(
            store, members.ps_rank, workers, servers, cfg.timeout_s, prefix=prefix, meter=self.meter, rejoin=cfg.join
        )

    def _share_checkpoint_dirs(self, trainer: pl.Trainer) -> None:
        """Every worker takes rank 0's folder for each ``ModelCheckpoint``: each picks one from its own logger's
        version, and Lightning's broadcast of rank 0's reaches no one in a world of one; through the job's store
        instead, so each worker's sync state lands next to rank 0's checkpoint, where a resume looks for it."""
        assert self._store is not None and self._group is not None
        checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        for i, callback in enumerate(checkpoints):
            key = f"{self._group.prefix}/checkpoint_dir/{i}"
            if self.global_rank == 0:
                self._store.set(key, str(callback.dirpath))
            else:
                callback.dirpath = self._store.get(key).decode()

    @override
    def configure_ddp(self) -> None:
        """Keeps the module unwrapped: the pull at the start of training makes the replicas identical."""

    @override
    def on_train_start(self) -> None:
        """Worker 0 gives the servers their shards (or the checkpoint's states), and every worker pulls."""
        super().on_train_start()
        trainer, module = self.lightning_module.trainer, self.lightning_module
        max_updates = trainer.max_steps  # Lightning counts every optimizer's steps, as the servers do
        by_epochs = max_updates is None or max_updates < 0
        if by_epochs:  # E epochs' worth of samples
            epochs = trainer.max_epochs if self._epoch_limit is None else self._epoch_limit[1]
            assert epochs is not None  # Lightning sets max_epochs when max_steps is unset
            per_batch = 1 if self.config.mode == "sync" else self.membership.first_workers  # one per worker batch
            max_updates = int(epochs) * int(trainer.num_training_batches) * per_batch * len(self.optimizers)
            if self.config.mode == "sync" and not module.automatic_optimization and not self.config.elastic:
                max_updates = None  # steps per batch are the module's: Lightning's own loop ends a lockstep run
        local_steps = self._settings.local_steps  # auto: the fastest worker's count
        if max_updates is not None and local_steps > 1:  # one push per local_steps worker steps
            max_updates = -(-max_updates // local_steps)
        params = [p for p in module.parameters() if p.requires_grad]
        assert self._group is not None
        spec = optimizer_spec(self.optimizers, params)
        # an end in epochs counts the live workers' samples: a lost worker's unused share of the updates is withdrawn
        withdraw = by_epochs and self.config.mode != "sync"  # a sync round is one batch of each live worker already
        settings = dataclasses.replace(
            self._settings, max_updates=max_updates, elastic=self.config.elastic, withdraw_lost_share=withdraw
        )
        self.client = PSClient(self._group, params, spec, settings)
        if not self.config.join:  # (a worker added with join enters a running fit)
            self._group.meet("the start of training", self.membership.first_workers)
        if self.membership.ps_rank == 0:
            self.client.init_servers(self._resume_state.get("servers"))
        if "client" in self._resume_state:
            self.client.load_state_dict(self._resume_state["client"])
        self.last_reply = self.client.pull()
        if self.config.join:  # the step count the servers keep for this worker: its pushes applied, raised to the
            set_global_step(trainer, max(self.last_reply.clocks) * local_steps)  # slowest live worker's
        if local_steps > 1:
            adaptive = self.config.local_steps == "auto"
            lrs = lambda: current_lrs(self.optimizers)  # noqa: E731
            self._local = LocalSteps(self.client, local_steps, lrs, adaptive=adaptive)
            self._local.start()

    @override
    def on_validation_start(self) -> None:
        """In async/ssp during fit, each worker validates the parameters it pulls now (no worker waits for
        another): the servers' latest, not the reply to its last push."""
        super().on_validation_start()
        if self.own_world and self._local is None and self.client is not None and not self.client.stopped:
            self.last_reply = self.client.pull()  # (with local steps, the worker validates its own replica)

    # ------------------------------------------------------------------ the step
    @override
    def _optimizer_to_step(self, optimizer: Optimizer) -> Any:
        """The optimizer with a push in place of ``step``: ``on_before_optimizer_step`` and clipping see this
        worker's gradients, which are then pushed, and the model then holds the servers' fresh parameters."""
        return optimizer if self._settings.local_steps > 1 else ServerStepOptimizer(optimizer, self._push)

    @override
    def _skipping_nonfinite(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """The closure as it is: the push carries the check and the servers skip (:meth:`_push` counts it). With
        local steps, an inner step is skipped on the worker, as in the other modes."""
        if self._settings.local_steps > 1:
            return super()._skipping_nonfinite(closure, optimizer)
        return closure

    @override
    def on_sync_step_end(self) -> None:
        """With local steps: every ``local_steps`` inner steps, the pseudo-gradient goes to the servers."""
        if self._local is None or self.final_server_states is not None:
            return
        self._prepare_push()
        reply = self._local.after_step()
        if reply is not None:
            self._take_reply(reply)

    def _push(self, optimizer: Optimizer) -> None:
        assert self.client is not None
        if self.final_server_states is not None:  # the run ended at an earlier step of this batch (manual
            return  # optimization: several opt.step() per batch); the model holds the final parameters
        self._prepare_push()
        index = next((i for i, opt in enumerate(self.optimizers) if opt is optimizer), 0)
        clip = self._clips.pop(id(optimizer), None)
        self._take_reply(self.client.push(current_lrs(self.optimizers), index, clip))

    def _record_clip(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        """Stands in for the precision plugin's ``clip_gradients``: the clipping goes with ``optimizer``'s next push
        (none for ``clip_val`` ``None`` or ``<= 0``), and the servers clip what they step with (in sync the average of
        the workers' gradients, as DDP clips the all-reduced gradient)."""
        if clip_val is None or float(clip_val) <= 0:
            return
        algorithm = CLIP_ALGORITHMS[str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))]
        if isinstance(optimizer, LightningOptimizer):  # manual optimization hands the wrapper in
            optimizer = optimizer.optimizer
        self._clips[id(optimizer)] = Clip(algorithm, float(clip_val))

    def _prepare_push(self) -> None:
        assert self.client is not None
        if self.servers is not None:
            self.servers.raise_if_failed()
        if self.lightning_module.trainer.should_stop and not self.client.stopped:  # e.g. EarlyStopping: stop all
            self.client.request_stop()

    def _take_reply(self, reply: Any) -> None:
        trainer = self.lightning_module.trainer
        self.last_reply = reply
        if self.last_reply.skipped:  # a NaN or Inf gradient (skip_nonfinite): in sync every worker skipped it
            self._count_skipped_step(alone=self.config.mode != "sync")
        if self.last_reply.stop:
            trainer.should_stop = True
            self.end_mode_run()

    @override
    def step_metrics(self, write: bool) -> dict[str, float]:
        """``comm/*`` as the base logs them, plus, when written, the last reply's ``ps/version``; ``ps/staleness``
        (async, ssp); each server's ingress per update since the last written reply; and in the elastic modes, the
        workers each server counts as live, has dropped, and the rejoins it accepted."""
        metrics, reply = super().step_metrics(write), self.last_reply
        if not write or reply is None:
            return metrics
        metrics["ps/version"] = float(reply.version)
        if reply.stalest >= 0 and self.config.mode != "sync":
            metrics["ps/staleness"] = float(reply.stalest)
        if self.tolerates_lost_ranks:
            for i, (live, lost, joins) in enumerate(zip(reply.live_workers, reply.lost_workers, reply.joins)):
                metrics[f"ps/server{i}_live_workers"] = float(live)
                metrics[f"ps/server{i}_lost_workers"] = float(lost)
                metrics[f"ps/server{i}_joins"] = float(joins)
        if self._logged is not None and reply.version > self._logged[0]:
            for i, (now, then) in enumerate(zip(reply.server_bytes_recv, self._logged[1])):
                metrics[f"ps/server{i}_ingress_per_update"] = (now - then) / (reply.version - self._logged[0])
        self._logged = (reply.version, reply.server_bytes_recv)
        return metrics

    @override
    def _reported_cause(self, error: PeerError) -> str | None:
        """The failure another member of the PS group left in its store (a worker that lost a server), if any.

        A silent rank is often itself waiting on a frozen server, so its report is waited for, up to half of
        ``timeout_s`` (plus a second), and the error names the server, not only the rank that waited on it.
        """
        group = self._group
        if group is None:
            return None
        deadline = time.monotonic() + (self.config.timeout_s / 2 + 1.0 if names_a_silent_peer(error) else 0.0)
        while (reported := group.first_reported_failure()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return None if reported is None else f"{group.name(reported[0])} reported: {reported[1]}"

    # ------------------------------------------------------------------ Lightning's view of a world of its own
    @property
    @override
    def world_size(self) -> int:
        """1 for a worker that is a world of its own (:attr:`own_world`), as its default process group says."""
        return 1 if self.own_world else super().world_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """During ``fit``, this worker's shard of each dataset (the job's ranks share them); the whole dataset for a
        worker added with ``join``, and outside ``fit`` for a worker that is a world of its own, whose test and
        predict then cover every sample."""
        if self.config.join or (self.own_world and not self._fitting):
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    # ------------------------------------------------------------------ the end, and checkpoints
    @override
    def on_train_end(self) -> None:
        """Ends the servers' run if Lightning stopped first (see :meth:`end_mode_run`)."""
        super().on_train_end()
        self.end_mode_run()

    def end_mode_run(self) -> None:
        """After the run: each pulls the final parameters, worker 0 keeps the servers' state, all say goodbye.
        Called first in ``on_train_end`` by :class:`~lightning_sync.callbacks.SyncMetricsLogger`, so that the other
        callbacks see the final parameters, then by :meth:`on_train_end` (a no-op)."""
        if self.client is None or self.final_server_states is not None:
            return
        if not self.client.stopped:
            self.client.request_stop()
        self.last_reply = self.client.pull()
        self.membership.take_at_end(self.client, self.config.timeout_s)
        self.final_server_states = self.client.server_states() if self.membership.ps_rank == 0 else []
        self.client.close()

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        """Each worker adds its gradient codec's state; worker 0 every server's (parameters, optimizer, clocks)."""
        state = super().sync_state_dict()
        if self.client is not None:
            state["client"] = self.client.state_dict()
            if self.membership.ps_rank == 0:
                final = self.final_server_states
                state["servers"] = self.client.server_states() if final is None else final
        return state

    @override
    def _authority_pull(self) -> Any | None:
        """The servers hold the authoritative parameters: ``on_mismatch="resync"`` pulls them (with local steps, the
        next interval starts from them)."""
        return None if self.client is None else self._pull_from_servers

    def _pull_from_servers(self) -> Any:
        assert self.client is not None
        reply = self.client.pull()
        if self._local is not None:
            self._local.start()
        return reply

    @override
    def check_replicas(self, atol: float = 0.0) -> list[Any]:
        """With local steps, only right after a push (every sync worker pushes at the same step); a worker that is a
        world of its own has no one to compare with."""
        if self._local is not None and self._local.steps != 0:
            return []
        return super().check_replicas(atol)

    @override
    def tensors_to_check(self) -> dict[str, Any]:
        """With local steps, the parameters only: each worker's inner optimizer state is its own."""
        if self._local is None:
            return super().tensors_to_check()
        return dict(self.lightning_module.named_parameters())

    @override
    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Keeps the state for :meth:`on_train_start`, once the servers and the client exist."""
        super().load_sync_state_dict(state)
        self._resume_state = state

    @override
    def teardown(self) -> None:
        """Ends this rank's servers (awaited after a clean run, stopped after a failure), then tears down."""
        if self._epoch_limit is not None:
            set_max_epochs(*self._epoch_limit)
            self._epoch_limit = None
        restore_clip_gradients(self.precision_plugin)
        servers, self.servers, self.client = self.servers, None, None
        if servers is not None and self.final_server_states is None:
            servers.stop()
        elif servers is not None:
            servers.finish(self.config.timeout_s)
        super().teardown()


class Membership:
    """Who takes part in the ``ps`` fit: this worker's rank in the PS group, the workers the fit started with, and
    at the end, the workers the servers dropped (and why) and took in a spare slot, by worker rank.

    Args:
        elastic: whether a lost worker leaves the job running (then :meth:`take_at_end` asks the servers).
    """

    def __init__(self, elastic: bool) -> None:
        self.elastic = elastic
        self.ps_rank = -1  # this worker's rank in the PS group: its global rank, or (join) the spare slot it took
        self.first_workers = 0  # the workers the fit started with (the PS group's worker ranks before the spare slots)
        self.lost: dict[int, str] = {}  # elastic modes: the workers the servers dropped, and why
        self.added: list[int] = []  # the workers added to the run in a spare slot (their ranks)

    def take_at_end(self, client: Any, timeout_s: float) -> None:
        """After the stop, before the goodbye (elastic modes): who was lost once every worker is accounted for
        (:func:`~lightning_sync.ps.elastic.servers_at_end`), and the servers' joins: a join in a spare slot (a
        rank of ``first_workers`` or more) is an added worker. Worker 0 names each in a warning."""
        if not self.elastic:
            return
        grace = timeout_s + min(timeout_s / 4, 5.0) + 5.0
        self.lost, stats = servers_at_end(client, grace)
        joined = {int(worker) for server in stats for worker in server.get("joins", {})}
        self.added = sorted(w for w in joined if w >= self.first_workers)
        if self.ps_rank == 0 and self.lost:
            names = "; ".join(f"worker {w} (rank {w}): {why}" for w, why in self.lost.items())
            warnings.warn(f"the ps run ended on the live workers; lost: {names}", stacklevel=2)
        if self.ps_rank == 0 and self.added:
            names = ", ".join(f"worker {w}" for w in self.added)
            warnings.warn(f"the ps run took in workers added to it: {names}", stacklevel=2)
