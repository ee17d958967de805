"""Registry, PatchSpec and Patcher on a module the test defines (not an upstream)."""

import inspect
import sys
import types

import pytest
from packaging.specifiers import SpecifierSet

from replay_plugin import hooks, registry, settings, status
from replay_plugin.registry import Patcher, PatchSpec, ProbeResult

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
    status._reset_for_tests()
    yield mod
    sys.modules.pop(MOD, None)
    Target.__dict__.get("inherited") and delattr(Target, "inherited")


def spec(name="test.patch", install=None, probe=None, default=True, targets=(f"{MOD}:function",)):
    return PatchSpec(name=name, upstream="test-upstream", targets=targets, versions=SpecifierSet(">=0"),
                     default=default, why="w", fix="f", remove_when="r", install=install, probe=probe)


def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


def test_wrap_marks_calls_and_is_idempotent(target_module):
    p = Patcher(spec())
    w = p.wrap(f"{MOD}:function", add_one)
    assert target_module.function(3) == 7
    assert registry.patch_marker(target_module.function) == "test.patch"
    assert p.wrap(f"{MOD}:function", add_one) is w  # applying twice: no second layer
    assert target_module.function(3) == 7
    assert p.revert() == []
    assert target_module.function is function
    assert registry.patch_marker(target_module.function) is None


def test_wrap_method_patches_the_class_and_reverts_inherited(target_module):
    p = Patcher(spec())
    p.wrap(f"{MOD}:Target.method", add_one)
    p.wrap(f"{MOD}:Target.inherited", lambda w, i, a, k: w(*a, **k) + "!")
    assert Target().method(1) == 3 and Target().inherited() == "base!"
    assert type(inspect.getattr_static(Target, "method")) is registry.PluginWrapper
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
    assert registry.patch_marker(target_module.function) == "test.patch"


def fresh_registry():
    reg = registry.Registry()
    return reg


def test_states(target_module):
    reg = fresh_registry()
    reg.register(spec("a.not_implemented"))
    reg.register(spec("b.default_off", install=lambda p: None, default=False))
    reg.register(spec("c.toggled_off", install=lambda p: None))
    reg.register(spec("d.not_needed", install=lambda p: None, probe=lambda s: ProbeResult(False, "fixed upstream")))
    reg.register(spec("e.applied", install=lambda p: p.wrap(f"{MOD}:function", add_one),
                      probe=lambda s: ProbeResult(True, "bug present")))
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
    with pytest.raises(registry.PatchApplyError, match="ZeroDivisionError"):
        reg.apply("test.patch", settings.load({"REPLAY_PLUGIN_STRICT": "1"}))


def test_bad_toggle_value(target_module):
    reg = fresh_registry()
    reg.register(spec(install=lambda p: None))
    st = reg.apply("test.patch", settings.load({"REPLAY_PLUGIN_TEST_PATCH": "maybe"}))
    assert st.state == "error" and "REPLAY_PLUGIN_TEST_PATCH='maybe'" in st.reason


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


def test_probe_hook_overrides_spec_probe(target_module):
    class Policy:
        @hooks.hookimpl
        def replay_plugin_probe(self, spec):
            return ProbeResult(False, "site policy")

    reg = fresh_registry()
    reg.pm.register(Policy())
    reg.register(spec(install=lambda p: None, probe=lambda s: ProbeResult(True, "needed")))
    assert reg.apply("test.patch", settings.load({})).reason == "site policy"


def test_knob_may_not_collide_with_toggle():
    with pytest.raises(ValueError, match="collides"):
        PatchSpec(name="x.y", upstream="u", targets=("m:f",), versions=SpecifierSet(), default=True, why="",
                  fix="", remove_when="", knobs=(registry.Knob("REPLAY_PLUGIN_X_Y", "0", ""),))


def test_from_matrix_rejects_target_drift():
    with pytest.raises(ValueError, match="differ from the matrix"):
        PatchSpec.from_matrix("megatron.router_replay_scope", targets=("megatron.core:x",), install=None)
