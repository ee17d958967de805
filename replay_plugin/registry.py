"""Patch specifications and the machinery that applies and reverts them.

A :class:`PatchSpec` describes one patch: which upstream and targets, the supported versions,
default, environment toggle, why it exists, the upstream fix and when it can go, plus the code
that installs it (``install``, a ``"module:function"`` string loaded only when the target is
imported) and an optional ``probe`` that reports ``not-needed`` when the upstream is already
fixed. Our own specs take everything but code from ``compat_matrix.yaml``
(:meth:`PatchSpec.from_matrix`), so the matrix and the registry cannot disagree silently.

``install(patcher)`` changes upstream objects only through the :class:`Patcher` it is given,
which wraps with :class:`PluginWrapper` (a ``wrapt.FunctionWrapper`` carrying the patch name as
its marker) and remembers every change so that revert removes exactly this plugin's layer and
refuses, with a warning, when someone else wrapped on top of it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import pluggy
import wrapt
from packaging.specifiers import SpecifierSet

from . import compat, hooks, settings, status
from .status import PatchStatus

log = logging.getLogger("replay_plugin")

ENTRY_POINT_GROUP = "replay_plugin.patches"


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


class PatchApplyError(PatchError):
    """The patch's install function raised."""


# --------------------------------------------------------------------------- specs


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


Hook = Union[str, Callable[..., Any], None]


@dataclass
class PatchSpec:
    """One patch. ``install is None`` means registered but not implemented yet."""

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
    trigger: Optional[str] = None
    knobs: tuple[Knob, ...] = ()
    fingerprints: dict[str, dict[str, str]] = field(default_factory=dict)
    untested: dict[str, str] = field(default_factory=dict)
    pack: str = ""

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if not self.targets:
            raise ValueError(f"patch {self.name}: no targets")
        if self.trigger is None:
            self.trigger = self.targets[0].partition(":")[0]
        for knob in self.knobs:
            if knob.env == self.env:
                raise ValueError(f"patch {self.name}: knob {knob.env} collides with the patch toggle")

    @property
    def env(self) -> str:
        """The on/off toggle, ``REPLAY_PLUGIN_<NAME>``."""
        return settings.toggle_name(self.name)

    @property
    def implemented(self) -> bool:
        return self.install is not None

    @classmethod
    def from_matrix(
        cls,
        name: str,
        *,
        targets: tuple[str, ...],
        install: Hook,
        probe: Hook = None,
        trigger: Optional[str] = None,
        knobs: tuple[Knob, ...] = (),
        matrix: Optional[compat.Matrix] = None,
    ) -> "PatchSpec":
        """Build a spec whose metadata comes from compat_matrix.yaml.

        ``targets`` is what the code wraps; it must equal the matrix's list (else ValueError:
        the two drifted apart).
        """
        m = matrix or compat.load()
        entry = m.patches.get(name)
        if entry is None:
            raise ValueError(f"patch {name} has no entry in {m.path}")
        if tuple(targets) != entry.targets:
            raise ValueError(
                f"patch {name}: code targets {list(targets)} differ from the matrix's {list(entry.targets)}"
            )
        return cls(
            name=name,
            upstream=entry.upstream,
            targets=entry.targets,
            versions=entry.versions,
            default=entry.default,
            why=entry.why,
            fix=entry.fix,
            remove_when=entry.remove_when,
            install=install,
            probe=probe,
            trigger=trigger,
            knobs=knobs,
            fingerprints=entry.fingerprints,
            untested=entry.untested,
        )


def _load_hook(hook: Hook) -> Callable[..., Any]:
    if callable(hook):
        return hook
    assert isinstance(hook, str)
    module_name, _, attr = hook.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- wrapping


class PluginWrapper(wrapt.FunctionWrapper):
    """A ``wrapt.FunctionWrapper`` that carries the name of the patch that installed it.

    Note: wrapt proxies report the wrapped object's ``__class__``; test with
    ``type(obj) is PluginWrapper`` or :func:`patch_marker`.
    """

    def __init__(self, wrapped: Any, wrapper: Callable[..., Any], patch_name: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_replay_patch = patch_name

    @property
    def replay_plugin_patch(self) -> str:
        return self._self_replay_patch


def patch_marker(obj: Any) -> Optional[str]:
    """The patch name if ``obj`` is (or, through ``__wrapped__``, contains) our wrapper."""
    seen = 0
    while obj is not None and seen < 32:
        if _is_plugin_wrapper(obj):
            return obj._self_replay_patch
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return None


def _is_plugin_wrapper(obj: Any) -> bool:
    return issubclass(type(obj), PluginWrapper)


_MISSING = object()


@dataclass
class _Change:
    owner: Any
    attr: str
    new: Any
    old: Any  # _MISSING when the attribute came from a base class or did not exist


class Patcher:
    """What an ``install`` function uses to change upstream objects, reversibly."""

    def __init__(self, spec: PatchSpec) -> None:
        self.spec = spec
        self.changes: list[_Change] = []
        self._on_revert: list[Callable[[], None]] = []

    def wrap(self, target: str, wrapper: Callable[..., Any]) -> PluginWrapper:
        """Wrap ``module:qual.name`` with ``wrapper(wrapped, instance, args, kwargs)``.

        The class attribute (not a bound copy) is replaced, so every instance and every
        caller that looks the name up at call time sees the wrapper. Wrapping a target that
        already carries this patch's marker is a no-op that returns the existing wrapper.
        """
        module_name, _, qualname = target.partition(":")
        module = importlib.import_module(module_name)
        parent, attr, original = wrapt.resolve_path(module, qualname)
        current = inspect.getattr_static(parent, attr)
        if _is_plugin_wrapper(current) and current._self_replay_patch == self.spec.name:
            return current
        old = parent.__dict__.get(attr, _MISSING) if hasattr(parent, "__dict__") else _MISSING
        wrapper_obj = PluginWrapper(original, wrapper, self.spec.name)
        setattr(parent, attr, wrapper_obj)
        self.changes.append(_Change(parent, attr, wrapper_obj, old))
        return wrapper_obj

    def set(self, owner: Any, attr: str, value: Any) -> None:
        """Set ``owner.attr = value``; revert restores the old value (or deletes it)."""
        old = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attr, _MISSING)
        setattr(owner, attr, value)
        self.changes.append(_Change(owner, attr, value, old))

    def on_revert(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the patch is reverted (after the attribute changes are undone)."""
        self._on_revert.append(callback)

    def revert(self) -> list[str]:
        """Undo the changes in reverse order. Returns the problems (a change someone else
        wrapped on top of is left in place and reported)."""
        problems: list[str] = []
        for change in reversed(self.changes):
            current = change.owner.__dict__.get(change.attr, _MISSING) if hasattr(
                change.owner, "__dict__"
            ) else getattr(change.owner, change.attr, _MISSING)
            if current is change.new:
                if change.old is _MISSING:
                    try:
                        delattr(change.owner, change.attr)
                    except AttributeError:
                        pass
                else:
                    setattr(change.owner, change.attr, change.old)
                continue
            if _wraps(current, change.new):
                problems.append(
                    f"{_name(change.owner)}.{change.attr} was wrapped on top of the plugin by "
                    f"{type(current).__module__}.{type(current).__qualname__}; left in place"
                )
            else:
                problems.append(f"{_name(change.owner)}.{change.attr} was replaced by someone else; left as is")
        if not problems:
            self.changes.clear()
            for callback in reversed(self._on_revert):
                callback()
            self._on_revert.clear()
        return problems


def _wraps(obj: Any, inner: Any) -> bool:
    seen = 0
    while obj is not None and seen < 32:
        obj = getattr(obj, "__wrapped__", None)
        if obj is inner:
            return True
        seen += 1
    return False


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


# --------------------------------------------------------------------------- registry


class Registry:
    """All specs known in this process and what happened to each."""

    def __init__(self) -> None:
        self.specs: dict[str, PatchSpec] = {}
        self.patchers: dict[str, Patcher] = {}
        self.pm = pluggy.PluginManager(hooks.PROJECT)
        self.pm.add_hookspecs(hooks)
        self.blocked: set[str] = set()
        self.packs_loaded = False
        self.lock = threading.RLock()

    # -- loading ------------------------------------------------------------

    def load_packs(self, strict: bool = False) -> None:
        """Register every pack of the ``replay_plugin.patches`` entry-point group once.

        A pack that fails to load is recorded as a status event and logged (raised when
        strict); the other packs still load.
        """
        with self.lock:
            if self.packs_loaded:
                return
            self.packs_loaded = True
            seen: set[str] = set()
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in seen or ep.name in self.blocked:
                    continue  # a second install of the same pack (doctor reports it)
                seen.add(ep.name)
                try:
                    self.add_pack(ep.load(), ep.name)
                except Exception as exc:  # noqa: BLE001
                    message = f"patch pack {ep.name} ({ep.value}) failed to load: {exc!r}"
                    status.note(message)
                    log.warning("replay_plugin: %s", message)
                    if strict:
                        raise PatchError(message) from exc

    def add_pack(self, plugin: Any, name: str) -> list[PatchSpec]:
        """Register a pack object/module and the specs it returns."""
        with self.lock:
            if self.pm.get_plugin(name) is None:
                self.pm.register(plugin, name=name)
            impl = getattr(plugin, "replay_plugin_patches", None)
            specs = list(impl() if impl is not None else [])
            for spec in specs:
                self.register(spec, pack=name)
            return specs

    def register(self, spec: PatchSpec, pack: str = "") -> None:
        with self.lock:
            if spec.name in self.specs and self.specs[spec.name] is not spec:
                raise ValueError(f"patch {spec.name} registered twice (packs {self.specs[spec.name].pack!r}, {pack!r})")
            spec.pack = spec.pack or pack
            self.specs[spec.name] = spec

    def known_env(self) -> set[str]:
        names = set(settings.GLOBALS)
        for spec in self.specs.values():
            names.add(spec.env)
            names.update(k.env for k in spec.knobs)
        return names

    # -- state ----------------------------------------------------------------

    def _status(self, spec: PatchSpec, state: str, reason: str, version: Optional[str] = None) -> PatchStatus:
        st = PatchStatus(spec.name, spec.upstream, version, state, reason, list(spec.targets))
        status.record(st)
        return st

    def initial_state(self, spec: PatchSpec, cfg: settings.Settings) -> Optional[PatchStatus]:
        """The state a spec has before its target is imported; None when it should be armed."""
        try:
            toggle = cfg.toggle(spec.name)
        except settings.SettingError as exc:
            if cfg.strict:
                raise PatchError(f"patch {spec.name}: {exc}") from exc
            return self._status(spec, "error", f"{exc}; patch left off")
        if toggle is False:
            return self._status(spec, "disabled", f"{spec.env}=0")
        if toggle is None and not spec.default:
            return self._status(spec, "disabled", f"off by default; set {spec.env}=1 to enable")
        if not spec.implemented:
            return self._status(spec, "not-implemented", "spec registered; patch code not written yet")
        return None

    # -- apply / revert -------------------------------------------------------

    def apply(self, name: str, cfg: Optional[settings.Settings] = None) -> PatchStatus:
        """Apply one patch now (its trigger module must be importable). Idempotent.

        Never raises unless ``cfg.strict``; failures are recorded as ``error`` or
        ``skipped-version`` with the reason and logged once.
        """
        cfg = cfg or settings.load()
        with self.lock:
            spec = self.specs[name]
            if name in self.patchers:
                current = status.get(name)
                assert current is not None
                return current
            early = self.initial_state(spec, cfg)
            if early is not None:
                return early
            try:
                return self._apply(spec, cfg)
            except PatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - never break the user's import
                st = self._status(spec, "error", f"unexpected failure: {exc!r}")
                log.warning("replay_plugin: patch %s failed: %r", name, exc)
                self.pm.hook.replay_plugin_patch_failed(spec=spec, status=st, error=exc)
                if cfg.strict:
                    raise PatchApplyError(f"patch {name}: {exc!r}") from exc
                return st

    def _fail(self, spec: PatchSpec, cfg: settings.Settings, state: str, reason: str,
              version: Optional[str], error_cls: type[PatchError], cause: Optional[BaseException] = None) -> PatchStatus:
        st = self._status(spec, state, reason, version)
        log.warning("replay_plugin: patch %s not applied: %s", spec.name, reason)
        error = error_cls(f"patch {spec.name}: {reason}")
        self.pm.hook.replay_plugin_patch_failed(spec=spec, status=st, error=error)
        if cfg.strict:
            raise error from cause
        return st

    def _apply(self, spec: PatchSpec, cfg: settings.Settings) -> PatchStatus:
        upstream = self._upstream(spec)
        _, version = compat.installed_version(upstream) if upstream else (None, None)
        notes: list[str] = []
        if version is None:
            notes.append("version unknown (no distribution metadata)")
        elif not compat.version_in(version, spec.versions):
            reason = f"{spec.upstream} {version} is outside the supported range {spec.versions}"
            if not cfg.allow_unsupported:
                return self._fail(spec, cfg, "skipped-version", reason, version, UnsupportedVersionError)
            log.warning("replay_plugin: %s; applying anyway (REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1)", reason)
            notes.append(reason + ", allowed by REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1")
        else:
            notes.append(f"{spec.upstream} {version} in {spec.versions}")

        if spec.fingerprints:
            check = compat.check_fingerprints(spec.targets, spec.fingerprints, version)
            if check.state == "missing":
                return self._fail(spec, cfg, "error", check.detail, version, TargetMissingError)
            if check.state == "drift":
                # Drift on a version the matrix fingerprinted (or an unknown version) means the
                # code we wrap is not the code we tested: leave it alone. On an untested version
                # inside the range, apply with a warning (strict mode refuses).
                refuse = version is None or compat.recorded_for(spec.fingerprints, version) is not None
                if (refuse and not cfg.allow_unsupported) or cfg.strict:
                    return self._fail(spec, cfg, "error", f"fingerprint drift: {check.detail}", version,
                                      FingerprintDriftError)
                log.warning("replay_plugin: patch %s: %s; applying anyway", spec.name, check.detail)
            notes.append(check.detail)

        probe = self.pm.hook.replay_plugin_probe(spec=spec)
        if probe is None and spec.probe is not None:
            probe = _load_hook(spec.probe)(spec)
        if probe is not None and not probe.needed:
            return self._status(spec, "not-needed", probe.reason, version)
        if probe is not None:
            notes.append(f"probe: {probe.reason}")

        patcher = Patcher(spec)
        try:
            _load_hook(spec.install)(patcher)
        except Exception as exc:  # noqa: BLE001
            patcher.revert()
            return self._fail(spec, cfg, "error", f"install raised {exc!r}", version, PatchApplyError, exc)
        self.patchers[spec.name] = patcher
        st = self._status(spec, "applied", "; ".join(notes), version)
        log.info("replay_plugin: applied %s (%s)", spec.name, st.reason)
        self.pm.hook.replay_plugin_patch_applied(spec=spec, status=st)
        return st

    def _upstream(self, spec: PatchSpec) -> Optional[compat.Upstream]:
        try:
            return compat.load().upstreams.get(spec.upstream)
        except Exception:  # noqa: BLE001
            return None

    def revert(self, name: str) -> PatchStatus:
        """Remove this plugin's layer of one patch (refused, with a warning, when someone
        wrapped on top of it; the patch then stays ``applied`` with the reason)."""
        with self.lock:
            spec = self.specs[name]
            patcher = self.patchers.get(name)
            current = status.get(name)
            if patcher is None:
                return current or self._status(spec, "not-imported", "never applied")
            problems = patcher.revert()
            version = current.version if current else None
            if problems:
                reason = "revert refused: " + "; ".join(problems)
                log.warning("replay_plugin: %s: %s", name, reason)
                return self._status(spec, "applied", reason, version)
            del self.patchers[name]
            return self._status(spec, "reverted", "replay_plugin.deactivate()", version)

    def revert_all(self) -> list[PatchStatus]:
        """Revert in the reverse order of application, so that a patch wrapped on top of another
        one (both ours) is removed first instead of blocking the inner one's revert."""
        with self.lock:
            return [self.revert(name) for name in reversed(list(self.patchers))]


_REGISTRY: Optional[Registry] = None
_REGISTRY_LOCK = threading.Lock()


def get() -> Registry:
    """The process-wide registry."""
    global _REGISTRY
    with _REGISTRY_LOCK:
        if _REGISTRY is None:
            _REGISTRY = Registry()
        return _REGISTRY


def block_pack(name: str) -> None:
    """Do not load the pack registered under entry-point ``name`` (call before activation)."""
    get().blocked.add(name)
