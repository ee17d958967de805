"""Client side of the vLLM replay data: read it from offline outputs and served responses.

Pure (numpy and ``core``): a rollout client that talks to ``vllm serve`` needs no vLLM install.

Offline (``LLM.generate`` / ``AsyncLLM``)::

    out = llm.generate(prompts, SamplingParams(top_k=20, temperature=1.0,
                                              extra_args={"replay_sample_support": True}))
    rows = support_of(out[0].outputs[0])          # core.support.SupportRows or None
    routes = out[0].outputs[0].routed_experts      # compact ndarray (enable_return_routed_experts)

Served (``POST /v1/completions`` or ``/v1/chat/completions`` with
``"vllm_xargs": {"replay_sample_support": 1}``)::

    choice = response.json()["choices"][0]
    replay = decode_choice(choice)                 # ChoiceReplay(support=SupportRows, routed_experts=ndarray)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ReplayDataError, ReplayTypeError
from ..core.routes import ROUTE_DTYPES
from ..core.support import SupportRows
from ..core.wire import decode_array

#: The ``CompletionOutput`` attribute and the served choice key of the support rows.
SUPPORT_FIELD = "sample_support"
ROUTES_FIELD = "routed_experts"


def support_of(output: Any) -> SupportRows | None:
    """The support rows on a vLLM ``CompletionOutput`` (None when the request did not opt in)."""
    rows = getattr(output, "__dict__", {}).get(SUPPORT_FIELD)
    return rows if isinstance(rows, SupportRows) else None


class ChoiceReplay(NamedTuple):
    """Replay data of one served choice; a field is None when the response does not carry it."""

    support: SupportRows | None
    routed_experts: np.ndarray | None


def decode_support(doc: Mapping[str, Any]) -> SupportRows:
    """The ``sample_support`` document of a served choice -> ``SupportRows`` (validated)."""
    if not isinstance(doc, Mapping):
        raise ReplayTypeError(SUPPORT_FIELD, f"got {type(doc).__name__}", expected="an object of wire envelopes")
    missing = {"ids", "sampled", "sampled_logprob", "exact"} - set(doc)
    if missing:
        raise ReplayDataError(
            SUPPORT_FIELD, f"lacks {sorted(missing)}", expected="keys ids, sampled, sampled_logprob, exact"
        )
    return SupportRows(
        ids=decode_array(doc["ids"], dtypes=("int32",), ndim=2),
        sampled=decode_array(doc["sampled"], dtypes=("int32",), ndim=1),
        sampled_logprob=decode_array(doc["sampled_logprob"], dtypes=("float32",), ndim=1),
        exact=decode_array(doc["exact"], dtypes=("bool",), ndim=1),
    )


def decode_routes(doc: Mapping[str, Any]) -> np.ndarray:
    """A served ``routed_experts`` wire document -> ``[tokens, layers, topk]`` compact array."""
    if isinstance(doc, str):
        raise ReplayTypeError(
            ROUTES_FIELD,
            "is vLLM's base64 .npy string: the request did not opt in (send "
            "vllm_xargs replay_routed_experts) or the plugin's vllm.openai_fields patch is off",
            expected="a wire envelope",
        )
    return decode_array(doc, dtypes=tuple(d.name for d in ROUTE_DTYPES), ndim=3)


def decode_choice(choice: Mapping[str, Any]) -> ChoiceReplay:
    """Replay data of one served choice (a parsed JSON object)."""
    support = choice.get(SUPPORT_FIELD)
    routes = choice.get(ROUTES_FIELD)
    return ChoiceReplay(
        support=decode_support(support) if support is not None else None,
        routed_experts=decode_routes(routes) if routes is not None else None,
    )
