"""Patch pack for the FSDP/Ulysses utilities (entry point ``replay_plugin.patches: fsdp``): one
row per patch; targets, versions and the rest are in compat_matrix.yaml. Both patches share
the code (and probe) of :mod:`replay_plugin.fsdp.ulysses_nd_partition`.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..spec import Patch

_CODE = "replay_plugin.fsdp.ulysses_nd_partition"

PATCHES = {
    "ulysses.nd_partition": Patch(f"{_CODE}:install_verl"),
    "ulysses.nd_partition_skyrl": Patch(f"{_CODE}:install_skyrl"),
}


@hookimpl
def replay_plugin_patches() -> dict[str, Patch]:
    return PATCHES
