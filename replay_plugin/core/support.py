"""Sampler-support rows: capture from vLLM outputs and the dense trainer batch.

A *support row* lists, for one generated token, the ids the engine's sampler could have drawn
(after temperature, top-k/top-p/min-p and any masks); the trainer renormalises the sampled
token's logprob over exactly that set (``replay_plugin.core.logprobs``). Rows are int32
``[T, W]``, most probable first where known, ``-1`` only as trailing padding, no duplicates.
``support_from_flat_logprobs`` and ``support_from_sampling_mask`` read vLLM's outputs (duck-typed,
no vLLM import); ``dense_support_batch`` builds the validated ``[B, S, W]`` trainer tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError

logger = logging.getLogger(__name__)

#: Padding id in support rows.
PAD = -1
#: Largest token id an int32 row can hold.
INT32_MAX = int(np.iinfo(np.int32).max)
#: A row whose finite processed probabilities sum to at least ``1 - DEFAULT_MASS_TOLERANCE`` is
#: taken to be the whole support. vLLM computes processed logprobs as a float32 ``log_softmax``;
#: its rounding moves the sum of the kept probabilities off 1 by about ``2**-24 * |logsumexp|``
#: (1e-6 for logits of size ~10, 1e-5 for ~100). Any mass the row might still miss below this
#: bound changes the renormalised logprob by less than ``-log(1 - 1e-4) ~= 1e-4`` nats, far below
#: the bf16 train-inference noise this replay removes (~1e-2), so such rows are exact for
#: every practical purpose.
DEFAULT_MASS_TOLERANCE = 1e-4
#: Processed logprobs at or below this are probabilities that are exactly zero even in float64
#: (``exp(-746) == 0``): the sampler cannot draw such a token, so it is not part of the support.
#: vLLM forces a token by giving it a huge logit (the thinking budget sets the end-of-thinking
#: token's logit to 1e9, vLLM 0.30-0.32 ``thinking_budget_state.py``); the other top-k tokens then
#: keep finite processed logprobs near ``-1e9 / T``. Without this floor such a row lists them and
#: the trainer gives the forced token its natural share; with it the row is the forced token
#: alone (trainer and rollout logprob both 0). A natural row never loses mass to the floor.
UNREACHABLE_LOGPROB = -1000.0

InexactPolicy = Literal["repair", "mask", "error"]
_POLICIES = ("repair", "mask", "error")


@dataclasses.dataclass
class SupportRows:
    """Support rows of one sequence of generated tokens.

    Attributes:
        ids: int32 ``[T, W]`` token ids, ``-1`` only as trailing padding. Rows from logprobs are
            ordered by descending probability; rows from a sampling mask put the sampled token
            first (see ``support_from_sampling_mask``).
        sampled: int32 ``[T]``, the token the engine sampled at each position (``-1`` for rows
            without a capture, e.g. observation tokens or a synthetic EOS).
        sampled_logprob: float32 ``[T]``, the engine's processed logprob of the sampled token
            (the rollout logprob of the importance ratio); NaN where the source did not carry it.
        exact: bool ``[T]``, True when the row provably is the sampler's whole support and
            contains the sampled token.

    Construction validates dtypes, shapes, the id range, trailing-only padding and that exact
    rows contain their sampled token (``ReplayDataError`` / ``ReplayTypeError`` naming the
    field and token). Duplicates are checked by ``dense_support_batch``.
    """

    ids: np.ndarray
    sampled: np.ndarray
    sampled_logprob: np.ndarray
    exact: np.ndarray

    def __post_init__(self) -> None:
        self.ids = _int32_array(self.ids, "ids", ndim=2)
        t = self.ids.shape[0]
        self.sampled = _int32_array(self.sampled, "sampled", ndim=1)
        logprob = np.asarray(self.sampled_logprob)
        if logprob.ndim != 1 or not (logprob.dtype.kind == "f" or logprob.size == 0):
            raise ReplayTypeError(
                "sampled_logprob",
                f"got dtype {logprob.dtype} with shape {logprob.shape}",
                expected="a 1-D float array",
            )
        self.sampled_logprob = logprob.astype(np.float32, copy=False)
        exact = np.asarray(self.exact)
        if exact.ndim != 1 or not (exact.dtype == np.bool_ or exact.size == 0):
            raise ReplayTypeError(
                "exact", f"got dtype {exact.dtype} with shape {exact.shape}", expected="a 1-D bool array"
            )
        self.exact = exact.astype(np.bool_, copy=False)
        for name in ("sampled", "sampled_logprob", "exact"):
            n = getattr(self, name).shape[0]
            if n != t:
                raise ReplayDataError(name, f"has {n} entries for {t} support rows", expected=f"{t}")
        if t == 0:
            return
        below = self.ids < PAD
        if below.any():
            tok = int(np.argmax(below.any(axis=1)))
            raise ReplayDataError("ids", f"holds id {int(self.ids[tok].min())}", token=tok, expected="ids >= -1")
        _check_trailing_padding(self.ids, "ids", None)
        contains = (self.ids == self.sampled[:, None]).any(axis=1)
        bad = self.exact & ~contains
        if bad.any():
            tok = int(np.argmax(bad))
            raise ReplayDataError(
                "exact",
                f"row flagged exact does not contain its sampled token {int(self.sampled[tok])}",
                token=tok,
                expected="exact rows to contain the sampled token",
            )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def width(self) -> int:
        """Row width ``W``."""
        return int(self.ids.shape[1])

    @classmethod
    def empty(cls, count: int, width: int) -> SupportRows:
        """``count`` rows without support (observation tokens, a synthetic EOS)."""
        return cls(
            ids=np.full((count, width), PAD, dtype=np.int32),
            sampled=np.full(count, PAD, dtype=np.int32),
            sampled_logprob=np.full(count, np.nan, dtype=np.float32),
            exact=np.zeros(count, dtype=np.bool_),
        )

    @classmethod
    def concat(cls, parts: Sequence[SupportRows]) -> SupportRows:
        """Rows of several turns, in order; all parts must share one width."""
        if not parts:
            raise ReplayDataError("ids", "no parts to concatenate", expected="at least one SupportRows")
        widths = {p.width for p in parts}
        if len(widths) != 1:
            raise ReplayDataError("ids", f"parts have widths {sorted(widths)}", expected="one width")
        return cls(
            ids=np.concatenate([p.ids for p in parts]),
            sampled=np.concatenate([p.sampled for p in parts]),
            sampled_logprob=np.concatenate([p.sampled_logprob for p in parts]),
            exact=np.concatenate([p.exact for p in parts]),
        )


def support_from_flat_logprobs(
    flat: Any,
    width: int,
    *,
    mass_tolerance: float = DEFAULT_MASS_TOLERANCE,
    min_logprob: float = UNREACHABLE_LOGPROB,
) -> SupportRows:
    """Support rows from vLLM ``FlatLogprobs`` produced with processed logprobs and ``logprobs=N``.

    Args:
        flat: an object with attributes ``start_indices``, ``end_indices``, ``token_ids`` and
            ``logprobs`` (vLLM's ``FlatLogprobs``), or a mapping with those keys; each a list or
            a numpy array. Position ``i`` is ``[start_indices[i], end_indices[i])`` of the flat
            arrays: entry 0 is the sampled token and its processed logprob, entries ``1..N`` the
            top-N in descending order with ``-inf`` for masked tokens.
        width: output row width ``W`` (>= 1). Usually the request's ``top_k`` (= ``N``).
        mass_tolerance: see ``DEFAULT_MASS_TOLERANCE``.
        min_logprob: entries at or below it cannot be drawn and are not members (see
            ``UNREACHABLE_LOGPROB``; ``-inf`` keeps every finite entry).

    Returns:
        ``SupportRows`` with ``T = len(start_indices)`` rows. A row holds the entries among
        ``1..N`` above ``min_logprob``, in the engine's order (descending processed logprob), at
        most ``W`` of them. The sampled token is not added when it is missing (the row is
        recorded as seen). ``exact`` is True when (some of the N entries are ``-inf`` or at most
        ``min_logprob``, or the members carry
        probability mass ``>= 1 - mass_tolerance``) and the row contains the sampled token and
        fits in ``W`` and no entry is NaN/+inf and the sampled logprob is finite. A row with more
        finite entries than ``W`` keeps its ``W`` most probable members and is inexact: the
        trainer cannot renormalise over ids it never saw. Never raises on inexact rows.

    Raises:
        ReplayTypeError: a field is missing or not numeric.
        ReplayDataError: inconsistent indices (a position without entries, indices outside the
            flat arrays, ``token_ids`` and ``logprobs`` of different lengths) or negative ids.

    Vectorised path: everything after the conversion to numpy is array code with no Python loop
    over tokens, for both uniform rows (vLLM's layout: every position ``N + 1`` wide and
    contiguous, read by a reshape) and ragged rows (an index matrix). Numpy inputs (e.g. the
    engine's arrays before they become lists) skip the conversion; Python lists (vLLM's
    ``FlatLogprobs`` fields) are converted with ``np.fromiter`` to int32/float32 first, which is
    about two thirds of the cost at ``N = 20``.
    """
    w = _check_width(width)
    start, end, tokens, logprobs = _read_flat_logprobs(flat)
    if start.shape[0] == 0:
        return _empty_rows(w)
    ids2, lp2, absent = _position_matrix(start, end, tokens, logprobs)
    _check_flat_ids(ids2)
    cand, cand_lp, absent = _descending(ids2[:, 1:], lp2[:, 1:], absent)
    sampled, sampled_lp = ids2[:, 0], lp2[:, 0]
    ids, exact = _rows_from_candidates(cand, cand_lp, absent, sampled, sampled_lp, w, mass_tolerance, min_logprob)
    return _rows_unchecked(ids, sampled.astype(np.int32), sampled_lp.astype(np.float32), exact)


def _read_flat_logprobs(flat: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four ``FlatLogprobs`` fields as arrays, checked for consistency.

    Returns ``start`` and ``end`` (int64 ``[T]``), ``tokens`` (integer ``[E]``) and
    ``logprobs`` (float ``[E]``), ``E`` the number of flat entries; every position
    ``[start[i], end[i])`` lies inside the flat arrays and holds at least the sampled token.
    """
    start = _index_array(_get(flat, "start_indices"), "start_indices")
    end = _index_array(_get(flat, "end_indices"), "end_indices")
    tokens = _flat_ids(_get(flat, "token_ids"))
    logprobs = _flat_logprobs(_get(flat, "logprobs"))
    t = start.shape[0]
    if end.shape[0] != t:
        raise ReplayDataError("end_indices", f"has {end.shape[0]} entries for {t} start indices", expected=f"{t}")
    if logprobs.shape[0] != tokens.shape[0]:
        raise ReplayDataError(
            "logprobs",
            f"has {logprobs.shape[0]} entries for {tokens.shape[0]} token ids",
            expected="one logprob per token id",
        )
    lens = end - start
    short = lens < 1
    if short.any():
        tok = int(np.argmax(short))
        raise ReplayDataError(
            "end_indices",
            f"position has {int(lens[tok])} entries",
            token=tok,
            expected="at least the sampled token",
        )
    outside = (start < 0) | (end > tokens.shape[0])
    if outside.any():
        tok = int(np.argmax(outside))
        raise ReplayDataError(
            "start_indices",
            f"entries [{int(start[tok])}, {int(end[tok])}) lie outside the {tokens.shape[0]} flat entries",
            token=tok,
            expected="indices inside the flat arrays",
        )
    return start, end, tokens, logprobs


def _position_matrix(
    start: np.ndarray, end: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The flat entries as one row per position (``T >= 1`` positions).

    Returns ids ``[T, C]`` and logprobs ``[T, C]`` (``C`` = the widest position; column 0 the
    sampled token) and ``absent``, bool ``[T, C - 1]``: candidate slots past a shorter
    position's end, which read as ``-inf``. ``absent`` is None when every position is ``C``
    wide and they follow each other (vLLM's layout, read by a reshape without copying).
    """
    t = start.shape[0]
    lens = end - start
    row_len = int(lens[0])
    uniform = bool((lens == row_len).all()) and bool((start == start[0] + row_len * np.arange(t, dtype=np.int64)).all())
    if uniform:
        lo = int(start[0])
        ids2 = tokens[lo : lo + t * row_len].reshape(t, row_len)
        lp2 = logprobs[lo : lo + t * row_len].reshape(t, row_len)
        return ids2, lp2, None
    row_len = int(lens.max())
    cols = np.arange(row_len, dtype=np.int64)
    present = cols[None, :] < lens[:, None]
    index = np.where(present, start[:, None] + cols[None, :], 0)
    ids2 = tokens[index]
    # Absent entries read as -inf so ordering and mass ignore them; they prove nothing.
    lp2 = np.where(present, logprobs[index], -np.inf)
    return ids2, lp2, ~present[:, 1:]


def _check_flat_ids(ids2: np.ndarray) -> None:
    """Every id of the ``[T, C]`` position matrix in ``[0, INT32_MAX]``."""
    if ids2.size and (ids2.min() < 0 or ids2.max() > INT32_MAX):
        tok = int(np.argmax(((ids2 < 0) | (ids2 > INT32_MAX)).any(axis=1)))
        raise ReplayDataError(
            "token_ids",
            f"position holds ids {ids2[tok].tolist()}",
            token=tok,
            expected=f"ids in [0, {INT32_MAX}]",
        )


def _descending(
    cand: np.ndarray, cand_lp: np.ndarray, absent: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Candidates ``[T, N]`` (ids, logprobs, ``absent`` flags) ordered finite first, by
    descending logprob, ``-inf`` and NaN last; ties keep the engine's order."""
    # vLLM's entries are torch.topk output: finite ones first, descending, -inf last. One
    # comparison checks that (NaN fails it too); reorder only when a source breaks it (stable,
    # so ties keep the engine's order).
    # +inf passes that check at the front, where it would leave a PAD before the members (it is
    # not a member): such rows are reordered too.
    n = cand.shape[1]
    if n > 1 and not (bool((cand_lp[:, 1:] <= cand_lp[:, :-1]).all()) and not np.isposinf(cand_lp[:, 0]).any()):
        key = np.where(np.isfinite(cand_lp), -cand_lp, np.inf)
        order = np.argsort(key, axis=1, kind="stable")
        cand = np.take_along_axis(cand, order, axis=1)
        cand_lp = np.take_along_axis(cand_lp, order, axis=1)
        if absent is not None:
            absent = np.take_along_axis(absent, order, axis=1)
    return cand, cand_lp, absent


def _rows_from_candidates(
    cand: np.ndarray,
    cand_lp: np.ndarray,
    absent: np.ndarray | None,
    sampled: np.ndarray,
    sampled_lp: np.ndarray,
    w: int,
    mass_tolerance: float,
    min_logprob: float = UNREACHABLE_LOGPROB,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows int32 ``[T, W]`` (the candidates above ``min_logprob``, at most ``W``) and ``exact``
    bool ``[T]`` from descending candidates ``[T, N]`` and the sampled ids / logprobs ``[T]``."""
    t, n = cand.shape
    if absent is None and t and n:
        fast = _rows_from_ordinary_candidates(cand, cand_lp, sampled, sampled_lp, w, mass_tolerance, min_logprob)
        if fast is not None:
            return fast
    finite = np.isfinite(cand_lp)
    member = finite & (cand_lp > min_logprob)
    # An entry that cannot be drawn (-inf, or finite at or below the floor) proves that every
    # token ranked after it cannot be drawn either: the members before it are the whole support.
    unreachable = (cand_lp == -np.inf) | (finite & ~member)
    if absent is not None:
        unreachable &= ~absent
    # Anything that is neither finite nor -inf (NaN, +inf) is not a processed logprob.
    garbage = ~(finite | (cand_lp == -np.inf)).all(axis=1)

    count = np.count_nonzero(member, axis=1)
    ids = np.full((t, w), PAD, dtype=np.int32)
    k = min(n, w)
    ids[:, :k] = np.where(member[:, :k], cand[:, :k], PAD)
    contains = (ids == sampled[:, None]).any(axis=1)
    closed = unreachable.any(axis=1)
    mass = np.exp(np.where(member, cand_lp, -np.inf)).sum(axis=1, dtype=np.float64)
    exact = (closed | (mass >= 1.0 - mass_tolerance)) & contains & (count <= w) & ~garbage & np.isfinite(sampled_lp)
    return ids, exact


def _rows_from_ordinary_candidates(
    cand: np.ndarray,
    cand_lp: np.ndarray,
    sampled: np.ndarray,
    sampled_lp: np.ndarray,
    w: int,
    mass_tolerance: float,
    min_logprob: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_rows_from_candidates` for candidates with no absent slot and no NaN or +inf
    (every row an engine produces), with the same result in a fifth of the time at 4,096 rows:
    None for any other input. Numpy reduces short rows slowly (a ``[T, 36]`` ``any(axis=1)``
    costs ~10x an elementwise pass), so it uses that members are a prefix of descending
    candidates: a row's member count is the first non-member (``argmin``), ``closed`` is a
    count below ``N``, and the mass is summed only for the rows that are not closed."""
    if not cand_lp.max() < np.inf:  # NaN propagates through max: either one takes the general path
        return None
    t, n = cand.shape
    member = cand_lp > min_logprob  # -inf and finite entries only: the floor is the whole test
    count = np.where(member[:, -1], n, np.argmin(member, axis=1))
    k = min(n, w)
    ids = np.full((t, w), PAD, dtype=np.int32)
    ids[:, :k] = cand[:, :k]
    np.copyto(ids[:, :k], PAD, where=~member[:, :k])
    equal = cand[:, :k] == sampled[:, None]
    first = np.argmax(equal, axis=1)
    contains = equal[np.arange(t), first] & (first < count)
    closed = count < n
    exact = contains & (count <= w) & np.isfinite(sampled_lp)
    open_rows = np.flatnonzero(~closed & exact)
    if open_rows.size:  # every candidate of such a row is a member
        mass = np.exp(cand_lp[open_rows]).sum(axis=1, dtype=np.float64)
        exact[open_rows] = mass >= 1.0 - mass_tolerance
    return ids, exact


def support_from_sampling_mask(
    mask: Any,
    sampled_ids: Any,
    width: int,
    *,
    sampled_logprobs: Any = None,
) -> SupportRows:
    """Support rows from vLLM's native ``SamplingMask`` (vLLM >= 0.28, model runner V2).

    Args:
        mask: an object or mapping with ``token_ids``: either a list of per-position id lists
            (``vllm.outputs.SamplingMask``) or a flat id array plus CSR ``offsets``
            (``[T + 1]``, ``vllm.v1.outputs.SamplingMaskLists``; ``offsets=None`` with a flat
            array means a single position). A plain list of lists is accepted too.
        sampled_ids: ``[T]`` the generated token ids (``CompletionOutput.token_ids``).
        width: output row width ``W`` (>= 1).
        sampled_logprobs: optional ``[T]`` processed logprobs of the sampled tokens (e.g. entry 0
            of the flat logprobs when ``logprobs=0`` was requested). Without it
            ``sampled_logprob`` is NaN: a mask carries no probabilities.

    Ordering rule: a mask lists survivors by token id, not by probability, so the sampled token
    is put first and the other members follow in the mask's order (ascending id for vLLM). The
    support logprob does not depend on the order; only truncation does, and keeping the sampled
    token first means a truncated row still contains it.

    ``exact`` is True when the mask contains the sampled token and its members fit in ``W``.
    A wider mask (ties, a large ``top_k`` or ``top_p``) keeps the sampled token and the first
    ``W - 1`` others and is flagged inexact. Repeats of the sampled id are dropped; other
    duplicates are left for ``dense_support_batch`` to reject.

    Vectorised path: CSR input (flat array + offsets) is handled by array code with no Python
    loop over tokens; a list of lists is first flattened with ``np.fromiter`` over
    ``itertools.chain`` (C-level iteration, no per-token Python statement).
    """
    w = _check_width(width)
    flat, offs = _mask_csr(mask)
    t = offs.shape[0] - 1
    sampled, logprob = _mask_sampled(sampled_ids, sampled_logprobs, t)
    if t == 0:
        return _empty_rows(w)
    if flat.size and (flat.min() < 0 or flat.max() > INT32_MAX):
        tok = int(np.searchsorted(offs, int(np.argmax((flat < 0) | (flat > INT32_MAX))), side="right") - 1)
        raise ReplayDataError("token_ids", "mask holds an id outside int32", token=tok, expected="ids >= 0")
    ids, exact = _sampled_first_rows(flat, offs, sampled, w)
    return _rows_unchecked(ids, sampled.astype(np.int32), logprob, exact)


def _mask_csr(mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """A mask in any accepted form as CSR: flat ids ``[E]`` and int64 offsets ``[T + 1]``
    partitioning them."""
    token_ids = _get(mask, "token_ids") if not _is_sequence_of_rows(mask) else mask
    offsets = _get_optional(mask, "offsets")
    if offsets is not None:
        flat = _flat_ids(token_ids)
        offs = _index_array(offsets, "offsets")
    elif isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
        flat = _flat_ids(token_ids)
        offs = np.array([0, flat.shape[0]], dtype=np.int64)
    else:
        flat, offs = _flatten_lists(token_ids)
    t = offs.shape[0] - 1
    if t < 0 or (t > 0 and (offs[0] != 0 or offs[-1] != flat.shape[0] or (np.diff(offs) < 0).any())):
        raise ReplayDataError(
            "offsets",
            f"offsets {offs[:8].tolist()}... do not partition {flat.shape[0]} ids",
            expected="non-decreasing offsets from 0 to the number of ids",
        )
    return flat, offs


def _mask_sampled(sampled_ids: Any, sampled_logprobs: Any, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The sampled ids (int64 ``[T]``) and their logprobs (float32 ``[T]``, NaN when not given)."""
    sampled = np.asarray(sampled_ids)
    if sampled.ndim != 1 or sampled.shape[0] != t or (sampled.size and sampled.dtype.kind not in "iu"):
        raise ReplayDataError(
            "sampled_ids", f"got shape {sampled.shape} dtype {sampled.dtype}", expected=f"{t} integer ids"
        )
    sampled = sampled.astype(np.int64, copy=False)
    if sampled_logprobs is None:
        return sampled, np.full(t, np.nan, dtype=np.float32)
    logprob = np.asarray(sampled_logprobs, dtype=np.float32)
    if logprob.shape != (t,):
        raise ReplayDataError("sampled_logprobs", f"got shape {logprob.shape}", expected=f"shape ({t},)")
    return sampled, logprob


def _sampled_first_rows(
    flat: np.ndarray, offs: np.ndarray, sampled: np.ndarray, w: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows int32 ``[T, W]`` (the sampled token first when the mask holds it, then the other
    members in mask order, cut at ``W``) and ``exact`` bool ``[T]``, from CSR ``flat`` /
    ``offs`` and the sampled ids ``[T]``."""
    t = offs.shape[0] - 1
    lens = np.diff(offs)
    row = np.repeat(np.arange(t, dtype=np.int64), lens)
    is_sampled = flat == sampled[row]
    n_sampled = np.bincount(row[is_sampled], minlength=t)
    has_sampled = n_sampled > 0
    others = ~is_sampled
    before = np.concatenate(([0], np.cumsum(others, dtype=np.int64)))
    rank = before[:-1] - before[offs[:-1]][row]
    col = rank + has_sampled[row]
    keep = others & (col < w)
    ids = np.full((t, w), PAD, dtype=np.int32)
    ids[row[keep], col[keep]] = flat[keep]
    ids[has_sampled, 0] = sampled[has_sampled]
    members = lens - n_sampled + has_sampled
    exact = has_sampled & (members <= w)
    return ids, exact


@dataclasses.dataclass(frozen=True)
class DenseSupport:
    """Result of ``dense_support_batch``.

    Attributes:
        ids: int32 ``[B, S, W]``; each response right-aligned, ``-1`` elsewhere.
        loss_mask: bool ``[B, S]``; the caller's loss masks right-aligned, minus the rows the
            ``"mask"`` policy dropped. Use it as the loss mask of the replayed batch.
        num_inexact: loss-bearing rows that were not exact (the ones the policy acted on).
        num_synthetic_eos: loss-bearing rows without support (scored over the full vocabulary).
        policy: the ``on_inexact`` policy that was applied.
    """

    ids: np.ndarray
    loss_mask: np.ndarray
    num_inexact: int
    num_synthetic_eos: int
    policy: str


def dense_support_batch(
    rows: Sequence[SupportRows | np.ndarray | Sequence[Sequence[int]]],
    response_ids: Sequence[Any],
    loss_masks: Sequence[Any],
    seq_len: int,
    eos_token_id: int | Iterable[int] | None,
    *,
    on_inexact: InexactPolicy = "repair",
    vocab_size: int | None = None,
) -> DenseSupport:
    """Dense ``[B, S, W]`` support batch, validated, with the ``on_inexact`` policy applied.

    Args:
        rows: per trajectory, its ``SupportRows`` or a plain ``[T_b, W]`` integer array (a plain
            array carries no exactness flag: a row counts as exact iff it contains its response
            token).
        response_ids: per trajectory, its ``T_b`` response token ids.
        loss_masks: per trajectory, ``T_b`` loss-mask values (nonzero = loss-bearing).
        seq_len: ``S``; responses are right-aligned in it (the trainer's ``[batch, seq]`` layout).
        eos_token_id: the EOS id, or several, or None (then no row may lack support).
        on_inexact: what happens to loss-bearing rows that are not exact:
            ``"repair"`` (default): a row missing its sampled token gets it in place of its
            last (weakest) valid member, a row that contains it is kept as recorded.
            ``"mask"``: the row leaves the loss (``loss_mask`` False there; its ids are kept).
            ``"error"``: ``ReplayDataError`` naming the trajectory and token.
            Default ``"repair"`` because most inexact rows already contain the sampled token
            (ties at the k-th logit: the recorded members are the most probable ones and each
            missing member carries at most the k-th probability), so repair leaves them unchanged
            and the error is the small missing mass; it keeps every token in the loss.
            ``"mask"`` drops exactly the tokens drawn where the distribution
            is flat (a selection bias in the gradient); ``"error"`` stops a run for an engine
            artifact that occurs on several percent of bf16 tokens. The count is returned and
            logged at WARNING either way.
        vocab_size: when given, ids must lie in ``[-1, vocab_size)`` and response ids in
            ``[0, vocab_size)``.

    Validation (``ReplayDataError`` naming field, trajectory, token index): one row per response
    token; one width; ``T_b <= S``; id range; ``-1`` only as trailing padding; no duplicate ids;
    ``SupportRows.sampled`` equal to the response token on every supported row; exact rows
    contain it; at most one loss-bearing row without support per trajectory, and its token is
    EOS (a synthetic EOS appended after the engine returned). Inputs are never modified.
    """
    if on_inexact not in _POLICIES:
        raise ValueError(f"on_inexact must be one of {_POLICIES}, got {on_inexact!r}")
    b = len(rows)
    if len(response_ids) != b or len(loss_masks) != b:
        raise ReplayDataError(
            "rows",
            f"{b} support entries, {len(response_ids)} responses, {len(loss_masks)} loss masks",
            expected="one of each per trajectory",
        )
    s = int(seq_len)
    eos = _eos_set(eos_token_id)
    id_limit = INT32_MAX if vocab_size is None else int(vocab_size) - 1
    prepared, w = _rows_of_one_width(rows)
    out = np.full((b, s, w), PAD, dtype=np.int32)
    loss_out = np.zeros((b, s), dtype=np.bool_)
    n_inexact = 0
    n_eos = 0
    for i, (ids, sampled, exact) in enumerate(prepared):
        resp, lm = _response_and_loss_mask(i, response_ids[i], loss_masks[i], ids.shape[0], s)
        t = resp.shape[0]
        if t == 0:
            continue
        _check_support_ids(i, ids, resp, id_limit)
        supported = ids[:, 0] >= 0 if w else np.zeros(t, dtype=np.bool_)
        contains = (ids == resp[:, None]).any(axis=1)
        is_exact = _exact_rows(i, sampled, exact, resp, supported, contains)
        inexact = supported & ~is_exact & lm
        n_inexact += int(inexact.sum())
        fixed, lm_after = _apply_inexact_policy(i, ids, resp, lm, inexact, contains, on_inexact)
        n_eos += _count_synthetic_eos(i, resp, ~supported & lm, eos)
        out[i, s - t :] = fixed
        loss_out[i, s - t :] = lm_after
    log = logger.warning if n_inexact else logger.debug
    log(
        "support batch: %d loss-bearing inexact row(s) (on_inexact=%r), %d synthetic EOS row(s), %d trajectories",
        n_inexact,
        on_inexact,
        n_eos,
        b,
    )
    return DenseSupport(out, loss_out, n_inexact, n_eos, on_inexact)


def _rows_of_one_width(
    rows: Sequence[Any],
) -> tuple[list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]], int]:
    """Per trajectory ``(ids [T_b, W], sampled [T_b] or None, exact [T_b] or None)`` and the
    common width ``W`` (0 for an empty batch); plain arrays carry no ``sampled`` / ``exact``."""
    prepared = []
    width: int | None = None
    sampled: np.ndarray | None
    exact: np.ndarray | None
    for i, r in enumerate(rows):
        if isinstance(r, SupportRows):
            ids, sampled, exact = r.ids, r.sampled, r.exact
        else:
            ids = np.asarray(r)
            if ids.ndim != 2 or (ids.size and ids.dtype.kind != "i"):
                raise ReplayTypeError(
                    "support",
                    f"got dtype {ids.dtype} with shape {ids.shape}",
                    trajectory=i,
                    expected="SupportRows or a 2-D signed integer array (an unsigned dtype cannot hold the -1 "
                    "padding: uint8 makes it 255, a member id)",
                )
            sampled = exact = None
        if width is None:
            width = int(ids.shape[1])
        elif ids.shape[1] != width:
            raise ReplayDataError("support", f"rows have width {ids.shape[1]}", trajectory=i, expected=f"width {width}")
        prepared.append((ids, sampled, exact))
    return prepared, width or 0


def _response_and_loss_mask(
    i: int, response: Any, loss_mask: Any, n_rows: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Trajectory ``i``'s response ids (integer ``[T]``) and loss mask (bool ``[T]``), checked
    against its ``n_rows`` support rows and ``seq_len``."""
    resp = np.asarray(response)
    if resp.ndim != 1 or (resp.size and resp.dtype.kind not in "iu"):
        raise ReplayTypeError(
            "response_ids",
            f"got dtype {resp.dtype} with shape {resp.shape}",
            trajectory=i,
            expected="a 1-D integer sequence",
        )
    t = resp.shape[0]
    lm = np.asarray(loss_mask)
    if lm.shape != (t,):
        raise ReplayDataError(
            "loss_mask",
            f"has shape {lm.shape} for {t} response tokens",
            trajectory=i,
            expected=f"shape ({t},)",
        )
    if n_rows != t:
        raise ReplayDataError(
            "support",
            f"{n_rows} rows for {t} response tokens",
            trajectory=i,
            expected="one row per response token",
        )
    if t > seq_len:
        raise ReplayDataError(
            "response_ids", f"{t} tokens do not fit seq_len {seq_len}", trajectory=i, expected=f"<= {seq_len}"
        )
    return resp, lm.astype(np.bool_)


def _check_support_ids(i: int, ids: np.ndarray, resp: np.ndarray, id_limit: int) -> None:
    """Trajectory ``i``: response ids ``[T]`` in ``[0, id_limit]``; rows ``[T, W]`` with ids in
    ``[-1, id_limit]``, ``-1`` only as trailing padding, no id twice in a row."""
    bad_resp = (resp < 0) | (resp > id_limit)
    if bad_resp.any():
        tok = int(np.argmax(bad_resp))
        raise ReplayDataError(
            "response_ids",
            f"id {int(resp[tok])} out of range",
            trajectory=i,
            token=tok,
            expected=f"[0, {id_limit + 1})",
        )
    bad = (ids < PAD) | (ids > id_limit)
    if bad.any():
        tok = int(np.argmax(bad.any(axis=1)))
        val = int(ids[tok][bad[tok]][0])
        raise ReplayDataError(
            "support",
            f"id {val} out of range",
            trajectory=i,
            token=tok,
            expected=f"ids in [-1, {id_limit + 1})",
        )
    _check_trailing_padding(ids, "support", i)
    if ids.shape[1] > 1:
        srt = np.sort(ids, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            tok = int(np.argmax(dup.any(axis=1)))
            val = int(srt[tok, 1:][dup[tok]][0])
            raise ReplayDataError(
                "support",
                f"id {val} appears twice in the row",
                trajectory=i,
                token=tok,
                expected="no duplicate ids",
            )


def _exact_rows(
    i: int,
    sampled: np.ndarray | None,
    exact: np.ndarray | None,
    resp: np.ndarray,
    supported: np.ndarray,
    contains: np.ndarray,
) -> np.ndarray:
    """Bool ``[T]``: supported rows that are exact. With ``SupportRows`` their flags, after
    checking that each row was captured for its response token; for a plain array, the rows
    that contain their response token."""
    if sampled is None or exact is None:
        return supported & contains
    mismatch = supported & (sampled != resp)
    if mismatch.any():
        tok = int(np.argmax(mismatch))
        raise ReplayDataError(
            "sampled",
            f"row was captured for token {int(sampled[tok])} but the response holds {int(resp[tok])}",
            trajectory=i,
            token=tok,
            expected="rows aligned with the response tokens",
        )
    wrong = exact & supported & ~contains
    if wrong.any():
        tok = int(np.argmax(wrong))
        raise ReplayDataError(
            "exact",
            "row flagged exact does not contain the response token",
            trajectory=i,
            token=tok,
            expected="exact rows to contain their sampled token",
        )
    return exact & supported


def _apply_inexact_policy(
    i: int,
    ids: np.ndarray,
    resp: np.ndarray,
    lm: np.ndarray,
    inexact: np.ndarray,
    contains: np.ndarray,
    policy: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[T, W]`` and loss mask ``[T]`` after the ``on_inexact`` policy acted on the
    loss-bearing ``inexact`` rows (``ids`` and ``lm`` themselves are never modified)."""
    if not inexact.any():
        return ids, lm
    if policy == "error":
        tok = int(np.argmax(inexact))
        raise ReplayDataError(
            "exact",
            "loss-bearing support row is inexact (the sampler's support was wider "
            "than the recorded row, or the row lacks the sampled token)",
            trajectory=i,
            token=tok,
            expected="exact rows (on_inexact='error')",
        )
    if policy == "mask":
        return ids, lm & ~inexact
    missing = np.flatnonzero(inexact & ~contains)
    if not missing.size:
        return ids, lm
    fixed = ids.copy()
    last = (ids[missing] >= 0).sum(axis=1) - 1
    fixed[missing, last] = resp[missing]
    return fixed, lm


def _count_synthetic_eos(i: int, resp: np.ndarray, empty: np.ndarray, eos: frozenset) -> int:
    """1 when trajectory ``i`` has one loss-bearing row without support (``empty``, bool
    ``[T]``) and its token is an EOS, 0 when it has none; anything else raises."""
    if not empty.any():
        return 0
    where_empty = np.flatnonzero(empty)
    if where_empty.size > 1:
        raise ReplayDataError(
            "support",
            f"{where_empty.size} loss-bearing tokens have no support row (tokens {where_empty[:8].tolist()})",
            trajectory=i,
            token=int(where_empty[1]),
            expected="at most one per trajectory (the synthetic EOS)",
        )
    tok = int(where_empty[0])
    if int(resp[tok]) not in eos:
        raise ReplayDataError(
            "support",
            f"loss-bearing token {int(resp[tok])} has no support row",
            trajectory=i,
            token=tok,
            expected=f"support for every loss-bearing token but the EOS {sorted(eos)}",
        )
    return 1


# --------------------------------------------------------------------------- helpers


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        if name in obj:
            return obj[name]
    elif hasattr(obj, name):
        return getattr(obj, name)
    raise ReplayTypeError(name, f"missing on {type(obj).__name__}", expected=f"an attribute or key {name!r}")


def _get_optional(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _is_sequence_of_rows(obj: Any) -> bool:
    # A NamedTuple such as vLLM's SamplingMaskLists is a mask object, not a tuple of rows.
    return isinstance(obj, (list, tuple)) and not hasattr(obj, "token_ids")


def _check_width(width: Any) -> int:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise ReplayTypeError("width", f"got {width!r}", expected="an int >= 1")
    return int(width)


def _index_array(values: Any, field: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ReplayTypeError(field, f"got dtype {arr.dtype} with shape {arr.shape}", expected="1-D integers")
    return arr.astype(np.int64, copy=False)


def _flat_ids(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        arr = values
    else:
        arr = _from_list(values, np.int32) if isinstance(values, list) else np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ReplayTypeError("token_ids", f"got dtype {arr.dtype} with shape {arr.shape}", expected="1-D integers")
    return arr


def _flat_logprobs(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        arr = values
    else:
        # vLLM's floats come from float32 tensors: float32 holds them exactly.
        arr = _from_list(values, np.float32) if isinstance(values, list) else np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind != "f"):
        raise ReplayTypeError("logprobs", f"got dtype {arr.dtype} with shape {arr.shape}", expected="1-D floats")
    return arr


def _from_list(values: list, dtype) -> np.ndarray:
    # np.fromiter over a list is ~20% faster than np.asarray, and 32-bit results halve the work
    # after it; ids beyond int32 or odd input fall back to np.asarray (then range-checked).
    try:
        return np.fromiter(values, dtype=dtype, count=len(values))
    except (TypeError, ValueError, OverflowError):
        return np.asarray(values)


def _flatten_lists(lists: Any) -> tuple[np.ndarray, np.ndarray]:
    rows = list(lists)
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    offs = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    total = int(offs[-1])
    if rows and all(isinstance(r, np.ndarray) for r in rows):
        flat = np.concatenate(rows).astype(np.int64, copy=False) if total else np.zeros(0, np.int64)
    else:
        try:
            flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        except (TypeError, ValueError) as exc:
            raise ReplayTypeError("token_ids", f"not lists of ints ({exc})", expected="lists of int ids") from exc
    return flat, offs


def _int32_array(values: Any, field: str, *, ndim: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(np.int32)
    if arr.ndim != ndim or arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size):
        # Unsigned refused: these arrays hold -1 as padding / "no sample", which uint8 stores as
        # 255, a member id (issue 32, item 1).
        raise ReplayTypeError(
            field, f"got dtype {arr.dtype} with shape {arr.shape}", expected=f"a {ndim}-D signed integer array"
        )
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > INT32_MAX):
            raise ReplayDataError(field, "holds values outside int32", expected="int32 token ids")
        arr = arr.astype(np.int32)
    return arr


def _check_trailing_padding(ids: np.ndarray, field: str, trajectory: int | None) -> None:
    if ids.shape[1] < 2:
        return
    valid = ids >= 0
    gap = valid[:, 1:] & ~valid[:, :-1]
    if gap.any():
        tok = int(np.argmax(gap.any(axis=1)))
        raise ReplayDataError(
            field,
            f"row {ids[tok].tolist()} has -1 before a member",
            trajectory=trajectory,
            token=tok,
            expected="-1 only as trailing padding",
        )


def _rows_unchecked(ids: np.ndarray, sampled: np.ndarray, logprob: np.ndarray, exact: np.ndarray) -> SupportRows:
    # Capture builds rows that satisfy the contract by construction; skip __post_init__'s checks
    # (they would cost about a third of the conversion time).
    rows = object.__new__(SupportRows)
    rows.ids, rows.sampled, rows.sampled_logprob, rows.exact = ids, sampled, logprob, exact
    return rows


def _empty_rows(width: int) -> SupportRows:
    return SupportRows.empty(0, width)


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, (int, np.integer)):
        return frozenset({int(eos_token_id)})
    return frozenset(int(e) for e in eos_token_id)
