"""``replay-plugin bench fsdp``: the FSDP replay path against the plain full-vocabulary path.

One training step (forward, response logprobs, backward) of a random-weight Hugging Face
Qwen3-MoE model on a remove-padding microbatch, float32, with three logprob functions:
``plain`` (``replay=False``), ``replay_logits`` and ``replay_hidden`` (hidden states and the
LM-head weight: logits never formed). Time is the best of interleaved steps; peak memory is
measured per method in a fresh subprocess (``bench._memory``) and compared with a bound that
grows with the support width, not the vocabulary.

Routed-expert replay: the ``plain`` step of a smaller-vocabulary Qwen3-MoE with and without
``replay_routes`` around it, replaying the model's own routes (so both steps send the same tokens
to the same experts and the difference is the plugin's work), and a forward-only pass.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from replay_plugin.bench import Result
from replay_plugin.bench._memory import module_main, peak_delta, run_module_measure

BENCH = "fsdp"
FULL = {"batch": 8, "seq": 640, "response": 384, "vocab": 32768, "hidden": 256, "layers": 2, "experts": 8, "width": 32}
QUICK = {"batch": 4, "seq": 96, "response": 48, "vocab": 4096, "hidden": 64, "layers": 2, "experts": 4, "width": 8}
METHODS = ("plain", "replay_logits", "replay_hidden")
ROUTES_FULL = {
    "batch": 8,
    "seq": 512,
    "response": 256,
    "vocab": 4096,
    "hidden": 256,
    "layers": 4,
    "experts": 16,
    "top_k": 4,
    "width": 8,
}
ROUTES_QUICK = {
    "batch": 2,
    "seq": 64,
    "response": 32,
    "vocab": 1024,
    "hidden": 64,
    "layers": 2,
    "experts": 8,
    "top_k": 2,
    "width": 8,
}
#: bytes per (position, candidate) allowed as extra memory over the plain path: int64 index,
#: float32 value, the gather's gradient and masks, forward and backward
BYTES_PER_CANDIDATE = 64


def _model(shape: dict, **config: Any) -> Any:
    """The benchmarks' random Qwen3-MoE (float32) of ``shape`` (hidden, layers, experts, vocab,
    seq; top_k optional); ``config`` overrides or adds Qwen3MoeConfig fields (bench trl)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    h = shape["hidden"]
    fields = dict(
        vocab_size=shape["vocab"],
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
        num_hidden_layers=shape["layers"],
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=h // 4,
        num_experts=shape["experts"],
        num_experts_per_tok=shape.get("top_k", 2),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4 * shape.get("seq", 0),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    fields.update(config)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).to(torch.float32)


def _batch(shape: dict) -> dict:
    """Left-padded prompts, full-length responses, one synthetic EOS per row, ``W``-wide rows."""
    import numpy as np
    import torch

    b, s, a, v, w = shape["batch"], shape["seq"], shape["response"], shape["vocab"], shape["width"]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, v, size=(b, s))
    am = np.zeros((b, s), dtype=np.int64)
    for i, plen in enumerate(rng.integers((s - a) // 4, s - a + 1, size=b)):
        am[i, s - a - plen :] = 1
    ids = np.where(am == 1, ids, 0)
    support = np.full((b, s, w), -1, dtype=np.int32)
    # w - 1 distinct ids of 1..v-2 per row, shifted past the row's token: distinct, never the token
    # (the FSDP entry refuses a row holding an id twice, as a normaliser would count it twice)
    others = np.stack([rng.choice(v - 2, size=w - 1, replace=False) for _ in range(b * a)]).reshape(b, a, w - 1) + 1
    support[:, s - a :, 0] = ids[:, s - a :]
    support[:, s - a :, 1:] = np.where(others >= ids[:, s - a :, None], others + 1, others)
    ids[:, -1] = 0  # EOS appended after generation: loss-bearing, no support row
    support[:, -1] = -1
    idx = torch.from_numpy(am.reshape(-1).nonzero()[0])
    pos = np.clip(am.cumsum(-1) - 1, 0, None)
    ids_t = torch.from_numpy(ids)
    return {
        "input_ids": ids_t,
        "attention_mask": torch.from_numpy(am),
        "support": torch.from_numpy(support),
        "loss_mask": torch.ones(b, a, dtype=torch.bool),
        "indices": idx,
        "packed": ids_t.reshape(-1)[idx].unsqueeze(0),
        "positions": torch.from_numpy(pos).reshape(-1)[idx].unsqueeze(0),
        "weights": torch.from_numpy(rng.uniform(0.5, 1.5, size=(b, a))).float(),
    }


def _step_fn(method: str, model, batch: dict, shape: dict) -> Any:  # a callable with a clear() attribute
    from replay_plugin.fsdp import response_logprobs

    a = shape["response"]
    common = dict(indices=batch["indices"], temperature=1.0)

    def logprobs():
        # A function of its own, as in a trainer's logprob function: the logits (or hidden
        # states) are dropped when it returns; only what autograd saved lives on to the backward.
        if method == "replay_hidden":
            hidden = model.model(
                input_ids=batch["packed"], position_ids=batch["positions"], use_cache=False
            ).last_hidden_state
            lp = response_logprobs(
                hidden,
                batch["input_ids"],
                batch["attention_mask"],
                a,
                support_ids=batch["support"],
                loss_mask=batch["loss_mask"],
                lm_head_weight=model.lm_head.weight,
                **common,
            )
        else:
            logits = model(input_ids=batch["packed"], position_ids=batch["positions"], use_cache=False).logits
            if method == "plain":
                lp = response_logprobs(logits, batch["input_ids"], batch["attention_mask"], a, replay=False, **common)
            else:
                lp = response_logprobs(
                    logits,
                    batch["input_ids"],
                    batch["attention_mask"],
                    a,
                    support_ids=batch["support"],
                    loss_mask=batch["loss_mask"],
                    **common,
                )
        return lp

    def step():
        model.zero_grad(set_to_none=True)
        (-(batch["weights"] * logprobs()).sum()).backward()

    step.clear = lambda: model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    return step


# --------------------------------------------------------------------------- peak memory


def _measure_here(spec: dict) -> dict:
    """In the fresh subprocess: one step of ``spec['method']``, its resident-set peak delta."""
    shape = spec["shape"]
    model = _model(shape)
    batch = _batch(shape)
    step = _step_fn(spec["method"], model, batch, shape)
    step()
    step.clear()
    gc.collect()
    return peak_delta(step)


def _measure_peak(spec: dict) -> dict:
    return run_module_measure("replay_plugin.bench.fsdp", spec)


# --------------------------------------------------------------------------- routed-expert replay


def _route_replay_results(quick: bool) -> list[Result]:
    """Time of the plain step (and a no_grad forward) with ``replay_routes`` over without."""
    import torch

    from replay_plugin.fsdp import record_routes, replay_routes

    shape = ROUTES_QUICK if quick else ROUTES_FULL
    repeats = 2 if quick else 5
    model = _model(shape)
    batch = _batch(shape)
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=batch["packed"], position_ids=batch["positions"], use_cache=False)
    routes = rec.routes.to(torch.uint8)  # [1, nnz, L, K]: the model's own routes, compact
    train = _step_fn("plain", model, batch, shape)

    def train_replay() -> None:
        with replay_routes(model, routes):
            train()

    def infer() -> None:
        with torch.no_grad():
            model(input_ids=batch["packed"], position_ids=batch["positions"], use_cache=False)

    def infer_replay() -> None:
        with replay_routes(model, routes):
            infer()

    steps = {"train": train, "train_replay": train_replay, "infer": infer, "infer_replay": infer_replay}
    for step in steps.values():
        step()
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(10):
        with replay_routes(model, routes):
            pass
    context_ms = (time.perf_counter() - start) / 10 * 1e3
    tokens = int(routes.shape[1])
    note = (
        f"N={tokens} tokens, {shape['layers']} MoE layers x {shape['experts']} experts top-{shape['top_k']}, "
        f"H={shape['hidden']} V={shape['vocab']} float32, best of {repeats} interleaved rounds"
    )
    steps.clear()
    gc.collect()
    return [
        Result(BENCH, "route_replay_step_time", best["train_replay"] * 1e3, "ms", note=note),
        Result(
            BENCH,
            "route_replay_context_time",
            context_ms,
            "ms",
            note="replay_routes(...) built, entered and left without a forward: route checks, model scan",
        ),
        Result(
            BENCH,
            "route_replay_vs_plain_step",
            best["train_replay"] / best["train"],
            "x",
            goal="<= 1.05",
            note="forward + backward with replay_routes (own routes) over the same step without",
        ),
        Result(
            BENCH,
            "route_replay_vs_plain_forward",
            best["infer_replay"] / best["infer"],
            "x",
            goal="<= 1.05",
            note="no_grad forward (a logprob pass) with replay_routes over without",
        ),
    ]


# --------------------------------------------------------------------------- run


def run(quick: bool = False) -> list[Result]:
    """Measure and return the results (see the module docstring)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return [Result(BENCH, "(not available)", None, note=f"torch and transformers are required: {exc}")]
    shape = QUICK if quick else FULL
    repeats = 2 if quick else 3
    model = _model(shape)
    batch = _batch(shape)
    positions = int(batch["indices"].numel())
    shape_note = (
        f"B={shape['batch']} S={shape['seq']} A={shape['response']} N={positions} V={shape['vocab']} "
        f"H={shape['hidden']} W={shape['width']} float32, fwd+bwd"
    )
    steps = {m: _step_fn(m, model, batch, shape) for m in METHODS}
    for step in steps.values():
        step()
    best = {m: float("inf") for m in METHODS}
    for _ in range(repeats):
        for m, step in steps.items():
            start = time.perf_counter()
            step()
            best[m] = min(best[m], time.perf_counter() - start)
    del steps, model, batch
    gc.collect()

    results = [
        Result(
            BENCH,
            f"{m}_step_time",
            best[m] * 1e3,
            "ms",
            note=f"{shape_note}, best of {repeats} interleaved rounds" if m == "plain" else "",
        )
        for m in METHODS
    ]
    for m in METHODS[1:]:
        results.append(
            Result(
                BENCH,
                f"{m}_speedup_vs_plain",
                best["plain"] / best[m],
                "x",
                goal=">= 1",
                note="not slower than the full-vocabulary path",
            )
        )
    peaks = {m: _measure_peak({"method": m, "shape": shape}) for m in METHODS}
    for m, p in peaks.items():
        value = None if "error" in p else p["peak_delta_bytes"] / 2**20
        note = p.get("error", "fresh subprocess, VmHWM - VmRSS over one step")
        if p.get("hwm_reset") is False:
            note += " (clear_refs not writable: includes set-up)"
        results.append(Result(BENCH, f"{m}_peak_memory", value, "MiB", note=note))
    bound = positions * (shape["width"] + 1) * BYTES_PER_CANDIDATE / 2**20
    for m in METHODS[1:]:
        if "error" in peaks[m] or "error" in peaks["plain"]:
            continue
        extra = (peaks[m]["peak_delta_bytes"] - peaks["plain"]["peak_delta_bytes"]) / 2**20
        results.append(
            Result(
                BENCH,
                f"{m}_extra_memory_vs_plain",
                extra,
                "MiB",
                goal=f"<= {bound:.3g}",
                note=f"bound N*(W+1)*{BYTES_PER_CANDIDATE} B; the vocabulary would add "
                f"N*V*4 B = {positions * shape['vocab'] * 4 / 2**20:.0f} MiB per [N, V] tensor",
            )
        )
    results.extend(_route_replay_results(quick))
    return results


if __name__ == "__main__":
    raise SystemExit(module_main(sys.argv[1:], run, _measure_here))
