"""Megatron-core: the patches (``patches.py``, loaded by the registry), the route-replay driver
for Megatron trainers (:mod:`replay_plugin.megatron.replay`) and sampler-support replay
(:mod:`replay_plugin.megatron.support`).

Importing this package imports neither megatron nor torch: the public names are loaded from
their modules on first attribute access.
"""

from __future__ import annotations

from typing import Any

#: public name -> submodule that defines it
_EXPORTS = {
    "MicrobatchReplay": "replay",
    "ReplayConfigError": "replay",
    "StaleRoutesWarning": "router_replay_scope",
    "clear_routes": "replay",
    "cp_loss_scale": "support",
    "replay_layers": "replay",
    "replay_routes": "replay",
    "groups_of": "groups",
    "replay_response_logprobs": "support",
    "support_logprobs": "support",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
