"""The source of the one line in ``replay_plugin.pth``.

``site`` executes every ``.pth`` line that starts with ``import`` in every Python process of
the environment, twice in a venv (cpython#75723). The line therefore:

* uses the standard library only and imports nothing of this package at start-up
  (importing any module from site-packages costs about 1 ms, the finder below about 0.3 ms);
* checks ``REPLAY_PLUGIN_DISABLE`` before doing anything else;
* is idempotent (a marker attribute on the finder) and never raises or prints on the
  happy path;
* puts a finder on ``sys.meta_path`` that does nothing until the first import of a watched
  top-level name, then removes itself and hands over to ``replay_plugin._bootstrap``.

The committed ``replay_plugin.pth`` must equal :func:`pth_line` (a unit test checks it;
``python scripts/sync.py`` rewrites it).
"""

from __future__ import annotations

#: Top-level import names of every patch target (checked against compat_matrix.yaml by a test).
WATCHED = ("megatron", "skyrl", "verl", "vllm")

FINDER_SOURCE = '''
def arm(sys):
    import os
    if os.environ.get("REPLAY_PLUGIN_DISABLE", "").lower() in ("1", "true", "yes", "on"):
        return
    if any(getattr(f, "_replay_plugin_finder", 0) for f in sys.meta_path):
        return

    class ReplayPluginFinder:
        _replay_plugin_finder = 1

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] not in WATCHED:
                return None
            try:
                from replay_plugin._bootstrap import on_watched_import
                return on_watched_import(name, path, target)
            except Exception as exc:
                if getattr(exc, "replay_plugin_strict", False):
                    raise
                sys.stderr.write("replay_plugin: activation failed on import of %r: %r\\n" % (name, exc))

    sys.meta_path.insert(0, ReplayPluginFinder)

try:
    arm(sys)
except Exception:
    pass
'''


def pth_line() -> str:
    """The exact content of ``replay_plugin.pth`` (one line, starting with ``import``)."""
    source = FINDER_SOURCE.replace("WATCHED", repr(tuple(sorted(WATCHED))))
    return "import sys; exec(%r, {'sys': sys})\n" % source
