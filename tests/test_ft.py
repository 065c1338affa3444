"""Fault tolerance across replica groups (``lightning_sync.ft``, on torchft 0.2, the ``ft`` extra), on CPU and gloo.

The bad-input tests need no lighthouse. The others start torchft's ``torchft_lighthouse`` as a process and each
replica group (one rank) as a process of its own (``tests/ft_group_worker.py``), so that one can be SIGKILLed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from ft_group_worker import run_group, run_lightning_group

from lightning_sync.apps.ft_local import start_lighthouse
from lightning_sync.errors import ConfigError
from lightning_sync.ft import FaultTolerance, FaultToleranceUnavailable, check_lighthouse, require_torchft

HERE = Path(__file__).parent


def _config(**overrides: object) -> FaultTolerance:
    values: dict[str, object] = dict(lighthouse="localhost:29510", replica_group=0, num_replica_groups=3)
    values.update(overrides)
    return FaultTolerance(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize("group", [3, -1])
def test_replica_group_outside_range_is_refused(group):
    with pytest.raises(ConfigError, match=rf"replica_group={group} is not allowed; it must be"):
        _config(replica_group=group)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_min_replicas_above_num_replica_groups_is_refused():
    with pytest.raises(ConfigError, match=r"min_replicas=4 is not allowed; it must be <= num_replica_groups=3"):
        _config(min_replicas=4)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_quorum_timeout_shorter_than_the_lighthouse_waits_is_refused():
    # 5 s, as in the failing measurement: the lighthouse may wait 5 + 1 + 10 s for a lost group
    with pytest.raises(ConfigError, match=r"quorum_timeout_s=5 is not allowed; it must be > heartbeat_timeout_s"):
        _config(timeout_s=10.0, quorum_timeout_s=5.0)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_collective_timeout_longer_than_the_lighthouse_waits_is_refused():
    with pytest.raises(ConfigError, match=r"collective_timeout_s=30 is not allowed; it must be < heartbeat_timeout_s"):
        _config(timeout_s=5.0, collective_timeout_s=30.0)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_derived_timeouts_are_in_order():
    config = _config(timeout_s=4.0)
    collective, quorum = config.timeouts()
    wait = config.heartbeat_timeout_s + config.join_timeout_s + config.timeout_s  # sync_period_s: timeout_s
    assert collective.total_seconds() < wait < quorum.total_seconds()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_missing_lighthouse_address_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"lighthouse='' is not allowed; .*TORCHFT_LIGHTHOUSE"):
        FaultTolerance(replica_group=0, num_replica_groups=2)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "example:1234")
    assert FaultTolerance().lighthouse == "example:1234"


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_mode_that_cannot_be_fault_tolerant_is_refused():
    from lightning_sync.comm.periodic import PeriodicAverager, StreamingOptions
    from lightning_sync.config import PeriodicConfig
    from lightning_sync.ft.averager import check_fault_tolerant_knobs

    check_fault_tolerant_knobs(PeriodicAverager(sync_every=8, outer=True))
    check_fault_tolerant_knobs(PeriodicAverager(sync_every=8, streaming=StreamingOptions(fragments=2, sync_delay=1)))
    with pytest.raises(ConfigError, match=r"warmup_steps=2 is not allowed with fault tolerance; it must be 0"):
        check_fault_tolerant_knobs(PeriodicAverager(sync_every=8, warmup_steps=2))
    check_fault_tolerant_knobs(
        PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(outer_compression="int4"))
    )
    bf16 = StreamingOptions(outer_compression="bf16")
    with pytest.raises(
        ConfigError,
        match=r"outer_compression=BF16Compression\(.*\) is not allowed here: .* ride across_groups.*: int8, int4, sparseloco",
    ):
        check_fault_tolerant_knobs(PeriodicAverager(sync_every=8, outer=True, streaming=bf16))
    with pytest.raises(ConfigError, match=r"sync_every='auto' is not allowed with fault tolerance"):
        check_fault_tolerant_knobs(PeriodicAverager(sync_every="auto"))
    with pytest.raises(ConfigError, match=r"fault_tolerance is not allowed with mode='gradient'"):
        PeriodicConfig(mode="gradient", fault_tolerance=_config())


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_without_torchft_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # makes ``import torchft`` raise ImportError
    with pytest.raises(FaultToleranceUnavailable, match=r"lightning-sync\[ft\]") as info:
        require_torchft()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ with torchft
torchft_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchft") is None, reason="torchft (the ft extra) is not installed"
)


@torchft_missing
@pytest.mark.unit
@pytest.mark.timeout(20)
def test_no_lighthouse_at_the_address_names_it_within_timeout():
    from lightning_sync.apps.bench.launch import free_port

    port = free_port()  # a port nobody listens on
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"lighthouse='127.0.0.1:{port}': no lighthouse answered there within"):
        check_lighthouse(_config(lighthouse=f"127.0.0.1:{port}", timeout_s=2.0))
    assert time.monotonic() - started < 2.0 + 3.0


@pytest.fixture
def lighthouse(request, tmp_path):
    """torchft's ``torchft_lighthouse`` as a process of its own, as users run it: a ``LighthouseServer`` in this
    process would leave its runtime's threads here for good, and every later test that forks ranks from this process
    would fork a multi-threaded process (ranks then abort now and then)."""
    server = start_lighthouse(tmp_path / "lighthouse.log", getattr(request, "param", 2), 5000, 1000, start_timeout_s=20)
    try:
        yield server.address
    finally:
        server.stop()


def _start_group(
    lighthouse: str,
    group: int,
    min_replicas: int,
    steps: int,
    sync_every: int,
    out: Path,
    sleep_s: float = 0.0,
    groups: int = 3,
    ranks: int = 1,
    spec: str = "",
    nan_at: int = -1,
) -> multiprocessing.process.BaseProcess:
    """Group ``group`` (of ``ranks`` ranks) as a process forked from a forkserver that imported torch, torchft and
    lightning_sync once (three fresh interpreters would take that long each, on a small machine)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["ft_group_worker", "lightning_sync.ft.averager", "lightning_sync.ft.replica"])
    args = [lighthouse, group, groups, min_replicas, steps, sync_every, out, sleep_s, ranks, spec, nan_at]
    proc = ctx.Process(target=run_group, args=([str(a) for a in args], str(out.with_suffix(".log"))))
    proc.start()
    return proc


def _wait(procs: list[multiprocessing.process.BaseProcess], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    if any(proc.is_alive() for proc in procs):
        for proc in procs:
            proc.kill()
        pytest.fail(f"a replica group did not finish within {limit_s} s")


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("lighthouse", [3], indirect=True)
@pytest.mark.parametrize(
    "spec",
    ["", "2,1,0.0", "2,1,0.5", "1,0,0.0,int8", "2,1,0.5,int4", "1,0,0.0,sparseloco", "2,1,0.0,sparseloco"],
    ids=[
        "diloco",
        "streaming_k2_tau1",
        "k2_tau1_alpha",
        "int8",
        "k2_tau1_alpha_int4",
        "sparseloco",
        "k2_tau1_sparseloco",
    ],
)
def test_three_groups_compute_what_three_ordinary_ranks_do(lighthouse, spec, tmp_path):
    """DiLoCo every 8 steps for 40 steps (and streaming DiLoCo: 2 fragments, sync_delay 1, alpha 0 or 0.5; with
    int8/int4 or SparseLoCo pseudo-gradients): 3 groups of 1 rank through torchft against 3 ordinary gloo ranks."""
    from dist_utils import run_ranks
    from ft_group_worker import flat as flatten
    from ft_group_worker import make_model, ordinary_rank

    outs = [tmp_path / f"group{g}.pt" for g in range(3)]
    procs = [_start_group(lighthouse, g, 3, 40, 8, outs[g], spec=spec) for g in range(3)]
    _wait(procs, 100)
    logs = [out.with_suffix(".log").read_text() for out in outs]
    for g, proc in enumerate(procs):
        assert proc.exitcode == 0, f"group {g} failed:\n{logs[g][-3000:]}"
        syncs = 10 if spec.startswith("2,") else 5  # 2 fragments: one syncs every 4 steps
        assert f"committed={syncs} failed=0" in logs[g], f"group {g}: not {syncs} commits:\n{logs[g][-2000:]}"
    ordinary = str(tmp_path / "ordinary.pt")
    run_ranks(ordinary_rank, 40, 8, ordinary, spec, world_size=3)
    start = flatten(make_model())
    for g in range(3):
        ours, theirs = torch.load(outs[g], weights_only=True), torch.load(f"{ordinary}.rank{g}", weights_only=True)
        assert not torch.equal(ours, start), "the groups did not train"
        diff = float((ours - theirs).abs().max())
        print(f"{spec or 'diloco'}: group {g}: max |ft - ordinary| = {diff:.3g}")
        assert diff <= 1e-6, f"group {g}: max |ft - ordinary| = {diff:.3g}"


def _reached(log: Path, step: int) -> bool:
    """Whether a worker's log shows a step count of at least ``step`` (a group that heals jumps ahead)."""
    if not log.exists():
        return False
    steps = [int(line[5:]) for line in log.read_text().splitlines() if line.startswith("step ") and line[5:].isdigit()]
    return bool(steps) and max(steps) >= step


def _sync_times(log: str) -> list[tuple[float, int, int]]:
    """(time, committed, failed) of every sync line a worker printed."""
    out = []
    for line in log.splitlines():
        if line.startswith("sync at step"):
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f and not f.startswith("members"))
            out.append((float(fields["t"]), int(fields["committed"]), int(fields["failed"])))
    return out


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["", "2,1,0.5"], ids=["diloco", "streaming_k2_tau1_alpha"])
def test_survivors_commit_again_after_a_group_is_killed(lighthouse, spec, tmp_path):
    """3 groups, 120 steps of 20 ms, sync every 8; group 2 is SIGKILLed at about step 40: groups 0 and 1 commit
    again, finish with exit code 0 and equal parameters, and name the lost group."""
    outs = [tmp_path / f"group{g}.pt" for g in range(3)]
    procs = [_start_group(lighthouse, g, 2, 120, 8, outs[g], sleep_s=0.02, spec=spec) for g in range(3)]
    victim_log = outs[2].with_suffix(".log")
    deadline = time.monotonic() + 60
    while not _reached(victim_log, 40):
        if time.monotonic() > deadline or not procs[2].is_alive():
            for p in procs:
                p.kill()
            pytest.fail(f"group 2 never reached step 40:\n{victim_log.read_text()[-2000:]}")
        time.sleep(0.05)
    os.kill(procs[2].pid, signal.SIGKILL)
    killed_at = time.time()
    _wait(procs[:2], 90)
    logs = [out.with_suffix(".log").read_text() for out in outs[:2]]
    for g in range(2):
        assert procs[g].exitcode == 0, f"group {g} failed:\n{logs[g][-3000:]}"
        assert "replica group(s) [2] lost from the quorum" in logs[g], f"group {g} did not name the lost group"
    final = [torch.load(outs[g], weights_only=True) for g in range(2)]
    assert torch.equal(final[0], final[1]), f"survivors differ by {float((final[0] - final[1]).abs().max()):.3g}"
    recoveries = []
    for g in range(2):
        after = [(t, c) for t, c, _ in _sync_times(logs[g]) if t > killed_at]
        before = max((c for t, c, _ in _sync_times(logs[g]) if t <= killed_at), default=0)
        committed = [t for t, c in after if c > before]
        assert committed, f"group {g} never committed after the kill:\n{logs[g][-2000:]}"
        recoveries.append(committed[0] - killed_at)
    print(f"seconds from the kill to each survivor's next commit: {', '.join(f'{r:.2f}' for r in recoveries)}")


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("mode,commits", [("diloco", 2), ("allreduce", 8)])
def test_strategy_with_fault_tolerance_syncs_two_lightning_groups(lighthouse, mode, commits, tmp_path):
    """Two Lightning runs, each one replica group of ``PeriodicSyncStrategy(mode="diloco", fault_tolerance=...)`` or
    ``AllReduceStrategy(fault_tolerance=...)``: each reads its own half of the data, they end with equal parameters,
    and the ``ft/*`` metrics are logged."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["ft_group_worker", "lightning.pytorch", "lightning_sync.ft.replica"])
    outs = [tmp_path / f"group{g}.pt" for g in range(2)]
    procs = [
        ctx.Process(target=run_lightning_group, args=([lighthouse, g, 2, 8, str(outs[g]), mode], str(outs[g]) + ".log"))
        for g in range(2)
    ]
    for proc in procs:
        proc.start()
    _wait(procs, 130)
    logs = [Path(str(out) + ".log").read_text() for out in outs]
    for g, proc in enumerate(procs):
        others = "".join(f"\n--- group {o}'s log:\n{logs[o][-2000:]}" for o in range(2) if o != g)
        assert proc.exitcode == 0, f"group {g} failed:\n{logs[g][-3000:]}{others}"
    ends = [torch.load(out, weights_only=False) for out in outs]
    assert not set(ends[0]["seen"]) & set(ends[1]["seen"]), "the two groups read the same samples"
    assert len(set(ends[0]["seen"]) | set(ends[1]["seen"])) == 64, "one epoch of each group's shard: all 64 samples"
    assert torch.equal(ends[0]["params"], ends[1]["params"]), "the groups' final parameters differ"
    from ft_group_worker import flat as flatten
    from ft_group_worker import make_model

    assert not torch.equal(ends[0]["params"], flatten(make_model())), "the groups did not train"
    for end in ends:  # diloco: 2 syncs (steps 4 and 8); allreduce: every step; all committed, with both groups
        assert end["metrics"].get("ft/commits") == float(commits), end["metrics"]
        assert end["metrics"].get("ft/quorum_size") == 2.0 and end["metrics"].get("ft/failed_commits") == 0.0


def _kill_at_step(procs: list[multiprocessing.process.BaseProcess], victim: int, log: Path, step: int) -> float:
    """SIGKILLs ``procs[victim]`` once its log shows ``step``; returns the time of the kill."""
    deadline = time.monotonic() + 60
    while not _reached(log, step):
        if time.monotonic() > deadline or not procs[victim].is_alive():
            for p in procs:
                p.kill()
            pytest.fail(f"group {victim} never reached step {step}:\n{log.read_text()[-2000:] if log.exists() else ''}")
        time.sleep(0.05)
    assert procs[victim].pid is not None
    os.kill(procs[victim].pid, signal.SIGKILL)
    return time.time()


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_killed_group_restarted_heals_and_all_end_equal(lighthouse, tmp_path):
    """Group 2 is SIGKILLed at step 40 and started again with the same arguments while groups 0 and 1 train: it
    heals from a live group (parameters and momentum equal to the source's, bit for bit), trains on, and all three
    end with equal parameters."""
    outs = [tmp_path / f"group{g}.pt" for g in range(3)]
    procs = [_start_group(lighthouse, g, 2, 160, 8, outs[g], sleep_s=0.02) for g in range(3)]
    _kill_at_step(procs, 2, outs[2].with_suffix(".log"), 40)
    restarted = tmp_path / "group2_restarted.pt"
    procs.append(_start_group(lighthouse, 2, 2, 160, 8, restarted, sleep_s=0.02))
    _wait([procs[0], procs[1], procs[3]], 120)
    logs = {g: out.with_suffix(".log").read_text() for g, out in [(0, outs[0]), (1, outs[1]), (3, restarted)]}
    for g, proc in [(0, procs[0]), (1, procs[1]), (3, procs[3])]:
        assert proc.exitcode == 0, f"process {g} failed:\n{logs[g][-3000:]}"
    assert "replica group 2 healed from a live group" in logs[3], logs[3][-2000:]
    states = [torch.load(str(p) + ".state", weights_only=True) for p in (outs[0], outs[1], restarted)]
    [(step, healed)] = states[2]["healed"].items()
    sources = [s["snapshots"].get(step) for s in states[:2]]
    same = any(src is not None and torch.equal(healed, src) for src in sources)
    assert same, f"the healed state at step {step} is no live group's"
    assert torch.equal(states[0]["params"], states[1]["params"]) and torch.equal(
        states[0]["params"], states[2]["params"]
    )


class _HealingLink:
    """A stand-in for :class:`~lightning_sync.ft.replica.ReplicaGroupLink` with no quorum: ``start`` records this
    group's state (a live group serving a heal), or loads ``source``'s last recorded one and says it healed; every
    cross-group average is recorded by size."""

    def __init__(self, source: _HealingLink | None = None) -> None:
        self.config, self.source = _config(), source
        self.saved: dict[str, object] = {}
        self.state: dict[str, object] = {}
        self.averaged: list[list[int]] = []

    def register_state(self, key: str, save: object, load: object) -> None:
        self.saved[key] = (save, load)

    def start(self) -> bool:
        if self.source is None:
            self.state = {key: save() for key, (save, _) in self.saved.items()}  # type: ignore[operator]
            return False
        for key, (_, load) in self.saved.items():
            load(self.source.state[key])  # type: ignore[operator]
        self.source = None  # one heal
        return True

    def average_(self, tensors: list[torch.Tensor]) -> None:
        self.averaged.append([t.numel() for t in tensors])

    def commit(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _heal_into_the_live_schedule(rank: int, world: int) -> None:
    from ft_group_worker import OUTER, batch, inner_step, make_inner, make_model, streaming

    from lightning_sync.comm.meter import CommMeter
    from lightning_sync.ft.averager import FaultTolerantAverager

    def group(link: _HealingLink) -> tuple[FaultTolerantAverager, torch.nn.Module, torch.optim.Optimizer]:
        model = make_model()
        averager = FaultTolerantAverager(link, sync_every=8, streaming=streaming("2,1,0.5"), **OUTER)  # type: ignore[arg-type]
        averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
        return averager, model, make_inner(model)

    live_link = _HealingLink()
    live, model, inner = group(live_link)
    for _ in range(7):  # launches fragment 0 at step 3 and fragment 1 at step 7 (its state recorded at that quorum)
        inner_step(model, inner, batch(0, live.steps))
        live.step([inner])
    joiner_link = _HealingLink(source=live_link)
    joiner, model, inner = group(joiner_link)
    for _ in range(3):  # its own count launches fragment 0 at step 3: it heals at that quorum
        inner_step(model, inner, batch(1, joiner.steps))
        joiner.step([inner])
    assert joiner.steps == live.steps == 7
    live.close()  # lets each worker thread finish its averages
    joiner.close()
    # one cross-group average since it joined, of the fragment the live group launched at the quorum it healed at
    assert joiner_link.averaged == live_link.averaged[-1:] and live_link.averaged[0] != live_link.averaged[-1], (
        joiner_link.averaged, live_link.averaged)  # fmt: skip


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_group_that_heals_at_a_streaming_quorum_launches_the_live_groups_fragment():
    """The healed group launches the fragment the live groups launch at that quorum, not the one its own step count
    chose (which met theirs in one collective, of another size: gloo aborted the process)."""
    run_ranks(_heal_into_the_live_schedule, world_size=1)


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_frozen_group_is_left_behind_and_never_corrupts_the_others(lighthouse, tmp_path):
    """Group 1 is SIGSTOPped at step 40 for 4 s: groups 0 and 2 commit again within timeout_s + 5 s and end with
    equal parameters; after SIGCONT group 1 heals and ends equal to them, or exits with a clear message."""
    outs = [tmp_path / f"group{g}.pt" for g in range(3)]
    procs = [_start_group(lighthouse, g, 2, 320, 8, outs[g], sleep_s=0.02) for g in range(3)]
    log1 = outs[1].with_suffix(".log")
    deadline = time.monotonic() + 60
    while not _reached(log1, 40):
        assert time.monotonic() < deadline, "group 1 never reached step 40"
        time.sleep(0.05)
    assert procs[1].pid is not None
    os.kill(procs[1].pid, signal.SIGSTOP)
    stopped_at = time.time()
    time.sleep(4.0)
    os.kill(procs[1].pid, signal.SIGCONT)
    _wait(procs, 120)
    logs = [out.with_suffix(".log").read_text() for out in outs]
    for g in (0, 2):
        assert procs[g].exitcode == 0, f"group {g} failed:\n{logs[g][-3000:]}"
        committed = [t for t, c, _ in _sync_times(logs[g]) if t > stopped_at]
        assert committed and committed[0] - stopped_at <= 3.0 + 5.0, f"group {g} stalled:\n{logs[g][-2000:]}"
        assert "replica group(s) [1] lost from the quorum" in logs[g]
    final = {g: torch.load(outs[g], weights_only=True) for g in (0, 2)}
    assert torch.equal(final[0], final[2]), "the live groups differ"
    if procs[1].exitcode == 0:
        assert torch.equal(torch.load(outs[1], weights_only=True), final[0]), "the thawed group ended apart"
    else:
        assert "QuorumError" in logs[1] or "not committed" in logs[1], f"no clear message:\n{logs[1][-2000:]}"
    recovery = min(t for t, c, _ in _sync_times(logs[0]) if t > stopped_at) - stopped_at
    print(f"group 1 frozen: next commit of group 0 after {recovery:.2f} s; group 1 exit code {procs[1].exitcode}")


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_group_of_two_ranks_survives_the_loss_of_the_other_group(lighthouse, tmp_path):
    """2 groups of 2 ranks; both ranks of group 1 are SIGKILLed at step 40: group 0's ranks go on alone
    (min_replicas=1), finish with exit code 0 and equal parameters, and name the lost group."""
    outs = [tmp_path / f"group{g}.pt" for g in range(2)]
    procs = [_start_group(lighthouse, g, 1, 120, 8, outs[g], sleep_s=0.02, groups=2, ranks=2) for g in range(2)]
    log1 = outs[1].with_suffix(".log")
    deadline = time.monotonic() + 60
    while not _reached(log1, 40):
        assert time.monotonic() < deadline and procs[1].is_alive(), (
            f"group 1 never reached step 40:\n{log1.read_text()}"
        )
        time.sleep(0.05)
    [rank1] = [int(pid) for pid in log1.read_text().split("rank pids [", 1)[1].split("]", 1)[0].split(",")]
    os.kill(rank1, signal.SIGKILL)
    assert procs[1].pid is not None
    os.kill(procs[1].pid, signal.SIGKILL)
    _wait(procs[:1], 90)
    log0 = outs[0].with_suffix(".log").read_text()
    assert procs[0].exitcode == 0, f"group 0 failed:\n{log0[-3000:]}"
    assert "replica group(s) [1] lost from the quorum" in log0
    assert log0.count("finish committed=") == 2, "both ranks of group 0 finished"
    ranks = [torch.load(outs[0], weights_only=True), torch.load(f"{outs[0]}.rank1", weights_only=True)]
    assert torch.equal(ranks[0], ranks[1]), "group 0's two ranks differ"


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("lighthouse", [3], indirect=True)
def test_a_non_finite_contribution_is_never_committed_into_the_others(lighthouse, tmp_path):
    """Group 1's parameters turn NaN just before its sync at step 16: the averaged pseudo-gradient is NaN on every
    group, so every group skips that outer step (skip_nonfinite) and returns to the global copy; all three end
    finite and equal."""
    outs = [tmp_path / f"group{g}.pt" for g in range(3)]
    procs = [_start_group(lighthouse, g, 3, 40, 8, outs[g], nan_at=16 if g == 1 else -1) for g in range(3)]
    _wait(procs, 100)
    logs = [out.with_suffix(".log").read_text() for out in outs]
    for g, proc in enumerate(procs):
        assert proc.exitcode == 0, f"group {g} failed:\n{logs[g][-3000:]}"
    final = [torch.load(out, weights_only=True) for out in outs]
    assert all(bool(torch.isfinite(f).all()) for f in final), "a NaN reached a group's parameters"
    assert torch.equal(final[0], final[1]) and torch.equal(final[0], final[2]), "the groups differ"
    states = [torch.load(str(out) + ".state", weights_only=True) for out in outs]
    assert all(bool(torch.isfinite(s["snapshots"][24]).all()) for s in states), "a NaN was committed at step 16"


@torchft_missing
@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_one_fault_tolerant_group_resumes_exactly_from_a_checkpoint(lighthouse, tmp_path):
    """One replica group (DiLoCo every 4 steps): 32 steps (2 epochs) straight, against a run resumed from the
    checkpoint at step 16: the same parameters, bit for bit (the averager's state is in the checkpoint)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["ft_group_worker", "lightning.pytorch", "lightning_sync.ft.replica"])

    def run(out: Path, ckpt: str) -> dict:
        proc = ctx.Process(target=run_lightning_group, args=([lighthouse, 0, 1, 32, str(out), "diloco", ckpt],
                                                             str(out) + ".log"))  # fmt: skip
        proc.start()
        _wait([proc], 100)
        assert proc.exitcode == 0, Path(str(out) + ".log").read_text()[-3000:]
        return torch.load(out, weights_only=False)

    straight = run(tmp_path / "straight.pt", str(tmp_path / "ckpt_straight"))
    first = run(tmp_path / "first.pt", str(tmp_path / "ckpt"))  # writes step=16 (an epoch's end) and step=32
    for extra in (tmp_path / "ckpt").glob("*step=32*"):
        extra.unlink()
    resumed = run(tmp_path / "resumed.pt", str(tmp_path / "ckpt"))
    assert torch.equal(first["params"], straight["params"])
    assert len(resumed["seen"]) == 64, "the resumed run trained the second epoch: 16 steps of 4 samples"
    diff = float((resumed["params"] - straight["params"]).abs().max())
    assert torch.equal(resumed["params"], straight["params"]), f"max |resumed - straight| = {diff:.3g}"


# ------------------------------------------------------------------------------------------------ the Hydra app
def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from lightning_sync.apps import train

    with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_hydra_ft_none_is_the_default_and_adds_nothing():
    from lightning_sync.apps.ft_conf import fault_tolerance_arguments

    assert fault_tolerance_arguments(_compose("strategy=periodic")) == {}


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_hydra_ft_torchft_keys_are_checked_and_named():
    from lightning_sync.apps.ft_conf import fault_tolerance_arguments

    cfg = _compose("strategy=periodic", "strategy.mode=diloco", "ft=torchft", "ft.lighthouse=localhost:1",
                   "ft.num_replica_groups=2", "ft.replica_group=2")  # fmt: skip
    assert set(cfg.ft) == {"lighthouse", "replica_group", "num_replica_groups", "min_replicas", "timeout_s"}
    with pytest.raises(ConfigError, match=r"^ft\.replica_group=2 is not allowed; it must be in \[0, num_replica"):
        fault_tolerance_arguments(cfg)
    cfg = _compose("strategy=ddp", "ft=torchft", "ft.lighthouse=localhost:1")
    with pytest.raises(ConfigError, match=r"ft=torchft is not allowed with strategy='lightning_sync.DDPSync"):
        fault_tolerance_arguments(cfg)


@torchft_missing
@pytest.mark.unit
@pytest.mark.timeout(60)
def test_hydra_ft_torchft_passes_the_group_to_the_strategy(lighthouse):
    from lightning_sync.apps.ft_conf import fault_tolerance_arguments
    from lightning_sync.strategies import PeriodicSyncStrategy

    cfg = _compose("strategy=periodic", "strategy.mode=diloco", "ft=torchft", f"ft.lighthouse={lighthouse}",
                   "ft.num_replica_groups=3", "ft.replica_group=1", "ft.min_replicas=2", "ft.timeout_s=5")  # fmt: skip
    arguments = fault_tolerance_arguments(cfg)
    strategy = PeriodicSyncStrategy(mode="diloco", **arguments)
    assert strategy.fault_tolerance == FaultTolerance(lighthouse=lighthouse, replica_group=1, num_replica_groups=3,
                                                      min_replicas=2, timeout_s=5.0)  # fmt: skip
