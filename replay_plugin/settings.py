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
with a toggle. Unknown ``REPLAY_PLUGIN_*`` names are reported (usually a typo). An empty value
counts as unset (a patch toggle keeps its default; a global switch stays off). Every boolean
value (these variables, the ``.pth`` guard, the per-request vLLM keys) is read by
:func:`parse_bool` or :func:`is_true`, over the one table :data:`TRUE` / :data:`FALSE`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .spec import ENV_PREFIX as PREFIX

#: Global variables and their one-line meaning (rendered into docs/reference/environment.md by scripts/sync.py).
GLOBALS: dict[str, str] = {
    "REPLAY_PLUGIN_DISABLE": "`1`: nothing is activated; nothing beyond the .pth line runs",
    "REPLAY_PLUGIN_STRICT": "`1`: a patch that cannot apply (unsupported version, missing target, "
    "fingerprint drift, failing apply) raises instead of being recorded and skipped",
    "REPLAY_PLUGIN_ALLOW_UNSUPPORTED": "`1`: apply patches to upstream versions outside the matrix (logged)",
    "REPLAY_PLUGIN_STATUS_DIR": "directory: each process writes its status there as JSON (per host, pid, rank)",
    "REPLAY_PLUGIN_LOG_LEVEL": "level of the `replay_plugin` logger (default WARNING, whatever another library "
    "sets on the root logger; the plugin's own handler prints on stderr only what no other handler prints)",
    "REPLAY_PLUGIN_MATRIX": "path of an alternative compat_matrix.yaml (to try a matrix change before shipping it)",
}

#: Spellings of true and false (compared after ``strip().lower()``).
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


class SettingError(ValueError):
    """An environment variable holds a value this plugin cannot interpret."""


def parse_bool(name: str, value: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` or empty -> False, else SettingError."""
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise SettingError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def is_true(value: str) -> bool:
    """Whether ``value`` spells true; anything else (false, garbage) is False. Never raises."""
    return value.strip().lower() in TRUE


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    """The global kill switch, by the rule the .pth guard is generated from (:func:`is_true`)."""
    env = os.environ if environ is None else environ
    return is_true(env.get("REPLAY_PLUGIN_DISABLE", ""))


@dataclass(frozen=True)
class Settings:
    """A snapshot of the global switches. Per-patch toggles are read by :meth:`toggle`."""

    disable: bool
    strict: bool
    allow_unsupported: bool
    status_dir: str | None
    log_level: str | None
    environ: Mapping[str, str]

    def toggle(self, name: str) -> bool | None:
        """The boolean variable ``name`` (a patch's ``REPLAY_PLUGIN_<PATCH>``), None when unset.

        An empty value (``VAR=``, ``export VAR=$UNSET``) is unset, as for every ``REPLAY_PLUGIN_*``
        variable (:func:`load`, the feature knobs): the patch keeps its default. Read as ``0`` it
        switched a default-on patch off on an empty expansion. An unparseable value raises
        SettingError (the registry records it, or raises in strict mode).
        """
        value = self.environ.get(name)
        if value is None or not value.strip():
            return None
        return parse_bool(name, value)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the global switches. Bad boolean values are treated as unset and reported by
    :func:`problems` (they never raise here: this runs inside the user's import)."""
    env = dict(os.environ if environ is None else environ)
    return Settings(
        disable=disabled(env),
        strict=is_true(env.get("REPLAY_PLUGIN_STRICT", "")),
        allow_unsupported=is_true(env.get("REPLAY_PLUGIN_ALLOW_UNSUPPORTED", "")),
        status_dir=env.get("REPLAY_PLUGIN_STATUS_DIR") or None,
        log_level=env.get("REPLAY_PLUGIN_LOG_LEVEL") or None,
        environ=env,
    )


def problems(known: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
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
