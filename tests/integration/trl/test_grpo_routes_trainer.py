"""trl.routes, the trainer side of routed-expert replay, in a whole ``GRPOTrainer.train()``
(trl 1.16.0, CPU, HF generate).

TRL's HF generate returns no routes (the guard refuses ``replay_routed_experts`` there; vLLM
colocate returns them, tested with the vLLM rows). The patch needs only ``replay_routes`` /
``replay_router_padding_mask`` in TRL's batch, so the test's trainer subclass puts them there
after TRL generated: the experts the model itself picks for each prompt+completion token,
recorded with ``replay_plugin.fsdp.record_routes`` (a stand-in for the rollout's), or those
rotated by one expert.

- the model's own routes: every number TRL logs equals the run without routes (replay is exact
  where the routers agree);
- rotated routes: the loss's gradient changes (replay is live), and it is the same with and
  without gradient checkpointing (the backward's recompute replays too: the scope spans
  ``training_step``);
- routes a generation backend delivers into the rollout (the test's subclass stands in for vLLM's,
  which tests/integration/trl's vLLM tests use): trl.rollout_batch lays them on TRL's padded grid
  (no route exactly where TRL pads) and TRL's old-policy pass replays them chunk by chunk (own
  routes: old logprobs within 1e-5 of the run without; rotated: off by more than 1e-3), and
  TRL logs the agreement trl.routes measured there: ``replay/router_agreement`` (the trainer's own
  routers) 1.0 for own routes and 0.0 for rotated ones, ``replay/route_agreement`` (the replayed
  forward) 1.0 for both.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import trl_harness as H  # noqa: E402
from support.upstream import need  # noqa: E402

NUMBERS = ("loss", "grad_norm", "entropy", "aux_loss")
ROUTER, ROUTE = "replay/router_agreement", "replay/route_agreement"


def _run(model_dir: str, output_dir: str, routes: str | None, **overrides) -> list[dict]:
    import torch
    from trl import GRPOTrainer

    from replay_plugin.fsdp import record_routes

    class WithRoutes(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if routes is None:
                return out
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            model = self.accelerator.unwrap_model(self.model)
            with torch.no_grad(), record_routes(model) as rec:
                model(input_ids=ids, attention_mask=mask)
            experts = rec.routes
            if routes == "rotated":
                experts = (experts + 1) % H.EXPERTS
            out["replay_routes"] = experts.to(torch.uint8)
            out["replay_router_padding_mask"] = mask == 0
            return out

    trainer = WithRoutes(
        model=model_dir,
        reward_funcs=H.length_reward,
        args=H.config(output_dir, **overrides),
        train_dataset=H.dataset(),
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    need("trl")
    return H.save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3_moe_r3")))


def test_routes_replayed_through_training_step(model_dir, tmp_path):
    need("trl")
    import trl.trainer.grpo_trainer  # noqa: F401

    import replay_plugin

    assert {p["name"]: p["state"] for p in replay_plugin.status()}["trl.routes"] == "applied"
    base = _run(model_dir, str(tmp_path / "base"), None)
    own = _run(model_dir, str(tmp_path / "own"), "own")
    rotated = _run(model_dir, str(tmp_path / "rotated"), "rotated")
    rotated_no_gc = _run(model_dir, str(tmp_path / "rotated_no_gc"), "rotated", gradient_checkpointing=False)
    assert len(base) == len(own) == len(rotated) == 2
    for b, o in zip(base, own):
        for key in NUMBERS:
            assert o[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (key, o[key], b[key])
    assert abs(rotated[0]["grad_norm"] - base[0]["grad_norm"]) > 1e-3 * base[0]["grad_norm"]
    assert rotated[0]["entropy"] != pytest.approx(base[0]["entropy"], rel=1e-6)
    for r, n in zip(rotated, rotated_no_gc):
        for key in NUMBERS:
            assert n[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (key, n[key], r[key])
    print(
        f"grad_norm step 1: base {base[0]['grad_norm']:.6f} own routes {own[0]['grad_norm']:.6f} rotated "
        f"{rotated[0]['grad_norm']:.6f} (no GC {rotated_no_gc[0]['grad_norm']:.6f})"
    )


def _run_rollout_routes(
    model_dir: str, output_dir: str, routes: str | None, outer_recording: bool = False
) -> tuple[dict, list[dict]]:
    """A run whose generation backend returns routes: the test's subclass stands in for one (TRL's
    HF generate returns none) by delivering, per completion, the experts the model picks for its
    unpadded prompt + completion into the rollout ``trl.rollout_batch`` opened (``rollout``'s
    contract), own or rotated. The switch asks for routes; it is set after the trainer is built
    (the guard refuses routes with HF generate, rightly for a real job)."""
    import numpy as np
    import torch
    from trl import GRPOTrainer

    from replay_plugin.fsdp import record_routes
    from replay_plugin.trl import rollout

    class RoutingBackend(GRPOTrainer):
        batches: list = []

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            current = rollout.current()
            if current is not None and routes is not None:
                model = self.accelerator.unwrap_model(self.model)
                delivered = []
                for p, c in zip(prompt_ids, completion_ids):
                    with torch.no_grad(), record_routes(model) as rec:
                        model(input_ids=torch.tensor([list(p) + list(c)]))
                    experts = rec.routes[0]
                    if routes == "rotated":
                        experts = (experts + 1) % H.EXPERTS
                    delivered.append(rollout.Completion(routes=experts.numpy().astype(np.uint8)))
                current.deliver(delivered)
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.batches.append(out)
            return out

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if not outer_recording:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            # a recording of the caller's around every TRL scoring pass, the old-policy one too
            with record_routes(self.accelerator.unwrap_model(self.model)):
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    trainer = RoutingBackend(
        model=model_dir,
        reward_funcs=H.length_reward,
        args=H.config(output_dir, steps_per_generation=4),
        train_dataset=H.dataset(),
    )
    if routes is not None:
        trainer.args.generation_kwargs = {"extra_args": {"replay_routed_experts": True}}
    trainer.train()
    (batch,) = trainer.batches
    return batch, [h for h in trainer.state.log_history if "loss" in h]


def test_rollout_routes_reach_the_batch_and_every_pass(model_dir, tmp_path, monkeypatch):
    """Routes delivered by a backend: TRL's batch carries them on its padded grid, TRL's old-policy
    pass over the fresh generation replays them chunk by chunk, and the training steps too."""
    need("trl")
    base, base_steps = _run_rollout_routes(model_dir, str(tmp_path / "base"), None)
    own, own_steps = _run_rollout_routes(model_dir, str(tmp_path / "own"), "own")
    rotated, rotated_steps = _run_rollout_routes(model_dir, str(tmp_path / "rotated"), "rotated")
    monkeypatch.setenv("REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT", "0")  # trl.routes' knob: no own-router forward
    _, quiet_steps = _run_rollout_routes(model_dir, str(tmp_path / "quiet"), "rotated")
    assert "replay_routes" not in base
    grid = own["replay_routes"]
    mask = own["replay_router_padding_mask"]
    p, c = own["prompt_ids"].size(1), own["completion_ids"].size(1)
    assert tuple(grid.shape[:2]) == (own["prompt_ids"].size(0), p + c) and grid.shape[2:] == (H.LAYERS, 2)
    # no route exactly where TRL pads (left of the prompts, right of the completions)
    attention = torch_cat(own["prompt_mask"], own["completion_mask"])
    assert bool((attention == 0).any()) and bool((mask == (attention == 0)).all())
    # the old-policy pass (no grad, per chunk): own routes change nothing, rotated ones do
    m = own["completion_mask"].bool()
    assert (own["old_per_token_logps"] - base["old_per_token_logps"])[m].abs().max().item() < 1e-5
    assert (rotated["old_per_token_logps"] - base["old_per_token_logps"])[m].abs().max().item() > 1e-3
    assert own_steps[0]["grad_norm"] == pytest.approx(base_steps[0]["grad_norm"], rel=1e-6)
    assert rotated_steps[0]["grad_norm"] != pytest.approx(base_steps[0]["grad_norm"], rel=1e-4)
    # TRL's logged metrics (one generation: step 1's entry): the trainer's own routers agree with
    # its own routes and never with rotated ones; the replayed forward used the rollout's experts
    agree = {
        name: [(s.get(ROUTER), s.get(ROUTE)) for s in steps]
        for name, steps in (("base", base_steps), ("own", own_steps), ("rotated", rotated_steps))
    }
    print(f"(router_agreement, route_agreement) per step: {agree}")
    assert agree["base"] == [(None, None)] * 2  # no routes asked: nothing measured, nothing logged
    assert agree["own"] == [(1.0, 1.0), (None, None)]
    assert agree["rotated"] == [(0.0, 1.0), (None, None)]
    assert [(s.get(ROUTER), s.get(ROUTE)) for s in quiet_steps] == [(None, 1.0), (None, None)]
    for q, r in zip(quiet_steps, rotated_steps):  # the extra forward changes none of TRL's numbers
        for key in NUMBERS:
            assert q[key] == r[key], (key, q[key], r[key])
    # a recording of the caller's open across the old-policy pass: not measured (recordings do not
    # nest), said in a warning; replay and TRL's numbers unchanged
    monkeypatch.delenv("REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT")
    with pytest.warns(UserWarning, match="not measured for this generation"):
        _, outer_steps = _run_rollout_routes(model_dir, str(tmp_path / "outer"), "rotated", outer_recording=True)
    assert [(s.get(ROUTER), s.get(ROUTE)) for s in outer_steps] == [(None, None)] * 2
    for o, r in zip(outer_steps, rotated_steps):
        for key in NUMBERS:
            assert o[key] == r[key], (key, o[key], r[key])


def torch_cat(a, b):
    import torch

    return torch.cat([a, b], dim=1)
