"""``replay-plugin bench logprobs``: support-renormalised logprobs and support capture.

Forward + backward, float32, in one process: ``support_logprobs_from_hidden`` against the
full-vocabulary path and against skyrl 0.4.0's fused support path (when importable), on random
and Zipf-distributed supports; ``support_logprobs`` against ``log_softmax`` + gather; and
``support_from_flat_logprobs`` at top_k 20 from numpy arrays and Python lists; and the cost of
``replay_plugin.metrics.mismatch_metrics`` on the step's T tokens against the support-logprob
step it accompanies (without routes, and with route agreement over 48 layers x top-8). Time is
the best of interleaved runs after a warm-up; peak memory is measured per method in a fresh
subprocess (``bench._memory``).
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

from replay_plugin.bench import Result
from replay_plugin.bench._memory import module_main, peak_delta, run_module_measure

BENCH = "logprobs"
FULL_SHAPE = {"tokens": 4096, "hidden": 1024, "vocab": 65536, "width": 32}
QUICK_SHAPE = {"tokens": 256, "hidden": 128, "vocab": 4096, "width": 8}
PEER_CHUNKS = (4096, 16384, 65536)
METRICS_ROWS = 8  # the step's T tokens as [8, T / 8] sequences
METRICS_ROUTES = (48, 8, 128)  # layers, top-k, experts (a Qwen3-30B-A3B-sized router)
METRICS_CALLS = 20  # calls per timed round (one call is ~1 ms: below the timer's noise)
FLAT_TOKENS, FLAT_TOP_K = 65536, 20


# --------------------------------------------------------------------------- inputs


def _supports(kind: str, shape: dict, seed: int = 0):
    """int32 ``[T, W]`` support rows with unique ids per row, and the sampled ids ``[T]``."""
    import numpy as np
    import torch

    t, v, w = shape["tokens"], shape["vocab"], shape["width"]
    rng = np.random.default_rng(seed)
    if kind == "random":
        ids = rng.integers(0, v, size=(t, w))
    else:
        # Zipf(1.1) over a random permutation of the vocabulary: frequent tokens recur in many
        # rows. Draw 4W per row with replacement, keep the first W distinct.
        ranks = np.arange(1, v + 1, dtype=np.float64)
        cdf = np.cumsum(ranks**-1.1)
        cdf /= cdf[-1]
        perm = rng.permutation(v)
        draws = perm[np.minimum(np.searchsorted(cdf, rng.random((t, 4 * w))), v - 1)]
        ids = np.empty((t, w), dtype=np.int64)
        for i in range(t):
            _, first = np.unique(draws[i], return_index=True)
            uniq = draws[i][np.sort(first)][:w]
            ids[i, : uniq.size] = uniq
            ids[i, uniq.size :] = rng.integers(0, v, size=w - uniq.size)
    # make every row's ids distinct (redraw duplicates until none remain)
    while True:
        srt = np.sort(ids, axis=1)
        dup_rows = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        if dup_rows.size == 0:
            break
        ids[dup_rows, -1] = rng.integers(0, v, size=dup_rows.size)
        ids[dup_rows] = rng.permuted(ids[dup_rows], axis=1)
    sampled = ids[np.arange(t), rng.integers(0, w, size=t)]
    return torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(sampled.astype(np.int64))


def _fused_inputs(kind: str, shape: dict):
    import torch

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(shape["tokens"], shape["hidden"], generator=g).requires_grad_()
    weight = (torch.randn(shape["vocab"], shape["hidden"], generator=g) * 0.02).requires_grad_()
    upstream = torch.randn(shape["tokens"], generator=g)
    support, sampled = _supports(kind, shape)
    return hidden, weight, support, sampled, upstream


def _peer():
    """skyrl 0.4.0's ``sample_support_scores``, or None with the reason."""
    try:
        from skyrl.backends.skyrl_train.utils.sample_support_replay import sample_support_scores
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"skyrl not importable here ({type(exc).__name__}: {exc})"
    return sample_support_scores, ""


def _step_fn(method: str, inputs, chunk: int | None = None) -> Any:  # a callable with a clear() attribute
    """One forward + backward of ``method`` on the fused-path inputs (gradients cleared first;
    ``step.clear()`` frees them)."""
    import torch

    hidden, weight, support, sampled, upstream = inputs

    def clear():
        hidden.grad = None
        weight.grad = None

    if method == "replay":
        from replay_plugin.core.logprobs import support_logprobs_from_hidden

        def step():
            clear()
            out, _ = support_logprobs_from_hidden(hidden, weight, sampled, support)
            torch.autograd.backward(out, upstream)

    elif method == "full":

        def step():
            clear()
            logits = hidden @ weight.t()
            out = torch.log_softmax(logits, dim=-1).gather(1, sampled.unsqueeze(1)).squeeze(1)
            torch.autograd.backward(out, upstream)

    elif method == "peer":
        peer, _ = _peer()

        def step():
            clear()
            res = peer(
                hidden,
                sampled,
                support,
                vocab_start_index=0,
                vocab_end_index=weight.shape[0],
                tp_group=None,
                lm_head_weight=weight,
                temperature=1.0,
                chunk_size=chunk,
            )
            torch.autograd.backward(res.logprobs, upstream)

    else:
        raise ValueError(method)
    step.clear = clear  # type: ignore[attr-defined]
    return step


def _logits_inputs(shape: dict):
    import torch

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(shape["tokens"], shape["vocab"], generator=g).requires_grad_()
    upstream = torch.randn(shape["tokens"], generator=g)
    support, sampled = _supports("random", shape)
    return logits, support, sampled, upstream


def _logits_step_fn(method: str, inputs) -> Any:  # a callable with a clear() attribute
    import torch

    from replay_plugin.core.logprobs import support_logprobs

    logits, support, sampled, upstream = inputs

    def clear():
        logits.grad = None

    def step():
        clear()
        if method == "logits_support":
            out, _ = support_logprobs(logits, sampled, support)
        else:
            out = torch.log_softmax(logits, dim=-1).gather(1, sampled.unsqueeze(1)).squeeze(1)
        torch.autograd.backward(out, upstream)

    step.clear = clear  # type: ignore[attr-defined]
    return step


def _interleaved_best(steps: dict, rounds: int) -> dict:
    """Best time of each step over ``rounds`` rounds that run every step once, after a warm-up."""
    for step in steps.values():
        step()
    best = {name: float("inf") for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _best_time(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def _metrics_step_fn(shape: dict, routes: bool) -> Callable[[], None]:
    """``METRICS_CALLS`` calls of ``mismatch_metrics`` on ``[8, T / 8]`` float32 logprobs (the
    trainer's requiring grad, as in a loss function; ragged rows), with routes: uint8 rollout
    routes ``[8, T / 8, L, K]`` against int64 trainer routes in another order, 10% of the (token,
    layer) pairs on another expert."""
    import torch

    from replay_plugin.metrics import mismatch_metrics

    g = torch.Generator().manual_seed(4)
    rows, cols = METRICS_ROWS, shape["tokens"] // METRICS_ROWS
    rollout = -torch.rand(rows, cols, generator=g) * 4.0
    trainer = (rollout + 0.01 * torch.randn(rows, cols, generator=g)).clamp(max=0.0).requires_grad_()
    lengths = torch.randint(cols // 2, cols + 1, (rows,), generator=g)
    lengths[0] = cols
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    kwargs = {}
    if routes:
        layers, k, experts = METRICS_ROUTES
        base = torch.randint(0, experts, (rows, cols, layers, 1), generator=g)
        engine = (base + torch.arange(k) * (experts // k)) % experts  # k distinct experts
        moved = torch.rand(rows, cols, layers, generator=g) < 0.1
        own = engine.flip(-1).clone()
        own[..., 0] = torch.where(moved, (own[..., 0] + 1) % experts, own[..., 0])
        kwargs = {"trainer_routes": own, "rollout_routes": engine.to(torch.uint8)}

    def step() -> None:
        for _ in range(METRICS_CALLS):
            mismatch_metrics(trainer, rollout, mask, **kwargs)

    return step


# --------------------------------------------------------------------------- peak memory


def _measure_here(spec: dict) -> dict:
    """Runs inside the fresh subprocess: one step of ``spec['method']``, peak RSS delta."""
    shape = spec["shape"]
    if spec["method"].startswith("logits_"):
        step = _logits_step_fn(spec["method"], _logits_inputs(shape))
    else:
        step = _step_fn(spec["method"], _fused_inputs(spec["kind"], shape), spec.get("chunk"))
    # Warm up (library initialisation, thread pools, first-touch of lazily created buffers),
    # then free the gradients so the measured step allocates them again.
    step()
    step.clear()
    gc.collect()
    return peak_delta(step)


def _measure_peak(spec: dict) -> dict:
    return run_module_measure("replay_plugin.bench.logprobs", spec)


# --------------------------------------------------------------------------- flat logprobs


def _flat_inputs(tokens: int, top_k: int):
    import numpy as np

    rng = np.random.default_rng(3)
    vocab = 151_936
    ids = rng.integers(0, vocab, size=(tokens, top_k + 1)).astype(np.int32)
    lp = -np.sort(rng.exponential(1.0, size=(tokens, top_k + 1)).cumsum(axis=1), axis=1).astype(np.float32)
    cut = rng.integers(1, top_k + 1, size=tokens)  # top-p/min-p masked tails
    lp[np.arange(top_k + 1)[None, :] > cut[:, None]] = -np.inf
    lp[:, 0] = lp[:, 1]
    ids[:, 0] = ids[:, 1]
    width = top_k + 1
    arrays: dict[str, np.ndarray] = {
        "start_indices": np.arange(tokens, dtype=np.int64) * width,
        "end_indices": np.arange(1, tokens + 1, dtype=np.int64) * width,
        "token_ids": ids.reshape(-1),
        "logprobs": lp.reshape(-1),
    }
    lists = {k: v.tolist() for k, v in arrays.items()}
    return arrays, lists


def _metrics_results(best: dict, shape: dict, repeats: int) -> list[Result]:
    t_step = best["replay"]
    t_plain = best["metrics"] / METRICS_CALLS
    t_routes = best["metrics_routes"] / METRICS_CALLS
    grid = f"[{METRICS_ROWS}, {shape['tokens'] // METRICS_ROWS}]"
    layers, k, _ = METRICS_ROUTES
    rounds = f"best of {repeats} rounds interleaved with the step, {METRICS_CALLS} calls a round"
    return [
        Result(BENCH, "metrics_time", t_plain * 1e3, "ms", note=f"mismatch_metrics, {grid} float32, {rounds}"),
        Result(
            BENCH,
            "metrics_cost_per_support_step",
            t_plain / t_step,
            "x",
            goal="<= 0.01",
            note=f"metrics cost / support-logprob step (T={shape['tokens']}): mismatch_metrics on the "
            "step's tokens vs support_logprobs_from_hidden fwd+bwd (fused_random_time)",
        ),
        Result(
            BENCH,
            "metrics_routes_time",
            t_routes * 1e3,
            "ms",
            note=f"with route agreement, routes {grid[:-1]}, {layers}, {k}] uint8 (engine) vs int64 (trainer)",
        ),
        Result(
            BENCH,
            "metrics_routes_cost_per_support_step",
            t_routes / t_step,
            "x",
            note=f"route agreement grows with layers x top-k ({layers} x {k}), not with the LM-head step",
        ),
    ]


# --------------------------------------------------------------------------- run


def run(quick: bool = False) -> list[Result]:
    """Measure and return the results (see the module docstring)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return [Result(BENCH, "(not available)", None, note=f"torch is required: {exc}")]
    from replay_plugin.core.support import support_from_flat_logprobs

    shape = QUICK_SHAPE if quick else FULL_SHAPE
    repeats = 2 if quick else 5
    shape_note = "T={tokens} H={hidden} V={vocab} W={width} float32".format(**shape)
    results: list[Result] = []
    peer, peer_reason = _peer()
    py = f"python {sys.version_info.major}.{sys.version_info.minor}"

    for kind in ("random", "zipf"):
        inputs = _fused_inputs(kind, shape)
        # The plugin and the peer (each chunk size) run interleaved, round after round, so a
        # neighbour's load on the shared machine hits all of them alike; best round each.
        fast = {"replay": _step_fn("replay", inputs)}
        chunks = PEER_CHUNKS[1:2] if quick else PEER_CHUNKS
        if peer is not None:
            fast.update({f"peer_{c}": _step_fn("peer", inputs, c) for c in chunks})
        if kind == "random":  # the metrics a trainer logs next to this step, in the same rounds
            fast["metrics"] = _metrics_step_fn(shape, routes=False)
            fast["metrics_routes"] = _metrics_step_fn(shape, routes=True)
        best = _interleaved_best(fast, repeats)
        t_replay = best["replay"]
        if kind == "random":
            results.extend(_metrics_results(best, shape, repeats))
        full_repeats = 1 if not quick else repeats  # ~10 s a step at full size
        t_full = _best_time(_step_fn("full", inputs), full_repeats)
        best_chunk, t_peer = None, None  # type: tuple[int | None, float | None]
        if peer is not None:
            best_chunk = min(chunks, key=lambda c: best[f"peer_{c}"])
            t_peer = best[f"peer_{best_chunk}"]
        del inputs
        note = f"{kind} supports, {shape_note}, {py}, fwd+bwd, best of {repeats} interleaved rounds"
        results.append(Result(BENCH, f"fused_{kind}_time", t_replay * 1e3, "ms", note=note))
        results.append(
            Result(
                BENCH,
                f"full_{kind}_time",
                t_full * 1e3,
                "ms",
                note=f"hidden @ W.T, log_softmax, gather; best of {full_repeats}",
            )
        )
        results.append(Result(BENCH, f"fused_vs_full_speedup_{kind}", t_full / t_replay, "x", goal=">= 10", note=note))
        if t_peer is None:
            results.append(Result(BENCH, f"fused_vs_peer_speedup_{kind}", None, "x", goal="> 1", note=peer_reason))
        else:
            results.append(
                Result(BENCH, f"peer_{kind}_time", t_peer * 1e3, "ms", note=f"skyrl 0.4.0, chunk_size={best_chunk}")
            )
            results.append(
                Result(
                    BENCH,
                    f"fused_vs_peer_speedup_{kind}",
                    t_peer / t_replay,
                    "x",
                    goal="> 1",
                    note=f"peer chunk_size={best_chunk} (best of {chunks})",
                )
            )

        methods = ["replay"] if quick else ["replay", "full"] + (["peer"] if peer is not None else [])
        peaks = {}
        for method in methods:
            spec = {"method": method, "kind": kind, "shape": shape, "chunk": best_chunk}
            peaks[method] = _measure_peak(spec)
        for method, m in peaks.items():
            value = None if "error" in m else m["peak_delta_bytes"] / 2**20
            mnote = m.get("error", "fresh subprocess, VmHWM - VmRSS")
            if m.get("hwm_reset") is False:
                mnote += " (clear_refs not writable: includes input construction)"
            results.append(Result(BENCH, f"{method}_{kind}_peak_memory", value, "MiB", note=mnote))
        if "peer" in peaks and "error" not in peaks["peer"] and "error" not in peaks["replay"]:
            results.append(
                Result(
                    BENCH,
                    f"fused_vs_peer_peak_memory_ratio_{kind}",
                    peaks["replay"]["peak_delta_bytes"] / peaks["peer"]["peak_delta_bytes"],
                    "x",
                    goal="<= 1",
                )
            )
        elif quick:
            results.append(
                Result(
                    BENCH,
                    f"fused_vs_peer_peak_memory_ratio_{kind}",
                    None,
                    "x",
                    goal="<= 1",
                    note="quick mode measures only the plugin's peak",
                )
            )

    # support_logprobs from logits vs log_softmax + gather
    linputs = _logits_inputs(shape)
    t_sup = _best_time(_logits_step_fn("logits_support", linputs), repeats)
    t_lsm = _best_time(_logits_step_fn("logits_full", linputs), repeats)
    del linputs
    results.append(Result(BENCH, "logits_support_time", t_sup * 1e3, "ms", note=f"{shape_note}, fwd+bwd"))
    results.append(Result(BENCH, "logits_log_softmax_time", t_lsm * 1e3, "ms", note="log_softmax + gather"))
    results.append(Result(BENCH, "logits_support_vs_log_softmax_speedup", t_lsm / t_sup, "x"))
    if not quick:
        for method in ("logits_support", "logits_full"):
            m = _measure_peak({"method": method, "shape": shape})
            value = None if "error" in m else m["peak_delta_bytes"] / 2**20
            results.append(
                Result(
                    BENCH,
                    f"{method}_peak_memory",
                    value,
                    "MiB",
                    note=m.get("error", "fresh subprocess, VmHWM - VmRSS (logits grad included)"),
                )
            )

    # support rows from flat logprobs
    tokens = 4096 if quick else FLAT_TOKENS
    arrays, lists = _flat_inputs(tokens, FLAT_TOP_K)
    for name, data, goal in (("numpy", arrays, ">= 1000000"), ("lists", lists, None)):
        t = _best_time(functools.partial(support_from_flat_logprobs, data, FLAT_TOP_K), 5)
        results.append(
            Result(
                BENCH,
                f"flat_logprobs_{name}_tokens_per_s",
                tokens / t,
                "tok/s",
                goal=goal,
                note=(
                    f"top_k {FLAT_TOP_K}, {tokens} tokens, from {'numpy arrays' if name == 'numpy' else 'Python lists'}"
                ),
            )
        )
    results.append(
        Result(
            BENCH,
            "peer_flat_logprobs_tokens_per_s",
            None,
            "tok/s",
            note="skyrl's converter lives in vllm_server_actor.py, which imports vllm and ray at module level",
        )
    )
    return results


if __name__ == "__main__":
    raise SystemExit(module_main(sys.argv[1:], run, _measure_here))
