"""Patch ``trl.support_logprobs``: every logprob TRL's GRPOTrainer computes (old, reference,
current) is renormalised over the rollout's sampler support.

Gap (trl 1.16.0, trl#6789, open): the rollout samples from a top-k / top-p / min-p truncated
distribution, and TRL scores each completion token over the full vocabulary (its fused LM head,
``trainer/utils.py:add_fused_lm_head``). The trainer/sampler ratio of an untrained policy is the
support's mass, not 1 (measured here, top_k=8, top_p=0.9: 0.72-0.76).

All three of TRL's passes go through ``GRPOTrainer._get_per_token_logps_and_entropies``, which
calls the model once per chunk of ``batch_size`` rows, in order, with ``fused_lm_head=True``.
The patch wraps it: while it runs, two forward hooks on the model TRL patched (the module whose
``forward`` is TRL's ``_fused_forward``) take the backbone's last hidden state and replace, per
chunk, ``log_probs`` of the completion tokens that have a row by
:func:`replay_plugin.core.logprobs.support_logprobs_from_hidden` (the candidates' logits only,
TRL's temperature, gradients to the backbone and the LM head). Entropy, the aux loss and every
other output stay TRL's. Each chunk's ``input_ids`` must be the next rows of the pass (a drift
of TRL's chunk loop is refused), and every chunk must be scored.

Where the rows come from: in ``_compute_loss`` (wrapped), the micro-batch's ``replay_support``
(``trl.rollout_batch``); in the old and reference passes inside
``_generate_and_score_completions``, the generation being collected (``rollout.current()``). The
first of those passes (TRL's old policy, the model that just generated) also measures the
replayed logprob against the sampler's processed logprob (``batch.DIFF_CACHE``), which
``trl.rollout_batch`` logs into TRL's metrics.

Without rows the method is TRL's, untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from ..patcher import Patcher
from . import batch, rollout

_LOSS_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("replay_plugin_trl_loss_rows", default=None)
_FUSED = "_fused_forward"  # the name of TRL 1.16's fused forward (add_fused_lm_head)


def fused_module(model: Any) -> Any:
    """The module whose ``forward`` is TRL's fused LM-head forward (the policy or the reference
    model TRL patched; under PEFT / wrappers, the inner ``PreTrainedModel``).

    Raises:
        NotReplayable: none is (TRL did not install its fused head on this model).
    """
    from ..core.errors import NotReplayable

    for module in model.modules():
        # an instance attribute (types.MethodType); functools.wraps gave it the model's forward's
        # name, its code keeps TRL's. Under mixed precision accelerate (1.x, ``prepare_model`` with
        # native AMP: bf16=True on CPU) wraps that forward in autocast and keeps it as
        # ``_original_forward``.
        for attr in ("forward", "_original_forward"):
            code = getattr(getattr(module.__dict__.get(attr), "__func__", None), "__code__", None)
            if getattr(code, "co_name", None) == _FUSED:
                return module
    raise NotReplayable(
        "model",
        f"{type(model).__name__} carries no TRL fused LM head (add_fused_lm_head), which the plugin's support "
        "log-probs hook into",
        value=type(model).__name__,
    )


class _Pass:
    """One call of ``_get_per_token_logps_and_entropies``: the rows and the chunk cursor."""

    def __init__(self, trainer: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, rows: Any) -> None:
        self.trainer = trainer
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.c = int(logits_to_keep)
        self.rows = rows
        self.cursor = 0
        self.hidden: Any = None
        self.values: list = []  # (first row, replayed logprob, has-row mask) per chunk with rows

    def capture(self, module, args, output) -> None:
        self.hidden = output.last_hidden_state

    def replace(self, module, args, kwargs, output):
        import torch

        from ..core.errors import ReplayDataError
        from ..core.logprobs import support_logprobs_from_hidden

        if not kwargs.get("fused_lm_head"):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        b = ids.size(0)
        start, end = self.cursor, self.cursor + b
        self.cursor = end
        if end > self.input_ids.size(0) or not torch.equal(ids, self.input_ids[start:end].to(ids.device)):
            raise ReplayDataError(
                "input_ids",
                f"TRL scored rows {start}..{end - 1} of a pass of {self.input_ids.size(0)} with other token ids than "
                "the pass's: its chunk loop no longer scores the batch in order (trl version?)",
            )
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            raise ReplayDataError("hidden", "the backbone's last hidden state was not seen for this chunk")
        c = self.c
        sup = self.rows[start:end].to(ids.device)
        mask = self.attention_mask[start:end, -c:].to(ids.device) != 0
        has = (sup[..., 0] >= 0) & mask
        log_probs = output.log_probs
        if not bool(has.any()):
            return None
        head = module.get_output_embeddings()
        weight = head.weight
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor, as TRL's fused head does
            weight = weight.full_tensor()
        h = hidden[:, -c - 1 : -1].to(weight.device)
        sampled = ids[:, -c:].to(weight.device)
        lp, _ = support_logprobs_from_hidden(
            h[has],
            weight,
            sampled[has],
            sup[has].to(device=weight.device, dtype=torch.int32),
            temperature=float(self.trainer.temperature),
        )
        tail = log_probs[:, -c:]
        replayed = torch.zeros_like(tail).masked_scatter(has.to(tail.device), lp.to(tail.dtype))
        tail = torch.where(has.to(tail.device), replayed, tail)
        output.log_probs = torch.cat([log_probs[:, :-c], tail], dim=1) if log_probs.size(1) > c else tail
        self.values.append((start, replayed.detach(), has.to(tail.device)))
        return output

    def finish(self) -> None:
        from ..core.errors import ReplayDataError

        if self.cursor != self.input_ids.size(0):
            raise ReplayDataError(
                "input_ids",
                f"TRL scored {self.cursor} of the pass's {self.input_ids.size(0)} rows through its fused LM head",
            )


@contextlib.contextmanager
def _hooked(model: Any, state: _Pass) -> Iterator[None]:
    fused = fused_module(model)
    backbone = fused.base_model
    handles = [
        backbone.register_forward_hook(state.capture),
        fused.register_forward_hook(state.replace, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _bind(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
    """``_get_per_token_logps_and_entropies``'s first four arguments, however they were passed."""
    return model, input_ids, attention_mask, logits_to_keep


def _rows_of_generation(current: rollout.Rollout, width_c: int, device: Any) -> Any:
    import torch

    key = ("support", width_c)
    if key not in current.cache:
        current.cache[key] = torch.from_numpy(rollout.support_grid(current, width_c)).to(device)
    return current.cache[key]


def _scored(wrapped, instance, args, kwargs):
    import torch

    from ..core.errors import ReplayDataError

    rows = _LOSS_ROWS.get()
    current = None
    model, input_ids, attention_mask, logits_to_keep = _bind(*args, **kwargs)
    if rows is None:
        current = rollout.current()
        if current is None or not current.ask.support or current.completion_lengths is None:
            return wrapped(*args, **kwargs)
        rows = _rows_of_generation(current, int(logits_to_keep), input_ids.device)
    if tuple(rows.shape[:2]) != (input_ids.size(0), int(logits_to_keep)):
        raise ReplayDataError(
            batch.SUPPORT_KEY,
            f"rows of shape {tuple(rows.shape)} for a pass of {input_ids.size(0)} sequences scoring "
            f"{int(logits_to_keep)} completion tokens",
            expected=f"[{input_ids.size(0)}, {int(logits_to_keep)}, W]",
        )
    state = _Pass(instance, input_ids, attention_mask, int(logits_to_keep), rows)
    with _hooked(model, state):
        result = wrapped(*args, **kwargs)
    state.finish()
    if current is not None and batch.DIFF_CACHE not in current.cache:
        # the first pass over a fresh generation is TRL's old policy: the model that sampled it
        sampler = torch.from_numpy(rollout.sampled_logprob_grid(current, int(logits_to_keep)))
        diffs = []
        for start, replayed, has in state.values:
            ref = sampler[start : start + has.size(0)].to(replayed.device)
            keep = has & ~torch.isnan(ref)
            diffs.append((replayed[keep] - ref[keep]).abs().float())
        current.cache[batch.DIFF_CACHE] = torch.cat(diffs) if diffs else torch.zeros(0)
    return result


def _loss(wrapped, instance, args, kwargs):
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    rows = inputs.get(batch.SUPPORT_KEY) if isinstance(inputs, dict) else None
    if rows is None:
        return wrapped(*args, **kwargs)
    token = _LOSS_ROWS.set(rows)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _LOSS_ROWS.reset(token)


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer._get_per_token_logps_and_entropies", _scored)
    patcher.wrap("GRPOTrainer._compute_loss", _loss)
