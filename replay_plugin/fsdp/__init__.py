"""FSDP backend: Ulysses partitioning patches (verl, skyrl) and the FSDP replay path.

- ``patches.py``: the specs of ``ulysses.nd_partition`` (verl) and ``ulysses.nd_partition_skyrl``;
  their code is in ``ulysses_nd_partition.py``.
- :func:`response_logprobs` (``replay.py``): response logprobs of an FSDP trainer's microbatch,
  renormalised over the recorded sampler support, through remove-padding and Ulysses SP.
- :func:`replay_routes` / :func:`record_routes` (``route_replay.py``): routed-expert replay for
  Hugging Face MoE models; families and their weight formulas in ``hf_moe.py``, finding a model's
  MoE layers (and refusing the ones replay cannot reach) in ``moe_layers.py``, route checks and
  layouts in ``route_layout.py``, the patches ``transformers.moe_router_replay.<family>`` in
  ``moe_router_replay.py``.

Importing this package imports neither torch nor verl/skyrl/transformers: the public names are loaded on first
attribute access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record_routes", "replay_routes", "response_logprobs"]


def __getattr__(name: str) -> Any:
    if name == "response_logprobs":
        from . import replay

        return replay.response_logprobs
    if name in __all__:
        from . import route_replay

        return getattr(route_replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
