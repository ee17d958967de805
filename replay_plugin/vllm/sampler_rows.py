"""Patch ``vllm.sampler_rows``: a request's ``logprob_token_ids`` no longer replaces the top-k
logprob rows of the other requests of its engine step.

Gap (vLLM 0.30-0.32, V1 runner, ``v1/sample/sampler.py``): when any request of a step sets
``logprob_token_ids`` and another asks for ``logprobs``, ``Sampler.forward`` returns the
listed-id rows for the *whole* step ("prefer logprob_token_ids"); the other requests get their
sampled token followed by token 0 at ``-inf``. Any client of a shared server could thus make
every captured support row of the step inexact. Here, in that case, the step's rows are built
per request: requests with ``logprob_token_ids`` get exactly vLLM's listed-id rows (their own
columns; the extra ``-inf`` padding columns are cut by the front end as before), every other
request gets the top-N rows it asked for. That includes requests that did not opt into replay:
a plain ``logprobs`` request of such a step gets the rows it gets in any other step, not the
sampled-token-then-token-0 rows of stock vLLM (test_offline.py shows both). Applied only in
engines running ``processed_logprobs`` (the engines capture needs): elsewhere vLLM is left as
is. Model Runner V2 (``v1/worker/gpu/sample``) is not patched. Remove when vLLM keeps
per-request rows.

vLLM 0.33 keeps the V1 sampler (its ``Sampler.forward`` gained a ROCm fused path taken only without
logprobs; ``gather_specific_token_logprobs`` is 0.32's) and runs it wherever Triton is missing
(tested there, envs/vllm033v1). 0.34 removed it: the patch is retired there (``not-needed``,
compat_matrix.yaml). Model Runner V2 builds each request's row from that request's own
``logprob_token_ids`` or the step's top-N (``compute_topk_scores``): run on 0.34, a listing
request leaves the other requests' rows exactly as they are when served alone.
"""

from __future__ import annotations

from ..patcher import Patcher

_WIDTH = "_replay_plugin_topk_width"
PROCESSED = "processed_logprobs"


def _forward(wrapped, instance, args, kwargs):
    """``Sampler.forward``: note the step's top-N when ``logprob_token_ids`` would replace it."""
    metadata = args[1] if len(args) > 1 else kwargs.get("sampling_metadata")
    n = getattr(metadata, "max_num_logprobs", None)
    if (
        n is None
        or not getattr(metadata, "logprob_token_ids", None)
        or str(getattr(instance, "logprobs_mode", "")) != PROCESSED
    ):
        return wrapped(*args, **kwargs)
    instance.__dict__[_WIDTH] = n
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.__dict__.pop(_WIDTH, None)


def _specific_rows(wrapped, instance, args, kwargs):
    """``Sampler.gather_specific_token_logprobs``: listed-id rows for the requests that listed
    ids, top-N rows for the others (N noted by ``_forward``)."""
    result = wrapped(*args, **kwargs)
    n = instance.__dict__.get(_WIDTH)
    if n is None or result is None:
        return result
    import torch

    logprobs = args[0] if args else kwargs["logprobs"]
    listed = args[1] if len(args) > 1 else kwargs["logprob_token_ids"]
    sampled = args[2] if len(args) > 2 else kwargs["sampled"]
    columns = result.logprob_token_ids.shape[1]
    width = max(int(n), columns - 1)
    top = instance.gather_logprobs(logprobs, width, token_ids=sampled)
    ids = top.logprob_token_ids.clone()
    values = top.logprobs.clone()
    rows = torch.tensor(sorted(listed), dtype=torch.long, device=ids.device)
    ids[rows, :columns] = result.logprob_token_ids[rows].to(ids.dtype)
    ids[rows, columns:] = 0
    values[rows, :columns] = result.logprobs[rows].to(values.dtype)
    values[rows, columns:] = float("-inf")
    return result._replace(logprob_token_ids=ids, logprobs=values)


def install(patcher: Patcher) -> None:
    patcher.wrap("Sampler.forward", _forward)
    patcher.wrap("Sampler.gather_specific_token_logprobs", _specific_rows)
