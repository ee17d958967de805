"""Benchmarks behind ``replay-plugin bench [NAME ...]``.

Each benchmark module exposes ``run(quick: bool = False) -> list[Result]`` and measures the
plugin against the baseline a user would otherwise run, in one process, reporting ratios.
A benchmark whose upstream is not installed returns a single ``Result`` with ``value=None``
and a note naming the missing extra, instead of failing the whole run.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import statistics
from collections.abc import Callable

#: name -> module; ``replay-plugin bench`` with no argument runs them all, in this order.
BENCHES = {
    "startup": "replay_plugin.bench.startup",
    "wire": "replay_plugin.bench.wire",
    "logprobs": "replay_plugin.bench.logprobs",
    "megatron": "replay_plugin.bench.megatron",
    "vllm": "replay_plugin.bench.vllm",
    "fsdp": "replay_plugin.bench.fsdp",
    "skyrl": "replay_plugin.bench.skyrl",
    "trl": "replay_plugin.bench.trl",
}

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}


@dataclasses.dataclass
class Result:
    """One measured figure.

    ``value`` is the figure in ``unit`` (``None`` when it could not be measured, with the
    reason in ``note``); ``goal`` is an expression such as ``"<= 1.34"`` or ``None``.
    """

    bench: str
    metric: str
    value: float | None
    unit: str = ""
    goal: str | None = None
    note: str = ""

    @property
    def ok(self) -> bool | None:
        """Whether ``value`` meets ``goal`` (``None`` without a goal or a value)."""
        if self.goal is None or self.value is None:
            return None
        op, _, target = self.goal.partition(" ")
        return _OPS[op](self.value, float(target))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def run(names: list[str], quick: bool = False, runs: int = 1) -> list[Result]:
    """Run the named benchmarks (all when ``names`` is empty) and return their results.

    With ``runs`` > 1 each benchmark runs that many times, one after the other, and each figure
    is the median of its runs (:func:`median_of_runs`): one run of a throughput ratio on a
    shared 2-core machine resolves about +-5%, a goal is judged on the median.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    results: list[Result] = []
    for name in names or list(BENCHES):
        if name not in BENCHES:
            raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")
        try:
            module = importlib.import_module(BENCHES[name])
        except ImportError as exc:
            results.append(Result(name, "(not available)", None, note=f"{exc}"))
            continue
        results.extend(median_of_runs([module.run(quick=quick) for _ in range(runs)]))
    if quick:  # smoke shapes: the goals are stated for the full-size runs
        for r in results:
            r.goal = None
    return results


def median_of_runs(runs: list[list[Result]]) -> list[Result]:
    """One result per metric, in the first run's order: the median value of the runs (a metric
    missing from a run, or unmeasured in one, is left out of its median), the first run's note,
    and every run's value appended to the note when there is more than one run."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for first in runs[0]:
        values = [r.value for results in runs for r in results if r.metric == first.metric and r.value is not None]
        value = statistics.median(values) if values else None
        note = first.note + ("; " if first.note else "") + f"median of {len(values)} runs: "
        note += ", ".join(f"{v:.4g}" for v in values)
        out.append(dataclasses.replace(first, value=value, note=note))
    return out


def format_table(results: list[Result]) -> str:
    """A plain-text table: bench, metric, value, unit, goal, verdict, note."""
    rows = [("bench", "metric", "value", "unit", "goal", "ok", "note")]
    for r in results:
        value = "-" if r.value is None else f"{r.value:.4g}"
        verdict = {True: "yes", False: "NO", None: ""}[r.ok]
        rows.append((r.bench, r.metric, value, r.unit, r.goal or "", verdict, r.note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
