"""What every lightning_sync strategy shares: config, launcher, meter, metrics, consistency checks, checkpoint state.

:class:`SyncStrategyBase` is a Lightning ``DDPStrategy`` (process group setup, sampler injection, launchers and
teardown come from it) that connects the algorithms of :mod:`lightning_sync.comm` to the Lightning lifecycle.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import textwrap
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Self, override

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.consistency import TensorMismatch, check_replicas, check_same_structure, named_replicated_state
from lightning_sync.comm.meter import CommMeter, CommStats
from lightning_sync.comm.nonfinite import NonFiniteStepWarning, drop_grads, grads_are_finite, skipped_step_message
from lightning_sync.comm.peer_errors import PeerError, naming_peer, rendezvous_timeout_s
from lightning_sync.config import StrategyConfig, knob_docs
from lightning_sync.errors import CheckpointError, ConfigError
from lightning_sync.ft.config import as_fault_tolerance, require_torchft
from lightning_sync.strategies._gradients import GradientAllReduce
from lightning_sync.strategies._launcher import configure_launcher
from lightning_sync.strategies._lightning import LightningDDPHooks, insert_callback_first

LIGHTNING_ARGUMENTS: dict[str, str] = {
    "accelerator": "Lightning's accelerator (``None``: the Trainer's).",
    "parallel_devices": "The devices of this node's ranks (``None``: the Trainer's).",
    "cluster_environment": "How the ranks find each other (``None``: the one the Trainer detects).",
    "checkpoint_io": "The plugin that writes and reads checkpoints (``None``: Lightning's).",
    "precision_plugin": "The precision plugin (``None``: the one of the Trainer's ``precision``).",
    "process_group_backend": "The torch.distributed backend (``None``: ``nccl`` on CUDA, else ``gloo``).",
}
"""Lightning's own strategy arguments, which every mode's constructor takes as ``DDPStrategy`` does."""


_frozen_fits = 0  # fits in this process that froze the heap (``freeze_gc``) and have not released it


def freeze_startup_heap() -> None:
    """Exempts everything alive from later garbage collections (until :func:`release_startup_heap`).

    A full collection walks every tracked object (hundreds of thousands once torch and Lightning are loaded) and can
    outlast many small steps, on a random rank that every other rank then waits for; ``gc.freeze`` (free: it splices
    lists) leaves the collector only what training allocates.
    """
    global _frozen_fits
    gc.freeze()
    _frozen_fits += 1


def release_startup_heap() -> None:
    """Returns the frozen objects to the collector, once the last fit that froze them has released them."""
    global _frozen_fits
    if _frozen_fits > 0:
        _frozen_fits -= 1
        if _frozen_fits == 0:
            gc.unfreeze()


def _args_section(strategy: type) -> str:
    """Says where ``strategy``'s constructor arguments come from, then its Google-style ``Args:``: each parameter, in
    signature order, with its help (a field's of the strategy's ``config_class``, or a Lightning argument's)."""
    config = strategy.config_class  # type: ignore[attr-defined]
    docs = {**knob_docs(config), **LIGHTNING_ARGUMENTS}
    lines = [
        f"Takes the fields of :class:`~lightning_sync.config.{config.__name__}` and Lightning's own strategy arguments,",
        "as keyword arguments (see :class:`~lightning_sync.strategies._base.SyncStrategyBase`).",
        "",
        "Args:",
    ]
    for name in list(inspect.signature(strategy.__init__).parameters)[1:]:  # type: ignore[misc]  # after self
        lines += textwrap.wrap(
            f"{name}: {docs.get(name, '')}", 116, initial_indent="    ", subsequent_indent="        ",
            break_long_words=False, break_on_hyphens=False,
        )  # fmt: skip
    return "\n".join(lines)


def join_default_group(strategy: Any) -> None:
    """Joins the default process group through a ``TCPStore`` that waits :func:`rendezvous_timeout_s` for the ranks
    and then ``timeout_s`` for any key; the group's collectives wait ``timeout_s``. Lightning then leaves the group.

    Under torchrun the agent's store outlives a restart, so each attempt's keys are prefixed by its restart count: a
    restarted rank would otherwise read a peer's address from the failed attempt ("Gloo connectFullMesh failed",
    torch issue #135712; ``tests/test_restart.py``).

    Args:
        strategy: a lightning_sync strategy whose world ranks are set (``set_world_ranks``).
    """
    if dist.is_initialized():
        return
    env, timeout_s = strategy.cluster_environment, strategy.config.timeout_s
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env.main_address,
        env.main_port,
        strategy.world_size,
        is_master=strategy.global_rank == 0 and not agent_store,
        timeout=timedelta(seconds=rendezvous_timeout_s(timeout_s)),
        wait_for_workers=True,
        multi_tenant=True,  # as torch's env:// rendezvous: other stores of this process may share the port
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)  # as Lightning does
    device = strategy.root_device
    backend = strategy.process_group_backend or dist.get_default_backend_for_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_sync/attempt_{attempt}", store),
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=None if device.type == "cpu" else device,
    )
    if backend == "nccl":  # as Lightning does: torch warns at exit about an NCCL group left alive
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


_CHECKPOINT_KEY = "lightning_sync"
_WEIGHTS_ONLY_HINT = (
    "to start a new run from its weights only, load them into the module (e.g. Module.load_from_checkpoint) and fit "
    "without ckpt_path"
)


def sync_state_path(checkpoint_path: str | Path, rank: int) -> Path:
    """The file holding rank ``rank``'s sync state, next to the checkpoint ``checkpoint_path`` (a symlink, as
    ``ModelCheckpoint(save_last="link")`` writes for ``last.ckpt``, is followed to the file it names)."""
    path = Path(checkpoint_path)
    if path.is_symlink():
        path = path.resolve()
    return path.with_name(f"{path.name}.rank{rank}.pt")


def _read_checkpoint(path: Path, load: Callable[[], Any]) -> Any:
    """``load()``, the reading of ``path``.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt or not a PyTorch checkpoint.
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
    try:
        return load()
    except Exception as error:  # torch.load raises many types for a truncated or foreign file
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); the file is truncated, "
            "corrupt or not a PyTorch checkpoint"
        ) from error


def _check_resumable(checkpoint: Any, path: Path, strategy: str, ranks: int, rank: int) -> Path:
    """Checks that Lightning's ``checkpoint`` (read from ``path``) was saved by a ``strategy`` run of ``ranks``
    ranks, with rank ``rank``'s sync-state file next to it.

    Returns:
        That file (:func:`sync_state_path`).

    Raises:
        CheckpointError: it is not a Lightning checkpoint, has no lightning_sync state, was saved by another
            strategy or another number of ranks, or the rank's file is missing.
    """
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
    saved = checkpoint.get(_CHECKPOINT_KEY)
    if saved is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no lightning_sync state (it was saved by another strategy, e.g. "
            f"Lightning's own), so this {strategy!r} run cannot resume from it; {_WEIGHTS_ONLY_HINT}"
        )
    if saved.get("strategy") != strategy:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved by strategy {saved.get('strategy')!r}, this run uses "
            f"{strategy!r}; resume with the same strategy, or {_WEIGHTS_ONLY_HINT}"
        )
    if saved.get("world_size") != ranks:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved by {saved.get('world_size')} ranks, this run has "
            f"{ranks}; resume with the same number of ranks, or {_WEIGHTS_ONLY_HINT}"
        )
    own = sync_state_path(path, rank)
    if not own.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no sync state of rank {rank}: {str(own)!r} does not exist "
            "(each rank writes its own file next to the checkpoint; copy or move them together)"
        )
    return own


class SyncMetricsLogger(pl.Callback):
    """Logs a lightning_sync strategy's metrics (``comm/*``, ``sync/*``) after each training batch.

    Logs ``trainer.strategy.step_metrics(write)`` with ``LightningModule.log_dict`` (on step, not synced across ranks);
    ``write``: whether the logger writes this step (``global_step`` a multiple of ``log_every_n_steps``, or the end).
    """

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_metrics = getattr(trainer.strategy, "step_metrics", None)
        if step_metrics is None:
            return
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
        metrics = step_metrics((every > 0 and trainer.global_step % every == 0) or trainer.should_stop)
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """First among the callbacks' ``on_train_end``: a mode whose run outlasts Lightning's loop (``ps``: the servers'
        run, and the final pull) ends it, so the other callbacks see the final parameters."""
        end_mode_run = getattr(trainer.strategy, "end_mode_run", None)
        if end_mode_run is not None:
            end_mode_run()


class SyncStrategyBase(LightningDDPHooks):
    """Base of the lightning_sync strategies.

    A mode's constructor lists the fields of its config dataclass (``config_class``) as keyword arguments, each
    defaulting to the field's default (``comm_hook: str = DDPConfig.comm_hook``), then :data:`LIGHTNING_ARGUMENTS`,
    and passes its ``locals()`` here: IDEs, type checkers and LightningCLI see every knob, and the dataclass alone
    holds the defaults and validates them. :meth:`__init_subclass__` fills the ``Args:`` in from the fields' help.

    A mode holds its algorithm objects and this class forwards Lightning's hooks to them (a mode that all-reduces
    gradients by hand sets :attr:`gradients`). Every mode gets here the replica checks (:meth:`check_replicas`),
    Lightning's collectives with a lost peer named, and per-rank sync state in checkpoints (:meth:`save_checkpoint`).

    Args:
        arguments: the mode's constructor arguments, by name: one per field of ``config_class`` and one per
            Lightning argument (other names, such as ``self``, are ignored).

    Raises:
        ConfigError: a bad value, named ``strategy.<knob>`` (raised here, in the launching process, before any rank
            starts).

    Attributes:
        config: the validated config.
        meter: the communication meter (made in :meth:`setup_environment`, once the process group exists).
        gradients: the hand-made gradient all-reduce, where the mode has one (``None``: torch DDP, or none).
        fault_tolerance: the ``fault_tolerance`` knob of ``allreduce`` and ``periodic`` (``None``: none): the
            strategy's ranks are one replica group of :mod:`lightning_sync.ft`.
        skipped_steps: optimizer steps skipped because the gradients held a NaN or Inf (``skip_nonfinite``).
    """

    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    strategy_name: ClassVar[str] = ""
    """The name registered with Lightning's ``StrategyRegistry`` (the first docstring line is its description)."""
    config: Any  # a config_class instance: each mode reads its own knobs
    if TYPE_CHECKING:  # Lightning's is Optional; the hooks here run once the Trainer connected the module

        @property
        def lightning_module(self) -> Any: ...

    def __init__(self, arguments: Mapping[str, Any]) -> None:
        self.gradients: GradientAllReduce | None = None  # a mode's _check_algorithm_knobs may build it
        try:
            self.config = self.config_class.from_arguments(arguments)
            self.fault_tolerance = as_fault_tolerance(getattr(self.config, "fault_tolerance", None))
            if self.fault_tolerance is not None:
                require_torchft()  # a one-line error naming the lightning-sync[ft] extra
            self._check_algorithm_knobs()
        except ConfigError as error:
            raise error.under("strategy") from None
        lightning = {name: arguments[name] for name in LIGHTNING_ARGUMENTS}
        super().__init__(
            **lightning, start_method=self.config.start_method, timeout=timedelta(seconds=self.config.timeout_s),
            **self._torch_ddp_kwargs(),
        )  # fmt: skip
        self.meter: CommMeter | None = None
        self.skipped_steps = 0
        self._sync_steps = 0
        self._steps_unlogged = 0
        self._heap_frozen = False
        self._pending_sync_state: dict[str, Any] | None = None
        self._pending_optimizer_states: list[dict[str, Any]] | None = None
        self._comm_resumed = CommStats()
        self._comm_before_training: CommStats | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Appends :func:`_args_section` to the docstring of a mode that defines its constructor (unless it has
        ``Args:``)."""
        super().__init_subclass__(**kwargs)
        doc = inspect.cleandoc(cls.__doc__ or "")
        if "__init__" in vars(cls) and doc and "\nArgs:\n" not in doc:
            cls.__doc__ = doc + "\n\n" + _args_section(cls)

    @classmethod
    def from_config(cls, config: StrategyConfig, **lightning: Any) -> Self:
        """The strategy with ``config``'s knobs (a ``config_class`` instance) and Lightning's arguments ``lightning``."""
        return cls(**config.knobs(), **lightning)

    def _check_algorithm_knobs(self) -> None:
        """Checks the knobs that the mode's algorithms own, by building what can be built before launch."""

    def _torch_ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for torch's ``DistributedDataParallel`` (only the ``ddp`` mode wraps)."""
        return {}

    # ------------------------------------------------------------------ launch and setup
    @override
    def configure_launcher(self) -> None:
        """Lightning's launcher for the start method, Hydra-aware for ``popen`` (see ``_launcher``)."""
        configure_launcher(self, super().configure_launcher)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With fault tolerance, this group's ranks read shard ``replica_group`` of ``num_replica_groups``."""
        kwargs, ft = super().distributed_sampler_kwargs, self.fault_tolerance
        if ft is None:
            return kwargs
        size = int(kwargs["num_replicas"])
        return dict(kwargs, num_replicas=size * ft.num_replica_groups, rank=ft.replica_group * size + kwargs["rank"])

    @override
    def setup_distributed(self) -> None:
        """Joins the process group (:func:`join_default_group`: the ranks
        meet within ``rendezvous_timeout_s(timeout_s)``), then sets up as Lightning does."""
        self.set_world_ranks()
        join_default_group(self)
        super().setup_distributed()

    @override
    def setup_environment(self) -> None:
        """Joins the process group and makes the meter.

        With ``fork``, the child is first pinned to one OpenMP thread: a forked child deadlocks in libgomp when the
        parent had run a multi-threaded op.
        """
        if self.config.start_method == "fork":
            torch.set_num_threads(1)
        super().setup_environment()
        self.meter = CommMeter(timeout_s=self.config.timeout_s)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Sets up the model and optimizers, restores sync state from a checkpoint being resumed, and adds the
        :class:`SyncMetricsLogger` callback (first: the other callbacks' batch-end hooks see this step's metrics).

        Raises:
            ReplicaMismatchError: the ranks' models have different parameters or buffers (names, shapes, dtypes);
                checked first, as a collective on them would fail or hang.
        """
        if self.world_size > 1 and self.model is not None:
            check_same_structure([*self.model.named_parameters(), *self.model.named_buffers()])
        super().setup(trainer)
        if self._pending_sync_state is not None:
            self.load_sync_state_dict(self._pending_sync_state)
            self._pending_sync_state = None
        if not any(isinstance(cb, SyncMetricsLogger) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            insert_callback_first(trainer, SyncMetricsLogger())  # other callbacks see this step's metrics

    def _broadcast_from_rank0(self, tensors: Any) -> None:
        """Every rank takes rank 0's values of ``tensors`` (parameters, buffers), through the meter."""
        assert self.meter is not None
        with torch.no_grad():
            for tensor in tensors:
                self.meter.broadcast(tensor.data, src=0)

    def _setup_gradients(self) -> None:
        """For a mode that keeps the module unwrapped (from ``configure_ddp``): every rank takes rank 0's parameters
        and buffers (ranks seeded differently start identical), then :attr:`gradients`, if any, is set up."""
        assert self.model is not None and self.meter is not None
        self._broadcast_from_rank0([*self.model.parameters(), *self.model.buffers()])
        if self.gradients is not None:
            self.gradients.setup(self, self.meter)

    @override
    def on_train_start(self) -> None:
        """Starts the per-step meter count at the first step (setup traffic is not a step's), and freezes the
        start-up heap if ``freeze_gc`` (:func:`freeze_startup_heap`)."""
        super().on_train_start()
        if self.meter is not None:
            self._comm_before_training = self.meter.total
            self.meter.step()
            self._steps_unlogged = 0
        if self.config.freeze_gc and not self._heap_frozen:
            freeze_startup_heap()
            self._heap_frozen = True

    @override
    def teardown(self) -> None:
        """Removes the gradient hooks, returns the heap frozen at train start to the garbage collector, then tears
        down as Lightning's DDP does."""
        if self.gradients is not None:
            self.gradients.close()
        if self._heap_frozen:
            release_startup_heap()
            self._heap_frozen = False
        super().teardown()

    # ------------------------------------------------------------------ backward (with :attr:`gradients`)
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Opens a gradient sync round before each backward that is not inside :meth:`block_backward_sync` (and
        whose step syncs gradients)."""
        if self.gradients is None:
            super().pre_backward(closure_loss)
        elif self._syncs_gradients:
            self.gradients.start_round()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: backward only accumulates locally."""
        with super().block_backward_sync() if self.gradients is None else self.gradients.no_sync():
            yield

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the step (on :meth:`_optimizer_to_step`, the closure wrapped by :meth:`_closure_with_sync`), then the
        mode's end-of-step work, and checks replicas if asked to."""
        stepping = self._optimizer_to_step(optimizer)
        output = super().optimizer_step(
            stepping, self._skipping_nonfinite(self._closure_with_sync(closure), optimizer), model, **kwargs
        )
        self._sync_steps += 1
        self._steps_unlogged += 1
        self.on_sync_step_end()
        every = self.config.check_consistency_every
        if every and self._sync_steps % every == 0:
            self.check_replicas()
        return output

    def _optimizer_to_step(self, optimizer: Optimizer) -> Any:
        """What Lightning's step calls ``step(closure)`` on: the optimizer, or a mode's stand-in for it."""
        return optimizer

    def _closure_with_sync(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure to step with (forward, backward); with :attr:`gradients`, the sync is finished right after the
        closure's backward, so ``on_before_optimizer_step``, clipping, the grad scaler's unscale and the optimizer
        all see the averaged gradients."""
        gradients = self.gradients
        if gradients is None:
            return closure

        def closure_then_sync() -> Any:
            result = closure()
            assert self.model is not None
            gradients.finish(list(self.model.parameters()))
            return result

        return closure_then_sync

    def _skipping_nonfinite(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure``, then, if the (synced) gradients hold a NaN or Inf, the step is skipped and counted (see
        :mod:`lightning_sync.comm.nonfinite`; with a GradScaler the scaler skips it)."""
        if not self.config.skip_nonfinite:
            return closure

        def run() -> Any:
            output = closure()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            # the synchronizer's verdict on this round, taken once (it checked each bucket as it arrived), or else
            verdict = None if self.gradients is None else self.gradients.take_finite_verdict()  # the gradients' own
            if not (grads_are_finite(params) if verdict is None else verdict):
                self._count_skipped_step(alone=not self._syncs_gradients)
                if getattr(self.precision_plugin, "scaler", None) is None:
                    drop_grads(params)
                compressor = self._active_compressor()
                if compressor is not None:
                    compressor.forget_nonfinite()
            return output

        return run

    @property
    def _syncs_gradients(self) -> bool:
        """Whether the coming optimizer step all-reduces gradients (a mode with local steps says no for those)."""
        return True

    def _count_skipped_step(self, alone: bool) -> None:
        """Counts an optimizer step skipped for a NaN or Inf gradient and warns, naming the mode and the step: on
        rank 0 for a step every rank skipped together, on this rank for one it skipped ``alone``."""
        self.skipped_steps += 1
        mode = self.strategy_name.removeprefix("sync_")
        if getattr(self.config, "mode", None):
            mode += f" ({self.config.mode})"
        step = self.lightning_module.trainer.global_step
        if alone:
            warnings.warn(skipped_step_message(mode, step, self.global_rank), NonFiniteStepWarning, stacklevel=2)
        else:
            rank_zero_warn(skipped_step_message(mode, step), category=NonFiniteStepWarning)

    def on_sync_step_end(self) -> None:
        """Called after every optimizer step that the strategy took: advances the compressors' step counts."""
        if self.gradients is not None:
            self.gradients.end_step()

    # ------------------------------------------------------------------ metrics
    def step_metrics(self, write: bool) -> dict[str, float]:
        """The metrics to log after a training batch (called by
        :class:`SyncMetricsLogger`): ``ft/*`` with fault tolerance, and
        ``comm/*``.

        Args:
            write: whether the logger writes this step. Only then are ``comm/*`` returned, as the mean per
                optimizer step since the last write (each logged key costs Lightning about a millisecond).
        """
        metrics = {} if self.gradients is None else self.gradients.pop_metrics()
        if not write or self.meter is None or self._steps_unlogged == 0:
            return metrics
        steps, self._steps_unlogged = self._steps_unlogged, 0
        metrics.update({key: value / steps for key, value in self.meter.step().as_metrics().items()})
        if self.config.skip_nonfinite:
            metrics["sync/skipped_steps"] = float(self.skipped_steps)
        return metrics

    # ------------------------------------------------------------------ Lightning's collectives, a lost peer named
    def _reported_cause(self, error: PeerError) -> str | None:
        """What another process reported as its failure, where the mode keeps such reports (none here).

        Args:
            error: this rank's failure, naming the silent or lost peer.
        """
        return None

    @contextmanager
    def _naming_lost_peer(self, op: str) -> Iterator[None]:
        """Lightning's collective ``op``: a failure that a silent or lost peer caused (the Trainer's collectives run
        between the mode's own, so a killed rank often surfaces here first, as gloo's bare "Connection closed by
        peer") is raised as a :class:`~lightning_sync.comm.peer_errors.PeerError` naming it, plus the cause that
        peer reported, if any; other failures are left as they are."""
        try:
            with naming_peer(op, None, self.config.timeout_s):
                yield
        except PeerError as error:
            cause = self._reported_cause(error)
            if cause is None:
                raise
            raise PeerError(f"{error}; {cause}") from error.__cause__

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier; a silent or lost rank is named."""
        with self._naming_lost_peer("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; a silent or lost rank is named."""
        with self._naming_lost_peer("broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's reduce (``self.log(sync_dist=True)``, ``reduce_boolean_decision``); a silent or lost rank is
        named."""
        with self._naming_lost_peer("reduce"):
            return super().reduce(tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's all_gather; a silent or lost rank is named."""
        with self._naming_lost_peer("all_gather"):
            return super().all_gather(tensor, *args, **kwargs)

    # ------------------------------------------------------------------ replica consistency
    def tensors_to_check(self) -> dict[str, torch.Tensor]:
        """What must be identical on every rank after the current step, by name: the floating parameters, buffers
        and optimizer state (every rank steps on the same gradients; ``ps``'s local optimizer never steps)."""
        return named_replicated_state(self.lightning_module, self.optimizers)

    def check_replicas(self, atol: float = 0.0) -> list[TensorMismatch]:
        """Checks that every rank holds the same :meth:`tensors_to_check`, and acts as ``on_mismatch`` says (see
        :func:`~lightning_sync.comm.consistency.check_replicas`).

        Returns:
            The tensors that differ (empty: none, or one rank).
        """
        if self.world_size == 1:
            return []
        return check_replicas(
            self.tensors_to_check(), self._sync_steps, self.config.on_mismatch, atol=atol, pull=self._authority_pull()
        )

    def _authority_pull(self) -> Callable[[], Any] | None:
        """How ``on_mismatch="resync"`` fetches the authoritative parameters before rank 0's (``None``: rank 0 is
        the authority)."""
        return None

    # ------------------------------------------------------------------ checkpoint
    def _active_compressor(self) -> Compressor | None:
        """The compressor whose memory belongs in checkpoints (``None``: none yet, or the mode has none)."""
        return None if self.gradients is None else self.gradients.compressor

    @property
    def num_ranks(self) -> int:
        """The job's ranks, as launched (``world_size`` reads 1 where a mode makes each rank a world of its own)."""
        return self.num_nodes * self.num_processes

    @property
    def keeps_replicas_identical(self) -> bool:
        """Whether every rank's model and optimizer state are the same after each step (then Lightning's copy of
        rank 0's is all a resume needs)."""
        return True

    @property
    def comm_totals(self) -> CommStats:
        """This training's communication so far, summed over the runs it was resumed through (each run's setup
        traffic, the broadcast of rank 0's model, is not counted)."""
        if self.meter is None or self._comm_before_training is None:
            return self._comm_resumed
        return self._comm_resumed + (self.meter.total - self._comm_before_training)

    def sync_state_dict(self) -> dict[str, Any]:
        """This rank's sync state: counters, compressor memory, communication totals, :attr:`gradients`' state and
        (when replicas may differ) its own model and optimizer state; modes add their own."""
        state: dict[str, Any] = {
            "sync_steps": self._sync_steps,
            "skipped_steps": self.skipped_steps,
            "comm": vars(self.comm_totals).copy(),
        }
        compressor = self._active_compressor()
        if compressor is not None:
            state["compressor"] = compressor.state_dict()
        if self.gradients is not None:
            state["synchronizer"] = self.gradients.state_dict()
        if not self.keeps_replicas_identical:
            state["module_state"] = self.lightning_module.state_dict()
            state["optimizer_states"] = [opt.state_dict() for opt in self.optimizers]
        return state

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`sync_state_dict` returned on this rank, once the strategy is set up (the optimizer
        states come later, in :meth:`load_optimizer_state_dict`, after Lightning's own)."""
        self._sync_steps = int(state["sync_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "module_state" in state:
            self.lightning_module.load_state_dict(state["module_state"])
        self._comm_resumed = CommStats(**state.get("comm", {}))
        compressor = self._active_compressor()
        if compressor is not None and "compressor" in state:
            compressor.load_state_dict(state["compressor"])
        if self.gradients is not None and "synchronizer" in state:
            self.gradients.load_state_dict(state["synchronizer"])

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes Lightning's checkpoint, marked with the strategy and the number of ranks; every rank writes
        its own sync state next to it (:func:`sync_state_path`). Called on
        every rank (Lightning's ``Trainer.save_checkpoint`` waits at a barrier afterwards); no rank sends its state
        to another."""
        checkpoint[_CHECKPOINT_KEY] = {"strategy": self.strategy_name, "world_size": self.num_ranks}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        own = sync_state_path(filepath, self.global_rank)
        self.checkpoint_io.save_checkpoint(self.sync_state_dict(), own)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Rank 0 removes Lightning's file, every rank its own sync-state file (``ModelCheckpoint`` calls this on
        every rank)."""
        super().remove_checkpoint(filepath)
        self.checkpoint_io.remove_checkpoint(sync_state_path(filepath, self.global_rank))

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the checkpoint (Lightning's file, as ``weights_only`` says) and this rank's sync-state file (with
        ``weights_only=True`` unless ``weights_only`` is ``False``), and keeps that state to restore once the
        strategy is set up.

        Raises:
            CheckpointError: see :func:`_read_checkpoint` and :func:`_check_resumable`.
        """
        path = Path(checkpoint_path)
        checkpoint = _read_checkpoint(path, lambda: super(SyncStrategyBase, self).load_checkpoint(path, weights_only))
        own = _check_resumable(checkpoint, path, self.strategy_name, self.num_ranks, self.global_rank)
        self._pending_sync_state = _read_checkpoint(
            own, lambda: self.checkpoint_io.load_checkpoint(own, weights_only=weights_only is not False)
        )
        self._pending_optimizer_states = self._pending_sync_state.get("optimizer_states")
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's restore (rank 0's optimizer state on every rank), then, where the mode lets ranks' states
        differ, this rank's own state from the checkpoint."""
        super().load_optimizer_state_dict(checkpoint)
        if self._pending_optimizer_states is not None:
            for optimizer, state in zip(self.optimizers, self._pending_optimizer_states):
                optimizer.load_state_dict(state)  # moves the state to each parameter's device
            self._pending_optimizer_states = None
