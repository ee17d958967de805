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
reports). Values are read as SkyRL reads them (``job_config``: ``OmegaConf.from_cli``, flags by
Python's truth as SkyRL's ``if ie.enable_...:`` tests them, so ``=1`` is on). Nothing of SkyRL or
vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .patches import ROUTES_CONFIG_KEY, SUPPORT_CONFIG_KEY

#: (problem, fix)
Finding = tuple[str, str]

STRATEGY_KEY = "trainer.strategy"
TOP_K_KEY = "generator.sampling_params.top_k"
SUPPORT_PATCHES = (
    "skyrl.sample_support_rows",
    "skyrl.engine_support_width",
    "skyrl.generator_support_width",
    "vllm.sample_support",
)
FSDP_ROUTE_PATCHES = ("skyrl.fsdp_worker_routes", "skyrl.fsdp_routes_config")


def check(config: str | Mapping[str, Any], environ: Mapping[str, str]) -> list[Finding]:
    """Findings for a SkyRL job's config; ``job_config.ConfigError`` where it cannot be read."""
    from ..job_config import parse_config, truthy, would_apply

    cfg = parse_config(config, "SkyRL")
    out: list[Finding] = []
    if truthy(cfg.get(SUPPORT_CONFIG_KEY)):
        off = [(name, why) for name in SUPPORT_PATCHES for ok, why in [would_apply(name, environ)] if not ok]
        if off:
            detail = "; ".join(f"{name} {why}" for name, why in off)
            out.append(
                (
                    f"SkyRL's config sets {SUPPORT_CONFIG_KEY}=true but the plugin's capture is off ({detail}): "
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
    if truthy(cfg.get(ROUTES_CONFIG_KEY)) and str(cfg.get(STRATEGY_KEY, "fsdp")) in ("fsdp", "fsdp2"):
        states = {name: would_apply(name, environ) for name in FSDP_ROUTE_PATCHES}
        config_ok, workers_ok = states["skyrl.fsdp_routes_config"][0], states["skyrl.fsdp_worker_routes"][0]
        if config_ok and not workers_ok:
            out.append(
                (
                    f"SkyRL's config sets {ROUTES_CONFIG_KEY}=true with an FSDP strategy and skyrl.fsdp_routes_config "
                    f"lets it pass, but skyrl.fsdp_worker_routes {states['skyrl.fsdp_worker_routes'][1]}: the routes "
                    "would be captured and never replayed",
                    "switch skyrl.fsdp_worker_routes on, or skyrl.fsdp_routes_config off "
                    "(SkyRL then refuses the config)",
                )
            )
    return out


def _check_knob(environ: Mapping[str, str]) -> list[Finding]:
    """The job's ``ON_INEXACT`` value, read by the rule the server reads it by (``capture_guard``)."""
    from ..core.errors import NotReplayable
    from .capture_guard import on_inexact
    from .patches import ON_INEXACT_ENV

    try:
        on_inexact(environ)
    except NotReplayable as exc:
        return [(str(exc), f"unset {ON_INEXACT_ENV} or set it to error or repair")]
    return []
