"""Goodput under failures: fault-tolerant DiLoCo on torchft against fail-fast plus torchrun restarts.

Three replicas train ``char_lm`` with DiLoCo (``strategy=periodic strategy.mode=diloco strategy.sync_every=8``,
the Hydra app, one process per replica, ``OMP_NUM_THREADS=1``) for ``--seconds`` of wall time each, in three cases
that alternate (``ft``, ``restart``, ``none``, then again for each ``--repeats``). Every batch is padded to
``--step-s`` seconds (``callbacks=[...,pacer]``): three replicas on a machine of two cores would otherwise share its
cores, and losing one would speed the others up instead of costing a third of the work, as it does when each
replica has a host of its own.

- ``ft``: three replica groups of one rank on a local ``torchft_lighthouse`` (``ft=torchft``, ``ft.min_replicas=2``,
  ``ft.timeout_s=5``, heartbeat 1 s, join 5 s). Every ``--kill-every`` seconds one group is SIGKILLed (groups 2, 1,
  0, 2, ... in turn) and started again with its original command ``--restart-after`` seconds later; it heals from
  the live groups.
- ``restart``: today's fail-fast job, the same three ranks in one ``torchrun --max-restarts`` job that writes
  ``last.ckpt`` every ``--ckpt-every`` steps. The same kill schedule SIGKILLs one rank; torchrun then restarts all
  three, and they resume from ``last.ckpt`` (the steps since it are trained again). The killed rank's slot is down
  for ``--restart-after`` seconds, as the killed group's is under ``ft`` (its host comes back then): its restarted
  process waits that long before it starts, and the other two wait for it at the rendezvous.
  ``--instant-restart`` drops that wait (torchrun restarts all three at once, as on a host that never went away).
- ``none``: the ``ft`` case without faults.

Measured from the processes' own records (the Hydra log's commit lines, and the step clock ``callbacks=[default,step_clock]``):

- **tokens/s**: tokens whose training reached the model by ``--seconds``, divided by ``--seconds`` (start-up
  included). Under ``ft``/``none``: for every committed sync (deduplicated across groups by torchft's step), its
  participating groups x ``sync_every`` x batch x block size. Under ``restart``: the highest step reached x 3 x batch
  x block size (steps trained again after a restart count once).
- **validation loss at equal wall time**: the last ``val/loss`` before ``--seconds``; under ``ft``/``none`` the mean
  over groups of each group's last one (each group validates on its own shard).
- **per kill** (``ft``): seconds from the kill to the first commit without the killed group, and from the restart
  to the restarted group's first commit (Lightning's start-up included).

The goals of issue 25: ``ft`` >= 0.8 x ``none`` x the mean fraction of live groups, ``ft`` >= 1.5 x ``restart``,
kill to the next commit at most 2 s (median) and ``ft.timeout_s`` + 1 s (max), restart to its first commit at most
15 s. The script prints each run, the medians and the ratios, and writes ``records.json`` to ``--out`` and the page
beside it (``<out>.md`` and ``<out>.provenance.json``, for ``make docs-gen``); the runs' logs go to ``--work``.

    python benchmarks/ft_goodput.py                                   # 300 s per case, one round
    python benchmarks/ft_goodput.py --seconds 90 --kill-every 30 --restart-after 10 --out /tmp/goodput
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sync.apps.ft_local import (
    descendants,
    group_command,
    read_commits,
    start_lighthouse,
    start_process,
    stop_process,
)
from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance
from lightning_sync.callbacks import read_step_clock

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 3
SYNC_EVERY = 8
BATCH, BLOCK = 16, 64  # conf/data/text.yaml: windows per batch per rank, characters per window
TIMEOUT_S, HEARTBEAT_S, JOIN_S = 5.0, 1.0, 5.0


def _app(args: argparse.Namespace) -> list[str]:
    """The Hydra app's overrides every case shares: char_lm, DiLoCo every 8 steps, no end of its own, a step clock,
    and with ``--step-s`` a step pacer."""
    paced = args.step_s > 0
    return [
        "experiment=char_lm", "strategy=periodic", "strategy.mode=diloco", f"strategy.sync_every={SYNC_EVERY}",
        "trainer.max_steps=1000000", "trainer.val_check_interval=40", "trainer.limit_val_batches=4", "test=false",
        f"callbacks=[default,step_clock{',pacer' if paced else ''}]",
        *([f"callbacks.pacer.step_s={args.step_s}"] if paced else []),
    ]  # fmt: skip


@dataclass
class Proc:
    """One process a run started: its name, run folder and start time (unix)."""

    name: str
    run_dir: Path
    popen: subprocess.Popen[bytes]
    started: float


@dataclass
class Run:
    """One run of a case: its start (unix time), every process it started (restarts included) and its kills."""

    case: str
    start: float
    procs: list[Proc] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)


def _start(run: Run, name: str, command: list[str], run_dir: Path) -> Proc:
    proc = Proc(name, run_dir, start_process(command, run_dir / "stdout.log", cwd=ROOT), time.time())
    run.procs.append(proc)
    return proc


def _group(run: Run, args: argparse.Namespace, folder: Path, lighthouse: str, group: int, attempt: int) -> Proc:
    run_dir = folder / f"group{group}.{attempt}"
    clock = f"callbacks.step_clock.path={folder / f'group{group}.clock'}"  # one file for every attempt of a group
    command = group_command(
        lighthouse, group, GROUPS, run_dir, *_app(args), clock, min_replicas=2, timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_S, join_timeout_s=JOIN_S,
    )  # fmt: skip
    return _start(run, f"group{group}", command, run_dir)


GATE = "--gate"
"""First argument of torchrun's worker command under ``restart``: :func:`_gate` runs it."""


def _gate(folder: str, app: list[str]) -> None:
    """torchrun's worker under ``restart``: while this rank's slot is down (until the time its ``down.<LOCAL_RANK>``
    file in ``folder`` holds, written at the kill), it waits; then it becomes the Hydra app (same pid and
    environment)."""
    down = Path(folder) / f"down.{os.environ.get('LOCAL_RANK', '0')}"
    if down.exists():
        time.sleep(max(0.0, float(down.read_text()) - time.time()))
    os.execv(sys.executable, [sys.executable, "-m", "lightning_sync.train", *app])


def _kill_times(args: argparse.Namespace) -> list[float]:
    """Seconds into a run of each kill: every ``--kill-every`` seconds, none at the end."""
    return [k * args.kill_every for k in range(1, math.ceil(args.seconds / args.kill_every))]


def _torchrun_rank(torchrun: subprocess.Popen[bytes], local_rank: int) -> int | None:
    """The pid of torchrun's worker ``local_rank`` (the first process below torchrun with that ``LOCAL_RANK``), if
    it is running."""
    for pid in descendants(torchrun.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            return pid
    return None


def _run_case(case: str, args: argparse.Namespace, folder: Path) -> Run:
    folder.mkdir(parents=True, exist_ok=True)
    run = Run(case, time.time())
    kills = _kill_times(args) if case != "none" else []
    lighthouse = None
    pending: list[tuple[float, int, int]] = []  # (when, group, attempt) of the restarts to come

    def wait_until(moment: float) -> None:
        while time.time() < moment:
            for item in [p for p in pending if p[0] <= time.time()]:
                pending.remove(item)
                assert lighthouse is not None
                proc = _group(run, args, folder, lighthouse.address, item[1], item[2])
                next(k for k in run.kills if k.get("group") == item[1] and "restarted" not in k)["restarted"] = (
                    proc.started - run.start
                )
            time.sleep(0.05)

    try:
        if case == "restart":
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={GROUPS}",
                "--max-restarts=100", "--monitor-interval=0.5", __file__, GATE, str(folder), *_app(args),
                f"trainer.devices={GROUPS}", f"hydra.run.dir={folder / 'job'}",
                f"callbacks.step_clock.path={folder / 'job.clock'}",
                f"+callbacks.model_checkpoint.every_n_train_steps={args.ckpt_every}",
            ]  # fmt: skip
            _start(run, "job", command, folder / "job")
        else:
            lighthouse = start_lighthouse(folder / "lighthouse.log", 2, int(JOIN_S * 1000), int(HEARTBEAT_S * 1000))
            for g in range(GROUPS):
                _group(run, args, folder, lighthouse.address, g, 0)
        for k, at in enumerate(kills):
            victim = (GROUPS - 1 - k) % GROUPS
            wait_until(run.start + at)
            now = time.time()
            if case == "restart":
                if not args.instant_restart:  # the slot comes back when the ft case restarts its group
                    (folder / f"down.{victim}").write_text(str(now + args.restart_after))
                pid = _torchrun_rank(run.procs[0].popen, victim)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                run.kills.append({"at": now - run.start, "rank": victim, "pid": pid})
            else:
                proc = next(p for p in reversed(run.procs) if p.name == f"group{victim}")
                stop_process(proc.popen)
                run.kills.append({"at": now - run.start, "group": victim})
                pending.append((now + args.restart_after, victim, k + 1))
        wait_until(run.start + args.seconds)
    finally:
        for proc in run.procs:
            stop_process(proc.popen)
        if lighthouse is not None:
            lighthouse.stop()
    return run


def measure(run: Run, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The run's figures (see the module's docstring)."""
    horizon = args.seconds
    tokens_per_step = BATCH * BLOCK
    result: dict[str, Any] = {"case": run.case, "seconds": horizon, "kills": run.kills}
    if run.case == "restart":
        clock = read_step_clock(folder / "job.clock")
        reached = max((s for t, s, _ in clock.steps if t - run.start <= horizon), default=0)
        vals = [v for t, _, v in clock.vals if t - run.start <= horizon]
        output = (run.procs[0].run_dir / "stdout.log").read_text(errors="replace")
        result.update(
            steps=reached, tokens=reached * GROUPS * tokens_per_step, val_loss=vals[-1] if vals else None,
            resumes=output.count("resumed from"), live_fraction=None,
        )  # fmt: skip
    else:
        commits = [
            c for c in read_commits(*(p.run_dir / "train.log" for p in run.procs)) if c.time - run.start <= horizon
        ]
        by_step: dict[int, Any] = {}
        for c in commits:
            by_step.setdefault(c.step, c)
        finals = []
        for g in range(GROUPS):
            vals = [v for t, _, v in read_step_clock(folder / f"group{g}.clock").vals if t - run.start <= horizon]
            if vals:
                finals.append(vals[-1])
        dead = sum(min(k.get("restarted", horizon), horizon) - k["at"] for k in run.kills)
        result.update(
            commits=len(by_step), steps=max(by_step, default=0) * SYNC_EVERY,
            tokens=sum(len(c.groups) for c in by_step.values()) * SYNC_EVERY * tokens_per_step,
            val_loss=statistics.fmean(finals) if finals else None, live_fraction=1.0 - dead / (GROUPS * horizon),
        )  # fmt: skip
        for kill in run.kills:
            at = run.start + kill["at"]
            after = [c for c in commits if c.time > at and kill["group"] not in c.groups]
            kill["to_next_commit_s"] = after[0].time - at if after else None
            if "restarted" in kill:
                restarted = run.start + kill["restarted"]
                own = [c for c in commits if c.group == kill["group"] and c.time > restarted]
                kill["restart_to_commit_s"] = own[0].time - restarted if own else None
    if not result["tokens"]:
        logs = sorted(folder.glob("*/stdout.log"))
        tail = logs[0].read_text(errors="replace")[-3000:] if logs else "(no log)"
        raise RuntimeError(f"case {run.case!r} trained nothing in {horizon:g} s; {logs[:1]} ends with:\n{tail}")
    result["tokens_per_s"] = result["tokens"] / horizon
    return result


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per case over the repeats, the event figures over every kill, and the issue's ratios."""
    cases = {}
    for case in ("ft", "restart", "none"):
        mine = [r for r in runs if r["case"] == case]
        if mine:
            cases[case] = {
                "tokens_per_s": _median([r["tokens_per_s"] for r in mine]),
                "val_loss": _median([r["val_loss"] for r in mine]),
                "live_fraction": _median([r["live_fraction"] for r in mine]),
                "runs": len(mine),
            }
    events = [k for r in runs if r["case"] == "ft" for k in r["kills"]]
    to_commit = [k["to_next_commit_s"] for k in events if k.get("to_next_commit_s") is not None]
    to_rejoin = [k["restart_to_commit_s"] for k in events if k.get("restart_to_commit_s") is not None]
    summary: dict[str, Any] = {"cases": cases, "kills": len(events)}
    if to_commit:
        summary["kill_to_next_commit_s"] = {
            "min": min(to_commit),
            "median": statistics.median(to_commit),
            "max": max(to_commit),
        }
    if to_rejoin:
        summary["restart_to_first_commit_s"] = {
            "min": min(to_rejoin),
            "median": statistics.median(to_rejoin),
            "max": max(to_rejoin),
        }
    if {"ft", "none"} <= cases.keys() and cases["none"]["tokens_per_s"]:
        summary["ft_vs_none_at_live_fraction"] = cases["ft"]["tokens_per_s"] / (
            cases["none"]["tokens_per_s"] * cases["ft"]["live_fraction"]
        )
    if {"ft", "restart"} <= cases.keys() and cases["restart"]["tokens_per_s"]:
        summary["ft_vs_restart"] = cases["ft"]["tokens_per_s"] / cases["restart"]["tokens_per_s"]
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(summary: dict[str, Any], runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown page: one row per case (medians), the event figures and the ratios against the goals."""
    label = {
        "ft": "fault-tolerant DiLoCo (torchft)",
        "restart": "fail-fast + torchrun --max-restarts",
        "none": "no failures",
    }
    rows = [
        [f"`{case}`", label[case], _fmt(c["tokens_per_s"], ".0f"), _fmt(c["val_loss"], ".3f"),
         _fmt(c["live_fraction"], ".3f"), str(c["runs"])]
        for case, c in summary["cases"].items()
    ]  # fmt: skip
    table = markdown_table(
        ["case", "what", "tokens/s (median)", f"val loss at {args.seconds:g} s", "live groups (mean share)", "runs"],
        rows,
        align="llrrrr",
    )
    lines = [table, ""]
    for key, goal in (("kill_to_next_commit_s", f"goal: median <= 2 s, max <= {TIMEOUT_S + 1:g} s"),
                      ("restart_to_first_commit_s", "goal: <= 15 s")):  # fmt: skip
        figure = summary.get(key)
        if figure:
            what = key.replace("_s", "").replace("_", " ")
            lines.append(
                f"- {what}: {figure['min']:.2f} / {figure['median']:.2f} / {figure['max']:.2f} s (min / median / max "
                f"over {summary['kills']} kills; {goal})"
            )
    if "ft_vs_none_at_live_fraction" in summary:
        lines.append(
            f"- `ft` tokens/s / (`none` x live share): {summary['ft_vs_none_at_live_fraction']:.2f} (goal: >= 0.8)"
        )
    if "ft_vs_restart" in summary:
        lines.append(f"- `ft` tokens/s / `restart`'s: {summary['ft_vs_restart']:.2f} (goal: >= 1.5)")
    return "\n".join(lines) + "\n"


TITLE = "Goodput under failures: fault-tolerant DiLoCo against fail-fast with torchrun restarts"


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == [GATE]:
        _gate(given[1], given[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="wall time of each run")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    parser.add_argument(
        "--restart-after", type=float, default=20.0,
        help="seconds from a kill until the killed replica's host is back: ft restarts the group then; under restart "
        "the killed rank's restarted process waits until then",
    )  # fmt: skip
    parser.add_argument(
        "--instant-restart", action="store_true",
        help="restart: torchrun's restarted ranks all start at once (the killed one's host never went away)",
    )  # fmt: skip
    parser.add_argument("--ckpt-every", type=int, default=40, help="steps between last.ckpt writes (restart)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three cases, alternating")
    parser.add_argument("--cases", default="ft,restart,none")
    parser.add_argument(
        "--step-s", type=float, default=0.15,
        help="every batch of every replica takes at least this long (callbacks.pacer.step_s), so that each trains at "
        "its own pace as on a host of its own; 0: no pacing, the replicas share the machine's cores",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/ft_goodput",
        help="records.json goes in this folder, the page beside it (<out>.md, <out>.provenance.json)",
    )  # fmt: skip
    parser.add_argument("--work", type=Path, default=ROOT / "outputs/ft_goodput", help="the runs' folders and logs")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if case not in ("ft", "restart", "none"):
            parser.error(f"--cases: {case!r} is not one of ft, restart, none")
    shutil.rmtree(args.work, ignore_errors=True)
    runs = []
    for repeat in range(args.repeats):
        for case in cases:
            folder = args.work / f"{repeat}_{case}"
            figures = measure(_run_case(case, args, folder), args, folder)
            runs.append(figures)
            print(
                f"[{repeat}] {case}: {figures['tokens_per_s']:.0f} tokens/s, val loss "
                f"{_fmt(figures['val_loss'], '.3f')}, kills {json.dumps(figures['kills'])}",
                flush=True,
            )
    summary = summarize(runs)
    text = report(summary, runs, args)
    print("\n" + text)
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "records.json").write_text(
        json.dumps({"summary": summary, "runs": runs, "args": settings, "provenance": prov}, indent=1)
    )
    page = args.out.parent / f"{args.out.name}.md"
    page.write_text(text)
    command = shlex.join(["python", "benchmarks/ft_goodput.py", *(argv if argv is not None else sys.argv[1:])])
    note = (
        f"char_lm, DiLoCo every {SYNC_EVERY} steps, 3 replicas of one CPU rank each on one host, {args.seconds:g} s "
        f"per run; a kill every {args.kill_every:g} s (groups 2, 1, 0, ... in turn), restarted {args.restart_after:g} s "
        f"later under `ft`; under `restart` torchrun restarts all three ranks from a `last.ckpt` written every "
        f"{args.ckpt_every} steps, "
        + (
            "at once. "
            if args.instant_restart
            else f"the killed one's process waiting {args.restart_after:g} s for its host, the others for it. "
        )
        + f"Lighthouse: heartbeat {HEARTBEAT_S:g} s, join {JOIN_S:g} s; `ft.timeout_s="
        f"{TIMEOUT_S:g}`. "
        + (
            f"Every batch of every replica is padded to {args.step_s:g} s (`callbacks.pacer.step_s`), so that each "
            "trains at its own pace as on a host of its own."
            if args.step_s > 0
            else f"Unpaced: the replicas share {os.cpu_count()} cores, so the survivors of a kill get the lost "
            "one's CPU time."
        )
    )
    record = {**prov, "command": command, "title": TITLE, "note": note}
    page.with_suffix(".provenance.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
