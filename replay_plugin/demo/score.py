"""The demo's trainer side: re-score the rollout with a Megatron-core ``GPTModel``.

One microbatch holds every trajectory, left-padded to ``[B, S]``; the model sees the unpacked
layout of :class:`~replay_plugin.core.layout.TokenMetadataLayout` (valid tokens
left-justified). Four settings per precision:

``none``     the trainer's ordinary full-vocabulary logprob, its own routing
``routes``   routed-expert replay (``replay_plugin.megatron.replay_routes``)
``support``  sampler-support replay (logprob renormalised over the recorded support)
``both``     both

Route agreement is measured from what the routers actually did (a forward hook on every
``TopKRouter`` reads its routing map), not from what was installed; :func:`score` returns the
logprobs and both sides' experts on the ``[B, S - 1]`` next-token grid for
:func:`replay_plugin.demo.report.measure`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .report import Scored

SETTINGS = ("none", "routes", "support", "both")


@dataclass
class Batch:
    """Host-side batch built once from the rollout (all ``[B, S]`` unless noted)."""

    input_ids: np.ndarray  # int64, left-padded
    attention_mask: np.ndarray  # bool
    response_mask: np.ndarray  # bool, True at response tokens
    rollout_logprobs: np.ndarray  # float32, vLLM's processed logprob at response tokens
    routes: np.ndarray | None  # [B, S, L, K] compact, pad_batch
    router_padding_mask: np.ndarray | None  # bool, True = no recorded route
    support: np.ndarray  # int32 [B, S, W], right-aligned rows, -1 elsewhere
    pad_id: int
    num_inexact: int


def make_batch(trajectories: list, pad_id: int, eos_id: int) -> Batch:
    from ..core.routes import pad_batch
    from ..core.support import dense_support_batch

    lengths = [len(t.prompt) + len(t.response) for t in trajectories]
    B, S = len(trajectories), max(lengths)
    input_ids = np.full((B, S), pad_id, dtype=np.int64)
    attention = np.zeros((B, S), dtype=bool)
    response = np.zeros((B, S), dtype=bool)
    rollout_lp = np.zeros((B, S), dtype=np.float32)
    for i, t in enumerate(trajectories):
        seq = np.concatenate([t.prompt, t.response]).astype(np.int64)
        input_ids[i, S - len(seq) :] = seq
        attention[i, S - len(seq) :] = True
        response[i, S - len(t.response) :] = True
        rollout_lp[i, S - len(t.response) :] = t.support.sampled_logprob
    dense = dense_support_batch(
        [t.support for t in trajectories],
        [t.response for t in trajectories],
        [np.ones(len(t.response), dtype=bool) for t in trajectories],
        S,
        eos_id,
    )
    routes = rpm = None
    if all(t.routes is not None for t in trajectories):
        routes, rpm_t = pad_batch([t.routes for t in trajectories], attention)
        rpm = rpm_t.numpy()
    return Batch(
        input_ids, attention, response, rollout_lp, routes, rpm, np.asarray(dense.ids), pad_id, int(dense.num_inexact)
    )


class _RoutingSpy:
    """Records each router's routing map (``[tokens, experts]`` bool, tokens sequence-major)."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.maps: dict[int, Any] = {}
        self.handles = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                self.handles.append(module.register_forward_hook(self._hook(module)))

    def _hook(self, module: Any) -> Callable:
        def hook(mod, args, output):
            self.maps[int(mod.layer_number)] = output[1].detach()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def score(model: Any, batch: Batch, setting: str, *, temperature: float = 1.0) -> Scored:
    """Forward the batch once under ``setting`` and score every response token."""
    import torch

    from ..core.layout import TokenMetadataLayout
    from ..megatron import clear_routes, replay_response_logprobs, replay_routes

    use_routes = setting in ("routes", "both")
    use_support = setting in ("support", "both")
    if use_routes and batch.routes is None:
        raise RuntimeError("routed-expert replay needs routes from the rollout (enable_return_routed_experts)")
    layout = TokenMetadataLayout.build(torch.from_numpy(batch.attention_mask), packed=False, align=1)
    ids = layout.align(torch.from_numpy(batch.input_ids), batch.pad_id)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    padding_mask = None
    if use_routes:
        replay = replay_routes(model, batch.routes, batch.router_padding_mask, layout)
        padding_mask = replay.padding_mask
    spy = _RoutingSpy(model)
    try:
        with torch.no_grad():
            logits = model(ids, positions, None, padding_mask=padding_mask)  # [B, A, V]
    finally:
        spy.remove()
        if use_routes:
            clear_routes(model)
    input_ids = torch.from_numpy(batch.input_ids)
    if use_support:
        per_pos = replay_response_logprobs(
            logits,
            input_ids,
            layout,
            support_ids=torch.from_numpy(batch.support),
            loss_mask=torch.from_numpy(batch.response_mask),
            temperature=temperature,
        )
    else:  # the trainer's ordinary logprob (Megatron's vocab_parallel_cross_entropy)
        per_pos = replay_response_logprobs(logits, input_ids, layout, temperature=temperature)
    # position s scores token s + 1
    scored = Scored(per_pos.numpy(), batch.rollout_logprobs[:, 1:], batch.response_mask[:, 1:])
    if batch.routes is not None and batch.router_padding_mask is not None and spy.maps:
        layers = sorted(spy.maps)
        scored.trainer_routes = _trainer_routes(spy.maps, layers, batch.routes.shape[-1], layout, ids.shape)
        scored.rollout_routes = batch.routes[:, :-1][:, :, [n - 1 for n in layers]]
        scored.route_mask = ~batch.router_padding_mask[:, :-1]
        scored.route_layers = [n - 1 for n in layers]
    return scored


def _trainer_routes(maps: dict, layers: list[int], k: int, layout: Any, aligned_shape: tuple) -> np.ndarray:
    """``[B, S-1, L, K]`` int64: the experts the routers sent the token at position s to (the
    token whose output scores token s+1), one row per layer of ``layers``; all ``-1`` where a
    router's map does not hold exactly ``k`` experts, and at positions without a token."""
    import torch

    B, A = aligned_shape
    per_layer = []
    for layer_number in layers:
        routing_map = maps[layer_number]
        used = routing_map.view(A, B, routing_map.shape[-1]).transpose(0, 1)  # tokens are sequence-major
        ids = used.to(torch.float32).topk(k, dim=-1).indices  # the k chosen experts, any order
        per_layer.append(torch.where((used.sum(-1) == k).unsqueeze(-1), ids, -1))
    routes = torch.stack(per_layer, dim=2)  # [B, A, L, K]
    return layout.restore(routes, -1).numpy()  # slot j -> the position of token j
