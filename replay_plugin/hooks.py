"""pluggy hook specifications: the extension surface of replay-plugin.

A *patch pack* is a module registered under the entry-point group ``replay_plugin.patches``
that implements :func:`replay_plugin_patches`. This package's own packs return a table whose
metadata lives in compat_matrix.yaml (see docs/development.md, "Adding a patch"); a third-party pack returns
complete ``PatchSpec`` objects::

    from replay_plugin.hooks import hookimpl
    from replay_plugin.spec import PatchSpec

    @hookimpl
    def replay_plugin_patches():
        return [PatchSpec(name="mysite.fix", upstream="megatron-core", ...)]

What pluggy does here: it discovers nothing itself (the registry loads each entry point so
that one broken pack cannot stop the others), but it blocks packs by name
(``replay_plugin.registry.block_pack(name)``, pytest's ``-p no:NAME``), calls each pack's hook as
the pack registers (a historic hook), and lets observers (telemetry, a site policy that fails a
job on a skipped patch) see every applied or failed patch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .spec import Patch, PatchSpec
    from .states import PatchStatus

PROJECT = "replay_plugin"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(historic=True)
def replay_plugin_patches() -> Mapping[str, Patch] | Iterable[PatchSpec]:
    """The pack's patches: ``{name: Patch}`` (metadata from compat_matrix.yaml) or specs.

    Called once per pack, when the pack registers.
    """


@hookspec
def replay_plugin_patch_applied(spec: PatchSpec, status: PatchStatus) -> None:
    """Observe a patch that was applied."""


@hookspec
def replay_plugin_patch_failed(spec: PatchSpec, status: PatchStatus, error: BaseException) -> None:
    """Observe a patch that failed to apply (``status.state`` is ``error`` or ``skipped-version``)."""
