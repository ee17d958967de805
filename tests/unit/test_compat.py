import copy

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
    ],
)
def test_schema_errors_name_the_entry(mutate, message):
    raw = copy.deepcopy(_raw())
    mutate(raw)
    with pytest.raises(compat.CompatMatrixError, match=message):
        compat.parse(raw)


def _target_function():
    return 1


def test_source_fingerprint_ignores_wrappers_and_trailing_space():
    import functools

    @functools.wraps(_target_function)
    def wrapper():
        return _target_function()

    assert compat.source_fingerprint(wrapper) == compat.source_fingerprint(_target_function)
    assert compat.source_fingerprint(_target_function).startswith("sha256:")


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
