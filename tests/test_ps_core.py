"""The parameter-server core (``lightning_sync.ps``) on plain torch.distributed, no Lightning.

Workers and servers run in forked processes (servers also as threads of the workers, or as the dedicated
interpreters that ``start_servers`` starts); assertions run inside them and every failure comes back through a
queue. ``tests/dist_utils.run_ranks``
does not fit here: it builds a default process group (the PS group must not use one), gives every process the same
role, and cannot signal a process from outside or collect results.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import ast  # noqa: E402
import io  # noqa: E402
import multiprocessing as mp  # noqa: E402
import pickle  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any

import pytest  # noqa: E402
import torch  # noqa: E402
from fake_clock import FakeClock  # noqa: E402
from fault_utils import NOTICED_WITHIN_S  # noqa: E402

import lightning_sync.ps as ps  # noqa: E402
from lightning_sync.apps.bench.launch import free_port as _free_port  # noqa: E402
from lightning_sync.comm.compression import TopKCompression, resolve_codec  # noqa: E402
from lightning_sync.ps._layout import ShardLayout  # noqa: E402
from lightning_sync.ps._protocol import (  # noqa: E402
    HEADER_BYTES,
    TAG_REPLY,
    TAG_REQUEST,
    TAG_REQUEST_DATA,
    Kind,
    Request,
)
from lightning_sync.ps.client import exchange  # noqa: E402
from lightning_sync.ps.shard import STALENESS_CAP  # noqa: E402

torch.set_num_threads(1)

HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------------------------- harness
def _child(name: str, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        # plain pickle: the queue's own pickler would pass tensors as shared memory, gone when this process exits
        results.put((name, "ok", pickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((name, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class _Procs:
    """Forked processes with named results; every process is killed at the end, stopped ones included."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("fork")
        self.results = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.received: dict[str, tuple[str, Any]] = {}

    def start(self, name: str, fn: Callable, *args: Any) -> Any:
        proc = self.ctx.Process(target=_child, args=(name, fn, args, self.results), daemon=True)
        proc.start()
        self.procs[name] = proc
        return proc

    def collect(self, names: list[str], timeout: float) -> dict[str, tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        while not set(names) <= set(self.received):
            try:
                name, status, value = self.results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = sorted(set(names) - set(self.received))
                raise AssertionError(f"no result from {missing} after {timeout} s; got {self.received}") from None
            self.received[name] = (status, pickle.loads(value) if status == "ok" else value)
        return {n: self.received[n] for n in names}

    def ok(self, names: list[str], timeout: float) -> dict[str, Any]:
        """Every named process's return value; fails the test with the tracebacks of those that raised."""
        out = self.collect(names, timeout)
        errors = [f"{n}:\n{v}" for n, (s, v) in sorted(out.items()) if s != "ok"]
        assert not errors, "\n".join(errors)
        return {n: v for n, (_, v) in out.items()}

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.join(5)


@pytest.fixture
def procs():
    p = _Procs()
    try:
        yield p
    finally:
        p.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    first, second = model[0], model[2]
    return torch.optim.SGD(
        [{"params": first.parameters(), "lr": 0.1}, {"params": second.parameters(), "lr": 0.03}],
        lr=0.1,
        momentum=0.9,
    )


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    """Gradients of worker ``rank``'s batch number ``step`` (deterministic, any process can recompute them)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(model(x), y).backward()


def _join(rank: int, port: int, num_workers: int, num_servers: int, timeout_s: float, colocated: bool = True):
    """Worker ``rank``'s store, colocated server thread (if any) and group member."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    server = None
    if colocated and rank < num_servers:
        server = ps.start_servers("colocated", rank, HOST, port, num_workers, num_servers, timeout_s=timeout_s)
    group = ps.PSGroup(store, rank, num_workers, num_servers, timeout_s, connect_timeout_s=30)
    return store, server, group


def _client(group: ps.PSGroup, model: torch.nn.Module, opt: torch.optim.Optimizer, **config: Any) -> ps.PSClient:
    params = list(model.parameters())
    return ps.PSClient(group, params, ps.optimizer_spec(opt, params), ps.PSConfig(**config))


def _started_sgd_worker(group: ps.PSGroup, rank: int, **config: Any):
    """The test model, its SGD optimizer and a client that has pulled the servers' start (worker 0 set it)."""
    model = _model()
    opt = _optimizer(model, "sgd")
    client = _client(group, model, opt, **config)
    if rank == 0:
        client.init_servers()
    client.pull()
    return model, opt, client


def _join_dedicated(rank: int, port: int, num_servers: int, timeout_s: float) -> ps.PSGroup:
    """Worker ``rank`` of 2 joins a group whose servers are their own processes (worker 0 hosts the store)."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    return ps.PSGroup(store, rank, 2, num_servers, timeout_s, connect_timeout_s=30)


def _server_process(port: int, server: int, num_workers: int, num_servers: int, timeout_s: float) -> dict:
    """A forked server process: its stats, or (when it fails) the error and when it failed."""
    try:
        return {"stats": ps.run_server(HOST, port, server, num_workers, num_servers, timeout_s=timeout_s)}
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------------------- units
@pytest.mark.unit
@pytest.mark.timeout(10)
def test_shard_by_bytes_is_balanced_deterministic_and_whole():
    gen = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 10_000, (40,), generator=gen)]
    for k in (1, 2, 3, 7):
        owner = ps.shard_by_bytes(sizes, k)
        assert owner == ps.shard_by_bytes(list(sizes), k)  # deterministic
        load = [sum(s for s, o in zip(sizes, owner) if o == i) for i in range(k)]
        assert sum(load) == sum(sizes) and all(0 <= o < k for o in owner)
        assert max(load) - min(load) <= max(sizes), (k, load)
        assert set(owner) == set(range(k))  # nobody empty
    assert ps.shard_by_bytes([400, 300, 200, 100], 2) == [0, 1, 1, 0]  # 500 / 500
    assert sorted(ps.shard_by_bytes([0, 0, 0], 3)) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"num_servers=5 exceeds the number of parameter tensors \(4\)"):
        ps.shard_by_bytes([1, 2, 3, 4], 5)
    with pytest.raises(ValueError, match="num_servers=0"):
        ps.shard_by_bytes([1], 0)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_settings_are_validated_with_the_field_named():
    with pytest.raises(ValueError, match=r"compression=PowerSGDCompression\(.* ride point_to_point.*: none, fp16"):
        resolve_codec("powersgd", needs=("point_to_point",))
    with pytest.raises(ValueError, match=r"mode='ring'"):
        ps.PSConfig(mode="ring")
    with pytest.raises(ValueError, match=r"max_staleness=-1"):
        ps.PSConfig(mode="ssp", max_staleness=-1)
    with pytest.raises(ValueError, match=r"max_updates=0"):
        ps.PSConfig(max_updates=0)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_optimizer_spec_keeps_groups_and_shard_optimizer_mirrors_them():
    model = _model()
    opt = _optimizer(model, "two_groups")
    params = list(model.parameters())
    spec = ps.optimizer_spec(opt, params)
    assert spec.group_of == (0, 0, 1, 1) and spec.classes == ("torch.optim.sgd:SGD",)
    assert ps.OptimizerSpec.from_dict(spec.as_dict()) == spec
    shard_opt, mirrored = ps.build_shard_optimizer(spec, [params[1], params[3]], [1, 3])
    assert mirrored == [0, 1]
    assert [g["lr"] for g in shard_opt.param_groups] == [0.1, 0.03]
    assert all(g["momentum"] == 0.9 for g in shard_opt.param_groups)
    with pytest.raises(ValueError, match="hold 2 parameter"):
        ps.optimizer_spec(opt, params[:2])
    with pytest.raises(ValueError, match=r"params\[1\] is the same tensor as params\[0\]"):
        ps.optimizer_spec(opt, [params[0], params[0]])


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_server_shard_state_dict_round_trip_is_bitwise():
    model = _model()
    params = list(model.parameters())
    spec = ps.optimizer_spec(_optimizer(model, "two_groups"), params)
    a = ps.ServerShard(params, range(4), spec, num_workers=2)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(a.layout.numel, generator=gen) for _ in range(4)]
    for g in grads[:2]:
        a.apply(g, [0.1, 0.03])
        a.record(1, 3)
    b = ps.ServerShard([torch.zeros_like(p) for p in params], range(4), spec, num_workers=2)
    b.load_state_dict(a.state_dict())
    assert (b.version, b.clocks, b.stats()["staleness_histogram"]) == (2, [0, 2], [{}, {3: 2}])
    for g in grads[2:]:
        a.apply(g, [0.1, 0.03])
        b.apply(g, [0.1, 0.03])
    assert torch.equal(a.packed(), b.packed())
    with pytest.raises(ValueError, match="state holds parameters"):
        ps.ServerShard(params[:2], range(2), spec, num_workers=2).load_state_dict(a.state_dict())


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_worker_liveness_declares_only_unheld_silent_workers_lost():
    from lightning_sync.ps.server import WorkerLiveness

    clock = FakeClock()
    names = {None: "server 0", 0: "worker 0", 1: "worker 1", 2: "worker 2"}
    watch = WorkerLiveness(3, timeout_s=5.0, connect_timeout_s=20.0, name=names.__getitem__, clock=clock)
    clock.advance(10.0)
    watch.check(initialized=False, held=())  # before the initial parameters nobody is lost
    assert watch.bound(False) == 20.0 and watch.patience(False, ()) == pytest.approx(10.01)
    watch.restart()
    clock.advance(4.0)
    watch.heard(0)
    assert watch.patience(True, held={1}) == pytest.approx(1.01)  # worker 2 is due first; worker 1 is held
    clock.advance(2.0)  # worker 1 (held) and worker 2 silent for 6 s, worker 0 for 2 s
    with pytest.raises(ps.PSTimeoutError, match=r"^worker 2 sent nothing for 6\.0 s \(server 0 heard"):
        watch.check(initialized=True, held={1})
    watch.live[2] = False  # a goodbye
    watch.check(initialized=True, held={1})
    error = watch.silence_error(held={0, 1}, context="waiting for requests")
    assert str(error).startswith("worker 1 sent nothing for 6.0 s; worker 0 sent nothing for 2.0 s (server 0 waiting")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_worker_whose_held_reply_is_released_is_not_taken_for_silent():
    from lightning_sync.ps.server import WorkerLiveness

    clock = FakeClock()
    watch = WorkerLiveness(2, timeout_s=4.0, connect_timeout_s=20.0, name=str, clock=clock)
    watch.restart()
    watch.heard(0)  # worker 0's push: its reply is held (ssp) while worker 1 is frozen
    clock.advance(5.0)
    assert watch.silent(initialized=True, held={0}) == {1: 5.0}  # worker 1 is dropped, worker 0's reply released
    watch.answered(0)
    assert watch.waited() == 0.0 and watch.patience(True, held=()) == pytest.approx(0.01)  # worker 1 is due
    watch.live[1] = False  # dropped
    assert watch.patience(True, held=()) == pytest.approx(4.01)  # worker 0 has timeout_s for its next request
    watch.live[1] = True
    clock.advance(1.0)
    assert watch.silent(initialized=True, held=()) == {1: 6.0}  # worker 0 waited on the server, it was not silent
    clock.advance(4.0)
    assert set(watch.silent(initialized=True, held=())) == {0, 1}  # from the reply on, its silence counts


def _leaves(state: Any) -> int:
    """How many values a state holds (a tensor counts as one): its size, apart from the tensors' own."""
    if isinstance(state, dict):
        return sum(1 + _leaves(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_leaves(v) for v in state)
    return 1


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_server_shard_staleness_record_is_bounded_and_resumes_its_stats():
    model = _model()
    params = list(model.parameters())
    spec = ps.optimizer_spec(_optimizer(model, "sgd"), params)
    pushes = 40

    def run(n: int) -> tuple[ps.ServerShard, list[list[int]]]:
        shard = ps.ServerShard(params, range(4), spec, num_workers=3)
        values: list[list[int]] = [[], [], []]
        for k in range(n):  # a few distinct values per worker, and one far beyond the cap
            worker = k % 3
            staleness = 5000 if k == 7 else worker + (k // 3) % 6
            shard.record(worker, staleness)
            values[worker].append(staleness)
        return shard, values

    small, _ = run(pushes)
    large, values = run(10 * pushes)
    assert _leaves(large.state_dict()) == _leaves(small.state_dict()), "the checkpoint grows with the pushes"

    # The stats are those of the full history (values at or above the cap are counted under it).
    def histogram(h: list[int]) -> dict[int, int]:
        clamped = [min(s, STALENESS_CAP) for s in h]
        return {s: clamped.count(s) for s in sorted(set(clamped))}

    stats = large.stats()
    assert stats["last_staleness"] == [h[-1] for h in values]
    assert stats["staleness_histogram"] == [histogram(h) for h in values]
    assert stats["staleness_histogram"][1][STALENESS_CAP] == 1  # push 7 (worker 1), staleness 5000
    # A resumed shard (through a weights-only file) reports the same stats, and goes on counting alike.
    buffer = io.BytesIO()
    torch.save(large.state_dict(), buffer)
    buffer.seek(0)
    resumed = ps.ServerShard(params, range(4), spec, num_workers=3)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.stats() == stats
    for shard in (large, resumed):
        shard.record(2, 4)
    assert resumed.stats() == large.stats()
    # A state of the older form (every value) loads into the same stats.
    older = {k: v for k, v in large.state_dict().items() if k not in ("staleness_counts", "last_staleness")}
    older["staleness_history"] = [h + [4] if w == 2 else h for w, h in enumerate(values)]
    resumed.load_state_dict(older)
    assert resumed.stats() == large.stats()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_codec_sizes_and_topk_error_feedback():
    layout = ShardLayout([(30, 10), (10,)], [torch.float32, torch.float32])
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(30, 10, generator=gen), torch.randn(10, generator=gen)] for _ in range(3)]
    for name, nbytes in (("none", 310 * 4), ("fp16", 310 * 2), ("bf16", 310 * 2), ("topk", 31 * 8)):
        codec = TopKCompression(density=0.1) if name == "topk" else resolve_codec(name)()
        payload = codec.pack(layout.flat_fp32(grads[0]), 0)
        assert payload.dtype == torch.uint8 and payload.numel() == nbytes == codec.packed_nbytes(layout.numel), name
        decoded = codec.unpack(payload, layout.numel)
        exact = layout.flat_fp32(grads[0])
        tolerance = {"none": 0.0, "fp16": 1e-3, "bf16": 1e-2}.get(name)
        if tolerance is not None:
            assert torch.allclose(decoded, exact, atol=tolerance, rtol=tolerance), name
    codec = TopKCompression(density=0.1)
    sent = torch.zeros(310)
    for g in grads:
        decoded = codec.unpack(codec.pack(layout.flat_fp32(g), 3), layout.numel)
        assert (decoded != 0).sum() <= 31
        sent += decoded
    total = sum(layout.flat_fp32(g) for g in grads)
    # error feedback: what was sent plus what is kept adds up to every gradient pushed
    assert torch.allclose(sent + codec.residuals[3], total, atol=1e-5)
    restored = TopKCompression(density=0.1)
    restored.load_state_dict(codec.state_dict())
    assert torch.equal(restored.residuals[3], codec.residuals[3])
    without = TopKCompression(density=0.1, error_feedback=False)
    without.pack(layout.flat_fp32(grads[0]), 0)
    assert not without.residuals


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_ps_package_imports_no_lightning():
    root = Path(ps.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("lightning", "pytorch_lightning"), (path.name, name)
                assert not name.startswith(("lightning_sync.config", "lightning_sync.strategies")), (path.name, name)


# ---------------------------------------------------------------------------------------------------------- sync
def _sync_worker(rank: int, port: int, opt_kind: str, steps: int, config: dict, nan_at: int | None = None) -> dict:
    """Sync steps on 2 servers; worker 1's gradient holds a NaN at step ``nan_at``, if given."""
    _, server, group = _join(rank, port, 2, 2, timeout_s=10)
    model = _model()
    opt = _optimizer(model, opt_kind)
    client = _client(group, model, opt, mode="sync", **config)
    if rank == 0:
        client.init_servers()
    client.pull()
    replies = []
    for step in range(steps):
        _schedule(opt, step)
        _backward(model, rank, step)
        if rank == 1 and step == nan_at:
            model[2].bias.grad[0] = float("nan")  # on one server's shard only: both servers skip the step
        replies.append(client.push(ps.current_lrs(opt)))
        version = step + 1 - sum(r.skipped for r in replies)
        assert replies[-1].versions == (version, version) and replies[-1].staleness == (0, 0)
    client.close()
    if server is not None:
        server.finish(10)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "recv": [r.server_bytes_recv for r in replies],
        "push_nbytes": [client.push_nbytes(i) for i in range(2)],
        "shard_nbytes": client.shard_nbytes,
        "skipped": [r.skipped for r in replies],
    }


def _schedule(opt: torch.optim.Optimizer, step: int) -> None:
    """A learning-rate schedule run on the worker: halve every lr at step 2."""
    if step == 2:
        for group in opt.param_groups:
            group["lr"] *= 0.5


def _reference(opt_kind: str, steps: int, num_workers: int = 2, skip: int | None = None) -> list[torch.Tensor]:
    """One process: average the workers' gradients (worker order, fp32), one optimizer step, as DDP does; no step at
    all at step ``skip``."""
    model = _model()
    opt = _optimizer(model, opt_kind)
    for step in range(steps):
        _schedule(opt, step)
        if step == skip:
            continue
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(num_workers):
            _backward(model, rank, step)
            for t, p in zip(total, model.parameters()):
                t.add_(p.grad)
        for t, p in zip(total, model.parameters()):
            p.grad = t.div_(num_workers)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.dist
@pytest.mark.timeout(40)
@pytest.mark.parametrize("opt_kind", ["sgd", "two_groups"])
def test_sync_equals_averaged_gradient_step(procs, opt_kind):
    port, steps = _free_port(), 5
    for rank in range(2):
        procs.start(f"worker{rank}", _sync_worker, rank, port, opt_kind, steps, {})
    out = procs.ok(["worker0", "worker1"], timeout=30)
    expected = _reference(opt_kind, steps)
    for rank in range(2):
        got = out[f"worker{rank}"]["params"]
        assert all(torch.allclose(g, e, atol=1e-6, rtol=0) for g, e in zip(got, expected)), (rank, got, expected)
    assert all(torch.equal(a, b) for a, b in zip(out["worker0"]["params"], out["worker1"]["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(expected, _model().parameters()))  # it did train


@pytest.mark.dist
@pytest.mark.timeout(40)
@pytest.mark.parametrize("compression", ["none", "topk"])
def test_sync_skips_a_nonfinite_step_for_every_worker_on_every_server(procs, compression):
    """Worker 1's gradient holds a NaN at step 2, in one shard: no server steps, every worker is told, the optimizer
    state (momentum) is untouched, and training goes on as if that step had not been (``none``: the reference that
    skips it; ``topk``: finite, the NaN kept out of the error feedback)."""
    port, steps = _free_port(), 5
    for rank in range(2):
        procs.start(
            f"worker{rank}",
            _sync_worker,
            rank,
            port,
            "two_groups",
            steps,
            {"codec": resolve_codec(compression)().spec()},
            2,
        )
    out = procs.ok(["worker0", "worker1"], timeout=30)
    for rank in range(2):
        assert out[f"worker{rank}"]["skipped"] == [False, False, True, False, False], rank
        assert all(bool(p.isfinite().all()) for p in out[f"worker{rank}"]["params"]), rank
    assert all(torch.equal(a, b) for a, b in zip(out["worker0"]["params"], out["worker1"]["params"]))
    if compression == "none":
        expected = _reference("two_groups", steps, skip=2)
        got = out["worker0"]["params"]
        assert all(torch.allclose(g, e, atol=1e-6, rtol=0) for g, e in zip(got, expected)), (got, expected)


@pytest.mark.dist
@pytest.mark.timeout(40)
def test_sync_ingress_per_step_is_workers_times_shard_bytes(procs):
    totals = {}
    for compression in ("none", "topk"):
        port = _free_port()
        config = {"codec": (TopKCompression(0.1) if compression == "topk" else resolve_codec(compression)()).spec()}
        for rank in range(2):
            procs.start(f"{compression}{rank}", _sync_worker, rank, port, "sgd", 4, config)
        out = procs.ok([f"{compression}0", f"{compression}1"], timeout=30)[f"{compression}0"]
        model_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
        assert sum(out["shard_nbytes"]) == model_bytes
        for server in range(2):
            recv = [r[server] for r in out["recv"]]
            per_step = {b - a for a, b in zip(recv, recv[1:])}
            # between two replies a server got exactly one push (header + lr + gradient) from each of the 2 workers
            assert per_step == {2 * out["push_nbytes"][server]}, (compression, server, recv)
            if compression == "none":
                gradient = out["push_nbytes"][server] - HEADER_BYTES - 8
                assert gradient == out["shard_nbytes"][server]
                assert abs(gradient - model_bytes / 2) <= 5 * 6 * 4  # about half each (largest tensor: 5 x 6)
        totals[compression] = sum(n - HEADER_BYTES - 8 for n in out["push_nbytes"])  # gradient bytes per push
    assert totals["none"] == sum(p.numel() * 4 for p in _model().parameters())
    assert totals["topk"] < totals["none"] / 2, totals


# ---------------------------------------------------------------------------------------------------------- async/ssp
def _straggling_worker(
    rank: int, port: int, mode: str, max_staleness: int, steps: int, step_s: float, order: list[int] | None = None
) -> dict:
    """Worker ``rank`` of 3 pushes ``steps`` times, each after ``step_s`` of "compute" (worker 2: 3x as long); with
    ``order`` (worker ranks, one per push), the pushes of all three go in that order, each once the one before has
    its reply and every worker has pulled (an injected order: the staleness each sees is then fixed)."""
    store, server, group = _join(rank, port, 3, 1, timeout_s=10)
    model = _model()
    opt = _optimizer(model, "sgd")
    client = _client(group, model, opt, mode=mode, max_staleness=max_staleness)
    if rank == 0:
        client.init_servers()
    client.pull()
    turns = [i for i, r in enumerate(order or []) if r == rank]
    if order is not None and int(store.add("pulled", 1)) == 3:
        store.set("turn/0", "")
    log = []
    for step in range(steps):
        _backward(model, rank, step)
        time.sleep(step_s * (3 if rank == 2 else 1))  # the "compute" of a step; worker 2 is 3x slower
        if order is not None:
            store.wait([f"turn/{turns[step]}"])
        sent = time.monotonic()
        reply = client.push(ps.current_lrs(opt))
        log.append({"sent": sent, "replied": time.monotonic(), "reply": reply})
        if order is not None:
            store.set(f"turn/{turns[step] + 1}", "")
    stats = client.server_stats()[0] if rank == 0 else None
    client.close()
    if server is not None:
        server.finish(10)
    return {"log": log, "stats": stats}


@pytest.mark.dist
@pytest.mark.timeout(40)
def test_async_records_staleness_and_the_straggler_is_stalest(procs):
    """The straggler (worker 2) pushes once for every two of each fast worker, then its last four alone."""
    port, steps = _free_port(), 8
    order = [0, 1, 0, 1, 2] * 4 + [2] * 4
    for rank in range(3):
        procs.start(f"worker{rank}", _straggling_worker, rank, port, "async", 0, steps, 0.0, order)
    out = procs.ok([f"worker{r}" for r in range(3)], timeout=30)
    # worker 0 asked for the stats when it finished; the others may still have been pushing then
    histogram = out["worker0"]["stats"]["staleness_histogram"]
    counted = [sum(h.values()) for h in histogram]
    assert counted[0] == steps and all(n <= steps for n in counted)
    straggler = [e["reply"].staleness[0] for e in out["worker2"]["log"]]
    fast = [e["reply"].staleness[0] for r in (0, 1) for e in out[f"worker{r}"]["log"]]
    assert all(s >= 0 for s in straggler + fast)
    assert histogram[2] == dict(Counter(straggler[: counted[2]]))  # the reply carries what the server recorded
    assert straggler == [4, 4, 4, 4, 0, 0, 0, 0], straggler  # four others' pushes since its last reply; then alone
    assert sorted(fast) == sorted([0, 1, 1, 1] + [2, 2, 1, 1] * 3), fast  # one or two since their own


@pytest.mark.dist
@pytest.mark.timeout(40)
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_ssp_never_lets_a_worker_run_more_than_s_ahead(procs, max_staleness):
    port, steps = _free_port(), 8
    for rank in range(3):
        procs.start(f"worker{rank}", _straggling_worker, rank, port, "ssp", max_staleness, steps, 0.02)
    out = procs.ok([f"worker{r}" for r in range(3)], timeout=30)
    straggler_sent = [e["sent"] for e in out["worker2"]["log"]]
    for rank in range(3):
        for n, entry in enumerate(out[f"worker{rank}"]["log"], start=1):
            reply = entry["reply"]
            assert reply.clocks[0] == n and reply.clocks[0] - reply.min_clocks[0] <= max_staleness, (rank, n, reply)
            # the n-th reply only came once the straggler had sent its (n - s)-th push
            assert sum(t < entry["replied"] for t in straggler_sent) >= n - max_staleness, (rank, n)
    if max_staleness == 0:  # lockstep: one round of pushes per version step of 3
        assert all(e["reply"].version % 3 == 0 for r in range(3) for e in out[f"worker{r}"]["log"])


# ---------------------------------------------------------------------------------------------------------- stop
def _stopping_worker(rank: int, port: int, mode: str, max_updates: int | None, stop_after: int | None) -> dict:
    _, server, group = _join(rank, port, 2, 1, timeout_s=10)
    model, opt, client = _started_sgd_worker(group, rank, mode=mode, max_updates=max_updates)
    pushes, reply = 0, None
    for step in range(100):
        if stop_after is not None and rank == 1 and step == stop_after:
            reply = client.request_stop()
            break
        _backward(model, rank, step)
        reply = client.push(ps.current_lrs(opt))
        pushes += reply.applied
        if reply.stop:
            break
    stats = client.server_stats()[0]
    client.close()
    if server is not None:
        server.finish(10)
    return {"pushes": pushes, "stop": reply.stop, "reason": reply.stop_reason, "version": stats["version"]}


@pytest.mark.dist
@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    "mode, max_updates, stop_after, reason",
    [("async", 9, None, "max_updates=9 reached"), ("sync", 4, None, "max_updates=4 reached"),
     ("sync", None, 3, "worker 1 requested stop")],
)  # fmt: skip
def test_stop_reaches_every_worker(procs, mode, max_updates, stop_after, reason):
    port = _free_port()
    for rank in range(2):
        procs.start(f"worker{rank}", _stopping_worker, rank, port, mode, max_updates, stop_after)
    out = procs.ok(["worker0", "worker1"], timeout=30)
    assert all(out[w]["stop"] and out[w]["reason"] == reason for w in out), out
    version = out["worker0"]["version"]
    assert version == (max_updates if max_updates else stop_after)
    applied = out["worker0"]["pushes"] + out["worker1"]["pushes"]
    assert applied == (version if mode == "async" else 2 * version), out


def _mismatched_worker(rank: int, port: int) -> dict:
    _, server, group = _join(rank, port, 2, 1, timeout_s=10)
    model = _model()
    opt = _optimizer(model, "sgd")
    client = _client(group, model, opt, mode="sync" if rank == 0 else "async")
    if rank == 0:
        client.init_servers()
    out: dict[str, Any] = {}
    try:
        client.pull()
        for step in range(2):  # worker 1 left: the sync rounds go on with worker 0 alone
            _backward(model, rank, step)
            out["version"] = client.push(ps.current_lrs(opt)).version
    except ps.PSServerError as exc:
        out["error"] = str(exc)
    client.close()
    if server is not None:
        server.finish(10)
    return out


@pytest.mark.dist
@pytest.mark.timeout(30)
def test_a_worker_with_other_settings_is_refused(procs):
    port = _free_port()
    for rank in range(2):
        procs.start(f"worker{rank}", _mismatched_worker, rank, port)
    out = procs.ok(["worker0", "worker1"], timeout=20)
    assert out["worker0"] == {"version": 2}, out
    assert "server 0 (ps rank 2) refused the PULL" in out["worker1"]["error"], out
    assert "worker 1's ps settings" in out["worker1"]["error"], out


# ---------------------------------------------------------------------------------------------------------- resume
def _resuming_worker(rank: int, port: int, first: int, steps: int, states: dict | None, save: bool) -> dict:
    _, server, group = _join(rank, port, 2, 2, timeout_s=10)
    model = _model()
    opt = _optimizer(model, "two_groups")
    client = _client(group, model, opt, mode="sync", codec=TopKCompression(density=0.3).spec())
    if states is not None:
        client.load_state_dict(states["clients"][rank])
    if rank == 0:
        client.init_servers(None if states is None else states["servers"])
    client.pull()
    for step in range(first, first + steps):
        _backward(model, rank, step)
        reply = client.push(ps.current_lrs(opt))
    out = {"params": [p.detach().clone() for p in model.parameters()], "client": client.state_dict()}
    out["version"] = reply.version
    if save and rank == 0:
        out["servers"] = client.server_states()
    client.close()
    if server is not None:
        server.finish(10)
    return out


@pytest.mark.dist
@pytest.mark.timeout(40)
def test_sync_checkpoint_over_the_transport_resumes_bitwise(procs):
    def run(tag: str, first: int, steps: int, states: dict | None, save: bool) -> dict:
        port = _free_port()
        for rank in range(2):
            procs.start(f"{tag}{rank}", _resuming_worker, rank, port, first, steps, states, save)
        return procs.ok([f"{tag}0", f"{tag}1"], timeout=30)

    straight = run("straight", 0, 6, None, False)
    half = run("half", 0, 3, None, True)
    states = {"servers": half["half0"]["servers"], "clients": [half[f"half{r}"]["client"] for r in range(2)]}
    assert [s["version"] for s in states["servers"]] == [3, 3] and states["clients"][0]["codec"]["residuals"]
    resumed = run("resumed", 3, 3, states, False)
    assert resumed["resumed0"]["version"] == 6
    for rank in range(2):
        a, b = straight[f"straight{rank}"]["params"], resumed[f"resumed{rank}"]["params"]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), rank


# ---------------------------------------------------------------------------------------------------------- failures
def _victim_worker(rank: int, port: int, mode: str, how: int, signalled: Any, timeout_s: float) -> dict:
    group = _join_dedicated(rank, port, 1, timeout_s)
    model, opt, client = _started_sgd_worker(group, rank, mode=mode)
    try:
        for step in range(400):
            if rank == 1 and step == 3:
                signalled.value = time.monotonic()
                os.kill(os.getpid(), how)
            _backward(model, rank, step)
            client.push(ps.current_lrs(opt))
            time.sleep(0.03)
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


# A frozen peer (SIGSTOP) can only be found by the timeout, so those cases use a short one and must see a
# PSTimeoutError. A killed one (SIGKILL) closes its connections at once; those cases check that the close is what
# is seen, so they use a timeout far longer than any scheduling delay and must fail well before it: a PSTimeoutError
# there would mean the close went unnoticed. With a short timeout both would be true of a worker descheduled for
# longer than it on a loaded machine, and which one it reports would depend on which it checks first.
_FROZEN_TIMEOUT_S, _KILLED_TIMEOUT_S = 2.0, 30.0


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "mode, how", [("sync", signal.SIGSTOP), ("sync", signal.SIGKILL)], ids=["sync-SIGSTOP", "sync-SIGKILL"]
)
def test_lost_worker_makes_the_server_exit_naming_it(procs, mode, how):
    """In sync (not elastic) a lost worker ends the run; async and ssp drop it (tests/test_ps_elastic.py)."""
    port = _free_port()
    timeout_s = _FROZEN_TIMEOUT_S if how == signal.SIGSTOP else _KILLED_TIMEOUT_S
    signalled = procs.ctx.Value("d", 0.0)
    procs.start("server", _server_process, port, 0, 2, 1, timeout_s)
    for rank in range(2):
        procs.start(f"worker{rank}", _victim_worker, rank, port, mode, how, signalled, timeout_s)
    server = procs.ok(["server"], timeout=60)["server"]
    assert "error" in server, server
    seconds = server["at"] - signalled.value
    if how == signal.SIGSTOP:  # silent: declared lost after timeout_s
        assert "worker 1 (ps rank 1) sent nothing" in server["error"] and "PSTimeoutError" in server["error"], server
        assert seconds <= timeout_s + NOTICED_WITHIN_S, seconds
    else:  # its receiving thread sees the connection close at once
        assert "worker 1 (ps rank 1) closed its connection" in server["error"], server
        assert "PSPeerLostError" in server["error"], server
        assert seconds < timeout_s / 2, seconds
    assert "worker 0 (ps rank 0)" not in server["error"], server
    survivor = procs.ok(["worker0"], timeout=timeout_s + 10)["worker0"]
    assert survivor["error"] and "server 0 (ps rank 2)" in survivor["error"], survivor


def _worker_of_lost_server(rank: int, port: int, pushes: Any, timeout_s: float) -> dict:
    group = _join_dedicated(rank, port, 2, timeout_s)
    model, opt, client = _started_sgd_worker(group, rank, mode="sync")
    try:
        for step in range(400):
            _backward(model, rank, step)
            client.push(ps.current_lrs(opt))
            with pushes.get_lock():
                pushes.value += 1
            time.sleep(0.03)
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}
    return {"error": None}


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_lost_server_makes_workers_raise_naming_it(procs, how):
    port = _free_port()
    timeout_s = _FROZEN_TIMEOUT_S if how == signal.SIGSTOP else _KILLED_TIMEOUT_S
    pushes = procs.ctx.Value("i", 0)
    for server in range(2):
        procs.start(f"server{server}", _server_process, port, server, 2, 2, timeout_s)
    for rank in range(2):
        procs.start(f"worker{rank}", _worker_of_lost_server, rank, port, pushes, timeout_s)
    deadline = time.monotonic() + 20
    while pushes.value < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pushes.value >= 6
    os.kill(procs.procs["server1"].pid, how)
    signalled = time.monotonic()
    out = procs.ok(["worker0", "worker1"], timeout=timeout_s + 30)
    expected = "PSTimeoutError" if how == signal.SIGSTOP else "PSPeerLostError"
    for rank in range(2):
        result = out[f"worker{rank}"]
        assert result["error"] and "server 1 (ps rank 3)" in result["error"] and expected in result["error"], result
        seconds = result["at"] - signalled
        if how == signal.SIGSTOP:
            assert seconds <= timeout_s + NOTICED_WITHIN_S, seconds
        else:  # the close, seen at once, not the timeout
            assert seconds < timeout_s / 2, seconds


class _GroupWithAStuckHeaderSend:
    """A worker's group whose server was killed while the request header was being written: gloo never fails that
    send (its wait would run out ``timeout_s``), but fails the posted receive of the reply at once."""

    timeout_s = 0.04  # the exchange's grace for a server's report is a quarter of it

    def __init__(self) -> None:
        self.waited: list[tuple[str, int]] = []

    def server_rank(self, server: int) -> int:
        return 1 + server

    def name(self, rank: int | None = None) -> str:
        return f"server {rank}"

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> tuple[str, int]:
        return "recv", tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> tuple[str, int]:
        return "send", tag

    def first_reported_failure(self, servers_only: bool = False) -> None:
        return None

    def reported_failure(self, rank: int) -> None:
        return None

    def wait(self, work: tuple[str, int], peer: int, what: str, *, receiving: bool, timeout_s: float) -> None:
        self.waited.append(work)
        if work == ("send", TAG_REQUEST):
            raise ps.PSTimeoutError("the header send waited out timeout_s")
        if work == ("recv", TAG_REPLY):
            raise ps.PSPeerLostError("server 1 closed its connection")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_exchange_waits_for_the_reply_before_the_request_header():
    """A PUSH to a killed server: the data send and the reply's receive fail (or complete) as gloo sees the close,
    the header send may never; so the exchange waits for the data, then the reply, and the header last (taken once
    a reply came), and raises the lost server at once rather than a timeout."""
    group = _GroupWithAStuckHeaderSend()
    payload = torch.zeros(8, dtype=torch.uint8)
    request = Request(Kind.PUSH, 0, 0, payload.numel(), 0, 0)
    with pytest.raises(ps.PSPeerLostError, match="closed its connection"):
        exchange(group, Kind.PUSH, [request], [payload], [torch.empty(0, dtype=torch.uint8)], reply_timeout=1.0)
    assert group.waited == [("send", TAG_REQUEST_DATA), ("recv", TAG_REPLY)], group.waited


def _server_that_will_die(port: int) -> dict:
    """A server member with its link to worker 0 up and a request header receive posted (as its receiving thread
    keeps one), then idle until it is killed."""
    store = ps.connect_store(HOST, port, is_host=False, timeout_s=30)
    group = ps.PSGroup(store, 1, 1, 1, 2.0, connect_timeout_s=30)
    group.connect(0)
    pending = group.recv(torch.zeros(HEADER_BYTES // 8, dtype=torch.int64), 0, TAG_REQUEST)
    group.post("ready", 1.0)
    time.sleep(120)
    return {"pending": pending is not None}


def _worker_resumed_after_the_kill(port: int) -> dict:
    """Stops itself once the server is ready; resumed after the server was killed, it sends a PULL at once: the
    request goes into the dead connection while gloo may not have read the close yet."""
    store = ps.connect_store(HOST, port, is_host=True, timeout_s=30)
    group = ps.PSGroup(store, 0, 1, 1, 2.0, connect_timeout_s=30)
    while not group.posted("ready", range(1, 2)):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    request = Request(Kind.PULL, 0, 0, 0, 0, 0)
    try:
        exchange(group, Kind.PULL, [request], None, [torch.empty(0, dtype=torch.uint8)], reply_timeout=2.0)
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_request_sent_into_a_killed_servers_connection_fails_at_once(procs):
    """gloo fails every posted receive when it reads a closed connection, but not a send it was writing then (one
    queued after the write met the reset): that send would wait out ``timeout_s`` (2 s here). The worker is frozen
    while the server is killed, then resumed straight into a PULL, so that its send and gloo's reading of the close
    race; over 8 rounds the send loses at least once in most runs. Every round must end with PSPeerLostError, from
    the reply's receive, well before the timeout (the exchange gives a lost server ``timeout_s / 4`` to leave its
    reason in the store, which a killed one never does)."""
    for round_ in range(8):
        port = _free_port()
        server = procs.start(f"server{round_}", _server_that_will_die, port)
        worker = procs.start(f"worker{round_}", _worker_resumed_after_the_kill, port)
        deadline = time.monotonic() + 30
        while _state(worker.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(worker.pid) == "T", "the worker did not stop itself"
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(0.2)  # the close has reached the worker's socket
        os.kill(worker.pid, signal.SIGCONT)
        out = procs.ok([f"worker{round_}"], timeout=30)[f"worker{round_}"]
        assert out["error"] and out["error"].startswith("PSPeerLostError: server 0 (ps rank 1)"), (round_, out)
        assert out["seconds"] < 1.5, (round_, out)  # the close and a 0.5 s grace for the server's report, not 2 s


def _worker_after_a_failed_peer(rank: int, port: int, server_pid: Any, failed_at: Any) -> dict:
    """Sync steps; at step 5 worker 0 freezes the server, lets worker 1 time out on it, then pushes itself."""
    group = _join_dedicated(rank, port, 1, 3.0)
    model, opt, client = _started_sgd_worker(group, rank, mode="sync")
    for step in range(400):
        if rank == 0 and step == 5:
            os.kill(server_pid.value, signal.SIGSTOP)
            deadline = time.monotonic() + 20
            while not failed_at.value and time.monotonic() < deadline:
                time.sleep(0.01)
        _backward(model, rank, step)
        started = time.monotonic()
        try:
            client.push(ps.current_lrs(opt))
        except ps.PSError as exc:
            if rank == 1:
                failed_at.value = time.monotonic()
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started, "step": step}
    return {"error": None}


@pytest.mark.dist
@pytest.mark.timeout(40)
def test_a_worker_stops_at_once_when_a_peer_already_gave_up(procs):
    """Worker 1 times out on a frozen server and reports it; worker 0's next push then fails at once, quoting that
    report, instead of waiting out ``timeout_s`` (3 s) on the same server."""
    port = _free_port()
    server_pid, failed_at = procs.ctx.Value("i", 0), procs.ctx.Value("d", 0.0)
    server_pid.value = procs.start("server", _server_process, port, 0, 2, 1, 3.0).pid
    for rank in range(2):
        procs.start(f"worker{rank}", _worker_after_a_failed_peer, rank, port, server_pid, failed_at)
    out = procs.ok(["worker0", "worker1"], timeout=30)
    late, first = out["worker0"], out["worker1"]
    # worker 1 is stuck at step 5, or at 4 when the server froze before sending its reply to that step
    assert first["step"] in (4, 5) and "PSTimeoutError: server 0 (ps rank 2)" in first["error"], first
    assert late["step"] == 5 and late["error"].startswith(
        "PSPeerLostError: worker 1 (ps rank 1) failed before this PUSH: PSTimeoutError: server 0 (ps rank 2)"
    ), late
    assert late["seconds"] < 0.5 * 3.0, late  # at once: well within the server's timeout_s (3 s) it would wait


# ---------------------------------------------------------------------------------------------------------- placement
def _dedicated_worker(rank: int, port: int) -> dict:
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=60)
    servers = ps.start_servers("dedicated", 0, HOST, port, 2, 2, timeout_s=20) if rank == 0 else None
    group = ps.PSGroup(store, rank, 2, 2, 20.0, connect_timeout_s=60)
    model, opt, client = _started_sgd_worker(group, rank, mode="sync")
    for step in range(3):
        _backward(model, rank, step)
        reply = client.push(ps.current_lrs(opt))
    client.close()
    out = {"version": reply.version}
    if servers is not None:
        out["codes"] = servers.wait(timeout_s=20)
        out["pids"] = [p.pid for p in servers.processes]
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dedicated_server_processes_exit_after_the_workers_finish(procs):
    port = _free_port()
    for rank in range(2):
        procs.start(f"worker{rank}", _dedicated_worker, rank, port)
    out = procs.ok(["worker0", "worker1"], timeout=50)
    assert out["worker0"]["version"] == out["worker1"]["version"] == 3
    assert out["worker0"]["codes"] == [0, 0]
    assert not any(_alive(pid) for pid in out["worker0"]["pids"])


@pytest.mark.e2e
@pytest.mark.timeout(20)
def test_stop_ends_a_frozen_server_at_once():
    """A frozen server (SIGSTOP) holds SIGTERM pending; ``stop`` SIGKILLs it and returns its exit code."""
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(frozen.pid, signal.SIGSTOP)
    assert ps.ServerProcesses([frozen]).stop() == [-signal.SIGKILL]
    assert frozen.poll() == -signal.SIGKILL


def _parent_of_servers(port: int, pids: Any) -> None:
    store = ps.connect_store(HOST, port, is_host=True, timeout_s=60)
    servers = ps.start_servers("dedicated", 0, HOST, port, 1, 1, timeout_s=30)
    group = ps.PSGroup(store, 0, 1, 1, 30.0, connect_timeout_s=60)  # returns once the server has joined
    pids.put([p.pid for p in servers.processes])
    time.sleep(60)  # the group stays open: a server sees a worker's closed connection at once
    group.close()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("frozen", [False, True], ids=["running", "frozen"])
def test_dedicated_server_processes_die_with_their_parent(procs, frozen):
    """A running server sees its parent's closed connection; a frozen one (SIGSTOP) sees nothing, and would hold
    the job's stderr open forever after its parent was killed (e.g. by Lightning's child observer)."""
    port = _free_port()
    pids = procs.ctx.Queue()
    parent = procs.start("parent", _parent_of_servers, port, pids)
    server_pids = pids.get(timeout=45)
    assert all(_alive(pid) for pid in server_pids)
    if frozen:
        for pid in server_pids:
            os.kill(pid, signal.SIGSTOP)
    os.kill(parent.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in server_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in server_pids if _alive(pid)]
    for pid in left:  # never leave a frozen server behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "a server outlived its parent"


@pytest.mark.unit
def test_a_reply_to_a_closed_worker_is_reported_as_that_workers_error_and_the_others_still_go():
    """A send to a worker whose connection closed (killed during a sync round's replies) comes back through
    ``next`` as that worker's error, as its receiving thread would report it; the server loop then drops it (elastic
    modes) or fails; the other workers' replies are sent."""
    from types import SimpleNamespace

    from lightning_sync.ps.errors import PSPeerLostError
    from lightning_sync.ps.server import WorkerChannels

    class Group:
        num_workers = 3
        sent: list[int] = []

        def send(self, tensor, worker, tag):
            if worker == 1:
                raise PSPeerLostError("worker 1 closed its connection (a send): its process is gone")
            self.sent.append(worker)
            return object()

    channels = WorkerChannels(Group(), server=0)  # type: ignore[arg-type]
    header = SimpleNamespace(kind=Kind.PUSH, header=lambda: torch.zeros(1))
    channels.send([(0, (header, None)), (1, (header, None)), (2, (header, None))])
    assert Group.sent == [0, 2] and set(channels._inflight) == {0, 2}
    worker, generation, request, payload, error = channels.next(timeout_s=1.0)
    assert (worker, generation, request, payload) == (1, 0, None, None)
    assert isinstance(error, PSPeerLostError)


@pytest.mark.unit
def test_workers_meet_only_when_all_have_come_and_a_missing_one_is_counted():
    """``PSGroup.meet``: a member waits until the other has come too; one alone fails after ``connect_timeout_s``,
    saying how many of the workers came."""
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    first, second = (ps.PSGroup(store, 2 + i, 2, 2, 5.0, connect_timeout_s=60, prefix="t") for i in range(2))
    waiting = threading.Thread(target=first.meet, args=("the start", 2), daemon=True)
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()  # it waits for the second worker (whatever the load: nothing else lets it return)
    second.meet("the start", 2)
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    alone = ps.PSGroup(store, 2, 2, 2, 5.0, connect_timeout_s=0.5, prefix="u")
    with pytest.raises(ps.PSTimeoutError, match="1 of the 2 workers reached the start within 0.5 s"):
        alone.meet("the start", 2)
