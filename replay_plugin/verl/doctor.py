"""Doctor checks for a verl job (``replay-plugin doctor --verl-config "KEY=VALUE ..."``, verl's
Hydra overrides, or a YAML file of verl's resolved config): the cases where the job asks for a
replay and the plugin would not deliver it, found before Ray starts.

In a running job the plugin refuses these where it can (the server before the model loads, the
engines at their first batch); the cases it cannot see from inside, because no patch of the
plugin runs to see them:

- ``actor_rollout_ref.rollout.custom.replay_sample_support=true`` while a verl patch the switch
  needs would not apply here (switched off, verl or vLLM outside the range, ``REPLAY_PLUGIN_DISABLE``):
  verl ignores an unknown ``custom`` key, the batch carries no rows and the engine scores over the
  full vocabulary;
- the switch with ``actor_rollout_ref.rollout.name`` other than vllm: the plugin captures rows in
  verl's vLLM server only (``verl.rollout_support_server``), so every trajectory is refused;
- ``router_replay.mode`` on the FSDP engine with both ``verl.fsdp_routes`` and the guard
  (``verl.engine_replay_guard``) not applying: verl accepts the key and never replays;
- ``enable_rollout_routing_replay`` without the strategy's ``router_replay.mode=R3``: the rollout
  captures routes that nothing replays.

Also reported: a ``replay_*`` key under ``custom`` the plugin does not know (a misspelt switch:
verl accepts it, the plugin refuses the job), a rollout config the server would refuse (``top_k``
-1, verl's default; greedy; raw logprobs; prefill/decode disaggregation), a strategy whose engine
does not score over the rows, and FSDP R3 without the rollout's routes or with mode R2. Keys not
given take verl 0.9.1's defaults (strategy ``fsdp``, ``trainer.use_v1`` true, ``top_k`` -1).

Values are read as verl reads them (``job_config``: Hydra's override grammar, flags by Python's
truth, ``router_replay.mode`` as the FSDP engine reads it). Nothing of verl or vLLM is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import NotReplayable
from . import switch
from .engine_batch import REPLAY_OFF

Finding = tuple[str, str]

ROLLOUT = "actor_rollout_ref.rollout."
SWITCH_KEY = switch.PREFIX + switch.SWITCH
STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
ENGINE_KEY = "model_engine"  # verl's config group: dp (fsdp), megatron, ...
USE_V1_KEY = "trainer.use_v1"
ROUTING_KEY = ROLLOUT + "enable_rollout_routing_replay"
NAME_KEY = ROLLOUT + "name"
#: the FSDP engines' router replay (``+...fsdp_config.router_replay.mode=R3``): actor, and ref
FSDP_MODE_KEYS = tuple(f"actor_rollout_ref.{role}.fsdp_config.router_replay.mode" for role in ("actor", "ref"))
#: strategy -> the actor's router replay mode, the one that replays the rollout's routes in training
#: (verl's own on Megatron and VeOmni, the plugin's on FSDP; torchtitan has none)
ACTOR_MODE_KEYS = {
    "fsdp": FSDP_MODE_KEYS[0],
    "fsdp2": FSDP_MODE_KEYS[0],
    "megatron": "actor_rollout_ref.actor.megatron.router_replay.mode",
    "veomni": "actor_rollout_ref.actor.veomni.router_replay.mode",
}
#: strategy -> the patch that makes its engine score over the rows
ENGINE_PATCHES = {
    "fsdp": "verl.fsdp_support_logprobs",
    "fsdp2": "verl.fsdp_support_logprobs",
    "megatron": "verl.megatron_support_logprobs",
}


def strategy(cfg: Mapping[str, Any]) -> str:
    value = cfg.get(STRATEGY_KEY)
    if value is None:
        value = {"dp": "fsdp"}.get(str(cfg.get(ENGINE_KEY, "dp")), cfg.get(ENGINE_KEY))
    return str(value)


def replay_mode(value: Any) -> str:
    """A ``router_replay.mode`` as the FSDP engine reads it (``engine_batch.replay_mode``): a
    false value (absent, ``null``, ``false``) is ``disabled``."""
    return str(value or "disabled")


def rollout_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The keys under ``actor_rollout_ref.rollout.`` as verl's nested rollout config (a later key
    replaces a value in its way, as OmegaConf's merge of Hydra's overrides does)."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if not key.startswith(ROLLOUT):
            continue
        *path, leaf = key[len(ROLLOUT) :].split(".")
        node = out
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out


def check(config: str | Mapping[str, Any], environ: Mapping[str, str]) -> list[Finding]:
    """Findings for a verl job's config; ``job_config.ConfigError`` where it cannot be read."""
    from ..job_config import parse_config, truthy, would_apply
    from .rollout_server import CAPTURE

    cfg = parse_config(config, "verl")
    out: list[Finding] = []
    rollout = rollout_config(cfg)
    engine = strategy(cfg)
    try:
        unknown = switch.unknown_keys(rollout)
        wants_support = not unknown and switch.requested(rollout)
    except NotReplayable as exc:  # custom is not a mapping, or the switch is not a boolean
        where = "" if exc.setting in str(exc) else f"{exc.setting}: "
        fix = f"set {SWITCH_KEY} to true or false" if exc.setting == SWITCH_KEY else f"make {exc.setting} a mapping"
        return [(f"{where}{exc}", fix)]
    for problem in unknown:
        out.append(
            (
                f"{problem}: verl accepts any key under custom and the plugin refuses the job",
                "correct the key's name (docs/integrations/verl.md, its opening block), or remove it",
            )
        )
    if wants_support:
        patch = ENGINE_PATCHES.get(engine)
        if patch is None:
            out.append(
                (
                    f"{SWITCH_KEY}=true with strategy {engine}: its engine scores over the full vocabulary "
                    "(the plugin's guard refuses the first batch)",
                    f"use strategy fsdp, fsdp2 or megatron ({STRATEGY_KEY}), or drop the switch",
                )
            )
        rollout_name = cfg.get(NAME_KEY)  # mandatory in verl (``???``): not given here, not judged
        if rollout_name is not None and str(rollout_name) != "vllm":
            out.append(
                (
                    f"{SWITCH_KEY}=true with {NAME_KEY}={rollout_name}: the plugin captures support rows in verl's "
                    "vLLM server only (verl.rollout_support_server), so every trajectory is refused",
                    f"set {NAME_KEY}=vllm, or drop the switch",
                )
            )
        needed = ["verl.rollout_support_server", "verl.rollout_support_batch", "verl.engine_replay_guard"]
        needed += [patch] if patch else []
        needed += ["verl.rollout_support_padding"] if truthy(cfg.get(USE_V1_KEY, True)) else []
        needed += list(CAPTURE)
        off = [(name, why) for name in needed for ok, why in [would_apply(name, environ)] if not ok]
        if off:
            out.append(
                (
                    f"verl's config sets {SWITCH_KEY}=true but patches it needs would not apply here ("
                    + "; ".join(f"{name} {why}" for name, why in off)
                    + "): verl ignores the key, its batch carries no support rows and the engine scores over the "
                    "full vocabulary",
                    "switch the listed patches on (unset their REPLAY_PLUGIN_* toggles and REPLAY_PLUGIN_DISABLE) and "
                    "install the supported versions (`replay-plugin matrix`: verl 0.9.1 with vLLM 0.30), in the "
                    "driver and in every Ray worker",
                )
            )
        try:
            switch.check_rollout_config(rollout)
        except NotReplayable as exc:
            out.append((str(exc), f"set {exc.setting} as the message says, or drop the switch"))
    if engine in ("fsdp", "fsdp2"):
        out += _check_fsdp_routes(cfg, environ)
    out += _check_routes_replayed(cfg, engine)
    return out


def _check_fsdp_routes(cfg: Mapping[str, Any], environ: Mapping[str, str]) -> list[Finding]:
    from ..job_config import truthy, would_apply

    out: list[Finding] = []
    for key in FSDP_MODE_KEYS:
        mode = replay_mode(cfg.get(key))
        if mode in REPLAY_OFF:
            continue
        routes_ok, routes_why = would_apply("verl.fsdp_routes", environ)
        guard_ok, _ = would_apply("verl.engine_replay_guard", environ)
        if not routes_ok:
            refused = "the engine refuses the first batch" if guard_ok else "silently: nothing refuses it"
            out.append(
                (
                    f"{key}={mode}: verl does not replay routes on its FSDP engine and verl.fsdp_routes {routes_why} "
                    f"({refused})",
                    "switch verl.fsdp_routes on (REPLAY_PLUGIN_VERL_FSDP_ROUTES, a supported verl version), or set "
                    f"{key}=disabled",
                )
            )
        elif mode != "R3":
            out.append((f"{key}={mode}: the plugin replays the rollout's routes (R3) only", f"set {key}=R3"))
        if not truthy(cfg.get(ROUTING_KEY, False)):
            out.append(
                (
                    f"{key}={mode} but {ROUTING_KEY} is not true: the batch carries no routed_experts (the engine "
                    "refuses the first batch)",
                    f"set {ROUTING_KEY}=true",
                )
            )
    return out


def _check_routes_replayed(cfg: Mapping[str, Any], engine: str) -> list[Finding]:
    """The rollout's routes captured (``enable_rollout_routing_replay``) with the actor's router
    replay off: vLLM returns every token's experts and nothing replays them (verl itself refuses
    R2 with the flag, and an invalid mode, at its first step)."""
    from ..job_config import truthy

    if not truthy(cfg.get(ROUTING_KEY, False)):
        return []
    key = ACTOR_MODE_KEYS.get(engine)
    mode = replay_mode(cfg.get(key)) if key else "disabled"
    if mode not in REPLAY_OFF:
        return []
    if key is None:
        where, fix = f"strategy {engine} has no router replay", f"use strategy {', '.join(ACTOR_MODE_KEYS)}"
    else:
        where, fix = f"{key} is {mode}", f"set {'+' if key in FSDP_MODE_KEYS else ''}{key}=R3"
    return [
        (
            f"{ROUTING_KEY} is true but {where}: the rollout captures every token's routed experts and nothing "
            "replays them (the trainer routes with its own router)",
            f"{fix}, or drop {ROUTING_KEY}",
        )
    ]
