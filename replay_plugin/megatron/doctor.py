"""Doctor checks for a Megatron trainer's model configuration
(``replay-plugin doctor --megatron-config FILE``): the settings under which routed-expert replay
silently does nothing, which the replay driver refuses at run time (:mod:`.replay`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: (problem, fix)
Finding = tuple[str, str]

#: Routing types that never consult RouterReplay (kept equal to the driver's list by a test).
NO_REPLAY_ROUTING = ("sinkhorn", "quantile_balancing")


def load_config(path: str) -> Mapping[str, Any]:
    """A ``TransformerConfig``'s fields from a YAML or JSON file: the mapping itself, or the one
    under a ``model`` / ``transformer_config`` key (Megatron-Bridge and NeMo style)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json"):
        doc = json.loads(text)
    else:
        import yaml

        doc = yaml.safe_load(text)
    if not isinstance(doc, Mapping):
        raise ValueError(f"{path}: expected a mapping of TransformerConfig fields, got {type(doc).__name__}")
    for key in ("transformer_config", "model"):
        if isinstance(doc.get(key), Mapping):
            return doc[key]
    return doc


def check(config: Mapping[str, Any] | str) -> list[Finding]:
    cfg = load_config(config) if isinstance(config, str) else config
    if not cfg.get("num_moe_experts"):
        return []  # a dense model: nothing to replay
    out: list[Finding] = []
    if not cfg.get("moe_enable_routing_replay", False):
        out.append(
            (
                "moe_enable_routing_replay is not true: the routers get no RouterReplay and routed-expert "
                "replay refuses the model",
                "set moe_enable_routing_replay: true in the model's TransformerConfig",
            )
        )
    if cfg.get("moe_router_fusion", False):
        out.append(
            (
                "moe_router_fusion is true: the fused top-k returns before RouterReplay is consulted",
                "set moe_router_fusion: false for replayed training",
            )
        )
    routing = cfg.get("moe_router_load_balancing_type", "aux_loss")
    types = routing if isinstance(routing, list) else [routing]
    bad = [t for t in types if t in NO_REPLAY_ROUTING]
    if bad:
        out.append(
            (
                f"moe_router_load_balancing_type {bad} never consults RouterReplay",
                "use a top-k routing type (aux_loss, seq_aux_loss, global_aux_loss, none)",
            )
        )
    if cfg.get("overlap_moe_expert_parallel_comm", False):
        out.append(
            (
                "overlap_moe_expert_parallel_comm is true: the combined 1F1B schedule runs the model without "
                "the forward hook routed-expert replay relies on",
                "set overlap_moe_expert_parallel_comm: false for replayed training",
            )
        )
    return out
