"""Time to a real loss at every link rate, composed from a trajectory and measured step times.

Training to a loss a user would stop at takes about a thousand steps on ``char_lm``; at 1 Mbit a step of Lightning
DDP takes over ten seconds, so no case can be run there end to end. The runs of a deterministic case, though, take the
same steps on any link (the link changes when bytes arrive, not what they are), so its time to a target is its
*trajectory's* steps times its *step time* on that link:

* **trajectories** (``python -m lightning_sync.bench workloads=char_lm network.rate=loopback budget_steps=...``):
  every case run to the target, Lightning DDP's validation loss at the end of its budget, once per seed; each
  record's ``steps_to_target`` (its time is not used: the windows time every rate alike, loopback included);
* **windows** (the same with ``window=N`` at each rate): every case's training ms per step over whole sync periods,
  sync steps included (``window_step_ms``);
* **validation** (the trajectories' command at one emulated rate): real end-to-end runs, to check the composition.

The cases whose steps depend on timing (the asynchronous parameter server) are never composed: their times are
their end-to-end runs (the trajectories' at loopback, the validation's at its rate).

:func:`compose` reads the three benchmarks' ``results.json`` and gives, per case and rate, the seconds to the target
over the seeds (mean, min, max), composed or measured; :func:`decide` the fastest case per rate, its speedup over
Lightning DDP and its steps over DDP's; :func:`decision_table`, :func:`time_table` and :func:`validation_table` the
tables. No torch here: it reads JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

RATES = ("1mbit", "10mbit", "100mbit", "1gbit", "loopback")
"""The columns, from the slowest link; ``loopback``: both ranks on one machine."""
REFERENCE = "lightning_ddp"
BOUND = "floor"
"""2 ranks that never communicate: its time is DDP's steps at the floor's step time (a bound, not a mode)."""
AGREE = 0.10
"""A composed time agrees with its end-to-end run when they are within this fraction of the end-to-end time."""


def _ok(records: Iterable[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in records if r.get("ok") and all(r.get(k) == v for k, v in match.items())]


def _stats(values: list[float | None]) -> dict[str, Any]:
    """Mean, min and max of the values, ``None`` (a seed that never reached the target) making all three ``None``."""
    if not values or any(v is None for v in values):
        return {"per_seed": values, "mean": None, "min": None, "max": None}
    done = [float(v) for v in values if v is not None]
    return {"per_seed": done, "mean": statistics.fmean(done), "min": min(done), "max": max(done)}


def compose(trajectories: dict[str, Any], windows: list[dict[str, Any]], validation: dict[str, Any] | None) -> dict:
    """Seconds to the target per case and rate.

    Args:
        trajectories: the loopback benchmark's ``results.json`` (its records' ``steps_to_target``; for the cases
            that are only measured, their ``seconds_to_target`` at loopback).
        windows: ``results.json`` of window runs (``window > 0``) at the emulated rates (median ``window_step_ms``
            over their repeats per case and rate).
        validation: a ``results.json`` of end-to-end runs at one or more emulated rates (or ``None``).

    Returns:
        ``{"cases": {case: {"steps": stats, "step_ms": {rate: ms}, "seconds": {rate: stats | None},
        "how": {rate: "composed" | "measured"}, "curve": [[step, validation loss], ...] of the first seed}},
        "targets": {seed: loss}, "validation": [...], "seeds": [...]}``.
        A case whose runs are not deterministic (``ps``) is only measured; the ``floor`` runs DDP's steps.
    """
    records = trajectories["records"]
    seeds = sorted({r["seed"] for r in _ok(records, case=REFERENCE)})
    targets = {r["seed"]: r.get("target_loss") for r in _ok(records, case=REFERENCE)}
    cases = list(dict.fromkeys(r["case"] for r in records))
    step_ms: dict[tuple[str, str], float] = {}
    for data in windows:
        for row in data["summary"]:
            if row.get("metric") == "window_step_ms" and row.get("median") is not None:
                step_ms.setdefault((row["case"], row["rate"]), row["median"])
    cases += [c for c, _ in step_ms if c not in cases]
    checked = validation["records"] if validation else []
    ddp_steps = {r["seed"]: r.get("steps_to_target") for r in _ok(records, case=REFERENCE)}
    out: dict[str, Any] = {}
    for case in cases:
        timed_alone = case.startswith("ps")
        steps = (
            [ddp_steps.get(s) for s in seeds]
            if case == BOUND
            else [next((r.get("steps_to_target") for r in _ok(records, case=case, seed=s)), None) for s in seeds]
        )
        first_seed = _ok(records, case=case, seed=seeds[0]) if seeds else []
        curve = [[step, loss] for _, step, loss in first_seed[0].get("trajectory") or []] if first_seed else []
        entry: dict[str, Any] = {"steps": _stats(steps), "step_ms": {}, "seconds": {}, "how": {}, "curve": curve}
        for rate in RATES:
            ms = step_ms.get((case, rate))
            if ms is not None:
                entry["step_ms"][rate] = ms
            runs = _ok([*records, *checked], case=case, rate=rate)
            if runs and timed_alone:
                entry["seconds"][rate] = _stats([r.get("seconds_to_target") for r in runs])
                entry["how"][rate] = "measured"
            elif ms is not None and not timed_alone:
                entry["seconds"][rate] = _stats([None if n is None else n * ms / 1e3 for n in steps])
                entry["how"][rate] = "composed"
            else:
                entry["seconds"][rate], entry["how"][rate] = None, "not run"
        out[case] = entry
    return {
        "seeds": seeds,
        "targets": targets,
        "cases": out,
        "validation": _validation(out, checked, seeds),
    }


def _validation(cases: dict[str, Any], checked: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Each end-to-end run of a composed case beside the composed time of its seed at its rate."""
    rows = []
    for record in checked:
        case, rate, seed = record["case"], record["rate"], record["seed"]
        entry = cases.get(case)
        if entry is None or entry["how"].get(rate) != "composed" or seed not in seeds:
            continue
        composed = entry["seconds"][rate]["per_seed"][seeds.index(seed)] if entry["seconds"][rate] else None
        measured = record.get("seconds_to_target") if record.get("ok") else None
        steps = entry["steps"]["per_seed"][seeds.index(seed)] if entry["steps"]["per_seed"] else None
        row = {
            "case": case,
            "rate": rate,
            "seed": seed,
            "composed_s": composed,
            "measured_s": measured,
            "steps_trajectory": steps,
            "steps_measured": record.get("steps_to_target"),
        }
        if composed is not None and measured:
            row["composed_over_measured"] = composed / measured
            row["agrees"] = abs(composed - measured) <= AGREE * measured
        rows.append(row)
    return rows


def reference_steps(composed: dict[str, Any]) -> str:
    """Lightning DDP's steps to the target (the end of its budget's last scoring), as the text quotes them: ``992``,
    or ``984 to 992`` where the seeds differ."""
    steps = composed["cases"][REFERENCE]["steps"]
    if steps["mean"] is None:
        return "?"
    low, high = f"{steps['min']:.0f}", f"{steps['max']:.0f}"
    return low if low == high else f"{low} to {high}"


def decide(composed: dict[str, Any], rates: Iterable[str] = RATES) -> list[dict[str, Any]]:
    """The fastest case to the target at each rate (by mean over the seeds), with the cases whose seed range overlaps
    its own (a tie), its speedup over Lightning DDP (DDP's mean over its mean) and its mean steps over DDP's."""
    cases = composed["cases"]
    ddp = cases.get(REFERENCE)
    rows = []
    for rate in rates:
        timed = {
            case: entry["seconds"][rate]
            for case, entry in cases.items()
            if case != BOUND and entry["seconds"].get(rate) and entry["seconds"][rate]["mean"] is not None
        }
        if not timed:
            continue
        best = min(timed, key=lambda c: timed[c]["mean"])
        ties = [c for c, s in timed.items() if c != best and s["min"] <= timed[best]["max"]]
        reference = (ddp or {}).get("seconds", {}).get(rate)
        steps, ddp_steps = cases[best]["steps"]["mean"], (ddp or {}).get("steps", {}).get("mean")
        rows.append(
            {
                "rate": rate,
                "fastest": best,
                "ties": sorted(ties, key=lambda c: timed[c]["mean"]),
                "seconds": timed[best],
                "speedup_vs_ddp": reference["mean"] / timed[best]["mean"] if reference and reference["mean"] else None,
                "steps_vs_ddp": steps / ddp_steps if steps and ddp_steps else None,
                "how": cases[best]["how"][rate],
            }
        )
    return rows


def _cell(stats: dict[str, Any] | None, how: str) -> str:
    if stats is None:  # not run at this rate
        return "-"
    if stats["mean"] is None:
        return "not reached"
    text = _seconds(stats["mean"]) + f" [{_seconds(stats['min'])}, {_seconds(stats['max'])}]"
    return text + (" (measured)" if how == "measured" and len(stats["per_seed"]) else "")


def _seconds(value: float) -> str:
    """Seconds as a person reads them: ``42 s``, ``13 min``, ``2.4 h``."""
    if value < 120:
        return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
    if value < 3 * 3600:
        return f"{value / 60:.1f} min" if value < 600 else f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2f}x"


def time_table(composed: dict[str, Any], rates: Iterable[str] = RATES) -> tuple[list[str], list[list[str]]]:
    """``(header, body)``: per case, its mean steps to the target and its seconds at each rate (mean [min, max])."""
    rates = [r for r in rates if any(e["seconds"].get(r) is not None for e in composed["cases"].values())]
    header = ["case", "steps to target", *rates]
    body = []
    for case, entry in composed["cases"].items():
        steps = entry["steps"]
        steps_text = "-" if steps["mean"] is None else f"{steps['mean']:.0f} [{steps['min']:.0f}, {steps['max']:.0f}]"
        if case.startswith("ps"):
            steps_text = "timing-dependent"
        elif entry["steps"]["mean"] is None and entry["steps"]["per_seed"]:
            steps_text = "not reached"
        label = f"`{case}`" + (" (bound: DDP's steps, no communication)" if case == BOUND else "")
        body.append([label, steps_text, *(_cell(entry["seconds"].get(r), entry["how"].get(r, "")) for r in rates)])
    return header, body


def decision_table(decisions: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """``(header, body)`` of the "which mode when" table."""
    header = ["link", "fastest to the target", "time (mean over seeds)", "speedup over Lightning DDP",
              "steps vs DDP", "ties (seed ranges overlap)"]  # fmt: skip
    body = [
        [
            d["rate"],
            f"`{d['fastest']}`",
            _seconds(d["seconds"]["mean"]) + (" (measured)" if d["how"] == "measured" else ""),
            "-" if d["speedup_vs_ddp"] is None else _times(d["speedup_vs_ddp"]),
            "-" if d["steps_vs_ddp"] is None else f"{d['steps_vs_ddp']:.2f}",
            ", ".join(f"`{c}`" for c in d["ties"]) or "none",
        ]
        for d in decisions
    ]
    return header, body


def validation_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """``(header, body)``: each composed time beside its end-to-end run."""
    header = ["case", "rate", "seed", "composed", "end to end", "composed / end to end", "steps (trajectory / run)"]
    body = [
        [
            f"`{r['case']}`",
            r["rate"],
            str(r["seed"]),
            "-" if r["composed_s"] is None else f"{r['composed_s']:.1f} s",
            "not reached" if r["measured_s"] is None else f"{r['measured_s']:.1f} s",
            "-" if "composed_over_measured" not in r else f"{r['composed_over_measured']:.3f}",
            f"{_count(r['steps_trajectory'])} / {_count(r['steps_measured'])}",
        ]
        for r in rows
    ]
    return header, body


def _count(steps: float | None) -> str:
    return "-" if steps is None else f"{steps:.0f}"
