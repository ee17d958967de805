"""Patches ``trl.hf_sampler_rows`` and ``trl.hf_warped_scores``: the sampler's support of every
token TRL's HF generate path (``use_vllm=False``) draws, as support rows of the rollout.

Gap (trl 1.16.0 with transformers 5.10-5.25): ``GRPOTrainer._generate_single_turn`` calls
``unwrapped_model.generate(...)`` with a ``GenerationConfig`` built from ``top_k`` / ``top_p`` /
``min_p`` / ``temperature``, and keeps the token ids only: what the sampler could have drawn at
each step is lost. transformers merges a caller's ``logits_processor`` *before* its warpers
(``GenerationMixin._get_logits_processor``: temperature, top-k, top-p, min-p ... are appended
after the merge), so a processor passed the ordinary way would see unwarped scores.

- ``trl.hf_sampler_rows`` wraps ``GRPOTrainer._generate_single_turn``: when the generation being
  collected (``trl.rollout_batch``) asks for support and TRL generates with transformers, it opens
  a recording, then turns what was recorded into one :class:`~replay_plugin.core.support.SupportRows`
  per completion, cut to TRL's EOS-cut completion (rows past it are the padded steps of finished
  sequences), and delivers them into the rollout in TRL's order.
- ``trl.hf_warped_scores`` wraps ``GenerationMixin._get_logits_processor``: inside a recording
  only, it refuses a processor that changes the scores' values (only the temperature and
  processors that mask tokens, whose scores then are the model's logits over the temperature
  on the support, are reproduced by the trainer), and appends a recorder after the last one.
  Each step the recorder keeps, per sequence, the ``W = top_k + slack`` highest-scoring ids of the
  finite (unmasked) scores and their log-softmax: the support and the processed logprobs the
  sampler draws from. Outside a recording it is transformers' own method.

A row is exact when the support has at most ``W`` members (ties at the k-th score widen it; the
slack is the vLLM pack's: ``replay_sample_support_slack`` or
``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK``); a wider one is refused, naming the completion and
the token. The trainer side (``trl.support_logprobs``) renormalises over these rows.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..patcher import Patcher
from . import rollout, switch

#: transformers processors whose output, on the tokens they leave finite, is the logits divided by
#: the temperature up to a per-row shift: the sampler's processed logprobs are the support's
#: renormalised logits (what the trainer computes). Any other processor is refused.
REPLAYABLE = frozenset(
    {
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TopHLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "PrefixConstrainedLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "LogitNormalization",
    }
)

_RECORDING: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "replay_plugin_trl_hf_recording", default=None
)


class Recorder:
    """Per decode step: the top-``width`` ids of the processed scores (``-1`` where masked), their
    log-softmax and how many scores were finite."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.steps: list[tuple[Any, Any, Any]] = []
        self.armed = False

    def __call__(self, input_ids, scores):
        import torch

        with torch.no_grad():
            s = scores.float()
            finite = torch.isfinite(s)
            count = finite.sum(dim=-1)
            w = min(self.width, s.size(-1))
            values, ids = torch.topk(s, w, dim=-1)
            logp = torch.log_softmax(s, dim=-1).gather(-1, ids)
            keep = torch.isfinite(values)
            ids = torch.where(keep, ids, torch.full_like(ids, -1))
            self.steps.append((ids.cpu(), logp.cpu(), count.cpu()))
        return scores


def _width(ask: switch.Ask, top_k: int) -> int:
    from ..vllm import options

    slack = ask.slack if ask.slack is not None else options.job_slack()
    return int(top_k) + int(slack)


def rows_of(recorder: Recorder, completion_ids: list[list[int]]) -> list[Any]:
    """One ``SupportRows`` per completion from the recorded steps (row ``i`` of step ``t`` is
    completion ``i``'s token ``t``).

    Raises:
        ReplayDataError: another batch size than TRL's, fewer steps than a completion has tokens, a
            support wider than the rows (naming the completion, the token and the fix).
    """
    import numpy as np

    from ..core.errors import ReplayDataError
    from ..core.support import SupportRows

    if not recorder.steps:
        raise ReplayDataError("replay_support", "transformers' generate ran no sampling step the plugin saw")
    batch = recorder.steps[0][0].shape[0]
    if batch != len(completion_ids):
        raise ReplayDataError(
            "replay_support", f"the sampler ran {batch} sequences, TRL returned {len(completion_ids)} completions"
        )
    ids = np.stack([s[0].numpy() for s in recorder.steps], axis=1).astype(np.int32)  # [B, S, W]
    logp = np.stack([s[1].numpy() for s in recorder.steps], axis=1)  # [B, S, W]
    count = np.stack([s[2].numpy() for s in recorder.steps], axis=1)  # [B, S]
    out = []
    for i, tokens in enumerate(completion_ids):
        t = len(tokens)
        if t > ids.shape[1]:
            raise ReplayDataError(
                "replay_support", f"completion {i}: {t} tokens, the sampler ran {ids.shape[1]} steps", trajectory=i
            )
        sampled = np.asarray(tokens, dtype=np.int32)
        rows = ids[i, :t]
        hit = rows == sampled[:, None]
        member = hit.any(axis=1)
        wide = count[i, :t] > recorder.width
        bad = np.flatnonzero(wide | ~member)
        if bad.size:
            k = int(bad[0])
            raise ReplayDataError(
                "replay_support",
                f"the sampler's support at this token has {int(count[i, k])} tokens, more than the rows' width "
                f"{recorder.width} (top_k + slack: ties at the k-th score, or top_p / min_p wider than top_k); raise "
                f"replay_sample_support_slack in {switch.WHERE}",
                trajectory=i,
                token=k,
            )
        sampled_logprob = np.where(hit, logp[i, :t], 0.0).sum(axis=1).astype(np.float32)
        out.append(SupportRows(ids=rows, sampled=sampled, sampled_logprob=sampled_logprob, exact=member & ~wide))
    return out


def _single_turn(wrapped, instance, args, kwargs):
    current = rollout.current()
    if (
        current is None
        or not current.ask.support
        or getattr(instance, "use_vllm", False)
        or getattr(instance, "use_transformers_continuous_batching", False)
    ):
        return wrapped(*args, **kwargs)
    recorder = Recorder(_width(current.ask, instance.top_k))
    token = _RECORDING.set(recorder)
    try:
        completion_ids, logprobs = wrapped(*args, **kwargs)
    finally:
        _RECORDING.reset(token)
    if not recorder.armed:
        from ..core.errors import NotReplayable
        from ..spec import toggle_name

        raise NotReplayable(
            toggle_name("trl.hf_warped_scores"),
            "TRL's HF generate ran without the plugin's recorder (patch trl.hf_warped_scores not applied: a "
            "transformers version outside its range, or switched off): the sampler's support was not captured",
        )
    current.deliver([rollout.Completion(rows=r) for r in rows_of(recorder, completion_ids)])
    return completion_ids, logprobs


def _processors(wrapped, instance, args, kwargs):
    processors = wrapped(*args, **kwargs)
    recorder = _RECORDING.get()
    if recorder is None:
        return processors
    from ..core.errors import NotReplayable

    for p in processors:
        name = type(p).__name__
        if name not in REPLAYABLE:
            raise NotReplayable(
                name,
                f"transformers' generate applies {name}, which changes the sampler's scores in a way the trainer "
                f"does not reproduce (its support log-probs would not be the sampler's); drop the setting that "
                f"adds it (GRPOConfig / generation_kwargs), or drop {switch.WHERE}'s replay keys",
                value=name,
            )
    processors.append(recorder)
    recorder.armed = True
    return processors


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer._generate_single_turn", _single_turn)


def install_recorder(patcher: Patcher) -> None:
    patcher.wrap("GenerationMixin._get_logits_processor", _processors)
