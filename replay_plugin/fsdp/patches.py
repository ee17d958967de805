"""Patch pack for the FSDP/Ulysses utilities (entry point ``replay_plugin.patches: fsdp``).

Only specs live here; the upstream gap, the probe and the wrapper are in
:mod:`replay_plugin.fsdp.ulysses_nd_partition`, imported when a target module is imported.
"""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec

_VERL = "verl.utils.ulysses"
_SKYRL = "skyrl.backends.skyrl_train.distributed.ulysses.utils"
_HERE = "replay_plugin.fsdp.ulysses_nd_partition"


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "ulysses.nd_partition",
            targets=(f"{_VERL}:ulysses_pad", f"{_VERL}:ulysses_pad_and_slice_inputs"),
            install=f"{_HERE}:install_verl",
            probe=f"{_HERE}:probe",
        ),
        PatchSpec.from_matrix(
            "ulysses.nd_partition_skyrl",
            targets=(f"{_SKYRL}:ulysses_pad_and_slice_inputs",),
            install=f"{_HERE}:install_skyrl",
            probe=f"{_HERE}:probe",
        ),
    ]
