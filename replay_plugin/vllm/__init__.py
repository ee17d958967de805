"""vLLM: the patches (``patches.py`` lists them; one module per patch, ``sample_support`` with
its two helpers ``sample_support_admission`` and ``sample_support_capture``), the
``vllm.general_plugins`` entry point (``plugin.register``) and the client helpers
(``client``: read support rows and routes from outputs and served responses).

Importing this package imports neither vllm nor numpy (the patch pack is loaded in every
process that imports a watched upstream); the client helpers load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChoiceReplay",
    "ReplayDataMissing",
    "decode_choice",
    "decode_routes",
    "decode_stream",
    "decode_support",
    "support_of",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
