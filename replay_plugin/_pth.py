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

#: Executed only when the plugin is not disabled and no finder is armed yet. The finder is a
#: plain function carrying ``find_spec`` and a marker as attributes: compiling a class body
#: costs more start-up time than the function alone.
FINDER_SOURCE = '''
def find_spec(name, path=None, target=None):
    if name.partition(".")[0] in WATCHED:
        try:
            from replay_plugin._bootstrap import on_watched_import
            return on_watched_import(name, path, target)
        except Exception as exc:
            if getattr(exc, "replay_plugin_strict", False):
                raise
            sys.meta_path[:] = [f for f in sys.meta_path if f is not find_spec]
            sys.stderr.write("replay_plugin: activation failed on import of %r: %r\\n" % (name, exc))
find_spec.find_spec = find_spec
find_spec._replay_plugin_finder = True
sys.meta_path.insert(0, find_spec)
'''

#: The guard runs before anything is compiled: with REPLAY_PLUGIN_DISABLE set (1/true/yes/on,
#: any case) or a finder already armed (the second run of the line in a venv), nothing else runs.
GUARD = (
    'os.environ.get("REPLAY_PLUGIN_DISABLE", "").lower() in ("1", "true", "yes", "on")'
    ' or any(getattr(f, "_replay_plugin_finder", 0) for f in sys.meta_path)'
)


def pth_line() -> str:
    """The exact content of ``replay_plugin.pth`` (one line, starting with ``import``)."""
    source = FINDER_SOURCE.replace("WATCHED", repr(tuple(sorted(WATCHED))))
    return "import os, sys; %s or exec(%r, {'sys': sys})\n" % (GUARD, source)
