"""pluggy hook specifications: the extension surface of replay-plugin.

A *patch pack* is a module (or object) registered under the entry-point group
``replay_plugin.patches`` that implements :func:`replay_plugin_patches`. Observers (telemetry,
a site policy) implement the other hooks. Example pack::

    from replay_plugin.hooks import hookimpl
    from replay_plugin.registry import PatchSpec

    @hookimpl
    def replay_plugin_patches():
        return [PatchSpec(name="mysite.fix", upstream="megatron-core", ...)]

Block a pack by its entry-point name with ``replay_plugin.registry.block_pack(name)`` before
activation (pytest's ``-p no:NAME`` idea).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .registry import PatchSpec, ProbeResult
    from .status import PatchStatus

PROJECT = "replay_plugin"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def replay_plugin_patches() -> "list[PatchSpec]":
    """Return the patch specs this pack provides (called once per process at activation)."""


@hookspec(firstresult=True)
def replay_plugin_probe(spec: "PatchSpec") -> "Optional[ProbeResult]":
    """Decide whether the installed upstream still needs ``spec``.

    Return a ``ProbeResult`` to override the spec's own probe (first non-None wins), or None to
    let the spec's probe decide. Called after the target module is imported.
    """


@hookspec
def replay_plugin_patch_applied(spec: "PatchSpec", status: "PatchStatus") -> None:
    """Observe a patch that was applied."""


@hookspec
def replay_plugin_patch_failed(spec: "PatchSpec", status: "PatchStatus", error: BaseException) -> None:
    """Observe a patch that failed to apply (``status.state == 'error'``)."""
