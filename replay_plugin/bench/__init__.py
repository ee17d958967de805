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
from collections.abc import Callable

#: name -> module; ``replay-plugin bench`` with no argument runs them all, in this order.
BENCHES = {
    "startup": "replay_plugin.bench.startup",
    "wire": "replay_plugin.bench.wire",
    "logprobs": "replay_plugin.bench.logprobs",
    "megatron": "replay_plugin.bench.megatron",
    "vllm": "replay_plugin.bench.vllm",
    "fsdp": "replay_plugin.bench.fsdp",
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


def run(names: list[str], quick: bool = False) -> list[Result]:
    """Run the named benchmarks (all when ``names`` is empty) and return their results."""
    results: list[Result] = []
    for name in names or list(BENCHES):
        if name not in BENCHES:
            raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")
        try:
            module = importlib.import_module(BENCHES[name])
        except ImportError as exc:
            results.append(Result(name, "(not available)", None, note=f"{exc}"))
            continue
        results.extend(module.run(quick=quick))
    if quick:  # smoke shapes: the goals are stated for the full-size runs
        for r in results:
            r.goal = None
    return results


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
