"""Patches ``transformers.moe_router_replay.<family>``: routed-expert replay in Hugging Face MoE blocks.

The upstream gap. transformers (5.10-5.25) has no way to make an MoE layer use given experts: each
family's router picks its own top-k (softmax or sigmoid, correction bias, group limits) inside the
block's forward and hands the ids straight to the experts module. An FSDP trainer scoring vLLM's
rollout therefore routes tokens to other experts than the engine did (bfloat16 rounding, other
kernels); Megatron has ``RouterReplay``, transformers has nothing. Open requests: SkyRL #815,
verl #5392, NeMo-RL #4170, ms-swift #7398; verl's VeOmni engine replays Qwen3-MoE only, keyed by
router firing order.

The wrapper. Per family, ``<Block>.forward`` (the one routing entry point present in every
supported version; where the routing code itself lives moved between 5.10 and 5.24, see
:mod:`replay_plugin.fsdp.hf_moe`) is wrapped with :func:`replay_plugin.fsdp.route_replay.block_forward`:
outside ``record_routes`` / ``replay_routes`` it calls the stock forward and nothing else; inside,
it replays or records for that one call. The family's ``load_balancing_loss_func`` (where it has
one) is wrapped with :func:`replay_plugin.fsdp.route_replay.load_balancing_loss_func`, which differs
from upstream only for router logits of a forward under ``replay_routes(..., aux_loss="replayed")``.

No probe: no transformers release can replay routes, the gap is always there. Arming costs one
post-import hook per family; the patch applies when the family's modeling module is first imported
(transformers imports it lazily, when the model class is first used), never at ``import
transformers``.
"""

from __future__ import annotations

from ..patcher import Patcher
from . import route_replay


def install(patcher: Patcher) -> None:
    for target in patcher.spec.targets:
        qualname = target.partition(":")[2]
        if qualname == "load_balancing_loss_func":
            patcher.wrap(target, route_replay.load_balancing_loss_func)
        else:
            patcher.wrap(target, route_replay.block_forward)
