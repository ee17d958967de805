"""``vllm.cpu_logprob_ranks`` on vLLM's real ``Sampler`` (no engine): the patched
``Sampler.gather_logprobs`` returns vLLM's own tensors on CPU, ties, -inf tails, NaN and sampled
tokens outside the top-N included.

The gap is cost, not values (the module docstring has the measurements); what a test can hold
is that native semantics are kept: the same ids, logprobs and ranks, in the same dtypes, as
vLLM's function, whose rank count over the vocabulary runs as stock (eagerly on CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import need

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _vllm():
    need("vllm")


def _rows(rng: np.random.Generator, t: int, vocab: int, clean: bool):
    """``[t, vocab]`` processed logprobs and sampled ids. ``clean``: every row top-k masked and
    its sampled token among its most probable (vLLM's top-k sampling: the top-N rank path);
    otherwise also NaN rows, unmasked rows and sampled tokens anywhere (the full count)."""
    import torch

    x = rng.normal(size=(t, vocab)).astype(np.float32) * 2
    x = np.round(x, 1)  # many exact ties across the vocabulary
    for i in range(t):
        kind = rng.integers(2) if clean else rng.integers(5)
        if kind in (0, 1):  # top-k masking, vLLM's processed rows
            kth = np.sort(x[i])[::-1][int(rng.integers(1, 40))]
            x[i, x[i] < kth] = -np.inf
        if kind == 2:
            x[i, rng.integers(vocab, size=3)] = np.nan
    lp = torch.from_numpy(x).log_softmax(-1)
    sampled = np.empty(t, dtype=np.int64)
    for i in range(t):
        row = lp[i].numpy()
        if clean:
            pool = np.argsort(-row, kind="stable")[: int(rng.integers(1, 4))]
        else:
            pool = np.flatnonzero(np.isfinite(row)) if rng.random() < 0.85 else np.arange(vocab)
        pool = pool if pool.size else np.arange(vocab)  # a NaN row (log_softmax of NaN)
        sampled[i] = rng.choice(pool)  # mostly a member; sometimes anything (even -inf)
    return lp, torch.from_numpy(sampled)


def test_gather_logprobs_returns_vllms_tensors():
    import torch
    from vllm.v1.sample.sampler import Sampler

    from replay_plugin.patcher import _is_plugin_wrapper

    patched = Sampler.__dict__["gather_logprobs"]
    assert _is_plugin_wrapper(patched), "vllm.cpu_logprob_ranks is not in place"
    stock = patched.__wrapped__
    rng = np.random.default_rng(0)
    fast = 0
    for t, n in [(0, 5), (1, 1), (1, 0), (32, 36), (32, 5), (7, 20), (64, 36), (3, 489)]:
        for clean in (True, False, True, False):
            lp, sampled = _rows(rng, t, 489, clean)
            got = Sampler.gather_logprobs(lp, n, token_ids=sampled)
            want = stock(lp, n, token_ids=sampled)
            assert type(got) is type(want) and tuple(got[3:]) == tuple(want[3:])  # None fields
            for a, b in zip(got[:3], want[:3]):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a.numpy(), b.numpy())
            top = want.logprobs[:, 1:]
            fast += bool(t and n and (want.logprobs[:, 0] > top[:, -1]).all())
    assert fast >= 8  # the top-N rank path ran, not only the full count
    # not float32 CPU rows: vLLM's own function
    half = torch.zeros(2, 8, dtype=torch.float64)
    got = Sampler.gather_logprobs(half, 3, token_ids=torch.zeros(2, dtype=torch.int64))
    assert got.logprobs.dtype == torch.float64
