"""Patch pack for the FSDP path (entry point ``replay_plugin.patches: fsdp``): one row per patch;
targets, versions and the rest are in compat_matrix.yaml.

- ``ulysses.nd_partition`` (verl) and ``ulysses.nd_partition_skyrl`` share the code (and probe)
  of :mod:`replay_plugin.fsdp.ulysses_nd_partition`.
- ``transformers.moe_router_replay.<family>``: one patch per Hugging Face MoE family, each
  triggered by the import of its own modeling module (:mod:`replay_plugin.fsdp.moe_router_replay`).
  The families are listed here as names, so that loading this pack imports nothing but the
  machinery (no torch at ``import transformers``); a test keeps them equal to
  ``replay_plugin.fsdp.hf_moe.FAMILIES``.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch

_CODE = "replay_plugin.fsdp.ulysses_nd_partition"
_MOE = "replay_plugin.fsdp.moe_router_replay"

#: ``config.model_type`` of every MoE family with routed-expert replay
MOE_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_next",
    "olmoe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "jamba",
    "dbrx",
    "granitemoe",
)

PATCHES = {
    "ulysses.nd_partition": Patch(f"{_CODE}:install_verl"),
    "ulysses.nd_partition_skyrl": Patch(f"{_CODE}:install_skyrl"),
    **{f"transformers.moe_router_replay.{family}": Patch(_MOE) for family in MOE_FAMILIES},
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
