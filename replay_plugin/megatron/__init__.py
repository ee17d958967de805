"""Megatron-core: the patches (``patches.py``, loaded by the registry) and the route-replay
driver for Megatron trainers (:mod:`replay_plugin.megatron.replay`).

Importing this package imports neither megatron nor torch: the driver's names are loaded on
first attribute access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MicrobatchReplay", "ReplayConfigError", "clear_routes", "replay_layers", "replay_routes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
