"""Patch ``megatron.router_layer_number``: record each router's global layer number on its
``RouterReplay``.

Gap (megatron-core 0.16.0 - 0.18.x): ``RouterReplay`` instances live in one process-global list
and carry no layer identity, so pipeline stages, virtual-pipeline chunks, dense-first layer
patterns and rebuilt models cannot be mapped onto them. The wrapper calls the original
``Router.set_layer_number`` and copies the number to ``router.router_replay.layer_number``; the
probe reports ``not-needed`` where upstream already does it. Fixed in 0.19.0 (NVIDIA/Megatron-LM
PR #5220); remove when that is the oldest supported megatron-core.

Multi-token-prediction (MTP) routers, measured: in 0.16.1 the MTP block builds its
``TransformerLayer`` with ``layer_number = depth + num_layers - offset`` and the layer adds the
pipeline offset back, so MTP depth ``d`` routers are numbered ``num_layers + d`` (beyond the
decoder's numbers; the router has no ``is_mtp_layer``). From 0.17.0 (``is_mtp_layer=True``, no
offset added; run on 0.17.1, 0.18.2 and 0.19.2) they are numbered ``d`` from 1 and collide with
decoder layers 1, 2, ...
(NeMo-RL #3903). The replay driver skips MTP routers on every version (routes carry no MTP rows).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..patcher import Patcher
from ..spec import PatchSpec, ProbeResult


class _ProbeReplay:
    layer_number = None


class _ProbeRouter:
    def __init__(self) -> None:
        self.layer_number = None
        self.router_replay = _ProbeReplay()


def probe_function(set_layer_number: Callable[..., Any]) -> ProbeResult:
    """Whether ``set_layer_number(router, n)`` leaves ``router.router_replay.layer_number`` unset."""
    router = _ProbeRouter()
    try:
        set_layer_number(router, 7)
    except Exception as exc:  # noqa: BLE001 - an upstream that needs more than the stand-in has
        return ProbeResult(
            True,
            f"probe could not run set_layer_number on a stand-in router ({exc!r}); patching (harmless when not needed)",
        )
    if router.router_replay.layer_number == 7:
        return ProbeResult(False, "Router.set_layer_number records the layer number on RouterReplay (PR #5220, 0.19+)")
    return ProbeResult(True, "Router.set_layer_number leaves RouterReplay without a layer number")


def probe(spec: PatchSpec) -> ProbeResult:
    from megatron.core.transformer.moe.router import TopKRouter

    return probe_function(inspect.unwrap(TopKRouter.set_layer_number))


def _set_layer_number(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    replay = getattr(instance, "router_replay", None)
    if replay is not None:
        replay.layer_number = instance.layer_number
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("TopKRouter.set_layer_number", _set_layer_number)
