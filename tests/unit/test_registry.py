"""Registry, PatchSpec and Patcher on a module the test defines (not an upstream)."""

import dataclasses
import inspect
import sys
import types

import pytest
from packaging.specifiers import SpecifierSet

from replay_plugin import hooks, registry, settings, states
from replay_plugin.patcher import Patcher, PluginWrapper, patch_marker
from replay_plugin.spec import Knob, Patch, PatchApplyError, PatchSpec, ProbeResult, UndeclaredTargetError

MOD = "replay_test_target_module"


class Base:
    def inherited(self):
        return "base"


class Target(Base):
    def method(self, x):
        return x + 1


def function(x):
    return x * 2


@pytest.fixture(autouse=True)
def target_module():
    mod = types.ModuleType(MOD)
    mod.Target, mod.function = Target, function
    sys.modules[MOD] = mod
    states._reset_for_tests()
    yield mod
    sys.modules.pop(MOD, None)
    Target.__dict__.get("inherited") and delattr(Target, "inherited")


def spec(
    name="test.patch",
    install=None,
    probe=None,
    default=True,
    targets=(f"{MOD}:function", f"{MOD}:Target.method", f"{MOD}:Target.inherited"),
):
    return PatchSpec(
        name=name,
        upstream="test-upstream",
        targets=targets,
        versions=SpecifierSet(">=0"),
        default=default,
        why="w",
        fix="f",
        remove_when="r",
        install=install,
        probe=probe,
    )


def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


def test_wrap_marks_calls_and_is_idempotent(target_module):
    p = Patcher(spec())
    w = p.wrap(f"{MOD}:function", add_one)
    assert target_module.function(3) == 7
    assert patch_marker(target_module.function) == "test.patch"
    assert p.wrap(f"{MOD}:function", add_one) is w  # applying twice: no second layer
    assert target_module.function(3) == 7
    assert p.revert() == []
    assert target_module.function is function
    assert patch_marker(target_module.function) is None


def test_wrap_method_patches_the_class_and_reverts_inherited(target_module):
    p = Patcher(spec())
    p.wrap(f"{MOD}:Target.method", add_one)
    p.wrap(f"{MOD}:Target.inherited", lambda w, i, a, k: w(*a, **k) + "!")
    assert Target().method(1) == 3 and Target().inherited() == "base!"
    assert type(inspect.getattr_static(Target, "method")) is PluginWrapper
    assert p.revert() == []
    assert Target().method(1) == 2 and "inherited" not in Target.__dict__ and Target().inherited() == "base"


def test_revert_refuses_when_someone_wrapped_on_top(target_module, caplog):
    import wrapt

    p = Patcher(spec())
    p.wrap(f"{MOD}:function", add_one)
    wrapt.wrap_function_wrapper(MOD, "function", lambda w, i, a, k: w(*a, **k) * 10)
    problems = p.revert()
    assert problems and "wrapped on top" in problems[0]
    assert target_module.function(1) == 30  # both layers still there: nothing was torn out
    assert patch_marker(target_module.function) == "test.patch"


def fresh_registry():
    reg = registry.Registry()
    return reg


def test_states(target_module):
    reg = fresh_registry()
    reg.register(spec("a.not_implemented"))
    reg.register(spec("b.default_off", install=lambda p: None, default=False))
    reg.register(spec("c.toggled_off", install=lambda p: None))
    reg.register(spec("d.not_needed", install=lambda p: None, probe=lambda s: ProbeResult(False, "fixed upstream")))
    reg.register(
        spec(
            "e.applied",
            install=lambda p: p.wrap(f"{MOD}:function", add_one),
            probe=lambda s: ProbeResult(True, "bug present"),
        )
    )
    cfg = settings.load({"REPLAY_PLUGIN_C_TOGGLED_OFF": "0"})
    got = {name: reg.apply(name, cfg) for name in reg.specs}
    assert got["a.not_implemented"].state == "not-implemented"
    assert got["b.default_off"].state == "disabled" and "REPLAY_PLUGIN_B_DEFAULT_OFF=1" in got["b.default_off"].reason
    assert got["c.toggled_off"].state == "disabled" and got["c.toggled_off"].reason == "REPLAY_PLUGIN_C_TOGGLED_OFF=0"
    assert got["d.not_needed"].state == "not-needed" and got["d.not_needed"].reason == "fixed upstream"
    assert got["e.applied"].state == "applied" and "probe: bug present" in got["e.applied"].reason
    assert target_module.function(1) == 3
    assert reg.apply("e.applied", cfg).state == "applied"  # idempotent
    assert target_module.function(1) == 3
    assert reg.revert("e.applied").state == "reverted"
    assert target_module.function(1) == 2


def test_would_apply_answers_what_apply_would_record_and_records_nothing(target_module, monkeypatch):
    """The question the frameworks' start-up checks and ``doctor`` ask before the upstream is
    imported: the toggle and the installed version against the range (what ``apply`` would
    record as ``disabled`` / ``skipped-version``)."""
    reg = fresh_registry()
    reg.register(dataclasses.replace(spec("a.ranged", install=lambda p: None), versions=SpecifierSet(">=0.30,<0.33")))
    installed = {"version": "0.30.0"}
    monkeypatch.setattr(registry.Registry, "_installed_version", staticmethod(lambda s: installed["version"]))
    assert reg.would_apply("a.ranged", settings.load({})) == (True, "applies")
    ok, why = reg.would_apply("a.ranged", settings.load({"REPLAY_PLUGIN_A_RANGED": "0"}))
    assert not ok and why == "disabled: REPLAY_PLUGIN_A_RANGED=0"
    installed["version"] = "0.24.0"
    ok, why = reg.would_apply("a.ranged", settings.load({}))
    assert not ok and why.startswith("skipped-version: test-upstream 0.24.0 is outside"), why
    assert reg.apply("a.ranged", settings.load({})).state == "skipped-version"  # the same answer
    assert reg.would_apply("a.ranged", settings.load({"REPLAY_PLUGIN_ALLOW_UNSUPPORTED": "1"}))[0]
    installed["version"] = None
    assert reg.would_apply("a.ranged", settings.load({})) == (False, "test-upstream is not installed here")
    assert reg.would_apply("b.unknown", settings.load({}))[0] is False
    states._reset_for_tests()
    reg.would_apply("a.ranged", settings.load({}))
    assert states.get("a.ranged") is None


def test_a_retired_version_is_not_needed_and_nothing_is_wrapped(target_module, monkeypatch, caplog):
    """``retired`` (compat_matrix.yaml): an upstream version outside the patch's range on purpose
    (vLLM 0.34 removed the code vllm.sampler_rows fixes). There the patch is ``not-needed`` with
    the matrix's reason, installs nothing and logs no failure; ``would_apply`` says it serves.
    A version outside both stays ``skipped-version``, and ALLOW_UNSUPPORTED does not apply a
    retired patch (its targets are gone)."""
    installs = []
    reg = fresh_registry()
    retired = dataclasses.replace(
        spec("a.retired", install=lambda p: installs.append(p)),
        versions=SpecifierSet(">=0.30,<0.34"),
        retired={">=0.34": "the upstream removed the code"},
    )
    reg.register(retired)
    installed = {"version": "0.34.0+cpu"}
    monkeypatch.setattr(registry.Registry, "_installed_version", staticmethod(lambda s: installed["version"]))
    reason = "test-upstream 0.34.0+cpu: the upstream removed the code"
    assert reg.would_apply("a.retired", settings.load({})) == (True, f"not-needed: {reason}")
    # known before the trigger is imported (it may not exist): recorded at arm time, not armed
    assert reg.arm(settings.load({})) == [] and states.get("a.retired").state == "not-needed"
    states._reset_for_tests()
    rows = {row["name"]: row for row in reg.status_rows(settings.load({}))}
    assert (rows["a.retired"]["state"], rows["a.retired"]["reason"]) == ("not-needed", reason)
    states._reset_for_tests()
    caplog.clear()
    st = reg.apply("a.retired", settings.load({"REPLAY_PLUGIN_ALLOW_UNSUPPORTED": "1"}))
    assert (st.state, st.reason) == ("not-needed", reason) and installs == []
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]
    states._reset_for_tests()
    reg = fresh_registry()
    reg.register(retired)
    installed["version"] = "0.29.0"
    assert reg.apply("a.retired", settings.load({})).state == "skipped-version"
    states._reset_for_tests()
    reg = fresh_registry()
    reg.register(retired)
    installed["version"] = "0.33.0"
    assert reg.apply("a.retired", settings.load({})).state == "applied" and len(installs) == 1


def test_failing_install_is_recorded_and_rolled_back(target_module):
    def install(p):
        p.wrap(f"{MOD}:function", add_one)
        raise RuntimeError("boom")

    reg = fresh_registry()
    reg.register(spec(install=install))
    st = reg.apply("test.patch", settings.load({}))
    assert st.state == "error" and "boom" in st.reason
    assert target_module.function is function  # partial change undone


def test_strict_mode_raises(target_module):
    reg = fresh_registry()
    reg.register(spec(install=lambda p: 1 / 0))
    with pytest.raises(PatchApplyError, match="ZeroDivisionError"):
        reg.apply("test.patch", settings.load({"REPLAY_PLUGIN_STRICT": "1"}))


def test_bad_toggle_value(target_module):
    reg = fresh_registry()
    reg.register(spec(install=lambda p: None))
    st = reg.apply("test.patch", settings.load({"REPLAY_PLUGIN_TEST_PATCH": "maybe"}))
    assert st.state == "error" and "REPLAY_PLUGIN_TEST_PATCH='maybe'" in st.reason


def test_empty_toggle_keeps_the_default(target_module, monkeypatch):
    """``REPLAY_PLUGIN_<PATCH>=`` (an empty expansion) is unset: a default-on patch applies; before,
    it read as ``0`` and the patch was ``disabled`` (issue 41: SkyRL's capture)."""
    monkeypatch.setattr(registry.Registry, "_installed_version", staticmethod(lambda s: "1.0"))
    reg = fresh_registry()
    reg.register(spec(install=lambda p: p.wrap(f"{MOD}:function", add_one)))
    cfg = settings.load({"REPLAY_PLUGIN_TEST_PATCH": ""})
    assert reg.would_apply("test.patch", cfg) == (True, "applies")
    assert reg.apply("test.patch", cfg).state == "applied"
    assert target_module.function(1) == 3
    reg.revert("test.patch")


def test_bad_toggle_value_is_logged_when_armed(target_module, caplog):
    reg = fresh_registry()
    reg.register(spec(install=lambda p: None))
    with caplog.at_level("WARNING", logger="replay_plugin"):
        assert reg.arm(settings.load({"REPLAY_PLUGIN_TEST_PATCH": "maybe"})) == []
    assert states.get("test.patch").state == "error"
    assert caplog.text.count("patch test.patch not applied: REPLAY_PLUGIN_TEST_PATCH='maybe'") == 1


def test_missing_target_is_an_error(target_module):
    target = f"{MOD}:gone"
    reg = fresh_registry()
    s = spec(install=lambda p: p.wrap(target, add_one), targets=(target,))
    s.fingerprints = {"1.0": {target: "sha256:0"}}
    reg.register(s)
    st = reg.apply("test.patch", settings.load({}))
    assert st.state == "error" and "cannot resolve" in st.reason


def test_observers_see_applied_and_failed(target_module):
    seen = []

    class Observer:
        @hooks.hookimpl
        def replay_plugin_patch_applied(self, spec, status):
            seen.append(("applied", spec.name, status.state))

        @hooks.hookimpl
        def replay_plugin_patch_failed(self, spec, status, error):
            seen.append(("failed", spec.name, type(error).__name__))

    reg = fresh_registry()
    reg.pm.register(Observer())
    reg.register(spec("ok.one", install=lambda p: p.wrap(f"{MOD}:function", add_one)))
    reg.register(spec("bad.one", install=lambda p: 1 / 0))
    reg.apply("ok.one", settings.load({}))
    reg.apply("bad.one", settings.load({}))
    assert seen == [("applied", "ok.one", "applied"), ("failed", "bad.one", "PatchApplyError")]
    reg.revert_all()


def test_knob_may_not_collide_with_toggle():
    with pytest.raises(ValueError, match="collides"):
        PatchSpec(
            name="x.y",
            upstream="u",
            targets=("m:f",),
            versions=SpecifierSet(),
            default=True,
            why="",
            fix="",
            remove_when="",
            knobs=(Knob("REPLAY_PLUGIN_X_Y", "0", ""),),
        )


def test_wrapping_an_undeclared_target_is_refused(target_module):
    p = Patcher(spec(targets=(f"{MOD}:function",)))
    with pytest.raises(UndeclaredTargetError, match="Target.method"):
        p.wrap(f"{MOD}:Target.method", add_one)
    with pytest.raises(UndeclaredTargetError, match="not exactly one of its targets"):
        p.wrap("Target.method", add_one)
    assert Target().method(1) == 2 and p.changes == []


def test_wrap_by_qualname_of_a_declared_target(target_module):
    p = Patcher(spec())
    p.wrap("function", add_one)
    assert target_module.function(3) == 7
    assert p.revert() == []


def test_pack_table_takes_metadata_from_the_matrix():
    (s,) = registry.pack_specs({"megatron.router_layer_number": Patch("mypkg.mod")}, "pk")
    assert s.targets == ("megatron.core.transformer.moe.router:TopKRouter.set_layer_number",)
    assert s.install == "mypkg.mod:install" and s.pack == "pk" and s.trigger == "megatron.core.transformer.moe.router"
    assert s.env == "REPLAY_PLUGIN_MEGATRON_ROUTER_LAYER_NUMBER" and s.why
    with pytest.raises(ValueError, match="no entry"):
        registry.pack_specs({"nowhere.patch": Patch("mypkg.mod")})


def test_probe_defaults_to_the_install_modules_probe(target_module):
    target_module.install = lambda p: p.wrap("function", add_one)
    target_module.probe = lambda s: ProbeResult(False, "fixed in this module's view")
    reg = fresh_registry()
    reg.register(spec(install=f"{MOD}:install"))
    st = reg.apply("test.patch", settings.load({}))
    assert st.state == "not-needed" and st.reason == "fixed in this module's view"


class _Pack:
    def __init__(self, specs=None, error=None):
        self.specs, self.error = specs or [], error

    @hooks.hookimpl
    def replay_plugin_patches(self):
        if self.error:
            raise self.error
        return self.specs


def test_packs_register_through_pluggy_and_can_be_blocked():
    reg = fresh_registry()
    assert [s.name for s in reg.add_pack(_Pack([spec("p.one")]), "one")] == ["p.one"]
    reg.pm.set_blocked("two")
    assert reg.add_pack(_Pack([spec("p.two")]), "two") == []
    with pytest.raises(RuntimeError, match="broken"):
        reg.add_pack(_Pack(error=RuntimeError("broken")), "three")
    assert not reg.pm.has_plugin("three")
    assert set(reg.specs) == {"p.one"} and reg.specs["p.one"].pack == "one"


def test_status_rows_query_records_nothing(target_module):
    reg = fresh_registry()
    reg.packs_loaded = True  # only the specs of this test
    reg.register(spec("q.waiting", install=lambda p: None))
    reg.register(spec("q.off", install=lambda p: None, default=False))
    rows = {r["name"]: r for r in reg.status_rows(settings.load({}))}
    assert rows["q.waiting"]["state"] == "not-imported" and rows["q.off"]["state"] == "disabled"
    rows = {r["name"]: r for r in reg.status_rows(settings.load({"REPLAY_PLUGIN_DISABLE": "1"}))}
    assert rows["q.waiting"]["state"] == "disabled" and "REPLAY_PLUGIN_DISABLE" in rows["q.waiting"]["reason"]
    assert states.records() == []


def test_status_says_replaced_when_another_library_replaced_a_wrapped_function(target_module):
    import functools

    reg = fresh_registry()
    reg.packs_loaded = True
    reg.register(spec("r.patch", install=lambda p: p.wrap(f"{MOD}:Target.method", add_one)))
    assert reg.apply("r.patch", settings.load({})).state == "applied"

    def rows():
        return {r["name"]: r for r in reg.status_rows(settings.load({}))}

    assert rows()["r.patch"]["state"] == "applied"
    ours = Target.__dict__["method"]

    @functools.wraps(ours)
    def on_top(self, x):  # a library wrapping on top, keeping __wrapped__: ours still runs
        return ours(self, x) * 10

    Target.method = on_top
    assert rows()["r.patch"]["state"] == "applied" and Target().method(1) == 30

    def replacement(self, x):  # a library replacing it (SkyRL-style ``Cls.attr = fn``, no __wrapped__)
        return x

    Target.method = replacement
    row = rows()["r.patch"]
    assert row["state"] == "replaced"
    assert "Target.method was replaced by" in row["reason"] and "replacement" in row["reason"]
    assert "no longer in place" in row["reason"]
    assert states.get("r.patch").state == "applied"  # the query records nothing
    Target.method = ours
    assert rows()["r.patch"]["state"] == "applied"
    assert reg.revert("r.patch").state == "reverted"


def test_partial_revert_keeps_only_the_changes_left_in_place(target_module):
    import wrapt

    p = Patcher(spec())
    p.wrap("function", add_one)
    p.wrap("Target.method", add_one)
    wrapt.wrap_function_wrapper(MOD, "function", lambda w, i, a, k: w(*a, **k) * 10)
    assert len(p.revert()) == 1
    assert Target().method(1) == 2  # undone
    assert [c.attr for c in p.changes] == ["function"]  # the one someone wrapped on top of
    assert p.displaced() == []  # still in place, inside the foreign wrapper
