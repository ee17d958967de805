"""Patch ``verl.megatron_r3_layout``: verl's own routed-expert replay (R3) on its Megatron engine
replays the routes of other tokens in the padded BSHD layout.

Upstream bug (verl 0.9.1, ``verl/utils/megatron/router_replay_utils.py:set_router_replay_data``):
the rollout's routes are always laid out as packed THD rows (``preprocess_thd_engine``: sequence
after sequence), but with ``use_remove_padding=false`` the engine feeds the model a padded
``[B, S]`` batch (``preprocess_bshd_engine``), whose routers see their tokens sequence-major
(``[S, B]``: token ``s`` of every sequence, then ``s + 1``). With one sequence per micro-batch the
two orders agree; with several, each router replays another token's experts. Measured here on
verl's engine (megatron-core 0.16.1, 4 sequences of 10 tokens in one micro-batch): 19% of the
tokens on their own experts with R3, against 100% without it; sequences of different lengths
make verl raise a shape error instead ("Router replay tensors are not aligned"). verl's VeOmni
actor config already refuses R3 without remove-padding (``workers/config/actor.py``); its Megatron
engine does not.

The patch refuses (``NotReplayable``, before any compute) ``router_replay.mode: R3`` with
``use_remove_padding=false`` when a micro-batch can hold more than one sequence (dynamic batch
size, or ``micro_batch_size_per_gpu > 1`` over a batch of several sequences), naming the keys to
change. One sequence per micro-batch, R2 and every other setting pass unchanged (R2 records and
replays through the same function, but was not measured here).

Fix upstream: lay the routes out like the model's tokens in ``set_router_replay_data`` (or refuse
as VeOmni does). Remove when verl does either (the fingerprints of the relied-on code change).
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from .engine_batch import non_tensor, replay_mode


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


def _forward_backward_batch(wrapped, instance, args, kwargs):
    data = args[0] if args else kwargs["data"]
    check(instance, data)
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("MegatronEngine.forward_backward_batch", _forward_backward_batch)
