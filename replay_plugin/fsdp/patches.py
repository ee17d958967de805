"""Patch pack for the FSDP/Ulysses utilities (entry point ``replay_plugin.patches: fsdp``)."""

from __future__ import annotations

from ..hooks import hookimpl
from ..registry import PatchSpec


@hookimpl
def replay_plugin_patches() -> list[PatchSpec]:
    return [
        PatchSpec.from_matrix(
            "ulysses.nd_partition",
            targets=("verl.utils.ulysses:ulysses_pad", "verl.utils.ulysses:ulysses_pad_and_slice_inputs"),
            install=None,
        ),
    ]
