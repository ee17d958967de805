"""Patch ``megatron.router_layer_number``: record each router's global layer number on its
``RouterReplay``.

The upstream gap (megatron-core 0.16.0 - 0.18.x): ``RouterReplay`` instances live in one
process-global list in construction order and carry no layer identity. Code that maps
per-layer routes onto them (SkyRL, NeMo-RL, verl) needs the global layer number to place a
pipeline stage's layers, virtual-pipeline chunks, dense-first layer patterns (DeepSeek-V3
style: the first MoE router is not layer 1) and rebuilt models. ``TransformerLayer`` computes
the global, 1-based, pipeline-offset number and hands it down through
``MoELayer.set_layer_number`` to ``Router.set_layer_number``, which stores it on the router only.
0.19.0 (NVIDIA/Megatron-LM PR #5220) added ``RouterReplay.layer_number`` and sets it there.

Note (upstream, all versions): MTP layers skip the pipeline offset and number their routers
from 1 per MTP depth, so they collide with decoder layer numbers (NeMo-RL PR #3903); the
replay driver does not replay MTP routers.

The probe calls the unwrapped upstream ``set_layer_number`` on a stand-in router whose
``router_replay`` has ``layer_number = None``: if the number arrives there, upstream already
does it (0.19+) and the patch reports ``not-needed``.

The wrapper calls the original, then sets ``router.router_replay.layer_number``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

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
        return ProbeResult(True, f"probe could not run set_layer_number on a stand-in router ({exc!r}); patching (harmless when not needed)")
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
