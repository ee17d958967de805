"""Patch ``megatron.expert_bias_padding_mask``: count expert-bias tokens with a ``[tokens]``
padding mask broadcast over the experts.

Bug (megatron-core 0.16.0 - 0.19.2, NVIDIA/Megatron-LM issue #6111): ``TopKRouter._apply_expert_bias``
computes ``routing_map & ~padding_mask`` with a ``[tokens, experts]`` map and a ``[tokens]`` mask,
so broadcasting lines tokens up with experts: a training forward with expert bias raises when
tokens != experts and miscounts silently when they are equal. Replay always passes a padding
mask. The probe runs the unwrapped upstream on a 3-token, 4-expert stand-in router; the wrapper
masks the routing map itself and calls the original with ``padding_mask=None``; a mask that is
not one flag per token raises :class:`ReplayDataError` (a ``[1]`` mask would otherwise broadcast
over every token and zero all counts, silently, with or without the fix). Fixed by PR
#6114 (on ``main``, in no release as of 0.19.2); remove once the oldest supported release has it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..core.errors import ReplayDataError
from ..patcher import Patcher
from ..spec import PatchSpec, ProbeResult


class _ProbeRouter:
    """The attributes ``_apply_expert_bias`` reads, for 4 experts (releases 0.16 - 0.19)."""

    def __init__(self, num_experts: int) -> None:
        import torch

        self.enable_expert_bias = True
        self.frozen_expert_bias = False
        self.local_tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32)


def probe_function(apply_expert_bias: Callable[..., Any]) -> ProbeResult:
    """Whether ``apply_expert_bias(router, routing_map, padding_mask=...)`` miscounts.

    3 tokens, 4 experts, top-2; token 1 is padding. A correct count is ``[1, 1, 1, 1]``.
    """
    import torch

    routing_map = torch.tensor([[True, True, False, False], [False, True, True, False], [False, False, True, True]])
    padding_mask = torch.tensor([False, True, False])  # True = padding
    expected = [1.0, 1.0, 1.0, 1.0]
    router = _ProbeRouter(4)
    try:
        with torch.enable_grad():
            apply_expert_bias(router, routing_map, padding_mask=padding_mask)
    except AttributeError as exc:  # an upstream that reads more than the stand-in has
        return ProbeResult(
            True,
            f"probe could not run _apply_expert_bias on a stand-in router ({exc!r}); patching (harmless when not "
            "needed)",
        )
    except Exception as exc:  # noqa: BLE001 - the bug is a broadcasting RuntimeError
        return ProbeResult(
            True, f"a [tokens] padding mask with 3 tokens and 4 experts raises {type(exc).__name__}: {exc}"
        )
    got = router.local_tokens_per_expert.tolist()
    if got != expected:
        return ProbeResult(True, f"a [tokens] padding mask miscounts expert-bias tokens: {got} instead of {expected}")
    return ProbeResult(False, "upstream broadcasts the padding mask over experts (NVIDIA/Megatron-LM PR #6114)")


def probe(spec: PatchSpec) -> ProbeResult:
    from megatron.core.transformer.moe.router import TopKRouter

    return probe_function(inspect.unwrap(TopKRouter._apply_expert_bias))


def _apply_expert_bias(wrapped, instance, args, kwargs):
    routing_map = args[0] if args else kwargs.get("routing_map")
    padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
    if padding_mask is None or routing_map is None or not getattr(instance, "enable_expert_bias", False):
        return wrapped(*args, **kwargs)
    import torch

    if not torch.is_grad_enabled():  # the original counts nothing then (eval, recompute)
        return wrapped(*args, **kwargs)
    tokens = routing_map.shape[0]
    if tuple(padding_mask.shape) != (tokens,):
        # A [1] mask would broadcast over every token (all counts zeroed, silently, as upstream
        # does too), a [experts] one over the expert columns (upstream's bug): only the flat
        # per-token mask TopKRouter.routing passes is meaningful here.
        raise ReplayDataError(
            "padding_mask",
            f"shape {list(padding_mask.shape)} for a routing map of {tokens} tokens x {routing_map.shape[-1]} experts "
            "in TopKRouter._apply_expert_bias",
            expected=f"[{tokens}] (one flag per token, True = padding), as TopKRouter.routing passes it",
        )
    valid = ~padding_mask.bool()
    return wrapped(routing_map & valid.unsqueeze(-1), padding_mask=None)  # [tokens, 1]: over experts


def install(patcher: Patcher) -> None:
    patcher.wrap("TopKRouter._apply_expert_bias", _apply_expert_bias)
