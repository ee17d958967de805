"""``replay-plugin doctor --verl-config``: verl's config asks for a replay that the plugin would not
deliver, found from the driver before Ray starts (the installed verl 0.9.1 and vLLM read through
the matrix; nothing of them imported). The silent cases are the ones no patch of the plugin runs
to refuse: the switch with a verl patch that would not apply (verl then ignores the ``custom``
key), and FSDP R3 with both the route patch and the guard off."""

import json
import os
import subprocess
import sys

from conftest import need

SWITCH = "+actor_rollout_ref.rollout.custom.replay_sample_support=true"
TOP_K = "actor_rollout_ref.rollout.top_k=20"
R3 = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"
ROUTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"


def findings(tmp_path, keys: str, env: dict | None = None) -> list[dict]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    proc = subprocess.run(
        [sys.executable, "-m", "replay_plugin.cli", "doctor", "--json", "--verl-config", keys],
        env={**base, **(env or {})}, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.stdout, proc.stderr
    return [f for f in json.loads(proc.stdout)["findings"] if f["check"] == "verl"]


def test_doctor_names_the_silent_verl_cases(tmp_path):
    need("verl", "vllm")
    job = f"{SWITCH} {TOP_K} {R3} {ROUTING}"
    assert findings(tmp_path, job) == []
    # the switch while a patch it needs is off: verl would ignore the key
    for variable, patch in (
        ("REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_BATCH", "verl.rollout_support_batch"),
        ("REPLAY_PLUGIN_VERL_FSDP_SUPPORT_LOGPROBS", "verl.fsdp_support_logprobs"),
        ("REPLAY_PLUGIN_VLLM_SAMPLER_ROWS", "vllm.sampler_rows"),
    ):
        (off,) = findings(tmp_path, job, {variable: "0"})
        assert f"{patch} disabled: {variable}=0" in off["problem"] and "verl ignores the key" in off["problem"], off
    (megatron,) = findings(
        tmp_path, f"{SWITCH} {TOP_K} actor_rollout_ref.actor.strategy=megatron",
        {"REPLAY_PLUGIN_VERL_MEGATRON_SUPPORT_LOGPROBS": "0"},
    )  # fmt: skip
    assert "verl.megatron_support_logprobs disabled" in megatron["problem"], megatron
    # the V1 padding patch matters to the TransferQueue batch only (verl's default trainer.use_v1)
    padding_off = {"REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_PADDING": "0"}
    assert findings(tmp_path, f"{SWITCH} {TOP_K} trainer.use_v1=false", padding_off) == []
    (v1,) = findings(tmp_path, f"{SWITCH} {TOP_K}", padding_off)
    assert "verl.rollout_support_padding disabled" in v1["problem"], v1
    support, routes = findings(tmp_path, job, {"REPLAY_PLUGIN_DISABLE": "1"})
    assert "REPLAY_PLUGIN_DISABLE is set" in support["problem"] and SWITCH[1:] in support["problem"], support
    assert "verl.fsdp_routes REPLAY_PLUGIN_DISABLE is set" in routes["problem"], routes
    # what the server or the engines would refuse at start or at the first batch, found earlier
    (top_k,) = findings(tmp_path, SWITCH)  # verl's default top_k is -1
    assert "actor_rollout_ref.rollout.top_k > 1 (got -1)" in top_k["problem"], top_k
    (titan,) = findings(tmp_path, f"{SWITCH} {TOP_K} actor_rollout_ref.actor.strategy=torchtitan")
    assert "strategy torchtitan" in titan["problem"], titan
    # FSDP R3: silent only when the guard is off too
    (guarded,) = findings(tmp_path, f"{R3} {ROUTING}", {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0"})
    assert "verl.fsdp_routes disabled" in guarded["problem"] and "refuses the first batch" in guarded["problem"]
    both_off = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}
    (silent,) = findings(tmp_path, f"{R3} {ROUTING}", both_off)
    assert "silently: nothing refuses it" in silent["problem"], silent
    (no_routes,) = findings(tmp_path, R3)
    assert "enable_rollout_routing_replay is not true" in no_routes["problem"], no_routes
    # Megatron's R3 is verl's own: no FSDP finding
    assert findings(tmp_path, f"{R3} actor_rollout_ref.actor.strategy=megatron", both_off) == []
