"""replay-plugin: routed-expert replay (R3) and bounded sampler-support replay for stock
Megatron-core, vLLM and FSDP/Ulysses RL jobs.

Installing the wheel is enough: a ``.pth`` line activates the plugin on the first import of a
patched upstream in every process. This module imports nothing heavy; the functions below are
the explicit controls.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "status"]


def activate() -> bool:
    """Arm every patch (idempotent). Needed only where ``.pth`` files are not processed
    (``python -S``/``-I``, ``pip install --target`` directories). Returns False when
    ``REPLAY_PLUGIN_DISABLE=1``."""
    from ._bootstrap import activate as _activate

    return _activate()


def deactivate() -> list:
    """Revert every patch this plugin applied in this process; returns their statuses."""
    from ._bootstrap import deactivate as _deactivate

    return _deactivate()


def status() -> list[dict]:
    """One record per registered patch in this process: ``name``, ``upstream``, ``version``,
    ``state``, ``reason``, ``targets`` (patches whose upstream is not imported yet show
    ``not-imported``, or their toggle state)."""
    from .registry import get

    return get().status_rows()
