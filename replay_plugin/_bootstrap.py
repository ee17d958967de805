"""Activation: from the first import of a watched upstream to patches in place.

Reached three ways, all idempotent:

* the ``.pth`` finder calls :func:`on_watched_import` on the first import of ``megatron``,
  ``vllm``, ``verl`` or ``skyrl`` in a process;
* vLLM's ``vllm.general_plugins`` entry point calls :func:`activate` in every vLLM process;
* users call ``replay_plugin.activate()`` where ``.pth`` files are not processed.

:func:`activate` loads the patch packs (pluggy, entry-point group ``replay_plugin.patches``)
and registers one wrapt post-import hook per patch trigger module, so every patch is applied
right after its module executes and before user code can bind the targets. A hook never lets
an exception escape into the user's import unless ``REPLAY_PLUGIN_STRICT=1``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from . import _pth, settings, states

log = logging.getLogger("replay_plugin")

_lock = threading.RLock()
_generation = 0  # bumped by deactivate(); hooks of an older generation do nothing
_active = False


def _remove_lazy_finder() -> None:
    finder = sys.__dict__.get(_pth.MARKER)
    if finder is not None:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]


class _FallbackHandler(logging.StreamHandler):
    """The ``replay_plugin`` logger's own handler: prints a record on stderr only where no other
    handler on its way up (the plugin's loggers, the root) would print it.

    Why: a third party can mute the root. vLLM 0.30's ``vllm.entrypoints.openai.api_server`` imports
    ``model_hosting_container_standards``, which sets the root logger *and each root handler* to
    ERROR (SkyRL's server actor and verl's ``vllm_async_server`` import that module), so the plugin's
    warnings ("patch ... not applied", SkyRL's repair counts) vanished there. With its own level the
    plugin's logger creates the record; this handler prints it when the handlers above are missing,
    or set above its level, and stays quiet where they print it (no duplicate lines). Like
    ``logging.lastResort`` it looks up ``sys.stderr`` when it writes.
    """

    #: how the plugin's configuration recognises its handler (also across a reload of this module)
    replay_plugin_fallback = True

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    def handle(self, record: logging.LogRecord) -> bool:
        if _printed_elsewhere(record, self):
            return False
        return bool(super().handle(record))


def _printed_elsewhere(record: logging.LogRecord, own: logging.Handler) -> bool:
    """Whether a handler other than ``own`` on the record's way up (what ``Logger.callHandlers``
    walks) takes ``record``'s level. A ``NullHandler`` prints nothing and does not count."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            if handler is own or getattr(handler, "replay_plugin_fallback", False):
                continue
            if isinstance(handler, logging.NullHandler):
                continue
            if record.levelno >= handler.level:
                return True
        logger = logger.parent if logger.propagate else None
    return False


def _configure_logging(cfg: settings.Settings) -> None:
    """The ``replay_plugin`` logger gets a level of its own (``REPLAY_PLUGIN_LOG_LEVEL``, else
    WARNING unless someone set one before activation) and the fallback handler: its warnings show
    whatever a third party later does to the root. Prints nothing itself on the happy path."""
    if not any(getattr(h, "replay_plugin_fallback", False) for h in log.handlers):
        log.addHandler(_FallbackHandler())
    level = logging.getLevelName(cfg.log_level.strip().upper()) if cfg.log_level else None
    if isinstance(level, int):
        log.setLevel(level)
        return
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
    if cfg.log_level:
        log.warning("replay_plugin: REPLAY_PLUGIN_LOG_LEVEL=%r is not a logging level; ignored", cfg.log_level)


def activate() -> bool:
    """Load the patch packs and arm a post-import hook per patch. Idempotent.

    Returns False when ``REPLAY_PLUGIN_DISABLE=1`` (nothing is done), True otherwise.
    Already-imported targets are patched immediately.
    """
    global _active
    with _lock:
        _remove_lazy_finder()
        cfg = settings.load()
        if cfg.disable:
            return False
        if _active:
            return True
        _active = True
        _configure_logging(cfg)
        if hasattr(os, "register_at_fork") and not _fork_hook_registered:
            _register_fork_hook()
        from . import registry

        reg = registry.get()
        reg.load_packs(strict=cfg.strict)
        for problem in settings.problems(reg.known_env(), cfg.environ):
            states.note(problem)
            log.warning("replay_plugin: %s", problem)
        generation = _generation
        to_arm = reg.arm(cfg)
    # Outside the lock: hooks of already-imported modules fire right here (wrapt calls them
    # immediately), and a hook may import modules that take other threads' import locks.
    import wrapt

    for spec in to_arm:
        wrapt.register_post_import_hook(_hook(spec.name, generation), spec.trigger)
    return True


_fork_hook_registered = False


def _register_fork_hook() -> None:
    """A forked child inherits the parent's patches and records; give it its own status file."""
    global _fork_hook_registered
    _fork_hook_registered = True
    os.register_at_fork(after_in_child=states.write_file)


def _hook(name: str, generation: int):
    def on_import(module: Any) -> None:
        if generation != _generation or not _active:
            return
        from . import registry

        cfg = settings.load()
        try:
            registry.get().apply(name, cfg)
        except Exception:
            if cfg.strict:
                raise
            log.exception("replay_plugin: unexpected failure applying %s", name)

    on_import.__name__ = f"replay_plugin_apply_{name.replace('.', '_')}"
    return on_import


def deactivate() -> list:
    """Revert every patch this plugin applied in this process; hooks still pending are
    disarmed. ``activate()`` may be called again afterwards."""
    global _active, _generation
    with _lock:
        _remove_lazy_finder()
        if not _active:
            return []
        from . import registry

        _generation += 1
        _active = False
        return registry.get().revert_all()


def is_active() -> bool:
    return _active


def on_watched_import(name: str, path: Any = None, target: Any = None) -> Any | None:
    """Called by the .pth finder on the first import of a watched top-level name.

    Activates, then lets wrapt's import-hook finder answer for ``name``: the triggering
    import already passed ``sys.meta_path[0]``, so without this delegation a hook on the
    triggering module itself would never fire. (wrapt cannot chain a namespace package's
    loader, which is None in the spec: a hook on ``megatron`` itself, a namespace package,
    would not fire; patches trigger on regular packages such as ``megatron.core``.)

    Never raises into the user's import, except what strict mode asked for
    (``REPLAY_PLUGIN_STRICT=1``): anything else is reported once on stderr.
    """
    _remove_lazy_finder()
    try:
        activate()
        from wrapt.importer import ImportHookFinder

        for finder in sys.meta_path:
            if isinstance(finder, ImportHookFinder):
                return finder.find_spec(name, path, target)
        return None
    except Exception as exc:
        if getattr(exc, "replay_plugin_strict", False) or settings.load().strict:
            raise
        sys.stderr.write(f"replay_plugin: activation failed on import of {name!r}: {exc!r}\n")
        return None
