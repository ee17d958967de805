"""The vLLM capture's row buffer and its one-row scalar path, held to ``core.support`` (no vLLM
import: the capture module imports none until a wrapper runs)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from replay_plugin.core.support import support_from_flat_logprobs
from replay_plugin.vllm import sample_support_capture as capture

NEG_INF = -np.inf


def _random_position(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``[sampled, top1..topN]`` ids and processed logprobs of one step, in vLLM's layout, with
    the cases the proof distinguishes: -inf tails, ties, forced rows (others near -1e9), full
    rows without -inf, and (rarely) garbage or disorder."""
    kind = rng.integers(6)
    k = int(rng.integers(1, n + 1))
    z = np.sort(rng.normal(size=n).astype(np.float32) * 3)[::-1]
    if kind == 1:  # ties at the k-th value
        z[k - 1 :] = z[k - 1]
    lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    if kind in (0, 1, 2):
        lp[k:] = NEG_INF
    if kind == 2:  # a forced token: the rest of the top-k sits near -1e9
        lp[0], lp[1:k] = 0.0, -1e9 + np.arange(k - 1)
    if kind == 3 and n > 2:
        lp[int(rng.integers(n))] = rng.choice([np.nan, np.inf])
    if kind == 4 and n > 2:
        lp[[0, 1]] = lp[[1, 0]]
    ids = rng.choice(5000, size=n, replace=False)
    pick = int(rng.integers(n)) if rng.random() < 0.9 else None
    sampled = ids[pick] if pick is not None else 5001
    sampled_lp = lp[pick] if pick is not None else np.float32(-3.0)
    return (
        np.concatenate([[sampled], ids]).astype(np.int32),
        np.concatenate([[sampled_lp], lp]).astype(np.float32),
    )


def test_one_row_path_equals_the_core_conversion():
    rng = np.random.default_rng(0)
    scalar = 0
    for _ in range(3000):
        n = int(rng.integers(1, 12))
        width = int(rng.integers(1, 14))
        ids, lps = _random_position(rng, n)
        start = np.array([0])
        ref = support_from_flat_logprobs(
            {"start_indices": start, "end_indices": start + n + 1, "token_ids": ids, "logprobs": lps}, width
        )
        row = capture._one_row(ids, lps, width)
        if row is None:  # only rows the general path must reorder or reject
            assert not (np.diff(lps[1:]) <= 0).all() or np.isnan(lps).any() or np.isposinf(lps[1:]).any()
            continue
        scalar += 1
        members, sampled, sampled_lp, exact = row
        expected = ref.ids[0][ref.ids[0] >= 0].tolist()
        assert members == expected, (ids, lps, width)
        assert (sampled, exact) == (int(ref.sampled[0]), bool(ref.exact[0])), (ids, lps, width)
        assert np.float32(sampled_lp) == ref.sampled_logprob[0] or np.isnan(ref.sampled_logprob[0])
    assert scalar > 2000


@pytest.mark.parametrize("same_width", [True, False])
def test_step_arrays_convert_as_the_core_converts_each_row(same_width):
    """``_rows_from_arrays`` (steps of one width stacked at once, or of several widths flattened)
    gives every row the core's conversion of that row alone, garbage and disorder included."""
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(200):
        n = 8 if same_width else int(rng.integers(6, 11))
        rows = [_random_position(rng, n) for _ in range(int(rng.integers(1, 4)))]
        steps.append((np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])))
    got = capture._rows_from_arrays([s[0] for s in steps], [s[1] for s in steps], 8)
    at = 0
    for ids, lps in steps:
        for i in range(ids.shape[0]):
            start = np.array([0])
            ref = support_from_flat_logprobs(
                {"start_indices": start, "end_indices": start + ids.shape[1], "token_ids": ids[i], "logprobs": lps[i]},
                8,
            )
            for name in ("ids", "sampled", "sampled_logprob", "exact"):
                np.testing.assert_array_equal(getattr(got, name)[at], getattr(ref, name)[0])
            at += 1
    assert at == len(got)


def _steps(rng, count, width=8):
    out = []
    for _ in range(count):
        ids, lps = _random_position(rng, width)
        while capture._one_row(ids, lps, width) is None:
            ids, lps = _random_position(rng, width)
        out.append((ids[None, :], lps[None, :]))
    return out


@pytest.mark.parametrize("delta", [False, True])
def test_streamed_outputs_view_the_rows_of_the_whole_request(delta):
    """Per output, the capture hands out views of one buffer (``CUMULATIVE``: all rows so far;
    ``DELTA``: the new ones): read-only, never rewritten, equal to converting all steps at once."""
    rng = np.random.default_rng(1)
    steps = _steps(rng, 300)
    state = capture._Capture(8, native=False)
    tokens: list[int] = []
    handed = []
    for ids, lps in steps:
        state.add(ids, lps)
        tokens.append(int(ids[0, 0]))
        output = types.SimpleNamespace(token_ids=tokens[-1:] if delta else tokens)
        rows = capture._output_rows(state, output, delta)
        assert len(rows) == len(output.token_ids) and not rows.ids.flags.writeable
        handed.append(rows)
    whole = capture._rows_from_arrays([s[0] for s in steps], [s[1] for s in steps], 8)
    last = handed[-1] if not delta else type(whole).concat(handed)
    for name in ("ids", "sampled", "sampled_logprob", "exact"):
        np.testing.assert_array_equal(getattr(last, name), getattr(whole, name))
    if not delta:  # an early output still shows its own prefix after the buffer grew
        np.testing.assert_array_equal(handed[10].ids, whole.ids[:11])


def test_rows_captured_for_other_tokens_are_emptied_and_flagged():
    rng = np.random.default_rng(2)
    state = capture._Capture(8, native=False)
    (ids, lps), (ids2, lps2) = _steps(rng, 2)
    state.add(ids, lps)
    state.add(ids2, lps2)
    wrong = int(ids2[0, 0]) + 1
    rows = capture._output_rows(state, types.SimpleNamespace(token_ids=[int(ids[0, 0]), wrong]), False)
    assert rows.sampled.tolist() == [int(ids[0, 0]), wrong]
    assert rows.ids[1].tolist() == [-1] * 8 and not rows.exact[1] and np.isnan(rows.sampled_logprob[1])
    # a token without any captured row gets an empty, inexact one
    rows = capture._output_rows(state, types.SimpleNamespace(token_ids=[int(ids[0, 0]), wrong, 7]), False)
    assert len(rows) == 3 and rows.sampled[2] == 7 and not rows.exact[2]


def _shared_steps(rng, steps: int, batch: int, width: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    """One engine step's ``[batch, width + 1]`` arrays per step (row ``j`` is request ``j``'s)."""
    out = []
    for _ in range(steps):
        rows = [_steps(rng, 1, width)[0] for _ in range(batch)]
        out.append((np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])))
    return out


def test_shared_step_rows_convert_as_own_copies_and_are_released():
    """Rows kept as references into a step's shared arrays (``add_shared``, the batched front
    end) give the same rows as per-request copies; a request holds at most ``_COMPACT_AT``
    steps' arrays (then copies its rows), however long it runs, and copies each row once."""
    import weakref

    rng = np.random.default_rng(4)
    steps = _shared_steps(rng, 3 * capture._COMPACT_AT + 5, batch=3)
    shared = [capture._Capture(8, native=False) for _ in range(3)]
    owned = [capture._Capture(8, native=False) for _ in range(3)]
    alive = []
    for ids, lps in steps:
        for j in range(3):
            shared[j].add_shared(ids, lps, j)
            owned[j].add(ids[j : j + 1], lps[j : j + 1])
        alive.append(weakref.ref(ids))
    del ids, lps
    steps.clear()
    still = sum(ref() is not None for ref in alive)
    assert 0 < still < capture._COMPACT_AT  # only the steps since the last compaction
    assert len(shared[0]._pending) == 3 + 5  # three compacted chunks, then the loose rows
    assert [e[3] - e[2] for e in shared[0]._pending[:3]] == [capture._COMPACT_AT] * 3
    n = 3 * capture._COMPACT_AT + 5
    for a, b in zip(shared, owned):
        a._convert()
        b._convert()
        x, y = a.buffer.view(0, n), b.buffer.view(0, n)
        assert a.buffer.size == n == b.buffer.size
        for name in ("ids", "sampled", "sampled_logprob", "exact"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_requests_finishing_together_convert_in_one_call(monkeypatch):
    """``convert_finishing``: the captured requests that finish in a step convert together, each
    getting exactly the rows it would convert alone; requests still running, other widths,
    native captures and requests without a capture are left as they were; stats count once."""
    rng = np.random.default_rng(5)
    steps = _shared_steps(rng, 20, batch=4)
    caps = [capture._Capture(8, native=False) for _ in range(3)] + [capture._Capture(8, native=True)]
    alone = [capture._Capture(8, native=False) for _ in range(3)]
    for ids, lps in steps:
        for j, cap in enumerate(caps):
            cap.add_shared(ids, lps, j)
        for j, cap in enumerate(alone):
            cap.add_shared(ids, lps, j)
    calls = []
    real = capture._rows_from_arrays
    monkeypatch.setattr(capture, "_rows_from_arrays", lambda *a: calls.append(len(a[0])) or real(*a))

    def processor(cap):
        return types.SimpleNamespace(**{capture._CAPTURE_ATTR: cap})

    states = {f"r{j}": types.SimpleNamespace(logprobs_processor=processor(c)) for j, c in enumerate(caps)}
    states["plain"] = types.SimpleNamespace(logprobs_processor=types.SimpleNamespace())
    outputs = [
        types.SimpleNamespace(request_id="r0", finish_reason="length"),
        types.SimpleNamespace(request_id="r1", finish_reason=None),  # still running
        types.SimpleNamespace(request_id="r2", finish_reason="stop"),
        types.SimpleNamespace(request_id="r3", finish_reason="length"),  # native
        types.SimpleNamespace(request_id="plain", finish_reason="length"),
        types.SimpleNamespace(request_id="gone", finish_reason="length"),
    ]
    before = capture.capture_stats()["rows"]
    capture.convert_finishing(outputs, states)
    assert len(calls) == 1 and calls[0] > 2  # one call for r0 and r2 together
    assert capture.capture_stats()["rows"] - before == 40
    assert not caps[0]._pending and not caps[2]._pending and len(caps[1]._pending) == 20
    for j in (0, 2):
        alone[j]._convert()
        for name in ("ids", "sampled", "sampled_logprob", "exact"):
            np.testing.assert_array_equal(
                getattr(caps[j].buffer.view(0, 20), name), getattr(alone[j].buffer.view(0, 20), name)
            )
