"""The registry: loads the patch packs, applies and reverts patches, answers the status query.

Applying a patch runs these steps in order, each able to stop it with a recorded reason: the
toggle (:meth:`Registry.initial_state`), the installed upstream version against the matrix
range, the target sources against the recorded fingerprints, the probe, then
``install(patcher)``. A patch that cannot apply never breaks the user's import: it is recorded
and logged once, and raises only under ``REPLAY_PLUGIN_STRICT=1``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import pkgutil
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pluggy

from . import compat, hooks, settings, states
from .patcher import Patcher
from .spec import (
    FingerprintDriftError,
    Hook,
    Patch,
    PatchApplyError,
    PatchError,
    PatchSpec,
    ProbeResult,
    TargetMissingError,
    UnsupportedVersionError,
)
from .states import PatchStatus

log = logging.getLogger("replay_plugin")

ENTRY_POINT_GROUP = "replay_plugin.patches"


# --------------------------------------------------------------------------- specs from packs


def spec_from_matrix(name: str, patch: Patch, matrix: compat.Matrix | None = None) -> PatchSpec:
    """The complete spec of one row of a pack's table: code from ``patch``, the rest (upstream,
    targets, versions, default, fingerprints, why) from compat_matrix.yaml."""
    m = matrix or compat.load()
    entry = m.patches.get(name)
    if entry is None:
        raise ValueError(f"patch {name} has no entry in {m.path}")
    module, _, function = patch.install.partition(":")
    return PatchSpec(
        name=name,
        upstream=entry.upstream,
        targets=entry.targets,
        versions=entry.versions,
        default=entry.default,
        why=entry.why,
        fix=entry.fix,
        remove_when=entry.remove_when,
        install=f"{module}:{function or 'install'}",
        trigger=patch.trigger or "",
        knobs=patch.knobs,
        fingerprints=entry.fingerprints,
        untested=entry.untested,
        retired=entry.retired,
    )


def pack_specs(result: Mapping[str, Patch] | Iterable[PatchSpec], pack: str = "") -> list[PatchSpec]:
    """The specs a pack's ``replay_plugin_patches`` hook returned (a table or specs)."""
    if isinstance(result, Mapping):
        specs = [spec_from_matrix(name, patch) for name, patch in result.items()]
    else:
        specs = list(result)
    for spec in specs:
        spec.pack = spec.pack or pack
    return specs


def _load(hook: Hook) -> Callable[..., Any]:
    if callable(hook):
        return hook
    assert isinstance(hook, str)
    return pkgutil.resolve_name(hook)


def _probe_of(spec: PatchSpec) -> Callable[..., ProbeResult] | None:
    """The spec's probe, else ``probe`` of the module its install function lives in (if any)."""
    if spec.probe is not None:
        return _load(spec.probe)
    if isinstance(spec.install, str):
        return getattr(importlib.import_module(spec.install.partition(":")[0]), "probe", None)
    return None


def _replaced_targets(targets: Iterable[str]) -> list[str]:
    """Targets whose current object is defined outside the target's module: another library
    replaced them (``Cls.attr = its_function``) before this plugin looked."""
    out = []
    for target in targets:
        module, _, qualname = target.partition(":")
        try:
            obj = pkgutil.resolve_name(target)
        except Exception:  # noqa: BLE001 - a missing target is reported by the fingerprint check
            continue
        defined_in = getattr(obj, "__module__", None)
        if defined_in and defined_in != module:
            name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
            out.append(f"{qualname} is now {defined_in}.{name} (replaced by another library)")
    return out


def _retired(spec: PatchSpec, version: str | None) -> str | None:
    """Why the patch is not needed at ``version`` (outside its range, inside a ``retired`` range
    of the matrix: the upstream no longer has the code it fixes), or None."""
    if version is None or compat.version_in(version, spec.versions):
        return None
    reason = compat.retired_reason(spec.retired, version)
    return None if reason is None else f"{spec.upstream} {version}: {reason}"


class _Refused(Exception):
    """A step decided the patch cannot be applied (state, reason, strict-mode error)."""

    def __init__(self, state: str, reason: str, error: type[PatchError], cause: BaseException | None = None):
        super().__init__(reason)
        self.state, self.reason, self.error, self.cause = state, reason, error, cause


# --------------------------------------------------------------------------- registry


class Registry:
    """All specs known in this process and what happened to each."""

    def __init__(self) -> None:
        self.specs: dict[str, PatchSpec] = {}
        self.patchers: dict[str, Patcher] = {}
        self.pm = pluggy.PluginManager(hooks.PROJECT)
        self.pm.add_hookspecs(hooks)
        self.packs_loaded = False
        self.lock = threading.RLock()
        self._registering: tuple[str, list[PatchSpec]] | None = None
        self.pm.hook.replay_plugin_patches.call_historic(result_callback=self._on_pack_result)

    # -- loading ------------------------------------------------------------

    def load_packs(self, strict: bool = False) -> None:
        """Register every pack of the ``replay_plugin.patches`` entry-point group once.

        Each entry point is loaded on its own (not pluggy's ``load_setuptools_entrypoints``, which
        stops at the first failure): a pack that fails is recorded and logged (raised when
        strict) and the others still load. A second install of a pack (same name) is skipped;
        ``doctor`` reports it.
        """
        with self.lock:
            if self.packs_loaded:
                return
            self.packs_loaded = True
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if self.pm.is_blocked(ep.name) or self.pm.has_plugin(ep.name):
                    continue
                try:
                    self.add_pack(ep.load(), ep.name)
                except Exception as exc:
                    message = f"patch pack {ep.name} ({ep.value}) failed to load: {exc!r}"
                    states.note(message)
                    log.warning("replay_plugin: %s", message)
                    if strict:
                        raise PatchError(message) from exc

    def add_pack(self, plugin: Any, name: str) -> list[PatchSpec]:
        """Register a pack (module or object); pluggy calls its hook, whose specs register here."""
        with self.lock:
            self._registering = (name, [])
            try:
                self.pm.register(plugin, name=name)
            except BaseException:
                if self.pm.is_registered(plugin):
                    self.pm.unregister(plugin)
                raise
            finally:
                _, added = self._registering
                self._registering = None
            return added

    def _on_pack_result(self, result: Mapping[str, Patch] | Iterable[PatchSpec]) -> None:
        pack, added = self._registering or ("", [])
        for spec in pack_specs(result, pack):
            self.register(spec)
            added.append(spec)

    def register(self, spec: PatchSpec) -> None:
        with self.lock:
            known = self.specs.get(spec.name)
            if known is not None and known is not spec:
                raise ValueError(f"patch {spec.name} registered twice (packs {known.pack!r}, {spec.pack!r})")
            self.specs[spec.name] = spec

    def known_env(self) -> set[str]:
        names = set(settings.GLOBALS)
        for spec in self.specs.values():
            names.add(spec.env)
            names.update(k.env for k in spec.knobs)
        return names

    # -- state ----------------------------------------------------------------

    @staticmethod
    def _status(spec: PatchSpec, state: str, reason: str, version: str | None = None) -> PatchStatus:
        return PatchStatus(spec.name, spec.upstream, version, state, reason, list(spec.targets), _tier(spec, version))

    def initial_state(self, spec: PatchSpec, cfg: settings.Settings) -> PatchStatus | None:
        """The state a spec has whatever is installed (toggled off, off by default, not
        implemented, unreadable toggle); None when it is to be armed. Records nothing."""
        try:
            toggle = cfg.toggle(spec.env)
        except settings.SettingError as exc:
            return self._status(spec, "error", f"{exc}; patch left off")
        if toggle is False:
            return self._status(spec, "disabled", f"{spec.env}=0")
        if toggle is None and not spec.default:
            return self._status(spec, "disabled", f"off by default; set {spec.env}=1 to enable")
        if not spec.implemented:
            return self._status(spec, "not-implemented", "spec registered; patch code not written yet")
        return None

    def arm(self, cfg: settings.Settings) -> list[PatchSpec]:
        """Record every spec's state before its upstream is imported; return the specs to apply
        when their trigger is imported. An unreadable toggle raises under strict mode."""
        with self.lock:
            armed = []
            for spec in self.specs.values():
                early = self.initial_state(spec, cfg) or self.retired_state(spec)
                states.record(early or self.waiting(spec))
                if early is None:
                    armed.append(spec)
                elif early.state == "error":
                    # an unreadable toggle leaves the patch off: said once, here (apply() is never
                    # called for a spec that is not armed)
                    log.warning("replay_plugin: patch %s not applied: %s", spec.name, early.reason)
                    if cfg.strict:
                        raise PatchError(f"patch {spec.name}: {early.reason}")
            return armed

    def waiting(self, spec: PatchSpec) -> PatchStatus:
        return self._status(spec, "not-imported", f"waiting for import of {spec.trigger}")

    def retired_state(self, spec: PatchSpec) -> PatchStatus | None:
        """``not-needed`` when the installed upstream lies in one of the spec's ``retired``
        ranges (its trigger module may not even exist there: vLLM 0.34 has no
        ``vllm.v1.sample.sampler``); the version is looked up only for specs that retire some."""
        if not spec.retired:
            return None
        version = self._installed_version(spec)
        reason = _retired(spec, version)
        return None if reason is None else self._status(spec, "not-needed", reason, version)

    def status_rows(self, cfg: settings.Settings | None = None) -> list[dict]:
        """One row per registered patch: ``name``, ``upstream``, ``version``, ``state``, ``reason``,
        ``targets``. Loads the packs' specs if nothing did yet (applies nothing, records nothing).
        An applied patch whose changes someone has since replaced reads ``replaced``, naming what
        replaced them."""
        cfg = cfg or settings.load()
        self.load_packs()
        rows = []
        for spec in sorted(self.specs.values(), key=lambda s: s.name):
            st = states.get(spec.name)
            if st is None and cfg.disable:
                st = self._status(spec, "disabled", "REPLAY_PLUGIN_DISABLE is set: nothing is activated")
            if st is None:
                st = self.initial_state(spec, cfg) or self.retired_state(spec) or self.waiting(spec)
            row = st.as_dict()
            patcher = self.patchers.get(spec.name)
            if row["state"] == "applied" and patcher is not None:
                displaced = patcher.displaced()
                if displaced:
                    row["state"] = "replaced"
                    row["reason"] = "; ".join(displaced) + ": the plugin's wrapper is no longer in place"
            rows.append(row)
        return rows

    def would_apply(self, name: str, cfg: settings.Settings | None = None) -> tuple[bool, str]:
        """Whether patch ``name`` would apply in a process of this environment with ``cfg``, and
        if not, why (its state and reason): its toggle and the installed upstream's version
        against its range, what ``status`` would show once the upstream is imported, short of
        fingerprint drift and probes (``matrix --check`` reports drift). Records nothing, imports
        no upstream."""
        cfg = cfg or settings.load()
        spec = self.specs.get(name)
        if spec is None:
            return False, "not registered (the plugin's pack did not load: `replay-plugin status`)"
        early = self.initial_state(spec, cfg)
        if early is not None:
            return False, f"{early.state}: {early.reason}"
        version = self._installed_version(spec)
        if version is None:
            return False, f"{spec.upstream} is not installed here"
        retired = _retired(spec, version)
        if retired is not None:
            return True, f"not-needed: {retired}"
        try:
            self._check_version(spec, cfg, version)
        except _Refused as refused:
            return False, f"{refused.state}: {refused.reason}"
        return True, "applies"

    # -- apply ----------------------------------------------------------------

    def apply(self, name: str, cfg: settings.Settings | None = None) -> PatchStatus:
        """Apply one patch now (its trigger module must be importable). Idempotent.

        Never raises unless ``cfg.strict``; failures are recorded as ``error`` or
        ``skipped-version`` with the reason and logged once.
        """
        cfg = cfg or settings.load()
        with self.lock:
            spec = self.specs[name]
            if name in self.patchers:
                current = states.get(name)
                assert current is not None
                return current
            early = self.initial_state(spec, cfg)
            if early is not None:
                states.record(early)
                if early.state == "error" and cfg.strict:
                    raise PatchError(f"patch {name}: {early.reason}")
                return early
            version = self._installed_version(spec)
            try:
                return self._apply(spec, cfg, version)
            except _Refused as refused:
                return self._fail(spec, cfg, version, refused)
            except PatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - never break the user's import
                return self._fail(
                    spec, cfg, version, _Refused("error", f"unexpected failure: {exc!r}", PatchApplyError, exc)
                )

    def _apply(self, spec: PatchSpec, cfg: settings.Settings, version: str | None) -> PatchStatus:
        retired = _retired(spec, version)
        if retired is not None:
            return states.record(self._status(spec, "not-needed", retired, version))
        notes = [self._check_version(spec, cfg, version)]
        if spec.fingerprints:
            notes.append(self._check_sources(spec, cfg, version))
        probe = _probe_of(spec)
        result = probe(spec) if probe is not None else None
        if result is not None and not result.needed:
            return states.record(self._status(spec, "not-needed", result.reason, version))
        if result is not None:
            notes.append(f"probe: {result.reason}")
        patcher = Patcher(spec)
        try:
            _load(spec.install)(patcher)
        except Exception as exc:
            patcher.revert()
            raise _Refused("error", f"install raised {exc!r}", PatchApplyError, exc) from exc
        self.patchers[spec.name] = patcher
        st = states.record(self._status(spec, "applied", "; ".join(notes), version))
        log.info("replay_plugin: applied %s (%s)", spec.name, st.reason)
        self.pm.hook.replay_plugin_patch_applied(spec=spec, status=st)
        return st

    @staticmethod
    def _installed_version(spec: PatchSpec) -> str | None:
        try:
            upstream = compat.load().upstreams.get(spec.upstream)
        except Exception:  # noqa: BLE001 - a broken matrix shows as "version unknown"
            return None
        return compat.installed_version(upstream)[1] if upstream else None

    @staticmethod
    def _check_version(spec: PatchSpec, cfg: settings.Settings, version: str | None) -> str:
        if version is None:
            return "version unknown (no distribution metadata)"
        if compat.version_in(version, spec.versions):
            tier = _tier(spec, version)
            note = " (source-verified: sources read, never run in CI)" if tier == "source-verified" else ""
            note = " (untested)" if tier == "untested" else note
            return f"{spec.upstream} {version} in {spec.versions}{note}"
        reason = f"{spec.upstream} {version} is outside the supported range {spec.versions}"
        if not cfg.allow_unsupported:
            raise _Refused("skipped-version", reason, UnsupportedVersionError)
        log.warning("replay_plugin: %s; applying anyway (REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1)", reason)
        return reason + ", allowed by REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1"

    @staticmethod
    def _check_sources(spec: PatchSpec, cfg: settings.Settings, version: str | None) -> str:
        """Drift on a version the matrix fingerprinted (or an unknown version) means the code we
        wrap is not the code we tested: refused. On an untested version inside the range it
        applies with a warning (strict mode refuses)."""
        check = compat.check_fingerprints(spec.targets, spec.fingerprints, version)
        if check.state == "missing":
            raise _Refused("error", check.detail, TargetMissingError)
        if check.state == "drift":
            detail = check.detail + "".join(f"; {r}" for r in _replaced_targets(spec.targets))
            recorded = version is not None and compat.recorded_for(spec.fingerprints, version) is not None
            if ((version is None or recorded) and not cfg.allow_unsupported) or cfg.strict:
                raise _Refused("error", f"fingerprint drift: {detail}", FingerprintDriftError)
            log.warning("replay_plugin: patch %s: %s; applying anyway", spec.name, detail)
            return detail
        return check.detail

    def _fail(self, spec: PatchSpec, cfg: settings.Settings, version: str | None, refused: _Refused) -> PatchStatus:
        st = states.record(self._status(spec, refused.state, refused.reason, version))
        log.warning("replay_plugin: patch %s not applied: %s", spec.name, refused.reason)
        error = refused.error(f"patch {spec.name}: {refused.reason}")
        self.pm.hook.replay_plugin_patch_failed(spec=spec, status=st, error=error)
        if cfg.strict:
            raise error from refused.cause
        return st

    # -- revert ---------------------------------------------------------------

    def revert(self, name: str) -> PatchStatus:
        """Remove this plugin's layer of one patch (refused, with a warning, when someone
        wrapped on top of it; the patch then stays ``applied`` with the reason)."""
        with self.lock:
            spec = self.specs[name]
            patcher = self.patchers.get(name)
            current = states.get(name)
            if patcher is None:
                return current or states.record(self._status(spec, "not-imported", "never applied"))
            version = current.version if current else None
            problems = patcher.revert()
            if problems:
                reason = "revert refused: " + "; ".join(problems)
                log.warning("replay_plugin: %s: %s", name, reason)
                return states.record(self._status(spec, "applied", reason, version))
            del self.patchers[name]
            return states.record(self._status(spec, "reverted", "replay_plugin.deactivate()", version))

    def revert_all(self) -> list[PatchStatus]:
        """Revert in the reverse order of application, so that a patch wrapped on top of another
        one (both ours) is removed first instead of blocking the inner one's revert."""
        with self.lock:
            return [self.revert(name) for name in reversed(list(self.patchers))]


def _tier(spec: PatchSpec, version: str | None) -> str | None:
    """The matrix tier of the installed ``version`` of the spec's upstream (compat.version_tier);
    ``unsupported`` outside the patch's own range, unless the patch is retired there (a twin of
    another line, e.g. vllm.served_endpoints_disagg on vLLM 0.25+: ``not-needed`` on a version the
    matrix supports, whose tier is the upstream's)."""
    if version is None:
        return None
    try:
        if not compat.version_in(version, spec.versions) and not compat.retired_reason(spec.retired, version):
            return "unsupported"
        upstream = compat.load().upstreams.get(spec.upstream)
        return compat.version_tier(upstream, version) if upstream else None
    except Exception:  # noqa: BLE001 - a status row never fails over its tier
        return None


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.Lock()


def get() -> Registry:
    """The process-wide registry."""
    global _REGISTRY
    with _REGISTRY_LOCK:
        if _REGISTRY is None:
            _REGISTRY = Registry()
        return _REGISTRY


def would_apply(name: str, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """:meth:`Registry.would_apply` for a process with ``environ`` (default: this one's), with
    ``REPLAY_PLUGIN_DISABLE`` taken into account; loads the packs' specs if nothing did yet."""
    import os

    env = dict(os.environ if environ is None else environ)
    if settings.disabled(env):
        return False, "REPLAY_PLUGIN_DISABLE is set"
    reg = get()
    reg.load_packs()
    return reg.would_apply(name, settings.load(env))


def block_pack(name: str) -> None:
    """Do not load the pack registered under entry-point ``name`` (call before activation)."""
    get().pm.set_blocked(name)
