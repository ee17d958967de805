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

What replay changes goes into TRL's own metrics (``GRPOTrainer._metrics[mode]``, averaged and
logged by TRL), measured once per generation on the first no-grad pass over it (TRL's old policy,
the model that just generated), over the tokens the rollout routed (attention mask 1, router
padding mask False), expert sets compared order-free in every MoE layer
(:func:`replay_plugin.core.metrics.same_expert_sets`):

- ``replay/router_agreement``: the share of those tokens whose experts the trainer's OWN routers
  pick (one more no-grad forward of the backbone per chunk, under TRL's autocast, outside any
  replay, recorded with :func:`replay_plugin.fsdp.record_routes`) equal the rollout's in every
  layer: what training would use without R3 (a bf16 trainer against a float32 vLLM rollout
  disagrees on some). ``REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT=0`` skips that forward and the metric;
- ``replay/route_agreement``: the same share for the experts the trainer's forward used (recorded
  inside the replay): 1 when replay works. The verl and SkyRL packs' ``rollout_corr/route_agreement``
  (:data:`replay_plugin.core.metrics.ROUTE_KEY`), same definition.

A generation without a routed token logs neither. If TRL runs no old-policy pass (vLLM's importance
sampling correction off and generation aligned with the optimizer steps) the first pass is the
reference model's, and the figures are that model's.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any

from ..patcher import Patcher
from . import batch, rollout
from .patches import ROUTER_AGREEMENT_ENV

#: TRL metric names (``GRPOTrainer._metrics[mode]``)
METRIC_ROUTER_AGREEMENT = "replay/router_agreement"
METRIC_ROUTE_AGREEMENT = "replay/route_agreement"
#: ``Rollout.cache`` key: the generation's agreement was measured (its first pass)
AGREEMENT_CACHE = "route_agreement"

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


def router_agreement_on(environ: Any = None) -> bool:
    """Whether the first pass over a generation measures the trainer's own routers
    (``REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT``: ``1``, the default, or ``0``).

    Raises:
        NotReplayable: any other value, naming the variable.
    """
    raw = (os.environ if environ is None else environ).get(ROUTER_AGREEMENT_ENV, "")
    value = raw.strip() or "1"
    if value in ("0", "1"):
        return value == "1"
    from ..core.errors import NotReplayable

    raise NotReplayable(
        ROUTER_AGREEMENT_ENV,
        f"{ROUTER_AGREEMENT_ENV}={raw!r}: expected 1 (measure replay/router_agreement, the default) or 0 (skip "
        "its extra no-grad forward). Fix the value, or unset it",
        value=raw,
    )


class _Agreement:
    """The counts behind the two metrics over one pass (tensors: no host sync until the end)."""

    def __init__(self, own: bool) -> None:
        self.own = own
        self.tokens: Any = 0
        self.router: Any = 0
        self.used: Any = 0
        self.skipped: Exception | None = None

    def skip(self, exc: Exception) -> None:
        """Not measured: a recording of the caller's spans the pass (recordings do not nest)."""
        import warnings

        self.skipped = exc
        warnings.warn(
            f"trl.routes: {METRIC_ROUTER_AGREEMENT} / {METRIC_ROUTE_AGREEMENT} not measured for this generation: "
            f"{exc}. Close your replay_plugin.fsdp.record_routes before TRL generates (e.g. record inside "
            "compute_loss, not around training_step, which generates)",
            stacklevel=2,
        )

    @staticmethod
    def _matches(found: Any, layers: Any, routes: Any, valid: Any) -> Any:
        from ..core.metrics import same_expert_sets

        index = list(layers)
        rollout_routes = routes[:, :, index].to(found.device)
        return (same_expert_sets(found[:, :, index], rollout_routes).all(-1) & valid.to(found.device)).sum()

    def own_routers(self, module: Any, ids: Any, attention_mask: Any, routes: Any, valid: Any) -> None:
        """One forward of the backbone by its own routers (no replay is open: ``enter`` opens it
        after), recorded; the caller runs under TRL's no_grad and autocast."""
        import torch

        from ..fsdp import record_routes

        backbone = module.base_model
        with torch.no_grad(), record_routes(backbone) as rec:
            backbone(input_ids=ids, attention_mask=attention_mask)
        self.router = self.router + self._matches(rec.routes, rec.layers, routes, valid)

    def replayed(self, rec: Any, routes: Any, valid: Any) -> None:
        self.tokens = self.tokens + valid.sum()
        self.used = self.used + self._matches(rec.routes, rec.layers, routes, valid)

    def log(self, trainer: Any) -> None:
        tokens = int(self.tokens)
        if not tokens or self.skipped is not None:
            return
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        if self.own:
            metrics[METRIC_ROUTER_AGREEMENT].append(float(self.router) / tokens)
        metrics[METRIC_ROUTE_AGREEMENT].append(float(self.used) / tokens)


class _ChunkReplay:
    """One pass of ``_get_per_token_logps_and_entropies`` over a fresh generation: each fused
    forward runs inside a replay of its chunk's routes (and, measuring, a recording of it)."""

    def __init__(self, routes: Any, padding: Any, measure: _Agreement | None = None) -> None:
        self.routes, self.padding = routes, padding
        self.measure = measure
        self.cursor = 0
        self.active: Any = None
        self.recording: Any = None
        self.chunk: Any = None

    def enter(self, module, args, kwargs):
        from ..fsdp import record_routes, replay_routes

        if not kwargs.get("fused_lm_head"):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        start, end = self.cursor, self.cursor + ids.size(0)
        self.cursor = end
        routes, padding = self.routes[start:end], self.padding[start:end]
        if self.measure is not None and self.measure.skipped is None:
            from ..fsdp.route_replay import ReplayStateError

            attention = kwargs.get("attention_mask")
            valid = ~padding if attention is None else (attention.to(padding.device) != 0) & ~padding
            self.chunk = (routes, valid)
            try:
                if self.measure.own:
                    self.measure.own_routers(module, ids, attention, routes, valid)
                self.recording = record_routes(module)
                self.recording.__enter__()
            except ReplayStateError as exc:  # the caller's own record_routes is open around the pass
                self.recording = None
                self.measure.skip(exc)
        self.active = replay_routes(module, routes, padding)
        self.active.__enter__()
        return None

    def exit(self, module, args, kwargs, output):
        # ``output`` is None when the forward raised (an always_call hook): nothing is measured
        if self.active is not None:
            active, self.active = self.active, None
            active.__exit__(None, None, None)
        if self.recording is not None:
            recording, self.recording = self.recording, None
            if output is None:
                recording.__exit__(RuntimeError, None, None)
            else:
                recording.__exit__(None, None, None)
                self.measure.replayed(recording, *self.chunk)
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
    measure = None
    if AGREEMENT_CACHE not in current.cache:  # the first pass over this generation
        current.cache[AGREEMENT_CACHE] = measure = _Agreement(own=router_agreement_on())
    fused = fused_module(model)
    state = _ChunkReplay(routes, padding, measure)
    handles = [
        fused.register_forward_pre_hook(state.enter, with_kwargs=True),
        fused.register_forward_hook(state.exit, with_kwargs=True, always_call=True),
    ]
    try:
        result = wrapped(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        state.exit(None, None, None, None)
    if measure is not None:
        measure.log(instance)
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer.training_step", _training_step)
    patcher.wrap("GRPOTrainer._prepare_inputs", _prepare_inputs)
    patcher.wrap("GRPOTrainer._get_per_token_logps_and_entropies", _scored)
