"""``replay-plugin bench fsdp --quick`` runs to its end on the FSDP entries as they are (not a timing
test: no figure is judged here). Its synthetic support rows once held an id twice, which the
entries refuse since the hostile-input checks: the benchmark stopped with ReplayDataError and
nothing in CI saw it."""

import math

from support.upstream import need


def test_fsdp_benchmark_runs_on_the_current_entries():
    need("transformers")
    from replay_plugin import bench

    results = bench.run(["fsdp"], quick=True)
    names = {r.metric for r in results}
    assert {"replay_logits_speedup_vs_plain", "replay_hidden_speedup_vs_plain", "route_replay_vs_plain_step"} <= names
    for r in results:
        assert r.value is not None and math.isfinite(r.value), (r.metric, r.note)
