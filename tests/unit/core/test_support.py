"""Support rows: capture from vLLM-shaped FlatLogprobs / SamplingMask, and the dense batch."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.support import (
    SupportRows,
    dense_support_batch,
    support_from_flat_logprobs,
    support_from_sampling_mask,
)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- a vLLM-shaped engine


@dataclasses.dataclass
class FakeFlatLogprobs:
    """The fields of ``vllm.logprobs.FlatLogprobs`` that capture reads (lists, as vLLM keeps them)."""

    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list


def processed_logprobs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's processed logprobs (>= 0.10.2, PyTorch top-k/top-p path): float32, -inf = masked.

    Temperature, then min-p, then top-k keeping every tie at the k-th value, then top-p keeping
    at least one token; log_softmax of the masked logits.
    """
    z = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    if min_p > 0:
        p = np.exp(z - z.max())
        p /= p.sum()
        z = np.where(p < min_p * p.max(), -np.inf, z)
    if top_k > 0:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1.0:
        order = np.argsort(z, kind="stable")  # ascending
        zs = z[order]
        p = np.exp(zs - zs.max())
        p /= p.sum()
        drop = np.cumsum(p) <= 1 - top_p
        drop[-1] = False
        z[order[drop]] = -np.inf
    finite = np.isfinite(z)
    out = np.full_like(z, -np.inf)
    zz = z[finite]
    out[finite] = zz - (zz.max() + np.log(np.exp(zz - zz.max()).sum()))
    return out.astype(np.float32)


def flat_from_engine(positions, n, sampled=None):
    """FlatLogprobs as vLLM builds it: per position [sampled, topk(processed, n)...]."""
    flat = FakeFlatLogprobs([], [], [], [])
    for i, lp in enumerate(positions):
        if sampled is None:
            choice = int(np.flatnonzero(np.isfinite(lp))[0])
        else:
            choice = int(sampled[i])
        order = np.argsort(-lp.astype(np.float64), kind="stable")[:n]  # torch.topk: descending
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [choice] + order.tolist()
        flat.logprobs += [float(lp[choice])] + [float(x) for x in lp[order]]
        flat.end_indices.append(len(flat.token_ids))
    return flat


def as_arrays(flat):
    return {
        "start_indices": np.asarray(flat.start_indices, dtype=np.int64),
        "end_indices": np.asarray(flat.end_indices, dtype=np.int64),
        "token_ids": np.asarray(flat.token_ids, dtype=np.int32),
        "logprobs": np.asarray(flat.logprobs, dtype=np.float32),
    }


def true_support(lp):
    return set(np.flatnonzero(np.isfinite(lp)).tolist())


def row_set(row):
    return set(int(x) for x in row if x >= 0)


# --------------------------------------------------------------------------- FlatLogprobs


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(20, 1.0, 0.0), (20, 0.9, 0.0), (8, 0.5, 0.0), (20, 1.0, 0.1), (5, 0.95, 0.05)]
)
def test_exact_rows_are_the_sampler_support(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k)
    positions, sampled = [], []
    for _ in range(200):
        lp = processed_logprobs(rng.normal(size=300) * 3, 0.8, top_k, top_p, min_p)
        p = np.exp(lp.astype(np.float64))
        positions.append(lp)
        sampled.append(int(rng.choice(300, p=p / p.sum())))
    flat = flat_from_engine(positions, top_k, sampled)
    rows = support_from_flat_logprobs(flat, top_k)
    assert rows.ids.dtype == np.int32 and rows.ids.shape == (200, top_k) and len(rows) == 200
    assert rows.sampled.tolist() == sampled
    np.testing.assert_array_equal(rows.sampled_logprob, [positions[i][s] for i, s in enumerate(sampled)])
    # no ties in random float logits: every row is the whole support, in descending order
    assert rows.exact.all()
    for i, lp in enumerate(positions):
        assert row_set(rows.ids[i]) == true_support(lp)
        members = rows.ids[i][rows.ids[i] >= 0]
        assert np.all(np.diff(lp[members]) <= 0)
        assert np.all(rows.ids[i][len(members) :] == -1)
    # numpy arrays and mappings give the same rows
    same = support_from_flat_logprobs(as_arrays(flat), top_k)
    for f in ("ids", "sampled", "sampled_logprob", "exact"):
        np.testing.assert_array_equal(getattr(same, f), getattr(rows, f))


def test_ties_at_the_kth_logit_are_flagged_inexact_and_recorded_as_seen():
    logits = np.array([5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0])
    lp = processed_logprobs(logits, 1.0, top_k=3)  # ties keep 5 tokens
    assert len(true_support(lp)) == 5
    flat = flat_from_engine([lp, lp], 3, sampled=[0, 4])
    rows = support_from_flat_logprobs(flat, 3)
    assert rows.ids.tolist() == [[0, 1, 2], [0, 1, 2]]  # as seen: the sampled 4 is not added
    assert rows.exact.tolist() == [False, False]
    assert rows.sampled.tolist() == [0, 4]


def test_sampled_token_outside_top_n_is_inexact():
    # an approximate pivot kept a token that torch.topk ranks below N
    lp = processed_logprobs(np.array([3.0, 2.0, 1.0, 0.5, 0.0]), 1.0, top_k=4)
    flat = flat_from_engine([lp], 2, sampled=[3])
    rows = support_from_flat_logprobs(flat, 2)
    assert rows.ids.tolist() == [[0, 1]] and not rows.exact[0]


def test_rows_all_neg_inf_past_the_support_are_exact_and_padded():
    lp = processed_logprobs(np.array([6.0, 5.0, 0.0, -1.0, -2.0, -3.0]), 1.0, top_k=5, top_p=0.5)
    assert true_support(lp) == {0}
    flat = flat_from_engine([lp], 5, sampled=[0])
    assert flat.logprobs[2:] == [NEG_INF] * 4
    rows = support_from_flat_logprobs(flat, 5)
    assert rows.ids.tolist() == [[0, -1, -1, -1, -1]] and rows.exact.tolist() == [True]


def test_top_k_one():
    lp = processed_logprobs(np.array([0.1, 2.0, 0.3]), 1.0, top_k=1)
    flat = flat_from_engine([lp], 1, sampled=[1])
    assert flat.token_ids == [1, 1] and flat.logprobs == [0.0, 0.0]
    rows = support_from_flat_logprobs(flat, 1)
    assert rows.ids.tolist() == [[1]] and rows.exact.tolist() == [True]
    # a tie at k = 1: both survive, the row holds one of them
    lp = processed_logprobs(np.array([2.0, 2.0, 0.3]), 1.0, top_k=1)
    rows = support_from_flat_logprobs(flat_from_engine([lp], 1, sampled=[1]), 1)
    assert rows.ids.tolist() == [[0]] and rows.exact.tolist() == [False]


def test_full_mass_without_neg_inf_is_exact_and_tolerance_is_respected():
    # support exactly N wide: no -inf entry, the finite entries carry all the mass
    lp = processed_logprobs(np.array([1.0, 0.5, 0.2, -9.0, -9.5]), 1.0, top_k=3)
    flat = flat_from_engine([lp], 3, sampled=[2])
    assert NEG_INF not in flat.logprobs
    assert support_from_flat_logprobs(flat, 3).exact.tolist() == [True]
    # no top-k: finite tail mass ~1e-6 missing -> exact only with a looser tolerance
    lp = processed_logprobs(np.array([1.0, 0.5, 0.2, -12.0, -12.5]), 1.0)
    flat = flat_from_engine([lp], 3, sampled=[0])
    assert support_from_flat_logprobs(flat, 3).exact.tolist() == [True]
    assert support_from_flat_logprobs(flat, 3, mass_tolerance=1e-8).exact.tolist() == [False]
    lp = processed_logprobs(np.array([1.0, 0.5, 0.2, -2.0, -2.5]), 1.0)
    assert support_from_flat_logprobs(flat_from_engine([lp], 3, sampled=[0]), 3).exact.tolist() == [False]


def test_forced_token_row_is_the_forced_token_alone():
    """vLLM forces a token (thinking budget) by setting its logit to 1e9 before temperature and
    top-k: the other top-k tokens keep finite processed logprobs near -1e9 / T. Keeping them
    (floor -inf, the behaviour before UNREACHABLE_LOGPROB) records a k-member row flagged exact,
    and the trainer then gives the forced token its natural share; with the floor the row is the
    forced token alone, exact, with logprob 0."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32) * 3
    logits[7] = 1e9  # the forced token
    lp = processed_logprobs(logits, 0.7, top_k=5)
    assert np.isfinite(lp).sum() == 5 and lp[7] == 0.0
    flat = flat_from_engine([lp], 8, sampled=[7])
    unfloored = support_from_flat_logprobs(flat, 8, min_logprob=NEG_INF)
    assert (unfloored.ids[0] >= 0).sum() == 5 and unfloored.exact.tolist() == [True]  # the silent error
    rows = support_from_flat_logprobs(flat, 8)
    assert rows.ids.tolist() == [[7, -1, -1, -1, -1, -1, -1, -1]]
    assert rows.exact.tolist() == [True] and rows.sampled_logprob.tolist() == [0.0]
    # the unreachable members also prove the row complete when the row is too narrow for them
    narrow = support_from_flat_logprobs(flat_from_engine([lp], 2, sampled=[7]), 2)
    assert narrow.ids.tolist() == [[7, -1]] and narrow.exact.tolist() == [True]
    # a natural row keeps every finite member, whatever its probability
    natural = processed_logprobs(np.array([30.0, 0.0, -200.0, -900.0, -5000.0]), 1.0, top_k=4)
    kept = support_from_flat_logprobs(flat_from_engine([natural], 4, sampled=[0]), 4)
    assert row_set(kept.ids[0]) == {0, 1, 2, 3} and kept.exact.tolist() == [True]


def test_width_smaller_and_larger_than_n():
    lp = processed_logprobs(np.array([4.0, 3.0, 2.0, 1.0, 0.0, -1.0]), 1.0, top_k=4)
    flat = flat_from_engine([lp, lp], 4, sampled=[0, 3])
    narrow = support_from_flat_logprobs(flat, 2)
    assert narrow.ids.tolist() == [[0, 1], [0, 1]] and narrow.exact.tolist() == [False, False]
    wide = support_from_flat_logprobs(flat, 6)
    assert wide.ids.tolist() == [[0, 1, 2, 3, -1, -1]] * 2 and wide.exact.tolist() == [True, True]


def test_ragged_and_unordered_layouts_take_the_general_path():
    flat = {
        # position 1 has N=1, position 2 starts after a gap, position 0 is out of order
        "start_indices": [0, 4, 8],
        "end_indices": [4, 6, 12],
        "token_ids": [7, 3, 7, 5, 2, 2, 99, 99, 1, 0, 1, 9],
        "logprobs": [-1.5, -2.0, -1.5, -0.9, 0.0, 0.0, 0.0, 0.0, -0.1, -3.0, -0.1, NEG_INF],
    }
    rows = support_from_flat_logprobs(flat, 3)
    assert rows.ids.tolist() == [[5, 7, 3], [2, -1, -1], [1, 0, -1]]
    assert rows.exact.tolist() == [False, True, True]


def test_non_finite_entries_make_rows_inexact():
    flat = FakeFlatLogprobs(
        [0, 3, 6],
        [3, 6, 9],
        [1, 1, 2, 1, 1, 2, 1, 1, 2],
        [-0.1, -0.1, float("nan"), -0.1, -0.1, NEG_INF, NEG_INF, -0.1, NEG_INF],
    )
    rows = support_from_flat_logprobs(flat, 2)
    assert rows.ids.tolist() == [[1, -1], [1, -1], [1, -1]]
    assert rows.exact.tolist() == [False, True, False]  # NaN entry; ok; sampled logprob -inf


def test_empty_input_and_flat_errors():
    rows = support_from_flat_logprobs(FakeFlatLogprobs([], [], [], []), 4)
    assert rows.ids.shape == (0, 4) and len(rows) == 0
    with pytest.raises(ReplayTypeError) as err:
        support_from_flat_logprobs({"start_indices": [0]}, 2)
    assert err.value.field == "end_indices"
    with pytest.raises(ReplayDataError) as err:
        support_from_flat_logprobs(FakeFlatLogprobs([0, 2], [2, 2], [1, 1], [0.0, 0.0]), 2)
    assert err.value.field == "end_indices" and err.value.token == 1 and "token 1" in str(err.value)
    with pytest.raises(ReplayDataError) as err:
        support_from_flat_logprobs(FakeFlatLogprobs([0, 2], [2, 5], [1, 1, 2, 2], [0.0] * 4), 2)
    assert err.value.field == "start_indices" and err.value.token == 1
    with pytest.raises(ReplayDataError) as err:
        support_from_flat_logprobs(FakeFlatLogprobs([0, 2], [2, 4], [1, 1, 2, -5], [0.0] * 4), 2)
    assert err.value.field == "token_ids" and err.value.token == 1
    with pytest.raises(ReplayDataError) as err:
        support_from_flat_logprobs(FakeFlatLogprobs([0], [2], [1, 1], [0.0]), 2)
    assert err.value.field == "logprobs"
    with pytest.raises(ReplayTypeError):
        support_from_flat_logprobs(FakeFlatLogprobs([0], [2], [1, 1], [0.0, 0.0]), 0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    width=st.integers(1, 8),
    rows=st.lists(
        st.tuples(
            st.integers(0, 30),
            # +inf and NaN are not processed logprobs: their rows are inexact, still well formed
            st.lists(
                st.sampled_from([0.0, -0.5, -1.0, -2.0, -7.0, NEG_INF, float("inf"), float("nan")]),
                min_size=6,
                max_size=6,
            ),
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_capture_contract_holds_for_arbitrary_flat_data(n, width, rows):
    flat = FakeFlatLogprobs([], [], [], [])
    for sampled, lps in rows:
        lps = sorted(lps[:n], reverse=True)
        ids = [(sampled + 3 * j + 1) % 40 for j in range(n)]
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [sampled] + ids
        flat.logprobs += [lps[0]] + lps
        flat.end_indices.append(len(flat.token_ids))
    out = support_from_flat_logprobs(flat, width)
    SupportRows(out.ids, out.sampled, out.sampled_logprob, out.exact)  # passes validation
    for i, (sampled, _lps) in enumerate(rows):
        members = [x for x in out.ids[i] if x >= 0]
        assert all(x in flat.token_ids[flat.start_indices[i] + 1 : flat.end_indices[i]] for x in members)
        if out.exact[i]:
            assert sampled in members


def _descending_candidates(rng: np.random.Generator, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``[t, n]`` candidates as the engine orders them (descending, -inf last) with the cases the
    conversion distinguishes: -inf tails, ties, entries at and around the unreachable floor,
    full rows whose mass sits just above or below the tolerance, and ids repeated in a row."""
    from replay_plugin.core.support import DEFAULT_MASS_TOLERANCE, UNREACHABLE_LOGPROB

    lp = np.sort(rng.normal(size=(t, n)).astype(np.float32) * 3, axis=1)[:, ::-1]
    lp = lp - np.log(np.exp(lp.astype(np.float64)).sum(axis=1, keepdims=True)).astype(np.float32)
    for i in range(t):
        kind, k = rng.integers(6), int(rng.integers(0, n + 1))
        if kind == 0:
            lp[i, k:] = -np.inf
        elif kind == 1:  # ties, then -inf
            lp[i, k // 2 : k] = lp[i, k // 2] if k else 0.0
            lp[i, k:] = -np.inf
        elif kind == 2:  # entries at or just above the floor
            lp[i, k:] = rng.choice(
                [UNREACHABLE_LOGPROB, np.nextafter(np.float32(UNREACHABLE_LOGPROB), 0), -1e9, -np.inf]
            )
            lp[i] = np.sort(lp[i])[::-1]
        elif kind == 3:  # full row, mass a hair below or above 1 - tolerance
            lp[i] = lp[i] + np.float32(rng.choice([-2, -0.5, 0.5]) * DEFAULT_MASS_TOLERANCE)
    ids = rng.integers(0, 50, size=(t, n)).astype(np.int32)  # repeats included
    pick = rng.integers(0, n, size=t)
    sampled = np.where(rng.random(t) < 0.8, ids[np.arange(t), pick], rng.integers(0, 60, size=t)).astype(np.int32)
    sampled_lp = np.where(rng.random(t) < 0.95, lp[np.arange(t), pick], rng.choice([np.nan, -np.inf], size=t))
    return ids, lp, sampled, sampled_lp.astype(np.float32)


@pytest.mark.parametrize("n,width", [(1, 1), (5, 3), (8, 8), (8, 12), (37, 36)])
def test_ordinary_rows_fast_path_equals_the_general_path(n, width):
    """Rows without NaN, +inf or absent slots take a prefix-based path; the general path (taken
    when ``absent`` is given, here all False: the same rows) must give the same ids and flags."""
    from replay_plugin.core.support import (
        DEFAULT_MASS_TOLERANCE,
        UNREACHABLE_LOGPROB,
        _rows_from_candidates,
        _rows_from_ordinary_candidates,
    )

    rng = np.random.default_rng(n * 100 + width)
    seen = set()
    for t in (1, 7, 400):
        cand, lp, sampled, sampled_lp = _descending_candidates(rng, t, n)
        for floor in (UNREACHABLE_LOGPROB, NEG_INF):
            fast = _rows_from_ordinary_candidates(cand, lp, sampled, sampled_lp, width, DEFAULT_MASS_TOLERANCE, floor)
            assert fast is not None
            general = _rows_from_candidates(
                cand, lp, np.zeros_like(lp, dtype=bool), sampled, sampled_lp, width, DEFAULT_MASS_TOLERANCE, floor
            )
            np.testing.assert_array_equal(fast[0], general[0])
            np.testing.assert_array_equal(fast[1], general[1])
            seen |= set(fast[1].tolist())
    assert seen == {True, False}
    lp[0, -1] = np.nan  # garbage anywhere: the general path decides
    assert _rows_from_ordinary_candidates(cand, lp, sampled, sampled_lp, width, 1e-4, UNREACHABLE_LOGPROB) is None
    lp[0, -1] = np.inf
    assert _rows_from_ordinary_candidates(cand, lp, sampled, sampled_lp, width, 1e-4, UNREACHABLE_LOGPROB) is None


# --------------------------------------------------------------------------- SamplingMask


@dataclasses.dataclass
class FakeSamplingMask:
    token_ids: list


class FakeSamplingMaskLists(NamedTuple):
    """Like ``vllm.v1.outputs.SamplingMaskLists``: a NamedTuple (CSR ids + offsets)."""

    token_ids: np.ndarray
    offsets: np.ndarray | None = None


def test_sampling_mask_rows_put_the_sampled_token_first():
    mask = FakeSamplingMask([[2, 5, 9], [4], [1, 3, 6, 7, 8], [0, 2]])
    rows = support_from_sampling_mask(mask, [9, 4, 7, 5], 4, sampled_logprobs=[-0.1, 0.0, -2.0, -0.3])
    assert rows.ids.tolist() == [[9, 2, 5, -1], [4, -1, -1, -1], [7, 1, 3, 6], [0, 2, -1, -1]]
    assert rows.exact.tolist() == [True, True, False, False]  # too wide; sampled not in mask
    assert rows.sampled_logprob.dtype == np.float32 and rows.sampled_logprob[2] == np.float32(-2.0)
    csr = FakeSamplingMaskLists(np.array([2, 5, 9, 4, 1, 3, 6, 7, 8, 0, 2]), np.array([0, 3, 4, 9, 11]))
    same = support_from_sampling_mask(csr, np.array([9, 4, 7, 5]), 4)
    assert same.ids.tolist() == rows.ids.tolist() and same.exact.tolist() == rows.exact.tolist()
    assert np.isnan(same.sampled_logprob).all()
    single = support_from_sampling_mask(FakeSamplingMaskLists(np.array([3, 8])), [8], 3)
    assert single.ids.tolist() == [[8, 3, -1]] and single.exact.tolist() == [True]
    as_lists = support_from_sampling_mask([np.array([1, 2]), np.array([4])], [2, 4], 2)
    assert as_lists.ids.tolist() == [[2, 1], [4, -1]]
    repeat = support_from_sampling_mask({"token_ids": [[5, 5, 1]]}, [5], 2)
    assert repeat.ids.tolist() == [[5, 1]] and repeat.exact.tolist() == [True]


def test_sampling_mask_errors():
    with pytest.raises(ReplayDataError) as err:
        support_from_sampling_mask(FakeSamplingMask([[1], [2]]), [1], 2)
    assert err.value.field == "sampled_ids"
    with pytest.raises(ReplayDataError) as err:
        support_from_sampling_mask(FakeSamplingMaskLists(np.array([1, 2]), np.array([0, 3])), [1], 2)
    assert err.value.field == "offsets"
    with pytest.raises(ReplayDataError) as err:
        support_from_sampling_mask(FakeSamplingMask([[1], [-2]]), [1, 2], 2)
    assert err.value.field == "token_ids" and err.value.token == 1


# --------------------------------------------------------------------------- SupportRows


def test_support_rows_validation():
    ok = SupportRows([[1, 2, -1]], [2], [-0.5], [True])
    assert len(ok) == 1 and ok.width == 3 and ok.ids.dtype == np.int32 and ok.sampled_logprob.dtype == np.float32
    with pytest.raises(ReplayDataError) as err:
        SupportRows([[1, 2], [1, -1], [-1, 3]], [1, 1, 3], [0.0] * 3, [False] * 3)
    assert err.value.field == "ids" and err.value.token == 2
    with pytest.raises(ReplayDataError) as err:
        SupportRows([[1, 2], [3, 4]], [1, 5], [0.0, 0.0], [True, True])
    assert err.value.field == "exact" and err.value.token == 1
    with pytest.raises(ReplayDataError) as err:
        SupportRows([[1, -3]], [1], [0.0], [False])
    assert err.value.field == "ids" and err.value.token == 0
    with pytest.raises(ReplayDataError) as err:
        SupportRows([[1]], [1, 2], [0.0], [False])
    assert err.value.field == "sampled"
    with pytest.raises(ReplayTypeError):
        SupportRows([[1.5]], [1], [0.0], [False])
    with pytest.raises(ReplayTypeError):
        SupportRows([[1]], [1], [0.0], [1])
    both = SupportRows.concat([ok, SupportRows.empty(2, 3)])
    assert (
        len(both) == 3 and both.ids[1:].tolist() == [[-1, -1, -1]] * 2 and both.exact.tolist() == [True, False, False]
    )


# --------------------------------------------------------------------------- dense batch

EOS = 2


def rows_of(ids, sampled, exact):
    return SupportRows(np.asarray(ids), np.asarray(sampled), np.zeros(len(sampled), np.float32), np.asarray(exact))


def test_dense_batch_layout_and_synthetic_eos(caplog):
    a = rows_of([[5, 6], [7, -1], [-1, -1]], [5, 7, -1], [True, True, False])
    b = rows_of([[9, 8]], [8], [True])
    with caplog.at_level(logging.DEBUG, logger="replay_plugin.core.support"):
        out = dense_support_batch([a, b], [[5, 7, EOS], [8]], [[1, 1, 1], [0]], 5, EOS, vocab_size=10)
    assert out.ids.shape == (2, 5, 2) and out.ids.dtype == np.int32
    assert out.ids[0].tolist() == [[-1, -1], [-1, -1], [5, 6], [7, -1], [-1, -1]]
    assert out.ids[1].tolist() == [[-1, -1]] * 4 + [[9, 8]]
    assert out.loss_mask.tolist() == [[False, False, True, True, True], [False] * 5]
    assert (out.num_inexact, out.num_synthetic_eos, out.policy) == (0, 1, "repair")
    assert "1 synthetic EOS" in caplog.text
    # plain arrays: exact iff they contain the response token
    out = dense_support_batch([np.array([[5, 6], [7, 1]])], [[5, 7]], [[1, 1]], 2, [EOS, 3])
    assert out.num_inexact == 0


REPAIR_ROWS = [  # an earlier design's repair of top-k rows: [sampled | top-k] -> repaired row
    ([100], [[8, 9, 10]], [[8, 9, 100]]),
    ([5], [[6, 7, -1]], [[6, 5, -1]]),
    ([42], [[9]], [[42]]),
]


@pytest.mark.parametrize("sampled,ids,repaired", REPAIR_ROWS)
def test_repair_policy_matches_the_earlier_design(sampled, ids, repaired, caplog):
    rows = rows_of(ids, sampled, [False])
    with caplog.at_level(logging.WARNING, logger="replay_plugin.core.support"):
        out = dense_support_batch([rows], [sampled], [[1]], 1, EOS)
    assert out.ids[0].tolist() == repaired and out.num_inexact == 1 and out.loss_mask.all()
    assert "1 loss-bearing inexact" in caplog.text
    assert rows.ids.tolist() == ids  # input untouched


def test_repair_keeps_inexact_rows_that_contain_the_sampled_token():
    rows = rows_of([[3, 4, 5]], [4], [False])
    out = dense_support_batch([rows], [[4]], [[1]], 1, EOS)
    assert out.ids[0].tolist() == [[3, 4, 5]] and out.num_inexact == 1


def test_mask_and_error_policies():
    rows = rows_of([[3, 4], [6, 7], [1, -1]], [4, 5, 1], [False, False, True])
    out = dense_support_batch([rows], [[4, 5, 1]], [[1, 1, 1]], 4, EOS, on_inexact="mask")
    assert out.loss_mask.tolist() == [[False, False, False, True]]
    assert out.ids[0, 1:].tolist() == [[3, 4], [6, 7], [1, -1]] and out.num_inexact == 2
    with pytest.raises(ReplayDataError) as err:
        dense_support_batch([rows], [[4, 5, 1]], [[1, 1, 1]], 4, EOS, on_inexact="error")
    assert (err.value.field, err.value.trajectory, err.value.token) == ("exact", 0, 0)
    # inexact rows outside the loss meet no policy
    out = dense_support_batch([rows], [[4, 5, 1]], [[0, 0, 1]], 4, EOS, on_inexact="error")
    assert out.num_inexact == 0
    with pytest.raises(ValueError, match="on_inexact"):
        dense_support_batch([rows], [[4, 5, 1]], [[1, 1, 1]], 4, EOS, on_inexact="drop")


GOOD = rows_of([[1, 3], [4, -1]], [1, 4], [True, True])


def corrupt_exact():
    """Rows whose ``exact`` flag was changed after validation (e.g. by a buggy producer)."""
    rows = rows_of([[1, 3], [5, 6]], [1, 4], [True, False])
    rows.exact = np.array([True, True])
    return rows


VALIDATION_CASES = [
    # (name, rows, responses, loss masks, field, trajectory, token)
    ("row count", [GOOD, rows_of([[1, 3]], [1], [True])], [[1, 4], [1, 4]], [[1, 1], [1, 1]], "support", 1, None),
    ("width", [GOOD, rows_of([[1, 3, 5]], [1], [True])], [[1, 4], [1]], [[1, 1], [1]], "support", 1, None),
    (
        "id range",
        [GOOD, rows_of([[1, 3], [4, 50]], [1, 4], [True, True])],
        [[1, 4], [1, 4]],
        [[1, 1], [1, 1]],
        "support",
        1,
        1,
    ),
    ("response range", [GOOD, GOOD], [[1, 4], [1, 40]], [[1, 1], [1, 1]], "response_ids", 1, 1),
    ("padding", [GOOD, np.array([[1, 3], [-1, 4]])], [[1, 4], [1, 4]], [[1, 1], [1, 1]], "support", 1, 1),
    ("duplicate", [GOOD, np.array([[1, 3], [4, 4]])], [[1, 4], [1, 4]], [[1, 1], [1, 1]], "support", 1, 1),
    ("sampled mismatch", [GOOD, GOOD], [[1, 4], [1, 3]], [[1, 1], [1, 1]], "sampled", 1, 1),
    ("exact without sampled", [GOOD, corrupt_exact()], [[1, 4], [1, 4]], [[1, 1], [1, 1]], "exact", 1, 1),
    (
        "non-eos empty",
        [GOOD, rows_of([[1, 3], [-1, -1]], [1, -1], [True, False])],
        [[1, 4], [1, 4]],
        [[1, 1], [1, 1]],
        "support",
        1,
        1,
    ),
    (
        "two empties",
        [GOOD, rows_of([[-1, -1], [-1, -1]], [-1, -1], [False, False])],
        [[1, 4], [EOS, EOS]],
        [[1, 1], [1, 1]],
        "support",
        1,
        1,
    ),
    ("loss mask length", [GOOD, GOOD], [[1, 4], [1, 4]], [[1, 1], [1]], "loss_mask", 1, None),
    (
        "too long",
        [GOOD, rows_of([[1, 3]] * 4, [1] * 4, [True] * 4)],
        [[1, 4], [1] * 4],
        [[1, 1], [1] * 4],
        "response_ids",
        1,
        None,
    ),
]


@pytest.mark.parametrize("case", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_every_validation_error_names_trajectory_token_and_field(case):
    _, rows, responses, masks, field, trajectory, token = case
    with pytest.raises(ReplayDataError) as err:
        dense_support_batch(rows, responses, masks, 3, EOS, vocab_size=10)
    e = err.value
    assert (e.field, e.trajectory, e.token) == (field, trajectory, token)
    assert f"field {field!r}" in str(e) and f"trajectory {trajectory}" in str(e)
    if token is not None:
        assert f"token {token}" in str(e)
    assert e.expected


def test_dense_batch_type_errors():
    with pytest.raises(ReplayTypeError) as err:
        dense_support_batch([np.array([[1.0, 2.0]])], [[1]], [[1]], 2, EOS)
    assert err.value.field == "support" and err.value.trajectory == 0
    with pytest.raises(ReplayDataError) as err:
        dense_support_batch([GOOD], [[1, 4], [1]], [[1, 1]], 2, EOS)
    assert err.value.field == "rows"
