"""FSDP backend: Ulysses partitioning patches (verl, skyrl) and the FSDP replay path.

- ``patches.py``: the specs of ``ulysses.nd_partition`` (verl) and ``ulysses.nd_partition_skyrl``;
  their code is in ``ulysses_nd_partition.py``.
- :func:`response_logprobs` (``replay.py``): response logprobs of an FSDP trainer's microbatch,
  renormalised over the recorded sampler support, through remove-padding and Ulysses SP.

Importing this package imports neither torch nor verl/skyrl: the public names are loaded on first
attribute access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["response_logprobs"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
