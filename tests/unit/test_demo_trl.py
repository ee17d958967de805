"""``replay-plugin demo --trainer trl``'s pure parts: TRL's log history read into step rows, the
per-step table, the JSON document, the plot's panels and the toy reward (no trl, no torch)."""

from __future__ import annotations

import json
import math

import pytest

from replay_plugin.demo import trl as demo

#: what trl 1.16's Trainer.state.log_history looks like after `logging_steps=1, max_steps=2`
#: (keys abridged from a real run of the demo), then train()'s summary entry
HISTORY = [
    {
        "loss": -0.002,
        "reward": 0.33,
        "kl": 0.0,
        demo.RATIO: 0.32,
        demo.LOGP_DIFF: 0.25,
        demo.LOGP_DIFF_MAX: 0.94,
        "learning_rate": 0.005,
        "step_time": 13.2,
        "epoch": 0.5,
        "step": 1,
    },
    {
        "loss": 0.28,
        "reward": 0.46,
        "kl": float("nan"),
        demo.RATIO: 0.41,
        demo.LOGP_DIFF: 0.08,
        demo.LOGP_DIFF_MAX: 0.38,
        "step": 2,
    },
    {"train_runtime": 20.1, "train_loss": 0.14, "total_flos": 0.0, "step": 2},
]


def test_step_rows_keep_every_numeric_metric_per_step_and_drop_the_summary():
    rows = demo.step_rows(HISTORY)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0][demo.RATIO] == 0.32 and rows[0]["step_time"] == 13.2
    assert rows[1]["kl"] is None  # NaN -> None
    assert all("train_runtime" not in r and "train_loss" not in r for r in rows)


def test_step_rows_merge_entries_of_one_step():
    rows = demo.step_rows([{"loss": 1.0, "step": 3}, {"eval_reward": 0.5, "step": 3}, {"note": "x", "step": 3}])
    assert rows == [{"step": 3, "loss": 1.0, "eval_reward": 0.5}]


def test_route_keys_are_found_only_when_logged():
    from replay_plugin.trl import routes

    assert demo.route_keys(["kl", demo.RATIO]) == []
    assert demo.route_keys(["kl", "replay/route_agreement"]) == ["replay/route_agreement"]
    # the names trl.routes logs: both found, once each, the own routers' first
    logged = [routes.METRIC_ROUTE_AGREEMENT, routes.METRIC_ROUTER_AGREEMENT, routes.METRIC_ROUTE_AGREEMENT]
    assert demo.route_keys(logged) == [routes.METRIC_ROUTER_AGREEMENT, routes.METRIC_ROUTE_AGREEMENT]
    assert [demo.route_label(k) for k in demo.route_keys(logged)] == ["router agree", "routes agree"]


def test_table_has_a_line_per_run_and_step_and_a_route_column_only_when_logged():
    stock = demo.step_rows(HISTORY)
    replay = [dict(r, **{demo.RATIO: 1.0, demo.LOGP_DIFF: 1e-6}) for r in stock]
    text = demo.table({"stock": stock, "replay": replay})
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert "routes agree" not in lines[0]
    assert lines[2].split()[:3] == ["stock", "1", "0.32000"]
    assert lines[4].split()[:4] == ["replay", "1", "1.00000", "1.00e-06"]
    assert lines[3].split()[5] == "-"  # the NaN kl
    replay[0]["replay/route_agreement"] = 0.875
    text = demo.table({"stock": stock, "replay": replay})
    assert "routes agree" in text.splitlines()[0]
    assert text.splitlines()[4].split()[-1] == "87.5%"
    assert text.splitlines()[2].split()[-1] == "-"
    replay[0]["replay/router_agreement"] = 0.75  # trl.routes logs both: a column each
    lines = demo.table({"stock": stock, "replay": replay}).splitlines()
    assert lines[0].split()[-4:] == ["router", "agree", "routes", "agree"]
    assert lines[4].split()[-2:] == ["75.0%", "87.5%"] and lines[5].split()[-2:] == ["-", "-"]


def test_document_is_json_with_runs_and_meta_and_no_nan(tmp_path):
    runs = {"stock": demo.step_rows(HISTORY), "replay": demo.step_rows(HISTORY[:1])}
    path = tmp_path / "out.json"
    demo.write_json(str(path), runs, {"steps": 2, "odd": float("inf")})
    doc = json.loads(path.read_text())  # strict JSON: NaN / inf would not round-trip as null
    assert doc["trainer"] == "trl"
    assert doc["meta"] == {"steps": 2, "odd": None}
    assert [r["step"] for r in doc["runs"]["stock"]] == [1, 2]
    assert doc["runs"]["stock"][1]["kl"] is None
    assert doc["runs"]["replay"][0][demo.RATIO] == 0.32


def test_plot_panels_are_the_five_metrics_plus_routes_when_logged():
    stock = demo.step_rows(HISTORY)
    panels = demo.plot_panels({"stock": stock})
    assert [m for m, _ in panels] == [demo.RATIO, demo.LOGP_DIFF, demo.LOGP_DIFF_MAX, demo.KL, demo.REWARD]
    kl = dict(panels)[demo.KL]
    assert kl["stock"] == ([1], [0.0])  # the step without a value is left out
    replay = [dict(r, **{"replay/route_agreement": 0.9}) for r in stock]
    panels = demo.plot_panels({"stock": stock, "replay": replay})
    assert panels[-1][0] == "replay/route_agreement"
    assert panels[-1][1]["stock"] == ([], []) and panels[-1][1]["replay"] == ([1, 2], [0.9, 0.9])
    replay[0]["replay/router_agreement"] = 0.8
    panels = demo.plot_panels({"stock": stock, "replay": replay})
    assert [m for m, _ in panels[-2:]] == ["replay/router_agreement", "replay/route_agreement"]
    assert panels[-2][1]["replay"] == ([1], [0.8])


def test_write_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "out.png"
    demo.write_plot(str(path), {"stock": demo.step_rows(HISTORY)}, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_share_reward():
    targets = demo.digit_tokens({"a": 0, "12": 1, "Ġ3": 2, "x": 3})
    assert targets == {1, 2}
    assert demo.token_share_reward([[1, 0, 2, 3], [], [0]], targets) == [0.5, 0.0, 0.0]
    assert not any(math.isnan(x) for x in demo.token_share_reward([[]], targets))


def test_shared_engine_builds_one_engine_with_the_demos_arguments():
    built = []

    def llm(*args, **kwargs):
        built.append((args, kwargs))
        return object()

    engine = demo.SharedEngine(llm, {"dtype": "float32", "enforce_eager": True, "max_logprobs": 36})
    first = engine(model="m", max_logprobs=20, dtype="bfloat16")
    assert engine(model="m") is first and engine.llm is first
    assert len(built) == 1
    args, kwargs = built[0]
    # the caller's own arguments win, but max_logprobs is never lowered below the rows' width
    assert kwargs == {"model": "m", "max_logprobs": 36, "dtype": "bfloat16", "enforce_eager": True}
    engine2 = demo.SharedEngine(llm, {"max_logprobs": 36})
    engine2(model="m", max_logprobs=64)
    assert built[-1][1]["max_logprobs"] == 64


def test_switches_are_the_plugins_keys():
    from replay_plugin.trl import switch

    class Args:
        generation_kwargs = None

    for name, kwargs in demo.SWITCHES.items():
        Args.generation_kwargs = kwargs
        ask = switch.asked(Args())
        assert (ask.support, ask.routes) == {
            "stock": (False, False),
            "support": (True, False),
            "replay": (True, True),
        }[name]


def test_run_names():
    assert demo.run_names("stock,support,replay") == ["stock", "support", "replay"]
    assert demo.run_names(" replay , stock") == ["replay", "stock"]
    for bad in ("", "stock,both", "stock,stock"):
        with pytest.raises(SystemExit, match="--trl-runs"):
            demo.run_names(bad)
