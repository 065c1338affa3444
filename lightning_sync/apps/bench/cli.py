r"""``python -m lightning_sync.bench [--out DIR] [key=value ...]``: run the cases against the anchors, write a report.

Each run is two torchrun nodes of one rank (both on 127.0.0.1, or with ``network.rate=1mbit|10mbit|100mbit|1gbit`` one
per network namespace behind a link of that rate, tbf on both ends; root only, otherwise that rate is skipped with
a note). For every rate and workload the cases alternate (A B A B) over ``repeats`` rounds. Output: one line per
finished run, then the tables; ``results.json``, ``results.md``, ``time_to_accuracy.json`` (digits) and one PNG per
workload in ``--out`` (default ``outputs/bench/<timestamp>/``), each run's logs in ``runs/``.

    python -m lightning_sync.bench                                   # latency-bound MLP, loopback
    python -m lightning_sync.bench workloads=digits network.rate=10mbit,100mbit \
        cases=lightning_ddp,torch_ddp,periodic,powersgd,topk,floor
    python -m lightning_sync.bench workloads=payload network.rate=1gbit
    python -m lightning_sync.bench workloads=latency_bound network.rate=1gbit cases=torch_ddp,allreduce repeats=5
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_sync._exit import skip_final_collection
from lightning_sync.apps.bench.config import BenchConfig, NetworkConfig, parse_overrides, reused_ddp_records
from lightning_sync.apps.bench.workloads import BOUNDS, CASE_HELP, WORKLOADS
from lightning_sync.apps.provenance import provenance
from lightning_sync.config import knob_docs
from lightning_sync.errors import ConfigError


def _knobs_help() -> str:
    lines = ["knobs (key=value; lists comma-separated):"]
    for prefix, cls in (("", BenchConfig), ("network.", NetworkConfig)):
        defaults = asdict(cls())
        for name, doc in knob_docs(cls).items():
            if doc:
                value = defaults[name]
                shown = ",".join(value) if isinstance(value, list) else value
                lines.append(f"  {prefix}{name}={shown}\n      {doc}")
    lines.append("cases:")
    lines += [f"  {name:<19}{text}" for name, text in CASE_HELP.items()]
    lines.append("workloads:")
    lines += [f"  {name:<19}{w.about}" for name, w in WORKLOADS.items()]
    return "\n".join(lines).replace("%", "%%") + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sync.bench",
        description=__doc__,
        epilog=_knobs_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="folder for the report (default: outputs/bench/<timestamp>)")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. network.rate=1gbit cases=allreduce,torch_ddp")
    return parser


def _value_text(workload: str, result: dict[str, Any]) -> str:
    metric = WORKLOADS[workload].metric
    if metric == "step_time":
        return f"{result['step_time_ms']:.2f} ms/step"
    if metric == "bus_bandwidth":
        return f"{result['allreduce_s']:.3f} s, busbw {result['busbw_mbit']:,.0f} Mbit/s"
    wire = result.get("wire_over_meter")
    wire_text = f", wire/meter {wire:.3f}" if wire else ""
    if metric == "time_to_loss":
        trajectory = result.get("trajectory") or [(0.0, 0, math.nan)]
        seconds, steps, final = trajectory[-1]
        if result.get("window_step_ms") is not None:
            first = next(step for _, step, _ in trajectory if step >= result["window_from"])
            return f"{result['window_step_ms']:.1f} ms/step over steps {first}-{steps}{wire_text}"
        if result["case"] in BOUNDS:
            return f"{seconds:.2f} s for {steps} steps (final loss {final:.4f}){wire_text}"
        if result.get("seconds_to_target") is None:
            return (
                f"target {result.get('target_loss')} not reached in {steps} steps (final loss {final:.4f}){wire_text}"
            )
        return (
            f"{result['seconds_to_target']:.2f} s to loss {result['target_loss']:.4f} ({result['steps_to_target']} "
            f"steps){wire_text}"
        )
    if result.get("seconds_to_target") is None:
        return f"target not reached (final accuracy {result.get('final_accuracy') or 0:.3f})"
    return f"{result['seconds_to_target']:.2f} s to target ({result['steps_to_target']} steps)"


class Targets:
    """The target of each time-to-loss workload and the time Lightning DDP took at each rate.

    The first ``lightning_ddp`` run of a workload and seed sets its target: the validation loss it ends its budget
    with (DDP is exact, so its loss curve is the same at every rate). Every later run of that workload and seed stops
    at the target, or once its training time passes ``give_up_factor`` times DDP's time at the same rate and seed.
    """

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.target: dict[tuple[str, int], float] = {}
        self.ddp_seconds: dict[tuple[str, str, int], float] = {}

    def spec(self, workload: str, rate: str, seed: int) -> dict[str, Any]:
        """What a run's spec needs: ``target`` and ``give_up_s`` (when known)."""
        if WORKLOADS[workload].metric != "time_to_loss" or (workload, seed) not in self.target:
            return {}
        ddp = self.ddp_seconds.get((workload, rate, seed))
        return {
            "target": self.target[workload, seed],
            "give_up_s": None if ddp is None else ddp * self.cfg.give_up_factor,
        }

    def observe(self, record: dict[str, Any]) -> None:
        """Takes the target and DDP's time from a ``lightning_ddp`` record, and fills in a record's time to the
        target and its time at ``budget_steps`` from its trajectory."""
        from lightning_sync.apps.bench.clock import first_reaching, window_step_seconds

        workload = record["workload"]
        trajectory = record.get("trajectory")
        if WORKLOADS[workload].metric != "time_to_loss" or not record.get("ok") or not trajectory:
            return
        if self.cfg.window:
            record["window_from"] = self.cfg.window_span(record["case"])[0]
            seconds = window_step_seconds(trajectory, record["window_from"])
            record["window_step_ms"] = None if seconds is None else 1e3 * seconds
            return
        seed = record["seed"]
        if record["case"] == "lightning_ddp":
            self.target.setdefault((workload, seed), trajectory[-1][2])
            self.ddp_seconds[workload, record["rate"], seed] = trajectory[-1][0]
        target = self.target.get((workload, seed))
        record["target_loss"] = target
        at_budget = [seconds for seconds, step, _ in trajectory if step == self.cfg.budget_steps]
        record["seconds_at_budget"] = at_budget[0] if at_budget else None
        if target is not None and record.get("seconds_to_target") is None and not record.get("gave_up"):
            reached = first_reaching(trajectory, target, lower_is_better=True)
            if reached is not None:
                record["seconds_to_target"], record["steps_to_target"] = reached


def _reuse_ddp(
    cfg: BenchConfig, plan: list[tuple[str, str, int, str]], targets: Targets, records: list[dict[str, Any]]
) -> list[tuple[str, str, int, str]]:
    """With ``ddp_from``: copies its ``lightning_ddp`` records into ``records`` (marked ``reused_from``, with this
    run's repeat of their seed), lets them set the targets, and returns the plan without those runs."""
    if not cfg.ddp_from:
        return plan
    repeat_of = {cfg.seed_of(r): r for r in range(cfg.repeats)}
    reused: set[tuple[str, str, int]] = set()
    for old in reused_ddp_records(cfg):
        key = (old["rate"], old["workload"], repeat_of[old["seed"]])
        if key in reused:
            continue
        record = {**old, "repeat": key[2], "reused_from": cfg.ddp_from}
        targets.observe(record)
        records.append(record)
        reused.add(key)
        print(f"reused: {key[0]} {key[1]} seed {old['seed']} lightning_ddp from {cfg.ddp_from}", flush=True)
    return [p for p in plan if not (p[3] == "lightning_ddp" and (p[0], p[1], p[2]) in reused)]


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the launcher's and the namespaces' clean-up


def run(cfg: BenchConfig, out: Path, records: list[dict[str, Any]]) -> bool:
    """Runs every rate, workload, repeat and case (cases alternating), appending one record per run to
    ``records`` (so an interrupted benchmark keeps what finished); returns whether every run succeeded.

    Rates that need root are skipped with a note when not root. Nothing is left behind on any exit: each run's
    processes are killed and each rate's namespaces deleted.
    """
    from lightning_sync.apps.bench.launch import RunFailed, network, root_problem, run_nodes

    rates = []
    for rate in cfg.network.rate:
        problem = root_problem(rate)
        if problem:
            print(f"skipped: {problem}", flush=True)
        else:
            rates.append(rate)
    plan = [
        (rate, w, r, c) for rate in rates for w in cfg.workloads for r in range(cfg.repeats) for c in cfg.cases_for(w)
    ]
    all_ok = True
    index = 0
    targets = Targets(cfg)
    plan = _reuse_ddp(cfg, plan, targets, records)
    for rate in rates:
        with network(rate, cfg.network.prefix) as hosts:
            for _, workload, repeat, case in [p for p in plan if p[0] == rate]:
                index += 1
                seed = cfg.seed_of(repeat)
                spec = {
                    "case": case,
                    "workload": workload,
                    "config": {**asdict(cfg), "seed": seed},
                    "nodes": 1 if case == "single" else 2,
                    "wire": hosts is not None and case != "single",
                    **targets.spec(workload, rate, seed),
                }
                started = time.perf_counter()
                record: dict[str, Any] = {
                    "workload": workload,
                    "rate": rate,
                    "case": case,
                    "repeat": repeat,
                    "seed": seed,
                }
                head = f"[{index}/{len(plan)}] {rate} {workload} repeat {repeat + 1}/{cfg.repeats} seed {seed} {case}:"
                try:
                    result = run_nodes(spec, out / "runs" / f"{rate}_{workload}_{case}_{repeat}", hosts, cfg.timeout_s)
                    record.update(ok=True, **result)
                    targets.observe(record)
                    text = _value_text(workload, record)
                except RunFailed as error:
                    all_ok = False
                    record.update(ok=False, error=str(error))
                    text = f"FAILED: {error}"
                record["wall_s"] = time.perf_counter() - started
                record["load_average"] = [round(x, 2) for x in os.getloadavg()]
                records.append(record)
                print(f"{head} {text} ({record['wall_s']:.0f} s)", flush=True)
    return all_ok


def main(argv: list[str] | None = None) -> None:
    skip_final_collection()
    args = _parser().parse_args(argv)
    try:
        cfg = parse_overrides(args.overrides)
    except ConfigError as error:
        sys.exit(f"error: {error}")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) if args.out else Path("outputs", "bench", stamp)
    signal.signal(signal.SIGTERM, _raise_exit)
    started = provenance()
    records: list[dict[str, Any]] = []
    all_ok = False
    try:
        all_ok = run(cfg, out, records)
    finally:
        if records:
            from lightning_sync.apps.bench.report import write

            text, files = write(records, cfg, out, started)
            print("\n" + text)
            print(f"written: {', '.join(str(f) for f in files)}")
    if not records:
        print("nothing ran")
    if not all_ok:
        sys.exit(1)
