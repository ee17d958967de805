"""What a patch is: its specification, the row a pack declares it with, its feature knobs, the
result of its probe and the errors of applying it.

Imports nothing from this package and nothing outside the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

#: Prefix of every environment variable of the plugin.
ENV_PREFIX = "REPLAY_PLUGIN_"


def toggle_name(patch_name: str) -> str:
    """``megatron.router_replay_scope`` -> ``REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE``."""
    return ENV_PREFIX + patch_name.upper().replace(".", "_").replace("-", "_")


# --------------------------------------------------------------------------- errors


class PatchError(RuntimeError):
    """A patch could not be applied (raised only under REPLAY_PLUGIN_STRICT=1)."""

    #: lets the .pth finder re-raise it instead of logging it (strict mode asked for it)
    replay_plugin_strict = True


class UnsupportedVersionError(PatchError):
    """The installed upstream is outside the patch's supported range."""


class FingerprintDriftError(PatchError):
    """The target's source differs from what the matrix recorded for this version."""


class TargetMissingError(PatchError):
    """A target named by the patch does not exist in the installed upstream."""


class UndeclaredTargetError(PatchError):
    """A patch tried to change an object its spec does not list among its targets."""


class PatchApplyError(PatchError):
    """The patch's install function raised."""


# --------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Knob:
    """A feature setting of a patch, read from the environment by the patch's own code."""

    env: str
    default: str
    help: str


@dataclass(frozen=True)
class ProbeResult:
    """``needed=False`` makes the registry report ``not-needed`` with ``reason``."""

    needed: bool
    reason: str


@dataclass(frozen=True)
class Patch:
    """One row of a pack's table (``{patch name: Patch(...)}``); everything else about the patch
    (upstream, targets, versions, default, fingerprints, why) comes from compat_matrix.yaml.

    ``install``: ``"module"`` (its ``install(patcher)``) or ``"module:function"``; the module's
    ``probe(spec)``, when it defines one, decides whether the upstream still needs the patch.
    ``trigger``: the module whose import applies the patch (default: the first target's module).
    """

    install: str
    trigger: str | None = None
    knobs: tuple[Knob, ...] = ()


Hook = str | Callable[..., Any] | None


@dataclass
class PatchSpec:
    """One patch, complete. ``install is None`` means registered but not implemented yet.

    ``install`` and ``probe`` are callables or ``"module:function"`` strings, loaded only when the
    trigger module is imported.
    """

    name: str
    upstream: str
    targets: tuple[str, ...]
    versions: SpecifierSet
    default: bool
    why: str
    fix: str
    remove_when: str
    install: Hook = None
    probe: Hook = None
    trigger: str = ""
    knobs: tuple[Knob, ...] = ()
    fingerprints: dict[str, dict[str, str]] = field(default_factory=dict)
    untested: dict[str, str] = field(default_factory=dict)
    #: version ranges outside ``versions`` where the upstream no longer has what the patch fixes
    #: (compat_matrix.yaml ``retired``): the patch is ``not-needed`` there, with the reason
    retired: dict[str, str] = field(default_factory=dict)
    pack: str = ""

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if not self.targets:
            raise ValueError(f"patch {self.name}: no targets")
        if not self.trigger:
            self.trigger = self.targets[0].partition(":")[0]
        for knob in self.knobs:
            if knob.env == self.env:
                raise ValueError(f"patch {self.name}: knob {knob.env} collides with the patch toggle")

    @property
    def env(self) -> str:
        """The on/off toggle, ``REPLAY_PLUGIN_<NAME>``."""
        return toggle_name(self.name)

    @property
    def implemented(self) -> bool:
        return self.install is not None
