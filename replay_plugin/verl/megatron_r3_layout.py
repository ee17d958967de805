"""Patch ``verl.megatron_r3_layout``: guards verl's own routed-expert replay (R3) on its Megatron
engine (``router_replay.mode: R3``, verl's ``RouterReplay``, which the plugin does not replace)
against two silent wrong routings, before any compute: routes laid out for other tokens in the
padded BSHD layout, and routes that were never captured (all zero). The patch name is the first
problem's.

1. Upstream bug (verl 0.9.1, ``verl/utils/megatron/router_replay_utils.py:set_router_replay_data``):
   the rollout's routes are always laid out as packed THD rows (``preprocess_thd_engine``:
   sequence after sequence), but with ``use_remove_padding=false`` the engine feeds the model a
   padded ``[B, S]`` batch (``preprocess_bshd_engine``), whose routers see their tokens
   sequence-major (``[S, B]``: token ``s`` of every sequence, then ``s + 1``). With one sequence
   per micro-batch the two orders agree; with several, each router replays another token's
   experts. Measured here on verl's engine (megatron-core 0.16.1, 4 sequences of 10 tokens in one
   micro-batch): 19% of the tokens on their own experts with R3, against 100% without it;
   sequences of different lengths make verl raise a shape error instead ("Router replay tensors
   are not aligned"). verl's VeOmni actor config already refuses R3 without remove-padding
   (``workers/config/actor.py``); its Megatron engine does not. Refused (``NotReplayable``):
   ``router_replay.mode: R3`` with ``use_remove_padding=false`` when a micro-batch can hold more
   than one sequence (dynamic batch size, or ``micro_batch_size_per_gpu > 1`` over a batch of
   several sequences), naming the keys to change. One sequence per micro-batch, R2 and every
   other setting pass unchanged (R2 records and replays through the same function, but was not
   measured here).

2. Routes that were not captured (issue 41 F7): verl's agent loop fills ``routed_experts`` with
   zeros where the rollout returned no route, and verl's R3 replays every row but each
   sequence's last (``build_r3_replay_mask``) as it stands: an all-zero row becomes the route
   ``[0, 0, ...]``, whose scatter into the routing map sends the token to expert 0 alone, at
   ``1/top-k`` of its gate. Measured here on verl's engine (bfloat16 engine, the float32
   rollout's batch, 4 samples): with all-zero routes for the whole batch 0% of the replayed
   tokens on the rollout's experts (100% on expert 0 alone, gate 0.5; 100% with the captured
   routes, 97.6% without R3) and response log-probs up to 0.32 nat from the captured routes'
   replay, without an error; with one sample's routes zero, that sample alike and the others
   unchanged. Refused (``ReplayDataError``) by the FSDP engine's rule
   (``engine_batch.check_captured``) on the engine's whole batch, before verl splits it: a
   sequence none of whose positions scoring a loss-bearing token has a captured route, naming
   ``routed_experts``, the batch row, its ``uid`` and
   ``actor_rollout_ref.rollout.enable_rollout_routing_replay``; the replayed positions are logged
   per batch (debug) and a partial capture once per process (warning: verl sends those tokens to
   expert 0). Only a top-k >= 2 model can be checked: its real routes never repeat an expert,
   while a top-1 model's ``[0]`` is a valid route to expert 0, so a top-1 rollout that returned
   no routes cannot be told apart and passes.

Fix upstream: lay the routes out like the model's tokens in ``set_router_replay_data`` (or refuse
as VeOmni does), and route uncaptured rows natively (the R3 replay mask could leave them out).
Remove when verl does both (the fingerprints of the relied-on code change).
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from .engine_batch import BATCH_ROUTES_KEY, batch_grid, check_captured, non_tensor, replay_mode, uncaptured_rows

#: what verl's Megatron R3 does with a row without a captured route (measured: module docstring)
UNCAPTURED_FATE = "are replayed by verl's R3 as the route [0, 0, ...], which sends the token to expert 0 alone"


def check(engine: Any, data: Any) -> None:
    from ..core.errors import NotReplayable

    config = engine.engine_config
    if replay_mode(engine) != "R3" or getattr(config, "use_remove_padding", True):
        return
    if not non_tensor(data, "enable_routing_replay", False):
        return
    several = len(data) > 1 and (
        non_tensor(data, "use_dynamic_bsz", True) or int(non_tensor(data, "micro_batch_size_per_gpu", 1)) > 1
    )
    if several:
        raise NotReplayable(
            "actor_rollout_ref.model.use_remove_padding",
            "verl's router_replay.mode=R3 on its Megatron engine lays the rollout's routes out packed (THD) while "
            "use_remove_padding=false feeds the model a padded [B, S] batch whose routers see tokens sequence-major: "
            "with several sequences per micro-batch every router would replay other tokens' experts (verl 0.9.1). "
            "Set actor_rollout_ref.model.use_remove_padding=true (verl's default), or one sequence per micro-batch "
            "(use_dynamic_bsz=false, micro_batch_size_per_gpu=1)",
            value=False,
        )


def check_captured_routes(engine: Any, data: Any) -> tuple[int, int] | None:
    """With verl's R3 replaying this batch, refuse a sequence none of whose positions scoring a
    loss-bearing token has a captured route (``engine_batch.check_captured``: the FSDP engine's
    rule), naming the batch row and its uid; ``(replayed, scoring)`` position counts, or None when
    verl does not replay the batch's routes or they are not in verl's jagged layout (verl's own
    checks then raise: routes whose lengths are neither the sequences' nor one less, dense routes).
    A row is not captured when it is all zero, for a top-k >= 2 model only (a top-1 ``[0]`` is a
    valid route). Each sequence's last row is not replayed by verl (its R3 mask), nor a scoring
    position, so routes one row short (verl's ``align_r3_router_replay_data``) read the same."""
    import torch

    if replay_mode(engine) != "R3" or not non_tensor(data, "enable_routing_replay", False):
        return None
    keys = data.keys()
    if BATCH_ROUTES_KEY not in keys or "input_ids" not in keys:
        return None
    routes, input_ids = data[BATCH_ROUTES_KEY], data["input_ids"]
    jagged = [isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged for t in (routes, input_ids)]
    if not all(jagged) or routes.dim() != 4:
        return None
    _, mask, _, lengths = batch_grid(input_ids)
    rows = routes.offsets().diff().to(lengths.device)
    if rows.shape != lengths.shape or bool(((rows != lengths) & (rows != lengths - 1)).any()):
        return None
    batch, seq = mask.shape
    has_row = torch.arange(seq, device=lengths.device)[None, :] < rows[:, None]
    no_route = torch.ones(batch * seq, dtype=torch.bool, device=mask.device)
    no_route[has_row.reshape(-1).nonzero().squeeze(1).to(mask.device)] = uncaptured_rows(routes.values()).to(
        mask.device
    )
    no_route = no_route.view(batch, seq) | ~mask
    return check_captured(
        data, no_route, mask, lengths, patch="verl.megatron_r3_layout", fate=UNCAPTURED_FATE, unit="batch"
    )


def _forward_backward_batch(wrapped, instance, args, kwargs):
    data = args[0] if args else kwargs["data"]
    check(instance, data)
    check_captured_routes(instance, data)
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("MegatronEngine.forward_backward_batch", _forward_backward_batch)
