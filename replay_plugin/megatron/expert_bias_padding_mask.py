"""Patch ``megatron.expert_bias_padding_mask``: count expert-bias tokens with a ``[tokens]``
padding mask broadcast over the experts.

The upstream bug (megatron-core 0.16.0 - 0.19.2, NVIDIA/Megatron-LM issue #6111, fixed on
``main`` by PR #6114, in no release as of 0.19.2): ``TopKRouter.routing`` flattens the padding
mask to ``[tokens]`` and hands it to ``TopKRouter._apply_expert_bias``, which computes
``routing_map & ~padding_mask`` with ``routing_map`` ``[tokens, experts]``. Broadcasting lines
the token axis of the mask up against the *expert* axis of the map:

* tokens != experts: a training forward (grad enabled) with aux-loss-free expert bias
  (``moe_router_enable_expert_bias``) and a padding mask raises ("The size of tensor a (E) must
  match the size of tensor b (T)"; under ``torch.compile``, which ``jit_fuser`` is on torch >=
  2.2, a ``TorchRuntimeError`` about broadcasting);
* tokens == experts: no error; whole expert *columns* are masked, so the counts that drive the
  next expert-bias update are silently wrong (e.g. ``[2, 2, 2, 0]`` instead of ``[1, 2, 2, 1]``).

Upstream's own test of the mask runs under ``no_grad`` with expert bias off, which is why it
passed. Replay always passes a padding mask (the router padding mask), so every R3 training
step with expert bias hits this.

The probe runs the *unwrapped* upstream function (``inspect.unwrap`` removes this plugin's
wrapper and ``torch.compile``'s, so the probe neither compiles nor sees our fix) on a stand-in
router with 3 tokens and 4 experts under grad. An upstream that counts ``[1, 1, 1, 1]`` (valid
rows 0 and 2) is fixed and the patch reports ``not-needed``; one that raises or miscounts is
patched. The result does not depend on the version number.

The wrapper masks the routing map itself (``routing_map & ~mask[:, None]``) and calls the
original with ``padding_mask=None``, so the original only counts: correct whether or not the
original handles the mask, and ``torch.compile`` keeps compiling the original.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

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

    routing_map = torch.tensor(
        [[True, True, False, False], [False, True, True, False], [False, False, True, True]]
    )
    padding_mask = torch.tensor([False, True, False])  # True = padding
    expected = [1.0, 1.0, 1.0, 1.0]
    router = _ProbeRouter(4)
    try:
        with torch.enable_grad():
            apply_expert_bias(router, routing_map, padding_mask=padding_mask)
    except AttributeError as exc:  # an upstream that reads more than the stand-in has
        return ProbeResult(True, f"probe could not run _apply_expert_bias on a stand-in router ({exc!r}); patching (harmless when not needed)")
    except Exception as exc:  # noqa: BLE001 - the bug is a broadcasting RuntimeError
        return ProbeResult(True, f"a [tokens] padding mask with 3 tokens and 4 experts raises {type(exc).__name__}: {exc}")
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
    valid = ~padding_mask.bool()
    if valid.dim() == routing_map.dim() - 1:
        valid = valid.unsqueeze(-1)  # [tokens] -> [tokens, 1]: broadcast over experts
    return wrapped(routing_map & valid, padding_mask=None)


def install(patcher: Patcher) -> None:
    patcher.wrap("TopKRouter._apply_expert_bias", _apply_expert_bias)
