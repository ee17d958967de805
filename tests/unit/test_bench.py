"""``replay-plugin bench --runs N``: each figure is the median of its runs, judged on the median."""

from __future__ import annotations

import pytest

from replay_plugin import bench
from replay_plugin.bench import Result


def _runs(*values):
    return [
        [
            Result("b", "ratio", v, "x", ">= 0.97", note="setting"),
            Result("b", "cost", None if v == 0.95 else 2 * v, "ms"),
        ]
        for v in values
    ]


def test_median_of_runs_judges_the_goal_on_the_median():
    merged = bench.median_of_runs(_runs(0.99, 0.95, 0.98, 1.01, 0.96))
    assert [r.metric for r in merged] == ["ratio", "cost"]
    ratio, cost = merged
    assert ratio.value == 0.98 and ratio.ok is True
    assert ratio.note == "setting; median of 5 runs: 0.99, 0.95, 0.98, 1.01, 0.96"
    assert cost.value == pytest.approx(1.97)  # 1.98, 1.96, 2.02, 1.92: the 4 measured runs
    assert cost.note.startswith("median of 4 runs")
    low = bench.median_of_runs(_runs(0.99, 0.95, 0.96))
    assert low[0].value == 0.96 and low[0].ok is False  # one good run does not pass the goal


def test_one_run_is_reported_as_measured():
    (only,) = _runs(0.99)
    assert bench.median_of_runs([only]) is only


def test_runs_must_be_positive():
    with pytest.raises(ValueError, match="runs must be >= 1"):
        bench.run(["startup"], runs=0)
