"""Train-inference mismatch metrics for every training step, from logprobs and routed experts.

:func:`mismatch_metrics` compares the trainer's logprobs of the sampled tokens with the rollout
engine's (and, optionally, the experts each token was routed to on both sides) and returns a
dict of 0-d tensors: no ``.item()``, no host synchronisation; the caller logs them. Key names
and definitions are verl 0.9.1's where verl has the figure, so dashboards carry over:
``rollout_corr/*`` from ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_offpolicy_metrics``,
and ``compute_is_metrics`` for token-level TIS, ``rollout_is="token"`` with a single
``rollout_is_threshold``), ``training/*`` from ``verl/utils/debug/metrics.py``
(``calculate_debug_metrics``). ``prefix=`` is prepended to every key.

Notation (per call): ``t`` / ``q`` the trainer's / rollout's logprob of a token, ``m`` the
response mask, ``N = sum(m)`` the scored tokens, ``r = t - q`` the log importance ratio
``log(pi_train / pi_rollout)``, ``w = exp(clamp(r, -20, 20))`` the importance ratio (verl's
``SAFETY_BOUND``), ``[lo, hi] = is_threshold``; sums and max run over the scored tokens. A
*sequence* is a row ``b`` of the ``[B, T]`` inputs, ``n_b`` its scored tokens; sequence means run
over all ``B`` rows, as verl's do (a row with ``n_b = 0`` adds 0 to the sum and 1 to the count).

================================================  =============================================
key (unit)                                        value
================================================  =============================================
``rollout_corr/kl`` (nats)                        ``sum(q - t) / N``: k1 estimate of
                                                  KL(rollout || trainer)
``rollout_corr/k3_kl`` (nats)                     ``sum(exp(r) - 1 - r) / N``: k3 estimate of it
``rollout_corr/chi2_token``                       ``sum(w**2) / N - 1``
``rollout_corr/chi2_seq``                         mean over the B rows of
                                                  ``exp(2 clamp(sum_t r, -20, 20)) - 1``
``rollout_corr/rollout_is_mean``                  ``sum(min(w, hi)) / N`` (truncated weights)
``rollout_corr/rollout_is_eff_sample_size``       ``(sum c)**2 / (N sum c**2)``, ``c = min(w, hi)``;
                                                  in (0, 1], 1 = all weights equal
``rollout_corr/rollout_is_ratio_fraction_high``   share of scored tokens with ``w > hi``
``rollout_corr/rollout_is_ratio_fraction_low``    share of scored tokens with ``w < lo``
``rollout_corr/log_ppl_diff`` (nats)              mean over the B rows of ``mean_t q - mean_t t``
                                                  (log of trainer / rollout perplexity; 0 for a
                                                  row without scored tokens)
``rollout_corr/log_ppl_abs_diff`` (nats)          mean over the B rows of ``|mean_t q - mean_t t|``
``rollout_corr/ratio_mean``                       ``sum(w) / N``, not truncated: the trainer's
                                                  probability mass on what the rollout could
                                                  sample (plugin; verl has no key)
``rollout_corr/log_ratio_abs_mean`` (nats)        ``sum |r| / N`` (plugin)
``rollout_corr/log_ratio_abs_max`` (nats)         ``max |r|`` (plugin)
``training/rollout_probs_diff_mean``              ``sum |exp(t) - exp(q)| / N``: probabilities,
                                                  despite verl's "logprob diff" wording
``training/rollout_probs_diff_max``               ``max |exp(t) - exp(q)|``
``training/rollout_probs_diff_std``               its standard deviation over the scored tokens,
                                                  ``N - 1`` in the denominator (``torch.std``)
``training/rollout_actor_probs_pearson_corr``     Pearson correlation of ``exp(t)`` and ``exp(q)``
``rollout_corr/route_agreement``                  with routes (plugin): share of the scored,
                                                  routed tokens whose expert set equals the
                                                  rollout's in every layer
``rollout_corr/route_agreement_layer_<l>``        the same in layer ``l`` alone, one key per layer
================================================  =============================================

Every value is a 0-d tensor on the inputs' device, float32 (float64 when an input is float64),
dimensionless unless marked; shares are in [0, 1]. ``is_threshold`` defaults to ``(0.5, 2.0)``,
verl's default ``rollout_is_threshold`` 2.0 and its lower bound ``1 / 2.0``; verl's own spellings
are accepted too (one number ``hi`` for ``(1 / hi, hi)``, the strings ``"2.0"`` and ``"0.5_2.0"``).
A figure without data is NaN, never an exception: every key when no token is scored (``N = 0``),
the standard deviation when ``N < 2``, the correlation when either side's probabilities are
constant (0/0, as ``torch.corrcoef`` and verl give), the route keys when no scored token is
routed. A NaN logprob on a scored token, on either side, makes every logprob key NaN.

Masks (``response_mask``, ``route_mask``) are bool, or integers that are all 0 or 1 (1 = the token
counts): the rule of every trainer-side entry (``replay_plugin.core.inputs``). Bool masks cost no
host synchronisation; an integer mask costs one, for checking its values.

Where this leaves verl, and why:

* ``k3_kl`` is computed from its Taylor series for small ``|r|`` (``expm1(r) - r`` above) and
  ``chi2_*`` as means of ``expm1(2 ...)``: the same values without the cancellation of
  ``exp(r) - 1`` in float32, which leaves verl's formulas rounding error at the ``|r| ~ 1e-6``
  a float32 trainer with both replays reaches (k3 ~ 1e-12; float32's step at 1 is 1.2e-7).
* Sequence means (``chi2_seq``, ``log_ppl_*``) average over every row of the block, an empty one
  counting as 0, as verl does: a block padded with empty rows (e.g. for balancing) lowers them.
  Means divide by ``N`` exactly (verl's ``masked_mean`` adds 1e-8 to the denominator). verl
  raises on an empty mask; here it is NaN.
* Precision: every figure is computed in float32 at least (float64 when an input is float64);
  verl computes in the input dtype. On bfloat16 logprobs most keys therefore differ from verl's
  (10 to 12 of the 14 shared ones, measured on 22 random batches); on float32 and float64 inputs
  they agree to rounding. To compare with verl on a bf16 trainer, pass both sides as
  ``.float()`` to verl too.
* ``lo`` is a parameter (verl's token-level TIS fixes ``lo = 1 / hi``); as in verl it only sets
  ``rollout_is_ratio_fraction_low``, the weights are truncated at ``hi`` alone.
* verl computes its figures once per batch, with an ``.item()`` each; a call here covers one
  ``[B, T]`` block without host synchronisation. Ratios of sums do not average over calls: to
  log one value per step, call once on the step's batch, or log the mean over microbatches
  (which weights every microbatch alike).
* Not computed: verl's perplexities themselves, IS max/min/std, the sequence-level
  ``rollout_is_seq_*`` figures and rejection-sampling figures (they describe a configured
  correction, not the mismatch).

Routes compare expert *sets*: the order of a token's top-k ids does not matter (vLLM lists them
by score, a trainer may not); a repeated id counts twice. Ids are compared as int16 (both
inputs 8 or 16 bits) or int32 (expert ids below 2**31, the widest dtype of the routes contract).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.inputs import as_mask

#: verl's ``SAFETY_BOUND``: log ratios (and their per-sequence sums) are clamped to +-20 before
#: exponentiating in the importance-ratio and chi-squared figures.
SAFETY_BOUND = 20.0

#: verl's default ``rollout_is_threshold`` (2.0) and its lower bound ``1 / 2.0``.
DEFAULT_IS_THRESHOLD = (0.5, 2.0)

#: The keys every call returns (without ``prefix``), in the order of the returned dict.
LOGPROB_KEYS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_eff_sample_size",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/ratio_mean",
    "rollout_corr/log_ratio_abs_mean",
    "rollout_corr/log_ratio_abs_max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_std",
    "training/rollout_actor_probs_pearson_corr",
)

#: With routes: the all-layer key, then one key per layer (``ROUTE_LAYER_KEY.format(label)``).
ROUTE_KEY = "rollout_corr/route_agreement"
ROUTE_LAYER_KEY = "rollout_corr/route_agreement_layer_{}"


class LogprobsWithMetrics(NamedTuple):
    """What a trainer entry (:func:`replay_plugin.megatron.replay_response_logprobs`,
    :func:`replay_plugin.fsdp.response_logprobs`) returns when given the rollout's logprobs:
    its logprobs, and :func:`mismatch_metrics` of them against the rollout's over the loss mask."""

    logprobs: torch.Tensor
    metrics: dict[str, torch.Tensor]


def mismatch_metrics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    trainer_routes: torch.Tensor | None = None,
    rollout_routes: torch.Tensor | None = None,
    route_mask: torch.Tensor | None = None,
    route_layers: Sequence[Any] | None = None,
    is_threshold: tuple[float, float] | float | str = DEFAULT_IS_THRESHOLD,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Train-inference mismatch of one batch: verl-named 0-d tensors, no host synchronisation.

    Args:
        trainer_logprobs: ``[B, T]`` float (bf16, fp16, fp32 or fp64): the trainer's logprob of
            each token, e.g. :func:`replay_plugin.megatron.replay_response_logprobs`'s
            ``[B, S - 1]`` (or ``[B, num_actions]``) output or
            :func:`replay_plugin.fsdp.response_logprobs`'s ``[B, A]`` (then pass the rollout's
            logprobs and the response mask of a ``[B, S]`` grid as ``x[:, 1:]`` / ``x[:, -A:]``).
            May require grad (the metrics are computed under ``torch.no_grad``).
        rollout_logprobs: ``[B, T]`` float: the engine's logprob of the same tokens, same grid.
        response_mask: ``[B, T]`` bool (or 0/1 integers), True at the scored tokens. Values
            elsewhere in the logprobs are never read (padding may hold 0, -inf or NaN).
        trainer_routes, rollout_routes: ``[B, T, L, K]`` integer expert ids (any integer dtype,
            e.g. the compact uint8 routes of :func:`replay_plugin.core.routes.pad_batch`), both
            or neither: the top-k experts each layer chose for the token whose output scored
            position ``t`` (in a ``[B, S - 1]`` next-token grid, the routes of token ``s``,
            i.e. ``routes[:, :-1]`` of a ``[B, S, L, K]`` batch).
        route_mask: ``[B, T]`` bool (or 0/1 integers), True where both sides have a real route
            (default: every scored token). Note the polarity: a router padding mask (True = no route) is its
            negation, ``~router_padding_mask[:, :-1]``.
        route_layers: ``L`` labels for the per-layer keys (default ``0 .. L-1``), e.g. the
            global layer indices of a pipeline stage's layers.
        is_threshold: ``(lo, hi)``, ``0 < lo <= hi``: the importance-ratio band of the
            fraction and effective-sample-size keys; or verl's forms ``hi`` (a number, or a
            string ``"hi"``: ``lo = 1 / hi``) and ``"lo_hi"``.
        prefix: prepended to every key (e.g. ``"actor/"``).

    Returns:
        ``{prefix + key: 0-d tensor}``: :data:`LOGPROB_KEYS`, then with routes :data:`ROUTE_KEY`
        and one :data:`ROUTE_LAYER_KEY` per layer; see the module docstring for each formula.

    Raises:
        ReplayTypeError: a non-tensor, non-float logprobs, a float mask, routes of a non-integer
            dtype, an ``is_threshold`` of bools or other objects.
        ReplayDataError: shapes that differ or are not ``[B, T]`` / ``[B, T, L, K]``, inputs
            on different devices, routes given on one side only (or ``route_mask`` /
            ``route_layers`` without routes), ``route_layers`` of the wrong length or with
            repeats, an integer mask value other than 0/1, a bad ``is_threshold``.
    """
    lo, hi = _check_threshold(is_threshold)
    _check_float(trainer_logprobs, "trainer_logprobs")
    shape = tuple(trainer_logprobs.shape)
    device = trainer_logprobs.device
    _check_float(rollout_logprobs, "rollout_logprobs", shape, device)
    response_mask = _check_mask(response_mask, "response_mask", shape, device)
    labels, route_mask = _check_routes(trainer_routes, rollout_routes, route_mask, route_layers, shape, device)
    if not isinstance(prefix, str):
        raise ReplayTypeError("prefix", f"{type(prefix).__name__}", expected="a str")
    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    with torch.no_grad():
        out = _logprob_metrics(trainer_logprobs.to(dtype), rollout_logprobs.to(dtype), response_mask, lo, hi)
        if trainer_routes is not None and rollout_routes is not None:
            valid = response_mask if route_mask is None else response_mask & route_mask
            out.update(_route_metrics(trainer_routes, rollout_routes, valid, labels, dtype))
    return {prefix + k: v for k, v in out.items()}


# --------------------------------------------------------------------------- math


def _logprob_metrics(t: torch.Tensor, q: torch.Tensor, m: torch.Tensor, lo: float, hi: float) -> dict:
    """Every formula of the module docstring but the routes; ``t``, ``q`` in the compute dtype.

    Values outside the mask are replaced before any arithmetic reads them (``where``, never a
    multiplication: ``0 * inf`` is NaN), so every per-token term below is 0 there. The terms
    are stacked and reduced together: one call costs a few dozen small kernels whatever the
    batch (each separate reduction would be another kernel launch, ~5 us on a CPU)."""
    dt = t.dtype
    nan = torch.full((), math.nan, dtype=dt, device=t.device)
    t = torch.where(m, t, 0.0)
    q = torch.where(m, q, 0.0)
    r = t - q
    rc = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = torch.where(m, torch.exp(rc), 0.0)
    c = w.clamp(max=hi)  # verl's truncated (TIS) weights
    pt, pq = torch.exp(t), torch.exp(q)  # 1 outside the mask on both sides
    d = (pt - pq).abs()
    terms = torch.stack(
        [
            m.to(dt),  # 0: N
            r,  # 1
            _k3(r),  # 2
            torch.expm1(2.0 * rc),  # 3: w**2 - 1
            w,  # 4
            c,  # 5
            c.square(),  # 6
            (w > hi).to(dt),  # 7 (w = 0 < hi outside the mask)
            (m & (w < lo)).to(dt),  # 8
            r.abs(),  # 9
            d,  # 10
            torch.where(m, pt, 0.0),  # 11
            torch.where(m, pq, 0.0),  # 12
        ]
    )
    rows = terms.sum(-1)  # [13, B]
    sums = rows.sum(-1)  # [13]
    n = sums[0]
    means = sums / n
    # sequences: every row of the block, as verl averages them (compute_offpolicy_metrics: a row
    # without a scored token has sum_t r = 0 and mean_t r = 0, so it adds 0 to each sum and 1 to
    # the count); mean_t r per row
    n_b, s_b = rows[0], rows[1]
    mean_b = s_b / n_b.clamp(min=1.0)
    seq = torch.stack([torch.expm1(2.0 * s_b.clamp(-SAFETY_BOUND, SAFETY_BOUND)), mean_b, mean_b.abs()]).sum(-1)
    seq_means = torch.where(n > 0, seq / max(n_b.numel(), 1), nan)
    # maxima of |r| and d (both >= 0 and 0 outside the mask)
    maxima = torch.where(n > 0, terms[9:11].amax((1, 2)), nan) if terms[0].numel() else nan.expand(2)
    # second moments about the means
    mt, mq, md = means[11], means[12], means[10]
    second = torch.stack(
        [
            torch.where(m, (pt - mt) * (pq - mq), 0.0),
            torch.where(m, (pt - mt).square(), 0.0),
            torch.where(m, (pq - mq).square(), 0.0),
            torch.where(m, (d - md).square(), 0.0),
        ]
    ).sum((1, 2))
    out = {
        "rollout_corr/kl": -means[1],
        "rollout_corr/k3_kl": means[2],
        "rollout_corr/chi2_token": means[3],
        "rollout_corr/chi2_seq": seq_means[0],
        "rollout_corr/rollout_is_mean": means[5],
        "rollout_corr/rollout_is_eff_sample_size": sums[5].square() / (n * sums[6]),
        "rollout_corr/rollout_is_ratio_fraction_high": means[7],
        "rollout_corr/rollout_is_ratio_fraction_low": means[8],
        "rollout_corr/log_ppl_diff": -seq_means[1],
        "rollout_corr/log_ppl_abs_diff": seq_means[2],
        "rollout_corr/ratio_mean": means[4],
        "rollout_corr/log_ratio_abs_mean": means[9],
        "rollout_corr/log_ratio_abs_max": maxima[0],
        "training/rollout_probs_diff_mean": means[10],
        "training/rollout_probs_diff_max": maxima[1],
        "training/rollout_probs_diff_std": torch.where(n > 1, (second[3] / (n - 1)).sqrt(), nan),
        "training/rollout_actor_probs_pearson_corr": (second[0] / (second[1] * second[2]).sqrt()).clamp(-1.0, 1.0),
    }
    # A NaN logprob on a scored token (either side) makes sum r NaN: every key shows it. Without
    # this the comparisons behind the fractions read NaN as False and stayed finite.
    poisoned = torch.isnan(sums[1])
    return {k: torch.where(poisoned, nan, v) for k, v in out.items()}


def _k3(r: torch.Tensor) -> torch.Tensor:
    """``exp(r) - 1 - r`` to the dtype's precision: its Taylor series to ``r**5`` below
    ``|r| = (360 eps)**(1/4)`` (0.081 in float32, 5e-4 in float64: there the first omitted term,
    ``r**4 / 360`` of the value, is one ``eps``), ``expm1(r) - r`` above (at most a few bits
    lost to the subtraction). ``exp(r) - 1 - r`` in float32 is rounding error below
    ``|r| ~ 1e-3``, and a float32 trainer with both replays sits at ~1e-6."""
    series = r.square() * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0))))
    cut = (360.0 * torch.finfo(r.dtype).eps) ** 0.25
    return torch.where(r.abs() < cut, series, torch.expm1(r) - r)


@functools.cache
def _sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparator pairs of Batcher's odd-even merge sort for ``n`` inputs (any ``n``; 19
    comparators for 8). Sorting K columns with elementwise min/max runs on whole
    ``[B, T, L]`` planes: ``torch.sort`` over a last dimension of 8 costs several times more on
    CPU (measured here, torch 2.13: ~4x for ``[4096, 48, 8]``)."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _sorted_planes(routes: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """``[*tokens, L, K]`` -> K contiguous ``[*tokens, L]`` planes, sorted ascending across planes."""
    planes = list(routes.movedim(-1, 0).to(dtype=dtype, memory_format=torch.contiguous_format).unbind(0))
    for i, j in _sorting_network(len(planes)):
        planes[i], planes[j] = torch.minimum(planes[i], planes[j]), torch.maximum(planes[i], planes[j])
    return planes


def same_expert_sets(trainer_routes: torch.Tensor, rollout_routes: torch.Tensor) -> torch.Tensor:
    """``[*tokens, L]`` bool: whether the two ``[*tokens, L, K]`` integer routes (any integer
    dtypes, the same shape, ``K >= 1``; not checked here) hold the same expert set in layer ``l``
    (order-free): the comparison behind :data:`ROUTE_KEY`. No host synchronisation."""
    # Compared in the narrowest of int16 / int32 that holds both dtypes (uint8, int8, int16 ->
    # int16; wider -> int32: expert ids are < 2**31, the core routes contract stops at int32):
    # the sorting network's min/max passes are memory-bound, int16 halves them against int32.
    trainer, rollout = trainer_routes, rollout_routes
    wide = max(trainer.dtype.itemsize, rollout.dtype.itemsize) > 2 or torch.uint16 in (trainer.dtype, rollout.dtype)
    common = torch.int32 if wide else torch.int16
    match: torch.Tensor | None = None  # [*tokens, L]: same expert set in layer l
    for a, b in zip(_sorted_planes(trainer, common), _sorted_planes(rollout, common)):
        match = a == b if match is None else match.logical_and_(a == b)
    assert match is not None  # K >= 1
    return match


def _route_metrics(
    trainer: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor, labels: list[str], dtype: torch.dtype
) -> dict:
    match = same_expert_sets(trainer, rollout)
    v = valid.to(dtype)
    n = v.sum()
    out = {ROUTE_KEY: (match.all(-1).to(dtype) * v).sum() / n}
    per_layer = (match.to(dtype) * v.unsqueeze(-1)).sum((0, 1)) / n  # [L]
    for i, label in enumerate(labels):
        out[ROUTE_LAYER_KEY.format(label)] = per_layer[i]
    return out


# --------------------------------------------------------------------------- input checks


def _check_threshold(is_threshold: Any) -> tuple[float, float]:
    """``(lo, hi)`` from a pair of numbers, one number ``hi`` (``lo = 1 / hi``, verl's token-level
    TIS), or verl's ``rollout_is_threshold`` strings ``"hi"`` and ``"lo_hi"`` (e.g. ``"0.5_2.0"``).
    Bools, other strings and other objects are refused (a string is not iterated: ``"12"`` is
    not ``(1, 2)``)."""

    def number(x: Any) -> float:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise ReplayTypeError(
                "is_threshold",
                f"{is_threshold!r} holds {type(x).__name__} {x!r}",
                expected="(lo, hi) numbers, one number hi, or verl's string 'hi' / 'lo_hi' (e.g. '0.5_2.0')",
            )
        return float(x)

    if isinstance(is_threshold, str):
        lo_text, sep, hi_text = is_threshold.strip().partition("_")
        try:
            lo, hi = (float(lo_text), float(hi_text)) if sep else (math.nan, float(lo_text))
        except ValueError:
            raise ReplayDataError(
                "is_threshold", f"{is_threshold!r}", expected="verl's string form 'hi' or 'lo_hi', e.g. '0.5_2.0'"
            ) from None
        if not sep:
            lo = 1.0 / hi if hi > 0 else math.nan
    elif isinstance(is_threshold, (tuple, list)) and len(is_threshold) == 2:
        lo, hi = (number(x) for x in is_threshold)
    elif isinstance(is_threshold, (tuple, list)):
        raise ReplayDataError("is_threshold", f"{is_threshold!r}", expected="a pair (lo, hi)")
    else:
        hi = number(is_threshold)
        lo = 1.0 / hi if hi > 0 else math.nan
    if not (0.0 < lo <= hi < math.inf):
        raise ReplayDataError("is_threshold", f"{is_threshold!r}", expected="0 < lo <= hi, finite")
    return lo, hi


def _check_tensor(x: Any, field: str, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ReplayTypeError(field, f"a {type(x).__name__}", expected=f"a torch tensor {expected}")


def _check_place(x: torch.Tensor, field: str, shape: tuple, device: torch.device) -> None:
    if tuple(x.shape[: len(shape)]) != shape:
        raise ReplayDataError(
            field, f"shape {tuple(x.shape)}", expected=f"the trainer_logprobs grid {list(shape)} as its leading dims"
        )
    if x.device != device:
        raise ReplayDataError(field, f"on {x.device}", expected=f"trainer_logprobs' device {device}")


def _check_float(x: Any, field: str, shape: tuple | None = None, device: torch.device | None = None) -> None:
    _check_tensor(x, field, "[B, T]")
    if not x.dtype.is_floating_point:
        raise ReplayTypeError(field, f"dtype {x.dtype}", expected="a floating-point dtype (logprobs)")
    if x.dim() != 2:
        raise ReplayDataError(
            field,
            f"shape {tuple(x.shape)}",
            expected="[B, T] (one row per sequence; a 1-D tensor of one sequence: x[None])",
        )
    if shape is not None and device is not None:
        if tuple(x.shape) != shape:
            raise ReplayDataError(field, f"shape {tuple(x.shape)}", expected=f"trainer_logprobs' shape {list(shape)}")
        _check_place(x, field, shape, device)


def _check_mask(x: Any, field: str, shape: tuple, device: torch.device) -> torch.Tensor:
    """The mask as bool (``core.inputs`` rule: bool, or integers 0/1; an integer mask costs one
    host sync for that check)."""
    _check_tensor(x, field, "[B, T] bool")
    if tuple(x.shape) != shape:
        raise ReplayDataError(field, f"shape {tuple(x.shape)}", expected=f"trainer_logprobs' shape {list(shape)}")
    _check_place(x, field, shape, device)
    return as_mask(x, field)


def _check_routes(
    trainer: Any, rollout: Any, mask: Any, layers: Sequence[Any] | None, shape: tuple, device: torch.device
) -> tuple[list[str], torch.Tensor | None]:
    """Route labels and the route mask as bool (None stays None)."""
    if trainer is None and rollout is None:
        for field, value in (("route_mask", mask), ("route_layers", layers)):
            if value is not None:
                raise ReplayDataError(field, "given without routes", expected="trainer_routes and rollout_routes too")
        return [], None
    for field, value, other in (
        ("trainer_routes", trainer, "rollout_routes"),
        ("rollout_routes", rollout, "trainer_routes"),
    ):
        if value is None:
            raise ReplayDataError(field, "missing", expected=f"both routes or neither ({other} was given)")
        _check_tensor(value, field, "[B, T, L, K]")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ReplayTypeError(field, f"dtype {value.dtype}", expected="an integer dtype (expert ids)")
        if value.dim() != 4 or value.shape[2] < 1 or value.shape[3] < 1:
            raise ReplayDataError(field, f"shape {tuple(value.shape)}", expected="[B, T, L, K] with L, K >= 1")
        _check_place(value, field, shape, device)
    if trainer.shape != rollout.shape:
        raise ReplayDataError(
            "trainer_routes",
            f"shape {tuple(trainer.shape)}",
            expected=f"rollout_routes' shape {tuple(rollout.shape)} (the same layers and top-k)",
        )
    if mask is not None:
        mask = _check_mask(mask, "route_mask", shape, device)
    num_layers = trainer.shape[2]
    labels = [str(i) for i in range(num_layers)] if layers is None else [str(x) for x in layers]
    if len(labels) != num_layers or len(set(labels)) != num_layers:
        raise ReplayDataError(
            "route_layers", f"{list(layers or [])!r}", expected=f"{num_layers} distinct labels, one per route layer"
        )
    return labels, mask
