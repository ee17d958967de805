import copy
import textwrap

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from replay_plugin import compat

SPEC = SpecifierSet(">=0.16.0,<0.20")


@pytest.mark.parametrize(
    "version,inside",
    [
        ("0.16.0", True),
        ("0.16.1", True),
        ("0.19.2", True),
        ("0.19.0rc1", True),  # pre-release of a supported version: in, on purpose
        ("0.19.0.dev3", True),  # dev release likewise
        ("0.17.1+cpu", True),  # local versions compare by their public part
        ("0.19.2.post1", True),
        ("0.16.0rc1", False),  # a pre-release precedes the lower bound
        ("0.20.0rc1", False),  # PEP 440: <0.20 excludes pre-releases of 0.20
        ("0.20.0", False),
        ("0.15.3", False),
    ],
)
def test_version_in(version, inside):
    assert compat.version_in(version, SPEC) is inside


def test_local_torch_version():
    assert compat.version_in("2.13.0+cpu", SpecifierSet("==2.13.0"))
    assert compat.version_in("2.13.0+cpu", SpecifierSet(">=2.6"))


def test_invalid_version():
    with pytest.raises(compat.CompatMatrixError, match="invalid version 'banana'"):
        compat.parse_version("banana")


def _raw():
    with open(compat.default_path()) as fh:
        return yaml.safe_load(fh)


def test_shipped_matrix_validates():
    m = compat.parse(_raw())
    assert "megatron-core" in m.upstreams and "megatron.router_replay_scope" in m.patches


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r.update(schema_version=2), "schema_version must be 1"),
        (lambda r: r.update(extra=1), "unknown top-level keys"),
        (lambda r: r["upstreams"]["vllm"].update(supported="not a spec"), "not a PEP 440 specifier"),
        (lambda r: r["upstreams"]["vllm"].update(tested=["0.10.0"]), "outside supported"),
        (lambda r: r["patches"]["megatron.router_replay_scope"].pop("why"), "missing keys \\['why'\\]"),
        (lambda r: r["patches"]["megatron.router_replay_scope"].update(upstream="nope"), "upstream 'nope'"),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(env="REPLAY_PLUGIN_X"),
            "unknown keys \\[.env.\\]",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(targets=["vllm.x:y"]),
            "is not inside 'megatron'",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(default="yes"),
            "'default' must be true or false",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(fingerprints={"0.16.1": {"a:b": "x"}}),
            "must hold exactly the targets",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(relies_on="megatron.core:x"),
            "'relies_on' must be a list of 'module:qualname'",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"].update(relies_on=["vllm.outputs:RequestOutput"]),
            "relies_on entry vllm.outputs:RequestOutput is not inside 'megatron'",
        ),
        (
            lambda r: r["patches"]["megatron.router_replay_scope"]["relies_on"].append("megatron.core.x:Y"),
            "fingerprints\\[0.16.0\\] must hold exactly the targets and relied-on names",
        ),
        (
            lambda r: r["upstreams"]["vllm"].update(source_verified={"0.40.0": "read"}),
            "source-verified version 0.40.0 is outside supported",
        ),
        (
            lambda r: r["upstreams"]["vllm"].update(source_verified={"0.30.0": "read"}),
            "version 0.30.0 is both tested and source-verified",
        ),
        (
            lambda r: r["upstreams"]["vllm"].update(source_verified={"0.31.0": ""}),
            "'source_verified' must map versions to the evidence",
        ),
        (
            lambda r: r["patches"]["vllm.sampler_rows"].update(retired=[">=0.34"]),
            "'retired' must map version ranges to reasons",
        ),
        (
            lambda r: r["patches"]["vllm.sampler_rows"].update(retired={">=0.34": " "}),
            "'retired' must map version ranges to reasons",
        ),
        (
            lambda r: r["patches"]["vllm.sampler_rows"].update(retired={"0.34": "gone"}),
            "retired range '0.34' is not a PEP 440 specifier set",
        ),
        (
            lambda r: r["patches"]["vllm.sampler_rows"].update(retired={">=0.33": "gone"}),
            "vllm 0.33.0 is both in versions <0.34,>=0.24.0 and retired \\(>=0.33\\)",
        ),
        (lambda r: r.update(pairings={"verl": "0.24"}), "'pairings' must be a list"),
        (lambda r: r["pairings"][0].pop("extra"), "pairings\\[0\\]: must be a mapping with exactly the keys"),
        (lambda r: r["pairings"][0].update(vllm="0.24"), "pairings\\[0\\]: 'vllm' is not a PEP 440 specifier set"),
        (lambda r: r["pairings"][0].update(version="one"), "pairings\\[0\\]: invalid version 'one'"),
        (lambda r: r["pairings"].append(dict(r["pairings"][0])), "verl 0.9.1 \\[vllm\\] is listed twice"),
    ],
)
def test_schema_errors_name_the_entry(mutate, message):
    raw = copy.deepcopy(_raw())
    mutate(raw)
    with pytest.raises(compat.CompatMatrixError, match=message):
        compat.parse(raw)


def _target_function():
    return 1


def test_source_fingerprint_ignores_wrappers():
    import functools

    @functools.wraps(_target_function)
    def wrapper():
        return _target_function()

    assert compat.source_fingerprint(wrapper) == compat.source_fingerprint(_target_function)
    assert compat.source_fingerprint(_target_function).startswith("sha256:")


WS_BASE = '''def f(x):
    """Doc."""
    y = (
        x
        + 1
    )

    return y
'''

# The fingerprint's normalisation (compat._digest): trailing whitespace of each line, a uniform
# indentation of the whole block (a method and a module-level function) and the line-end
# convention do not matter; any other change to the text does.
WS_SAME = {
    "trailing spaces and tabs": "".join(line + " \t " + "\n" for line in WS_BASE.splitlines()),
    "trailing spaces on the last line": WS_BASE.replace("return y\n", "return y    \n"),
    "whitespace on the blank line": WS_BASE.replace("\n\n", "\n        \n"),
    "CRLF line ends": WS_BASE.replace("\n", "\r\n"),
    "indented as a method": "class C:\n" + textwrap.indent(WS_BASE, "    "),
}
WS_CHANGED = {
    "whitespace inside a line": WS_BASE.replace("+ 1", "+  1"),
    "a line's indentation": WS_BASE.replace("        x\n", "          x\n"),
    "a trailing comment": WS_BASE.replace("return y\n", "return y  # note\n"),
    "a blank line removed": WS_BASE.replace("\n\n", "\n"),
    "a line joined": WS_BASE.replace("(\n        x\n        + 1\n    )", "(\n        x + 1\n    )"),
}


def _ws_fingerprints(tmp_path, monkeypatch, variants: dict) -> dict:
    """``{variant: (imported, static)}`` fingerprints of ``f`` (or ``C.f``) written to a module."""
    import pkgutil
    import sys

    root = tmp_path / "src"
    (root / "wsfp").mkdir(parents=True)
    (root / "wsfp" / "__init__.py").write_text("")
    names = {}
    for i, (label, text) in enumerate(variants.items()):
        (root / "wsfp" / f"v{i}.py").write_bytes(text.encode())
        names[label] = f"wsfp.v{i}:" + ("C.f" if text.startswith("class C") else "f")
    monkeypatch.syspath_prepend(str(root))
    try:
        out = {
            label: (compat.source_fingerprint(pkgutil.resolve_name(name)), compat.static_fingerprint(str(root), name))
            for label, name in names.items()
        }
    finally:
        for mod in [m for m in sys.modules if m == "wsfp" or m.startswith("wsfp.")]:
            del sys.modules[mod]
    return out


def test_source_fingerprint_ignores_trailing_whitespace_and_detects_other_whitespace(tmp_path, monkeypatch):
    """What the normalisation drops (above) gives the base's fingerprint, imported and read
    statically alike; a change next to it (inside a line, at a line's start, after the code,
    between lines) gives another."""
    assert all(text != WS_BASE for text in [*WS_SAME.values(), *WS_CHANGED.values()])
    prints = _ws_fingerprints(tmp_path, monkeypatch, {"base": WS_BASE, **WS_SAME, **WS_CHANGED})
    base = prints["base"][0]
    assert prints["base"] == (base, base)
    for label in WS_SAME:
        assert prints[label] == (base, base), label
    for label in WS_CHANGED:
        imported, static = prints[label]
        assert imported == static != base, label
    assert len({prints[label][0] for label in WS_CHANGED}) == len(WS_CHANGED)


def test_check_fingerprints_states():
    target = f"{__name__}:_target_function"
    fp = compat.source_fingerprint(_target_function)
    assert compat.check_fingerprints((target,), {"1.0": {target: fp}}, "1.0").state == "match"
    assert compat.check_fingerprints((target,), {"1.0": {target: fp}}, "1.0+cpu").state == "match"
    assert compat.check_fingerprints((target,), {"1.0": {target: "sha256:0"}}, "1.0").state == "drift"
    assert compat.check_fingerprints((target,), {"1.0": {target: fp}}, "1.1").state == "known"
    assert compat.check_fingerprints((target,), {"1.0": {target: "sha256:0"}}, "1.1").state == "drift"
    assert compat.check_fingerprints((target,), {}, "1.1").state == "unrecorded"
    missing = compat.check_fingerprints((f"{__name__}:nope",), {}, "1.0")
    assert missing.state == "missing" and not missing.ok


def test_check_fingerprints_names_changed_relied_on_code():
    target, relied = f"{__name__}:_target_function", f"{__name__}:_relied_function"
    t, r = compat.source_fingerprint(_target_function), compat.source_fingerprint(_relied_function)
    prints = {"1.0": {target: t, relied: r}, "2.0": {target: t, relied: "sha256:0"}}
    both = (target,), prints

    def check(version):
        return compat.check_fingerprints(*both, version, relies_on=(relied,))

    assert check("1.0").state == "match"
    drift = check("2.0")  # the wrapped function is the same, what it relies on is not
    assert drift.state == "drift" and drift.changed_targets == [] and drift.changed_relied_on == [relied]
    assert drift.detail == f"relied-on {relied} differs from the fingerprint recorded for 2.0"
    assert check("1.5").state == "known"  # unrecorded, but equal to 1.0
    # the runtime check (targets only) does not see relied-on drift
    assert compat.check_fingerprints(*both, "2.0").state == "match"
    prints = {"1.0": {target: "sha256:1", relied: "sha256:2"}, "3.0": {target: "sha256:3", relied: r}}
    unrecorded = compat.check_fingerprints((target,), prints, "2.1", relies_on=(relied,))
    assert unrecorded.state == "drift" and unrecorded.changed_relied_on == [relied]
    assert unrecorded.detail.endswith(f"changed since 1.0: targets {target}; relied-on {relied}")
    gone = compat.check_fingerprints((target,), prints, "1.0", relies_on=(f"{__name__}:gone",))
    assert gone.state == "missing" and f"cannot resolve relied-on {__name__}:gone" in gone.detail


def test_relied_on_code_a_version_does_not_define():
    """Code that moved between releases: recorded as ABSENT where a version does not define it;
    a version that then lacks code recorded as present is `missing`, and a target is never ABSENT."""
    target, absent, relied = f"{__name__}:_target_function", f"{__name__}:_Moved", f"{__name__}:_relied_function"
    t, r = compat.source_fingerprint(_target_function), compat.source_fingerprint(_relied_function)
    recorded = compat.check_fingerprints((target,), {}, "1.0", relies_on=(absent, relied))
    assert recorded.state == "unrecorded" and recorded.fingerprints[absent] == compat.ABSENT
    prints = {"1.0": {target: t, absent: compat.ABSENT, relied: r}, "2.0": {target: t, absent: "sha256:1", relied: r}}
    assert compat.check_fingerprints((target,), prints, "1.0", relies_on=(absent, relied)).state == "match"
    assert compat.check_fingerprints((target,), prints, "1.5", relies_on=(absent, relied)).state == "known"
    moved = compat.check_fingerprints((target,), prints, "2.0", relies_on=(absent, relied))
    assert moved.state == "missing" and moved.changed_relied_on == [absent] and not moved.ok
    assert moved.detail == f"cannot resolve relied-on {absent} (defined in 2.0)"
    assert compat.check_fingerprints((target,), prints, "2.1", relies_on=(absent, relied)).state == "known"  # = 1.0
    # the other way round: recorded absent, present now
    prints = {"1.0": {target: t, absent: compat.ABSENT, relied: compat.ABSENT}}
    drift = compat.check_fingerprints((target,), prints, "1.0", relies_on=(absent, relied))
    assert drift.state == "drift" and drift.changed_relied_on == [relied]
    raw = _raw()
    entry = raw["patches"]["megatron.router_replay_scope"]
    version = next(iter(entry["fingerprints"]))
    entry["fingerprints"][version][entry["targets"][0]] = compat.ABSENT
    with pytest.raises(compat.CompatMatrixError, match="a target cannot be 'absent'"):
        compat.parse(raw)


def _relied_function():
    return 2


def test_retired_ranges():
    """``retired``: versions outside a patch's range on purpose, with the reason (local labels
    ignored, as for ``versions``)."""
    m = compat.parse(_raw())
    retired = m.patches["vllm.sampler_rows"].retired
    assert compat.retired_reason(retired, "0.34.0+cpu") and compat.retired_reason(retired, "0.35.1")
    assert compat.retired_reason(retired, "0.33.0") is None and compat.retired_reason(retired, None) is None
    assert m.patches["vllm.sample_support"].retired == {}


def test_version_tier():
    up = compat.parse(_raw()).upstreams["megatron-core"]
    assert compat.version_tier(up, "0.16.1") == "tested"
    assert compat.version_tier(up, "0.19.2+local") == "tested"
    assert compat.version_tier(up, "0.16.0") == "source-verified"
    assert compat.version_tier(up, "0.19.1") == "untested"
    assert compat.version_tier(up, "0.20.0") == "unsupported"
    assert compat.version_tier(up, None) is None


def test_tested_and_source_verified_versions_are_fingerprinted():
    """A version CI tests, or one declared verified from its sources, has fingerprints recorded
    for every patch whose range holds it (`scripts/sync.py --fingerprints WHEEL ...` records
    them from the upstream's wheel)."""
    m = compat.parse(_raw())
    missing = []
    for p in m.patches.values():
        up = m.upstreams[p.upstream]
        for v in (*up.tested, *up.source_verified):
            if compat.version_in(v, p.versions) and compat.recorded_for(p.fingerprints, v) is None:
                missing.append(f"{p.name}: {p.upstream} {v}")
    assert not missing, "no fingerprints recorded for " + ", ".join(missing)


STATIC_PACKAGE = {
    "pkg/__init__.py": "from .impl import exported as reexported\nfrom . import impl\n",
    "pkg/impl.py": '''import functools
from abc import ABC


def deco(fn):
    @functools.wraps(fn)
    def inner(*a, **k):
        return fn(*a, **k)

    return inner


@deco
@deco
def exported(x):
    """Doc."""
    y = (
        x
        + 1
    )
    return y
    # trailing comment indented like the body: inspect keeps it


# a comment at module level: not part of it
class Base:
    def inherited(self):
        return 1  # same line


class Child(Base):
    class Inner:
        async def method(self):
            return 2

    def own(self):
        if True:
            pass

        # a comment after a blank line
    x = 1


alias = exported


class Abstract(ABC):
    def own(self):
        return 3


if False:
    def conditional():
        return 1
else:
    def conditional():
        return 2
''',
}


@pytest.mark.parametrize(
    "name",
    [
        "pkg.impl:exported",
        "pkg:reexported",
        "pkg.impl:Base",
        "pkg.impl:Child",
        "pkg.impl:Child.own",
        "pkg.impl:Child.inherited",
        "pkg.impl:Child.Inner.method",
        "pkg.impl:alias",
        "pkg.impl:Gone",  # not defined: both ways say ABSENT
        "pkg.impl:Child.gone",  # in neither the class nor its base
        "pkg:Gone",
        "pkg.impl:Abstract.own",
        # a standard-library base (abc.ABC) is read from this interpreter's library: absent, as
        # imported (vLLM's OpenAIServingChat derives from one; was StaticSourceError)
        "pkg.impl:Abstract.gone",
        # a module (or package) a version removed: its names are absent both ways (vLLM 0.34's
        # vllm.v1.sample.sampler); a missing top-level package is not (nothing installed)
        "pkg.removed:Gone",
        "pkg.removed.sub:Class.gone",
    ],
)
def test_static_fingerprint_equals_the_imported_one(tmp_path, monkeypatch, name):
    import pkgutil
    import sys

    for rel, text in STATIC_PACKAGE.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("pkg", "pkg.impl"):
        sys.modules.pop(mod, None)
    try:
        imported = compat.resolve_fingerprint(name)
        if imported != compat.ABSENT:
            assert imported == compat.source_fingerprint(pkgutil.resolve_name(name))
    finally:
        for mod in ("pkg", "pkg.impl"):
            sys.modules.pop(mod, None)
    assert (imported == compat.ABSENT) == ("gone" in name.lower())
    assert compat.static_fingerprint(str(tmp_path), name, absent_ok=True) == imported


def test_static_fingerprint_refuses_what_it_cannot_locate(tmp_path):
    for rel, text in STATIC_PACKAGE.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    with pytest.raises(compat.StaticSourceError, match="pkg.impl:conditional: 2 definitions found"):
        compat.static_fingerprint(str(tmp_path), "pkg.impl:conditional")
    with pytest.raises(compat.StaticNameAbsent, match="not found in the class or its bases"):
        compat.static_fingerprint(str(tmp_path), "pkg.impl:Child.nope")
    with pytest.raises(compat.StaticNameAbsent, match="pkg.impl:Nope: not defined"):
        compat.static_fingerprint(str(tmp_path), "pkg.impl:Nope")
    # a base class read from outside the root may define it: not known to be absent
    (tmp_path / "pkg" / "outside.py").write_text("from elsewhere import Base\n\n\nclass C(Base):\n    pass\n")
    with pytest.raises(compat.StaticSourceError, match="not found in the class or its bases") as info:
        compat.static_fingerprint(str(tmp_path), "pkg.outside:C.method", absent_ok=True)
    assert not isinstance(info.value, compat.StaticNameAbsent)
    # a star import may define anything
    (tmp_path / "pkg" / "star.py").write_text("from elsewhere import *\n")
    with pytest.raises(compat.StaticSourceError, match="0 definitions found"):
        compat.static_fingerprint(str(tmp_path), "pkg.star:anything", absent_ok=True)
    with pytest.raises(compat.StaticSourceError, match="no source file for module pkg.nope"):
        compat.static_fingerprint(str(tmp_path), "pkg.nope:f")
    with pytest.raises(compat.StaticSourceError, match="no source file for module nopkg.mod"):
        compat.static_fingerprint(str(tmp_path), "nopkg.mod:f", absent_ok=True)  # not installed at all
    with pytest.raises(ModuleNotFoundError):
        compat.resolve_fingerprint("replay_tests_no_such_package.mod:f")


def test_a_target_whose_module_lacks_a_dependency_is_read_from_source(tmp_path, monkeypatch):
    """An upstream installed without an optional extra (skyrl without [skyrl-train]: its server
    module imports uvicorn) is compared from its source files; the detail says why. A target whose
    source is gone still fails; so does one that changed."""
    pkg = tmp_path / "halfpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text("import not_installed_dependency_xyz\n\n\ndef serve(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "halfpkg.server:serve"
    recorded = compat._digest("def serve(x):\n    return x + 1\n")
    check = compat.check_fingerprints((name,), {"1.0": {name: recorded}}, "1.0")
    assert check.state == "match", check
    assert "read from source, not importable here: halfpkg.server" in check.detail
    assert "not_installed_dependency_xyz" in check.detail
    assert compat.check_fingerprints((name,), {"1.0": {name: "sha256:0"}}, "1.0").state == "drift"
    gone = compat.check_fingerprints(("halfpkg.server:other",), {"1.0": {}}, "1.0")
    assert gone.state == "missing" and "not_installed_dependency_xyz" in gone.detail


def test_pairing_tiers_of_a_pin_and_of_a_range():
    """What the doctor and the generated tables say about the vLLM a framework's extra brings."""
    up = compat.Upstream(
        "vllm",
        "vllm",
        {"vllm": "vllm"},
        SpecifierSet(">=0.28.0,<0.35"),
        ("0.29.0", "0.30.0"),
        source_verified={"0.28.0": "read"},
    )
    assert compat.pinned_version(SpecifierSet("==0.29.0")) == "0.29.0"
    assert compat.pinned_version(SpecifierSet(">=0.29.0")) is None
    assert compat.pairing_tiers(up, SpecifierSet("==0.29.0")) == "tested"
    assert compat.pairing_tiers(up, SpecifierSet("==0.28.0")) == "source-verified"
    assert compat.pairing_tiers(up, SpecifierSet("==0.24.0")) == "unsupported (the plugin supports >=0.28.0,<0.35)"
    assert compat.pairing_tiers(up, SpecifierSet(">=0.22.0,<=0.31.0")) == (
        "tested: 0.29.0, 0.30.0; source-verified: 0.28.0; unsupported below 0.28.0"
    )
    assert compat.pairing_tiers(up, SpecifierSet(">=0.29.0")) == "tested: 0.29.0, 0.30.0; unsupported from 0.35"
