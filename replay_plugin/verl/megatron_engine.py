"""Patch ``verl.megatron_support_logprobs``: verl's Megatron engine (``MegatronEngineWithLMHead``,
verl 0.9.1) scores with the rollout's sampler support.

Gap (verl 0.9.1): verl has no sampler-support replay. Its Megatron engine scores every token over
the full vocabulary (``_lm_head_logits_processor``: ``vocab_parallel_log_probs_from_logits`` on
the vocab-parallel logits), while the rollout drew it from a top-k/top-p support: the importance
ratio against the rollout's logprobs is the support's mass, not 1. Routed-expert replay is verl's
own here (``router_replay.mode: R3``, verl's ``RouterReplay``); the patch leaves it alone.

How: ``forward_step`` hands verl's forward function (``gptmodel_forward_model_engine``, which
``get_mcore_engine_forward_fn`` returns) a logits processor and its per-token arguments
(``label``, ``temperature``), and the forward function lays every argument out as it lays out the
model's input: packed THD (each sequence aligned to TP x CP, zigzag context-parallel shards, FP8
and bucket padding) or padded BSHD, the label rolled by one. When a micro-batch carries
:data:`BATCH_SUPPORT_KEY` (``rollout_sample_support``: int ``[B, R, W]`` response-aligned, ``-1``
padding; jagged ``[b, r_b, W]`` from the TransferQueue), the patch adds three arguments of its own,
one row per token of ``input_ids`` and already shifted to the label's position (position ``p``
holds what scoring token ``p + 1`` needs): the support row plus one (verl pads the layout with
zeros, which then read as no support), the loss flag, and the token's index (to name it in an
error). verl lays them out with its own code, so they land where the label lands whatever the
layout. The processor then computes the support-renormalised logprob on the raw vocab-parallel
logits (:func:`replay_plugin.megatron.support.support_logprobs`: tensor-parallel, gradients to
the logits) and runs verl's own processor for everything else (entropy over the full vocabulary,
sum pi^2, distillation outputs): verl's ``forward_step`` reads a shallow copy of the micro-batch
with ``distillation_only`` set, which skips only its own log-prob pass.

Every caller of the engine gets the replayed values: ``compute_log_prob`` (old log-probs),
``update_actor`` (the PPO loss) and ``compute_ref_log_prob`` (the reference model over the same
support, so that the KL penalty compares two distributions over one set), as on the FSDP engine.

Refused, naming the setting: fused kernels (``use_fused_kernels``: no logits) with support rows.
Refused before the forward, naming the micro-batch row, its uid and the response token
(``engine_batch.response_support``, the FSDP engine's rule too): a loss-bearing token whose row is
all ``-1`` (verl has no synthetic EOS; the low-level scoring gives such a row logprob 0, measured
in issue 41), an int64 id the int32 rows cannot hold (``2**32 + 5`` read as token 5), a per-sample
temperature that is not finite and > 0, a strided nested field.
A micro-batch with rows that the last pipeline stage did not score through the logits processor
(verl's forward path changed) raises rather than return full-vocabulary numbers.
"""

from __future__ import annotations

import contextvars
from typing import Any

from ..patcher import Patcher
from .engine_batch import (
    check_jagged,
    in_verl_terms,
    non_tensor,
    response_lengths,
    response_support,
    uniform_temperature,
)
from .switch import BATCH_SUPPORT_KEY

#: the logits-processor arguments the patch adds (verl lays each out like ``label``, unrolled)
SUPPORT_ARG = "replay_plugin_support"  # int32 [.., W]: support row + 1, 0 = none
LOSS_ARG = "replay_plugin_loss"  # bool [..]: the token scored here bears loss
TOKEN_ARG = "replay_plugin_token"  # int64 [..]: index of the position in input_ids.values() + 1

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"


class _MicroBatch:
    """The micro-batch ``forward_step`` is scoring, and whether its logits were replayed."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.scored = False


class _Batches:
    """The data iterator ``forward_step`` reads its micro-batch from: a micro-batch with support
    rows is checked, remembered, and handed to verl as a shallow copy with ``distillation_only``
    set (verl skips its own log-prob pass; the loss and postprocessing read the same tensors)."""

    def __init__(self, engine: Any, source: Any) -> None:
        self.engine = engine
        self.source = source
        self.current: _MicroBatch | None = None

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        batch = next(self.source)
        if BATCH_SUPPORT_KEY not in batch.keys() or non_tensor(batch, "distillation_only", False):
            return batch
        _check_engine(self.engine, batch)
        from verl.utils import tensordict_utils as tu

        self.current = _MicroBatch(batch)
        theirs = batch.copy()
        tu.assign_non_tensor(theirs, distillation_only=True)
        return theirs


_CURRENT: contextvars.ContextVar[_Batches | None] = contextvars.ContextVar("replay_plugin_verl_megatron", default=None)


def _check_engine(engine: Any, batch: Any) -> None:
    from ..core.errors import NotReplayable

    if type(engine).__module__ != ENGINE_MODULE:
        raise NotReplayable(
            "engine",
            f"sample-support replay on Megatron is implemented for verl's MegatronEngineWithLMHead ({ENGINE_MODULE}), "
            f"not {type(engine).__name__} of {type(engine).__module__}: switch the plugin's verl patches off for it",
            value=type(engine).__name__,
        )
    fused = non_tensor(batch, "use_fused_kernels", getattr(engine.engine_config, "use_fused_kernels", False))
    if fused:
        raise NotReplayable(
            "use_fused_kernels",
            "sample-support replay needs the model's logits, which verl's fused kernels never materialise: set "
            "actor_rollout_ref.model.use_fused_kernels=false",
            value=True,
        )


# --------------------------------------------------------------------------- the rows, per token


def label_aligned_rows(micro_batch: Any, input_ids: Any) -> dict[str, Any]:
    """The three per-token arguments (:data:`SUPPORT_ARG`, :data:`LOSS_ARG`, :data:`TOKEN_ARG`),
    jagged like ``input_ids`` ``[b, j]``: position ``p`` of sequence ``b`` carries what scoring
    its token ``p + 1`` needs, so that verl's layout of an unrolled argument puts it where its
    rolled ``label`` goes. Response token ``t`` of a sequence of ``L`` tokens with ``R`` response
    tokens is token ``L - R + t``, scored at position ``L - R + t - 1``."""
    import torch

    from ..core.errors import ReplayDataError

    if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
        raise ReplayDataError("input_ids", f"got {type(input_ids).__name__}", expected="verl's jagged [b, j] input_ids")
    check_jagged(input_ids, "input_ids")
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    response, support, loss = response_support(micro_batch, lengths)

    device = input_ids.device
    nnz, width, r_max = int(offsets[-1]), int(support.shape[-1]), int(response.max())
    t = torch.arange(r_max, device=device)
    inside = t[None, :] < response.to(device)[:, None]
    first = (offsets[:-1] + lengths - response).to(device) - 1  # where response token 0 is scored
    flat = (first[:, None] + t[None, :])[inside]
    rows = torch.zeros(nnz, width, dtype=torch.int32, device=device)
    rows[flat] = support[:, :r_max].to(device)[inside].to(torch.int32) + 1
    bears = torch.zeros(nnz, dtype=torch.bool, device=device)
    bears[flat] = loss[:, :r_max].to(device)[inside]
    index = torch.arange(1, nnz + 1, dtype=torch.int64, device=device)
    jagged = offsets.to(device)
    return {
        SUPPORT_ARG: torch.nested.nested_tensor_from_jagged(rows, jagged),
        LOSS_ARG: torch.nested.nested_tensor_from_jagged(bears, jagged),
        TOKEN_ARG: torch.nested.nested_tensor_from_jagged(index, jagged),
    }


def _temperature(micro_batch: Any, laid_out: Any) -> tuple[float, Any]:
    """``(T, per-position divisor or None)``: one temperature for the micro-batch, or (per sample,
    differing) verl's laid-out per-token temperature the logits are divided by."""
    t = uniform_temperature(micro_batch)
    if t is not None:
        return t, None
    return 1.0, laid_out.float().clamp_min(1e-8).unsqueeze(-1)


def _replayed(mb: _MicroBatch, logits: Any, label: Any, temperature: Any, extra: dict[str, Any], input_ids: Any) -> Any:
    """Support-renormalised log-probs in the layout of ``label`` (float32, 0 off the support)."""
    from ..core.errors import ReplayDataError
    from ..megatron.support import support_logprobs

    support = extra[SUPPORT_ARG].to(logits.device) - 1
    bears = extra[LOSS_ARG].to(logits.device).bool()
    t, divisor = _temperature(mb.batch, temperature)
    source = logits if divisor is None else logits / divisor.to(logits.device, logits.dtype)
    try:
        lp, _valid = support_logprobs(source, label.to(logits.device), support, temperature=t, loss_mask=bears)
    except ReplayDataError as exc:
        raise _named(exc, mb.batch, extra[TOKEN_ARG], input_ids) from exc
    return lp


def _named(exc: Any, micro_batch: Any, token_index: Any, input_ids: Any) -> Any:
    """A scoring error at a position of verl's layout, in verl's terms: the micro-batch row and the
    response token of the label scored there."""
    import torch

    if exc.trajectory is None or exc.token is None:
        return exc
    flat = int(token_index.reshape(-1, token_index.shape[-1])[exc.trajectory, exc.token]) - 1
    if flat < 0:
        return exc
    offsets = input_ids.offsets().cpu()
    row = int(torch.searchsorted(offsets, torch.tensor(flat), right=True)) - 1
    length = int(offsets[row + 1] - offsets[row])
    response = int(response_lengths(micro_batch, int(offsets.numel()) - 1)[row])
    return in_verl_terms(exc, micro_batch, row, flat - int(offsets[row]) + 1 - (length - response))


# --------------------------------------------------------------------------- the wrappers


def _forward_step(wrapped, instance, args, kwargs):
    names = ("batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func")
    bound = dict(zip(names, args, strict=False)) | kwargs
    batches = _Batches(instance, iter(bound["batch_iter"]))
    bound["batch_iter"] = batches
    token = _CURRENT.set(batches)
    try:
        result = wrapped(**bound)
    finally:
        _CURRENT.reset(token)
    mb = batches.current
    if mb is not None and not mb.scored and _post_process(bound["model"]):
        from ..core.errors import NotReplayable

        raise NotReplayable(
            "verl.megatron_support_logprobs",
            f"a micro-batch carrying {BATCH_SUPPORT_KEY} was not scored through the logits processor of verl's forward "
            "function (verl's Megatron forward path differs from the one the patch supports: check "
            "`replay-plugin matrix --check`); refusing to return full-vocabulary log-probs",
        )
    return result


def _post_process(model: Any) -> bool:
    from megatron.core.utils import get_attr_wrapped_model

    return bool(get_attr_wrapped_model(model, "post_process", allow_none=True, return_model_obj=False))


def _forward_fn(wrapped, instance, args, kwargs):
    batches = _CURRENT.get()
    mb = batches.current if batches is not None else None
    processor = kwargs.get("logits_processor")
    if mb is None or processor is None:
        return wrapped(*args, **kwargs)
    input_ids = args[1] if len(args) > 1 else kwargs["input_ids"]
    extra = label_aligned_rows(mb.batch, input_ids)

    def replaying(logits, *, label, temperature, **laid_out):
        mine = {k: laid_out.pop(k) for k in (SUPPORT_ARG, LOSS_ARG, TOKEN_ARG)}
        # before verl's processor: it divides the logits by the temperature in place
        log_probs = _replayed(mb, logits, label, temperature, mine, input_ids)
        out = processor(logits, label=label, temperature=temperature, **laid_out)
        out["log_probs"] = log_probs
        mb.scored = True
        return out

    kwargs = dict(kwargs)
    kwargs["logits_processor"] = replaying
    kwargs["logits_processor_args"] = {**(kwargs.get("logits_processor_args") or {}), **extra}
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("MegatronEngineWithLMHead.forward_step", _forward_step)
    patcher.wrap("verl.models.mcore.registry:gptmodel_forward_model_engine", _forward_fn)
