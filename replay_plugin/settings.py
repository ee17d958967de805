"""``REPLAY_PLUGIN_*`` environment variables.

Global switches:

=================================  ============================================================
``REPLAY_PLUGIN_DISABLE=1``        nothing is activated; nothing beyond the .pth line runs
``REPLAY_PLUGIN_<PATCH>=0/1``      per patch (name upper-cased, dots to underscores)
``REPLAY_PLUGIN_STRICT=1``         a patch that cannot apply raises instead of being skipped
``REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1``  apply patches to upstream versions outside the matrix
``REPLAY_PLUGIN_STATUS_DIR=DIR``   each process writes its status as JSON into DIR
``REPLAY_PLUGIN_LOG_LEVEL=LEVEL``  level of the ``replay_plugin`` logger
=================================  ============================================================

Feature knobs belong to a patch (``PatchSpec.knobs``) and share the prefix without colliding
with a toggle. Unknown ``REPLAY_PLUGIN_*`` names are reported (usually a typo).
This module imports only the standard library.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

PREFIX = "REPLAY_PLUGIN_"

#: Global variables and their one-line meaning (README's table is checked against this).
GLOBALS: dict[str, str] = {
    "REPLAY_PLUGIN_DISABLE": "`1`: nothing is activated; nothing beyond the .pth line runs",
    "REPLAY_PLUGIN_STRICT": "`1`: a patch that cannot apply (unsupported version, missing target, "
    "fingerprint drift, failing apply) raises instead of being recorded and skipped",
    "REPLAY_PLUGIN_ALLOW_UNSUPPORTED": "`1`: apply patches to upstream versions outside the matrix (logged)",
    "REPLAY_PLUGIN_STATUS_DIR": "directory: each process writes its status there as JSON (per host, pid, rank)",
    "REPLAY_PLUGIN_LOG_LEVEL": "level of the `replay_plugin` logger (default WARNING)",
    "REPLAY_PLUGIN_MATRIX": "path of an alternative compat_matrix.yaml (to try a matrix change before shipping it)",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class SettingError(ValueError):
    """An environment variable holds a value this plugin cannot interpret."""


def parse_bool(name: str, value: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` or empty -> False, else SettingError."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def toggle_name(patch_name: str) -> str:
    """``megatron.router_replay_scope`` -> ``REPLAY_PLUGIN_MEGATRON_ROUTER_REPLAY_SCOPE``."""
    return PREFIX + patch_name.upper().replace(".", "_").replace("-", "_")


def disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The global kill switch (same rule as the .pth line: 1/true/yes/on, any case)."""
    env = os.environ if environ is None else environ
    return env.get("REPLAY_PLUGIN_DISABLE", "").lower() in _TRUE


@dataclass(frozen=True)
class Settings:
    """A snapshot of the global switches. Per-patch toggles are read by :meth:`toggle`."""

    disable: bool
    strict: bool
    allow_unsupported: bool
    status_dir: Optional[str]
    log_level: Optional[str]
    environ: Mapping[str, str]

    def toggle(self, patch_name: str) -> Optional[bool]:
        """The patch's ``REPLAY_PLUGIN_<PATCH>`` value, or None when unset.

        An unparseable value raises SettingError (the registry records it, or raises in
        strict mode).
        """
        name = toggle_name(patch_name)
        value = self.environ.get(name)
        if value is None:
            return None
        return parse_bool(name, value)


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the global switches. Bad boolean values are treated as unset and reported by
    :func:`problems` (they never raise here: this runs inside the user's import)."""
    env = dict(os.environ if environ is None else environ)

    def flag(name: str) -> bool:
        try:
            return parse_bool(name, env.get(name, ""))
        except SettingError:
            return False

    return Settings(
        disable=disabled(env),
        strict=flag("REPLAY_PLUGIN_STRICT"),
        allow_unsupported=flag("REPLAY_PLUGIN_ALLOW_UNSUPPORTED"),
        status_dir=env.get("REPLAY_PLUGIN_STATUS_DIR") or None,
        log_level=env.get("REPLAY_PLUGIN_LOG_LEVEL") or None,
        environ=env,
    )


def problems(known: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Human-readable problems with ``REPLAY_PLUGIN_*`` variables: unknown names (with the
    closest known name) and unparseable boolean switches."""
    env = os.environ if environ is None else environ
    known_set = set(known) | set(GLOBALS)
    out: list[str] = []
    for name in sorted(env):
        if not name.startswith(PREFIX):
            continue
        if name not in known_set:
            close = difflib.get_close_matches(name, sorted(known_set), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}?" if close else ""
            out.append(f"unknown variable {name}{hint}")
    for name in ("REPLAY_PLUGIN_DISABLE", "REPLAY_PLUGIN_STRICT", "REPLAY_PLUGIN_ALLOW_UNSUPPORTED"):
        if name in env:
            try:
                parse_bool(name, env[name])
            except SettingError as exc:
                out.append(str(exc))
    return out
