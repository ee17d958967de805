"""Patch ``trl.rollout_batch``: the rollout's support rows and routes ride TRL's batch dict from
generation to the loss.

Gap (trl 1.16.0): ``GRPOTrainer._generate_and_score_completions`` keeps, of a generation, the
token ids and (vLLM only) the sampled token's logprob; nothing of the sampler's support or of
the routed experts reaches the trainer (trl#6789; TRL has no R3).

With the switch set (``switch.asked(args)``), the patch opens a :class:`~.rollout.Rollout`
around ``_generate_and_score_completions``; the generation backend's seams
(``trl.hf_sampler_rows``, the vLLM pack's rows) deliver into it. Wrapping ``_generate``, it
checks what was delivered against TRL's prompts and completions as soon as TRL has them (count,
tokens, route lengths), before TRL's old / reference passes score them (``trl.support_logprobs``
reads the rows there). When TRL returns, the batch gets, on TRL's grid (prompts left-padded to
``P``, completions right-padded to ``C``):

- ``replay_support`` int32 ``[B, C, W]`` (``-1`` pads past a completion's end and the row width);
- ``replay_routes`` ``[B, P + C, L, K]`` (the rollout's compact dtype) and
  ``replay_router_padding_mask`` bool ``[B, P + C]`` (True: no route, the model routes itself).

TRL's shuffle, split and buffering of the batch work on dim 0 and carry them unchanged to
``_compute_loss``. What the plugin measured goes into TRL's own metrics (averaged and logged by
TRL): ``replay/support_exact_fraction`` (the completion tokens whose row is the sampler's exact
support) and, where TRL scores the old policy right after generation, the trainer's replayed
logprob against the sampler's processed logprob, ``replay/sampler_logp_difference/{mean,max}``.

Without the switch the method is TRL's, untouched.
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from . import rollout, switch

SUPPORT_KEY = "replay_support"
ROUTES_KEY = "replay_routes"
ROUTER_PADDING_KEY = "replay_router_padding_mask"
#: TRL metric names (``GRPOTrainer._metrics[mode]``)
METRIC_EXACT = "replay/support_exact_fraction"
METRIC_DIFF_MEAN = "replay/sampler_logp_difference/mean"
METRIC_DIFF_MAX = "replay/sampler_logp_difference/max"
#: ``Rollout.cache`` key under which trl.support_logprobs leaves the old pass's differences
DIFF_CACHE = "sampler_logp_difference"


def _generate(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    current = rollout.current()
    if current is not None:
        prompt_ids, completion_ids = out[0], out[1]
        current.check(completion_ids, prompt_ids)
    return out


def _scored(wrapped, instance, args, kwargs):
    ask = switch.asked(instance.args)
    if not ask.any:
        return wrapped(*args, **kwargs)
    with rollout.collecting(ask) as current:
        output = wrapped(*args, **kwargs)
    add_to_batch(instance, current, output)
    return output


def add_to_batch(trainer: Any, current: rollout.Rollout, output: dict) -> None:
    """Adds the rollout's rows / routes to TRL's batch ``output`` and its measurements to TRL's metrics."""
    import torch

    from ..core.errors import ReplayDataError

    if current.completion_lengths is None:
        raise ReplayDataError(
            "completions",
            "the generation went through no path the plugin checks (GRPOTrainer._generate was not called)",
        )
    completion_ids = output["completion_ids"]
    device = completion_ids.device
    width_c = completion_ids.size(1)
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    if current.ask.support:
        output[SUPPORT_KEY] = torch.from_numpy(rollout.support_grid(current, width_c)).to(device)
        exact = rollout.exact_grid(current, width_c)
        tokens = sum(current.completion_lengths)
        metrics[METRIC_EXACT].append(float(exact.sum()) / tokens if tokens else 1.0)
        diffs = current.cache.get(DIFF_CACHE)
        if diffs is not None and diffs.numel():
            metrics[METRIC_DIFF_MEAN].append(diffs.mean().item())
            metrics[METRIC_DIFF_MAX].append(diffs.max().item())
    if current.ask.routes:
        routes, padding = rollout.routes_grid(current, output["prompt_ids"].size(1), width_c)
        output[ROUTES_KEY] = torch.from_numpy(routes).to(device)
        output[ROUTER_PADDING_KEY] = torch.from_numpy(padding).to(device)


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer._generate", _generate)
    patcher.wrap("GRPOTrainer._generate_and_score_completions", _scored)
