"""Patch ``trl.routes``: TRL's GRPOTrainer routes every token through the experts the rollout
used (routed-expert replay, R3) when its batch carries them.

Gap (trl 1.16.0): TRL has no routing replay (its MoE support is the load-balancing aux loss): the
trainer's routers pick their own experts for the rollout's tokens, and the trainer/rollout
mismatch of an MoE policy stays whatever the two routers disagree on.

The routes come from the generation backend (vLLM colocate returns them per completion; TRL's HF
generate returns none, refused by ``trl.replay_guard``) through ``trl.rollout_batch``, which puts
``replay_routes [B, P+C, L, K]`` and ``replay_router_padding_mask [B, P+C]`` on TRL's padded grid
into the batch. This patch only needs those two keys:

- ``GRPOTrainer.training_step`` opens a scope, and ``GRPOTrainer._prepare_inputs`` (called
  first thing inside it by transformers' ``Trainer.training_step``) enters
  :func:`replay_plugin.fsdp.replay_routes` for the micro-batch it returns: the forward, the
  backward and gradient-checkpoint recompute of the micro-batch all replay (the backward runs in
  ``training_step`` after ``compute_loss`` returned), and the scope closes with the step.
- the no-grad passes TRL runs on a fresh generation inside ``_generate_and_score_completions``
  (old policy, reference model) call the model once per chunk: each chunk runs inside a replay of
  its rows of the rollout's routes (forward hooks on the model TRL patched, as
  ``trl.support_logprobs``).

Rows without a route (padding, positions the rollout did not capture) are routed by the model.
Without the keys everything is TRL's. The reference model replays too (both score the same
tokens through the rollout's experts, as verl's Megatron R3 does for its reference).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from ..patcher import Patcher
from . import batch, rollout

_SCOPE: contextvars.ContextVar[tuple[contextlib.ExitStack, Any] | None] = contextvars.ContextVar(
    "replay_plugin_trl_route_scope", default=None
)


def _training_step(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    with contextlib.ExitStack() as stack:
        token = _SCOPE.set((stack, model))
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SCOPE.reset(token)


def _prepare_inputs(wrapped, instance, args, kwargs):
    inputs = wrapped(*args, **kwargs)
    scope = _SCOPE.get()
    if scope is not None and isinstance(inputs, dict) and batch.ROUTES_KEY in inputs:
        from ..fsdp import replay_routes

        stack, model = scope
        stack.enter_context(replay_routes(model, inputs[batch.ROUTES_KEY], inputs.get(batch.ROUTER_PADDING_KEY)))
    return inputs


class _ChunkReplay:
    """One pass of ``_get_per_token_logps_and_entropies`` over a fresh generation: each fused
    forward runs inside a replay of its chunk's routes."""

    def __init__(self, routes: Any, padding: Any) -> None:
        self.routes, self.padding = routes, padding
        self.cursor = 0
        self.active: Any = None

    def enter(self, module, args, kwargs):
        from ..fsdp import replay_routes

        if not kwargs.get("fused_lm_head"):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        start, end = self.cursor, self.cursor + ids.size(0)
        self.cursor = end
        self.active = replay_routes(module, self.routes[start:end], self.padding[start:end])
        self.active.__enter__()
        return None

    def exit(self, module, args, kwargs, output):
        if self.active is not None:
            active, self.active = self.active, None
            active.__exit__(None, None, None)
        return None


def _scored(wrapped, instance, args, kwargs):
    import torch

    from .logprobs import _bind, fused_module

    current = rollout.current()
    if current is None or not current.ask.routes or current.prompt_lengths is None:
        return wrapped(*args, **kwargs)
    model, input_ids, _, logits_to_keep = _bind(*args, **kwargs)
    width_c = int(logits_to_keep)
    width_p = input_ids.size(1) - width_c
    key = ("routes", width_p, width_c)
    if key not in current.cache:
        routes, padding = rollout.routes_grid(current, width_p, width_c)
        current.cache[key] = (torch.from_numpy(routes), torch.from_numpy(padding))
    routes, padding = current.cache[key]
    fused = fused_module(model)
    state = _ChunkReplay(routes, padding)
    handles = [
        fused.register_forward_pre_hook(state.enter, with_kwargs=True),
        fused.register_forward_hook(state.exit, with_kwargs=True, always_call=True),
    ]
    try:
        return wrapped(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        state.exit(None, None, None, None)


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer.training_step", _training_step)
    patcher.wrap("GRPOTrainer._prepare_inputs", _prepare_inputs)
    patcher.wrap("GRPOTrainer._get_per_token_logps_and_entropies", _scored)
