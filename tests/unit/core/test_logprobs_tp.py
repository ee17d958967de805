"""Vocabulary-parallel logprobs on real gloo process groups (2 and 4 CPU ranks).

Each rank holds a contiguous vocabulary shard; results and gradients must equal the unsharded
computation, and every call must make the same number of all_reduce calls whatever the data
(batches with and without synthetic EOS rows, rows whose members all live on another rank).
Support ids are checked against the global vocabulary (the sum of the shards), with every rank
raising the same error and no collective of its own.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, S, W, H, V = 3, 6, 5, 8, 24


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inputs(with_eos: bool):
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, S), generator=g)
    support = torch.full((B, S, W), -1, dtype=torch.int32)
    loss = torch.zeros(B, S, dtype=torch.bool)
    for i in range(B):
        for t in range(S - 1):
            k = int(torch.randint(1, W + 1, (1,), generator=g))
            ids = torch.randperm(V, generator=g)[:k]
            if int(y[i, t]) not in ids.tolist():
                ids[-1] = y[i, t]
            support[i, t, :k] = ids.int()
            loss[i, t] = True
    support[1, 2] = torch.tensor([0, 1, -1, -1, -1])  # all members on rank 0's shard
    y[1, 2] = 1
    support[2, 0] = -1  # no support, not loss-bearing
    loss[2, 0] = False
    if with_eos:
        loss[0, S - 1] = True
        loss[2, S - 1] = True
    traj = torch.arange(B).unsqueeze(1).expand(B, S).clone()
    upstream = torch.randn(B, S, generator=g, dtype=torch.float64)
    return hidden, weight, y, support, loss, traj, upstream


def _run(rank, world, port, fn_name, errors):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            globals()[fn_name](rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report to the parent through the queue
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    errors.put(_DONE)
    # Surprise (torch 2.13 CPU wheel, gloo): about one run in 40 under load, a rank aborts with
    # "terminate called without an active exception" (SIGABRT, exit -6) *after*
    # destroy_process_group returned on both ranks, in interpreter finalization (faulthandler:
    # no Python frame; a C++ static destructor meets a joinable thread). The checks are done and
    # reported by then, so the rank leaves without finalizers; the parent requires _DONE from
    # every rank, so a rank that dies earlier still fails the test.
    os._exit(0)


_DONE = "done"


def _spawn(fn_name: str, world: int) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_run, args=(r, world, port, fn_name, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = []
    done = 0
    while not errors.empty():
        message = errors.get()
        if message == _DONE:
            done += 1
        else:
            failures.append(message)
    for p in procs:
        if p.is_alive():
            p.kill()
            failures.append(f"pid {p.pid} timed out")
        elif p.exitcode != 0 and not failures:
            failures.append(f"pid {p.pid} exited with {p.exitcode}")
    if done != world and not failures:
        failures.append(f"{done} of {world} ranks reported their checks done")
    assert not failures, "\n".join(failures)


class _Counter:
    def __init__(self):
        self.calls = 0
        self.real = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _check_tp(rank, world):
    from replay_plugin.core.logprobs import (
        replay_logprobs,
        support_logprobs,
        support_logprobs_from_hidden,
    )

    group = dist.new_group(list(range(world)))
    shard = V // world
    lo = rank * shard
    counter = _Counter()
    torch.distributed.all_reduce = counter  # logprobs looks the function up at call time
    counts = {}
    for with_eos in (False, True):
        hidden, weight, y, support, loss, traj, upstream = _inputs(with_eos)
        for fused in (False, True):
            # unsharded reference on this process (no group: no collectives)
            h_ref = hidden.clone().requires_grad_()
            w_ref = weight.clone().requires_grad_()
            if fused:
                ref = replay_logprobs(h_ref, y, support, loss, traj, B, lm_head_weight=w_ref, temperature=0.8)
            else:
                ref = replay_logprobs(h_ref @ w_ref.t(), y, support, loss, traj, B, temperature=0.8)
            rgh, rgw = torch.autograd.grad((ref.logprobs * upstream).sum(), (h_ref, w_ref))

            h = hidden.clone().requires_grad_()
            w_local = weight[lo : lo + shard].clone().requires_grad_()
            before = counter.calls
            if fused:
                res = replay_logprobs(
                    h,
                    y,
                    support,
                    loss,
                    traj,
                    B,
                    lm_head_weight=w_local,
                    temperature=0.8,
                    vocab_start=lo,
                    tp_group=group,
                )
            else:
                res = replay_logprobs(
                    h @ w_local.t(), y, support, loss, traj, B, temperature=0.8, vocab_start=lo, tp_group=group
                )
            counts[(with_eos, fused)] = counter.calls - before
            gh, gw = torch.autograd.grad((res.logprobs * upstream).sum(), (h, w_local))
            assert torch.equal(res.valid, ref.valid) and torch.equal(res.full_vocab, ref.full_vocab)
            assert int(res.full_vocab.sum()) == (2 if with_eos else 0)
            torch.testing.assert_close(res.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gw, rgw[lo : lo + shard], rtol=1e-5, atol=1e-6)
            # hidden gradients are per-shard partial sums (column-parallel LM head convention)
            dist.all_reduce(gh, group=group)
            torch.testing.assert_close(gh, rgh, rtol=1e-5, atol=1e-6)

        # the support-only entry points: 2 collectives each
        before = counter.calls
        logits_local = (hidden @ weight.t())[..., lo : lo + shard]
        lp_sharded, _ = support_logprobs(logits_local, y, support, vocab_start=lo, tp_group=group)
        lp_fused, _ = support_logprobs_from_hidden(
            hidden, weight[lo : lo + shard], y, support, vocab_start=lo, tp_group=group
        )
        assert counter.calls - before == 4
        lp_full, _ = support_logprobs(hidden @ weight.t(), y, support)
        torch.testing.assert_close(lp_sharded, lp_full, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp_fused, lp_full, rtol=1e-5, atol=1e-6)
    # same number of collectives with and without synthetic EOS rows, fused or not
    assert set(counts.values()) == {4}, counts


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_rank(world):
    _spawn("_check_tp", world)


def _check_agree(rank, world):
    """Each rank holds different positions (as context-parallel shards do); only the last rank's
    logits hold NaN. With agree_groups every rank raises, naming the same trajectory and token."""
    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.logprobs import replay_logprobs

    _, _, y, support, loss, traj, _ = _inputs(with_eos=False)
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(rank))
    if rank == world - 1:
        logits[2, 3] = float("nan")
    tokens = torch.arange(S).expand(B, S)
    with pytest.raises(ReplayDataError) as err:
        replay_logprobs(logits, y, support, loss, traj, B, agree_groups=[dist.group.WORLD], token_index=tokens)
    assert (err.value.trajectory, err.value.token) == (2, 3)
    assert ("found by another rank" in str(err.value)) == (rank != world - 1)
    # the agreement is one all_reduce whatever the data
    counter = _Counter()
    dist.all_reduce = counter
    try:
        replay_logprobs(torch.randn(B, S, V), y, support, loss, traj, B, agree_groups=[dist.group.WORLD])
    finally:
        dist.all_reduce = counter.real
    assert counter.calls == 1


def test_ranks_agree_before_raising():
    _spawn("_check_agree", 2)


def _check_tp_vocabulary(rank, world):
    """Ids of another rank's shard are members; an id past the last shard is refused by every
    rank alike (before: dropped from the normaliser, silently), with no extra collective."""
    from replay_plugin.core.errors import ReplayDataError
    from replay_plugin.core.logprobs import (
        full_vocab_logprobs,
        replay_logprobs,
        support_logprobs,
        support_logprobs_from_hidden,
    )

    group = dist.new_group(list(range(world)))
    shard = V // world
    lo = rank * shard
    hidden, weight, y, support, loss, traj, _ = _inputs(with_eos=True)
    y, support = y.clone(), support.clone()
    support[0, 1] = torch.tensor([V - 1, 0, -1, -1, -1])  # both ends of the vocabulary: fine
    y[0, 1] = V - 1
    w_local = weight[lo : lo + shard]
    logits_local = (hidden @ weight.t())[..., lo : lo + shard]
    full = hidden @ weight.t()

    def calls(sup):
        yield "logits", lambda: support_logprobs(logits_local, y, sup, vocab_start=lo, tp_group=group)
        yield "hidden", lambda: support_logprobs_from_hidden(hidden, w_local, y, sup, vocab_start=lo, tp_group=group)
        yield (
            "replay",
            lambda: replay_logprobs(
                logits_local, y, sup, loss, traj, B, vocab_start=lo, tp_group=group, agree_groups=[group]
            ),
        )
        yield (
            "replay_hidden",
            lambda: replay_logprobs(
                hidden,
                y,
                sup,
                loss,
                traj,
                B,
                lm_head_weight=w_local,
                vocab_start=lo,
                tp_group=group,
                agree_groups=[group],
            ),
        )

    counter = _Counter()
    torch.distributed.all_reduce = counter
    try:
        good = {}
        for name, call in calls(support):
            before = counter.calls
            good[name] = (call(), counter.calls - before)
        lp_ref, _ = support_logprobs(full, y, support)
        torch.testing.assert_close(good["logits"][0][0], lp_ref, rtol=1e-5, atol=1e-6)
        for name in ("hidden", "replay", "replay_hidden"):
            lp = good[name][0][0] if name == "hidden" else good[name][0].logprobs
            torch.testing.assert_close(lp[support[..., 0] >= 0], lp_ref[support[..., 0] >= 0], rtol=1e-5, atol=1e-6)
        bad = support.clone()
        bad[2, 3] = torch.tensor([int(y[2, 3]), V, -1, -1, -1])  # V: past the last shard
        for name, call in calls(bad):
            before = counter.calls
            with pytest.raises(ReplayDataError) as err:
                call()
            assert counter.calls - before == good[name][1], name  # raised after the same collectives
            e = err.value
            assert (e.field, e.trajectory, e.token) == ("support_ids", 2, 3), (name, str(e))
            assert f"largest id {V}" in str(e) and f"split over {world} ranks" in str(e), str(e)
            assert "another rank" not in str(e)  # every rank found it itself
        # A synthetic EOS (trajectory 0's last token: loss-bearing, no support) is scored over the
        # full vocabulary: V - 1 (the last shard's last id) is fine, V and -2 are in no shard and
        # refused by every rank, found in the count that rides the SUM all-reduce (before: scored
        # -logsumexp, silently).
        for name, call in calls(support):
            if not name.startswith("replay"):
                continue
            y[0, S - 1] = V - 1
            res = call()
            ref = torch.log_softmax(full[0, S - 1], -1)[V - 1]
            torch.testing.assert_close(res.logprobs[0, S - 1].double(), ref, rtol=1e-5, atol=1e-6)
            for target in (V, -2):
                y[0, S - 1] = target
                before = counter.calls
                with pytest.raises(ReplayDataError) as err:
                    call()
                assert counter.calls - before == good[name][1], name
                e = err.value
                assert (e.field, e.trajectory, e.token) == ("sampled_ids", 0, S - 1), (name, str(e))
                assert f"sampled token {target} " in str(e) and "in no tensor-parallel rank's" in str(e), str(e)
        y[0, S - 1] = V
        with pytest.raises(ReplayDataError, match=f"token id {V} is negative or in no vocabulary shard"):
            full_vocab_logprobs(logits_local, y, vocab_start=lo, tp_group=group)
        unchecked = full_vocab_logprobs(logits_local, y, vocab_start=lo, tp_group=group, check_targets=False)
        torch.testing.assert_close(unchecked[0, S - 1].double(), -torch.logsumexp(full[0, S - 1], -1))
    finally:
        torch.distributed.all_reduce = counter.real


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_support_ids_are_checked_against_the_global_vocabulary(world):
    _spawn("_check_tp_vocabulary", world)
