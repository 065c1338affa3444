"""Every private or unstable Lightning API that lightning_sync uses, in one module.

Lightning has no public way to choose a strategy's launcher, to register DDP communication hooks from a subclass,
or to change the Trainer's loop limits during ``fit``; the strategies reach into Lightning for these here and
nowhere else (``make lint`` fails on a private Lightning name or an :data:`UNSTABLE_USES` entry in another file, and
pytest turns a ``DeprecationWarning`` naming one into an error). Verified for :data:`LIGHTNING_VERIFIED`; a new
Lightning release is checked against this module first.

What is used is listed in :data:`PRIVATE_NAMES` and :data:`UNSTABLE_USES`; each function or class below says
which Lightning attribute it reads, writes or overrides.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

LIGHTNING_VERIFIED = ("2.6.0", "2.6.6")
"""Lightning releases this module was read against and the test suite passed with."""

PRIVATE_NAMES = (
    "_configure_launcher",
    "_register_ddp_hooks",
    "_launcher",
    "_start_method",
    "_SubprocessScriptLauncher",
    "_call_children_scripts",
    "_check_can_spawn_children",
    "_set_num_threads_if_needed",
    "_batches_that_stepped",
)
"""The private Lightning names used in this module (and only here)."""

UNSTABLE_USES = (
    "launcher.procs",
    "launcher.launch (replaced)",
    "Trainer.fit_loop.max_epochs (written)",
    "Trainer.accumulate_grad_batches (written)",
    "Trainer.callbacks.insert",
    "Precision.clip_gradients (replaced on the instance)",
    "Trainer.fit_loop.epoch_loop step progress (written)",
)
"""Public-looking Lightning attributes used in ways Lightning does not document; also confined to this module."""


class LightningDDPHooks(DDPStrategy):
    """A ``DDPStrategy`` whose private hooks forward to methods of ours, which subclasses override instead."""

    @override
    def _configure_launcher(self) -> None:
        self.configure_launcher()

    def configure_launcher(self) -> None:
        """Sets ``self.launcher`` before launch (Lightning's: a launcher for the start method)."""
        super()._configure_launcher()

    @override
    def _register_ddp_hooks(self) -> None:
        self.register_ddp_hooks()

    def register_ddp_hooks(self) -> None:
        """Registers communication hooks on the ``DistributedDataParallel`` model (Lightning's: its ``ddp_comm_*``)."""
        super()._register_ddp_hooks()


def start_method(strategy: DDPStrategy) -> str:
    """The start method ``strategy`` launches its ranks with (``popen``, ``fork``, ``spawn``, ...)."""
    return strategy._start_method


def set_launcher(strategy: DDPStrategy, launcher: Any) -> None:
    """Makes ``launcher`` the launcher of ``strategy`` (from :meth:`LightningDDPHooks.configure_launcher`)."""
    strategy._launcher = launcher


class PopenLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher, with two hooks of ours.

    Args:
        child_command: ``(command, cwd)`` of the child for a local rank, in place of Lightning's re-run of this
            process's command line (``None``: Lightning's).
        observer: watches the children in place of Lightning's observer, which SIGKILLs every rank when a child exits
            with an error; ``launch`` is then Lightning's, restated with it.
    """

    def __init__(
        self,
        *args: Any,
        child_command: Callable[[int], tuple[list[str], str]] | None = None,
        observer: Callable[[list[subprocess.Popen]], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.child_command, self.observer = child_command, observer

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self.observer is None:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self.observer(self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        """Lightning's, restated with :attr:`child_command` where given."""
        if self.child_command is None:
            super()._call_children_scripts()
            return
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            LOCAL_RANK=str(env.local_rank()),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        for local_rank in range(1, self.num_processes):
            command, cwd = self.child_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=dict(os.environ, LOCAL_RANK=str(local_rank)), cwd=cwd))


def launcher_children(launcher: Any) -> list[subprocess.Popen]:
    """The child processes a ``popen`` launcher started (empty for other launchers and ``None``)."""
    return [proc for proc in getattr(launcher, "procs", []) if isinstance(proc, subprocess.Popen)]


def replace_launch(launcher: Any, launch: Callable[..., Any]) -> None:
    """Replaces ``launcher.launch`` on this instance (the strategy calls it to run every rank's function)."""
    launcher.launch = launch


def set_max_epochs(trainer: pl.Trainer, max_epochs: int | None) -> None:
    """Sets the fit loop's epoch limit (``-1``: none), during ``fit``."""
    trainer.fit_loop.max_epochs = max_epochs


def set_accumulate_grad_batches(trainer: pl.Trainer, batches: int) -> None:
    """Sets how many batches the Trainer accumulates per optimizer step (read by its loops at every batch)."""
    trainer.accumulate_grad_batches = batches


def insert_callback_first(trainer: pl.Trainer, callback: Any) -> None:
    """Puts ``callback`` first among the Trainer's callbacks, so its hooks run before the others'."""
    trainer.callbacks.insert(0, callback)  # type: ignore[attr-defined]  # set by Lightning's callback connector


def route_clip_gradients(plugin: Precision, clip: Callable[[Any, Any, Any], None]) -> None:
    """Makes the precision plugin's ``clip_gradients(optimizer, clip_val, gradient_clip_algorithm)`` call ``clip``.

    Every gradient clipping Lightning does, ``Trainer(gradient_clip_val=...)`` as ``LightningModule.clip_gradients``
    in manual optimization, ends in this call on the strategy's precision plugin, and Lightning has no hook for a
    strategy to take it over. So it is replaced on this plugin instance only, until :func:`restore_clip_gradients`.
    """
    plugin.clip_gradients = clip  # type: ignore[method-assign, assignment]


def restore_clip_gradients(plugin: Precision) -> None:
    """Undoes :func:`route_clip_gradients`: the plugin's own ``clip_gradients`` again (no-op if not routed)."""
    plugin.__dict__.pop("clip_gradients", None)


def set_global_step(trainer: pl.Trainer, steps: int) -> None:
    """Makes ``trainer.global_step`` (and the step its loggers write at) ``steps``, before the first batch of a fit:
    a rank that joins a running job continues its count instead of starting at 0."""
    epoch_loop = trainer.fit_loop.epoch_loop
    for total in (
        epoch_loop.automatic_optimization.optim_progress.optimizer.step.total,
        epoch_loop.manual_optimization.optim_step_progress.total,
    ):
        total.ready = total.completed = steps
    epoch_loop._batches_that_stepped = steps
