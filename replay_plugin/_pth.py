"""The source of the one line in ``replay_plugin.pth``.

``site`` runs every ``.pth`` line that starts with ``import`` in every Python process of the
environment, twice in a venv (cpython#75723). The line checks ``REPLAY_PLUGIN_DISABLE`` first,
uses the standard library only, imports nothing of this package at start-up, is idempotent
and silent: it puts a finder on ``sys.meta_path`` that does nothing until the first import of
a watched top-level name, then removes itself and hands over to ``replay_plugin._bootstrap``.
Start-up cost is measured by ``replay-plugin bench startup`` (docs/benchmarks.md).

The committed ``replay_plugin.pth`` equals :func:`pth_line` (``python scripts/sync.py``).
"""

from __future__ import annotations

from .settings import TRUE

#: Top-level import names of every patch target (checked against compat_matrix.yaml by a test).
WATCHED = ("megatron", "skyrl", "transformers", "trl", "verl", "vllm")

#: Executed only when the plugin is not disabled and no finder is armed yet. Compiling source
#: costs per statement, so the finder is a plain function (``find_spec`` is an attribute pointing
#: at itself), its marker lives on ``sys``, and every decision that can wait (error reporting,
#: strict mode) waits in ``_bootstrap.on_watched_import``. A failed import of the bootstrap (a
#: broken install) removes the finder, so it is not retried on every submodule import.
FINDER_SOURCE = (
    "def f(n, p=None, t=None):\n"
    " if n.partition('.')[0] in W:\n"
    "  try:\n"
    "   from replay_plugin._bootstrap import on_watched_import as o\n"
    "  except Exception:\n"
    "   return f in sys.meta_path and sys.meta_path.remove(f)\n"
    "  return o(n, p, t)\n"
    "f.find_spec = sys._replay_plugin_finder = f\n"
    "sys.meta_path.insert(0, f)"
)

#: ``sys`` attribute holding the armed finder (stays set after the bootstrap removed it, so a
#: second run of the line in a venv arms nothing).
MARKER = "_replay_plugin_finder"

#: The guard runs before the finder source is compiled: with REPLAY_PLUGIN_DISABLE true (by
#: ``settings.is_true``, generated from its table) or the line already run, nothing else happens.
GUARD = f'os.environ.get("REPLAY_PLUGIN_DISABLE", "").strip().lower() in {TRUE!r} or "{MARKER}" in sys.__dict__'


def armed_finder(sys_module=None):
    """The .pth finder if it is still on ``sys.meta_path`` (activation not triggered yet)."""
    import sys as _sys

    mod = sys_module or _sys
    finder = mod.__dict__.get(MARKER)
    return finder if finder is not None and finder in mod.meta_path else None


def pth_line() -> str:
    """The exact content of ``replay_plugin.pth`` (one line, starting with ``import``)."""
    watched = tuple(sorted(WATCHED))
    return f"import os, sys; {GUARD} or exec({FINDER_SOURCE!r}, {{'sys': sys, 'W': {watched!r}}})\n"
