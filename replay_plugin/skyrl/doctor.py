"""Doctor checks for a SkyRL job (``replay-plugin doctor --skyrl-config "KEY=VALUE ..."`` or a YAML
file of SkyRL's config): the cases where SkyRL's config asks for a replay and the plugin would not
deliver it, silently.

- ``generator.inference_engine.enable_return_sample_support_set``: without the plugin's capture
  (``skyrl.sample_support_rows``, ``skyrl.engine_support_width``, ``skyrl.generator_support_width``
  and vLLM's ``vllm.sample_support`` all applying in this environment) ``/skyrl/v1/generate``
  returns SkyRL's own top_k-wide rows, repaired where the sampled id is missing, and SkyRL trains
  on them as if they were the support.
- ``generator.inference_engine.enable_return_routed_experts`` with an FSDP strategy: with the
  config check patched but the worker patch off, the routes would be captured and never replayed.

A patch "applies" when it is switched on and the installed upstream is inside its range (what
``status`` would show after the import, short of fingerprint drift, which ``matrix --check``
reports). Nothing of SkyRL or vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: (problem, fix)
Finding = tuple[str, str]

SUPPORT_KEY = "generator.inference_engine.enable_return_sample_support_set"
ROUTES_KEY = "generator.inference_engine.enable_return_routed_experts"
STRATEGY_KEY = "trainer.strategy"
TOP_K_KEY = "generator.sampling_params.top_k"
SUPPORT_PATCHES = (
    "skyrl.sample_support_rows",
    "skyrl.engine_support_width",
    "skyrl.generator_support_width",
    "vllm.sample_support",
)
FSDP_ROUTE_PATCHES = ("skyrl.fsdp_worker_routes", "skyrl.fsdp_routes_config")


def parse(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """SkyRL's config as a flat ``{dotted key: value}``: from ``KEY=VALUE`` overrides (SkyRL's
    command-line form; values read as YAML scalars) or a YAML file's nested mapping."""
    import os

    import yaml

    if isinstance(config, Mapping):
        return _flatten(config)
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
        if not isinstance(doc, Mapping):
            raise ValueError(f"{config}: expected a mapping of SkyRL config keys")
        return _flatten(doc)
    out: dict[str, Any] = {}
    for token in config.split():
        key, sep, value = token.lstrip("+").partition("=")
        if not sep:
            raise ValueError(f"{token!r}: expected KEY=VALUE (SkyRL's override form) or a YAML file")
        out[key] = yaml.safe_load(value)
    return out


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def would_apply(name: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether patch ``name`` would apply in this environment, and if not why (its state)."""
    from .. import compat, registry, settings

    if settings.disabled(environ):
        return False, "REPLAY_PLUGIN_DISABLE is set"
    reg = registry.get()
    reg.load_packs()
    spec = reg.specs.get(name)
    if spec is None:
        return False, "not registered (the plugin's pack did not load: `replay-plugin status`)"
    early = reg.initial_state(spec, settings.load(dict(environ)))
    if early is not None:
        return False, f"{early.state}: {early.reason}"
    upstream = compat.load().upstreams.get(spec.upstream)
    dist, version = compat.installed_version(upstream) if upstream else (None, None)
    if version is None:
        return False, f"{spec.upstream} is not installed here"
    if not compat.version_in(version, spec.versions) and not settings.load(dict(environ)).allow_unsupported:
        return False, f"skipped-version: {dist} {version} is outside {compat.format_spec(spec.versions)}"
    return True, "applies"


def check(config: str | Mapping[str, Any], environ: Mapping[str, str]) -> list[Finding]:
    cfg = parse(config)
    out: list[Finding] = []
    if _true(cfg.get(SUPPORT_KEY)):
        off = [(name, why) for name in SUPPORT_PATCHES for ok, why in [would_apply(name, environ)] if not ok]
        if off:
            detail = "; ".join(f"{name} {why}" for name, why in off)
            out.append(
                (
                    f"SkyRL's config sets {SUPPORT_KEY}=true but the plugin's capture is off ({detail}): "
                    "/skyrl/v1/generate returns SkyRL's own rows of width top_k, with the sampled id written over "
                    "the weakest member where it is missing, and SkyRL trains on them as the sampler's support",
                    "switch the listed patches on (unset their REPLAY_PLUGIN_* toggles and REPLAY_PLUGIN_DISABLE) and "
                    "install the supported versions (`replay-plugin matrix`), in the driver and in every Ray worker",
                )
            )
        top_k = cfg.get(TOP_K_KEY)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k <= 1:
            out.append((f"{TOP_K_KEY}={top_k}: sample-support capture needs top_k > 1", f"set {TOP_K_KEY} > 1"))
        out += _check_knob(environ)
    if _true(cfg.get(ROUTES_KEY)) and str(cfg.get(STRATEGY_KEY, "fsdp")) in ("fsdp", "fsdp2"):
        states = {name: would_apply(name, environ) for name in FSDP_ROUTE_PATCHES}
        config_ok, workers_ok = states["skyrl.fsdp_routes_config"][0], states["skyrl.fsdp_worker_routes"][0]
        if config_ok and not workers_ok:
            out.append(
                (
                    f"SkyRL's config sets {ROUTES_KEY}=true with an FSDP strategy and skyrl.fsdp_routes_config lets it "
                    f"pass, but skyrl.fsdp_worker_routes {states['skyrl.fsdp_worker_routes'][1]}: the routes would be "
                    "captured and never replayed",
                    "switch skyrl.fsdp_worker_routes on, or skyrl.fsdp_routes_config off "
                    "(SkyRL then refuses the config)",
                )
            )
    return out


def _check_knob(environ: Mapping[str, str]) -> list[Finding]:
    from .patches import ON_INEXACT_ENV, ON_INEXACT_POLICIES

    value = environ.get(ON_INEXACT_ENV)
    if value is None or value.strip().lower() in ON_INEXACT_POLICIES:
        return []
    return [(f"{ON_INEXACT_ENV}={value!r} is not one of {', '.join(ON_INEXACT_POLICIES)}", f"unset {ON_INEXACT_ENV}")]


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"))
