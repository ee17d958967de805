"""``replay-plugin doctor --verl-config``: verl's config asks for a replay that the plugin would not
deliver, found from the driver before Ray starts (the installed verl 0.9.1 and vLLM read through
the matrix; nothing of them imported). The silent cases are the ones no patch of the plugin runs
to refuse: the switch with a verl patch that would not apply (verl then ignores the ``custom``
key), and FSDP R3 with both the route patch and the guard off."""

import json
import math
import os
import shlex
import subprocess
import sys

from support.upstream import need

SWITCH = "+actor_rollout_ref.rollout.custom.replay_sample_support=true"
TOP_K = "actor_rollout_ref.rollout.top_k=20"
R3 = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"
ROUTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
CUSTOM = "+actor_rollout_ref.rollout.custom"


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


# --------------------------------------------------------------------------- issue 41: read as verl reads


def clean_env(**env: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}, **env}


def verl_findings(keys: str, **env: str) -> list[tuple[str, str]]:
    from replay_plugin.verl import doctor

    return doctor.check(keys, clean_env(**env))


def test_doctor_reports_a_verl_config_it_cannot_read(tmp_path):
    """Issue 41 item 7: input the doctor cannot read, or that Hydra refuses, is one finding of
    check ``verl-config`` naming the input and the fix (exit 1), never a traceback; Hydra's own
    spellings that YAML rejects or splits wrongly are read, not refused."""
    need("verl")
    from replay_plugin import doctor

    (tmp_path / "adir").mkdir()
    (tmp_path / "bad.yaml").write_text("actor_rollout_ref: {rollout: [1,\n")
    (tmp_path / "latin1.yaml").write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")
    (tmp_path / "list.yaml").write_text("- actor_rollout_ref.rollout.top_k=20\n")
    unreadable = {
        "configs/does_not_exist.yaml": "no such file",
        str(tmp_path / "adir"): "is a directory",
        str(tmp_path / "bad.yaml"): "is not valid YAML",
        str(tmp_path / "latin1.yaml"): "is not UTF-8 text",
        str(tmp_path / "list.yaml"): "not a mapping",
        # one override written with a space, not quoted as one word: two words, neither complete
        f"{CUSTOM}={{replay_sample_support: true}}": "is not an override Hydra",
        "actor_rollout_ref.rollout.top_k=`20`": "is not an override Hydra",
        "actor_rollout_ref.rollout.top_k=[1,2": "is not an override Hydra",
        "actor_rollout_ref.rollout.top_k=!!python/name:os.system": "is not an override Hydra",
        "trainer.experiment_name='my run": "cannot be split into words",
        "actor_rollout_ref.rollout.top_k=20,40": "is a sweep",
        f"{SWITCH} {SWITCH[:-4]}false": "an earlier override already set",
        f"{TOP_K} ~actor_rollout_ref.rollout.top_k=40": "Hydra refuses the deletion",
        f"{CUSTOM}=[1,2] {SWITCH}": "Hydra cannot merge it",
        "actor_rollout_ref.rollout.top_k=${rollout_top_k}": "interpolation the doctor cannot resolve",
    }
    for config, words in unreadable.items():
        report = doctor.report(verl_config=config, environ=clean_env())
        found = [f for f in report["findings"] if f["check"].startswith("verl")]
        assert not report["ok"] and len(found) == 1, (config, found)
        assert found[0]["check"] == "verl-config" and words in found[0]["problem"] and found[0]["fix"], found
        assert any(found[0]["problem"].startswith(repr(w)) for w in [config, *config.split()]), found  # names it
    # what Hydra reads (verl starts with these): read, no verl-config finding
    for config in (
        "~actor_rollout_ref.rollout.top_k",
        f"{TOP_K} ~actor_rollout_ref.rollout.top_k=20",
        f'trainer.experiment_name="my run" {TOP_K}',
        f"'{CUSTOM}={{replay_sample_support: true}}' {TOP_K}",
        f"{CUSTOM}=5 {SWITCH} {TOP_K}",
        "trainer.experiment_name=@x trainer.project_name=*x trainer.default_local_dir=%x",
    ):
        report = doctor.report(verl_config=config, environ=clean_env())
        assert not [f for f in report["findings"] if f["check"].startswith("verl")], (config, report["findings"])


def test_doctor_command_prints_a_finding_not_a_traceback(tmp_path):
    need("verl")
    proc = subprocess.run(
        [sys.executable, "-m", "replay_plugin.cli", "doctor", "--verl-config", "configs/does_not_exist.yaml",
         "--skyrl-config", "+generator.inference_engine.enable_return_sample_support_set=true"],
        env=clean_env(), capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "PROBLEM [verl-config]: 'configs/does_not_exist.yaml': no such file" in proc.stdout, proc.stdout
    assert "PROBLEM [skyrl-config]: '+generator.inference_engine" in proc.stdout, proc.stdout


def _flat(doc, prefix=""):
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a, b) -> bool:
    """Equal values of the same type (``1`` is not ``True``), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_doctor_reads_overrides_as_hydra_composes_verls_config(monkeypatch):
    """Issue 41 item 8: the doctor's reading of each override equals what Hydra composes into
    verl's own config (``ppo_trainer``, verl 0.9.1's config directory) from the words a shell makes
    of the same line: the keys the line sets, with their values and types."""
    need("verl")
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from replay_plugin.job_config import parse_config

    monkeypatch.setenv("RP_DOCTOR_TOP_K", "20")
    lines = [
        "+actor_rollout_ref.rollout.custom={replay_sample_support:true}",  # YAML: a key "replay_sample_support:true"
        f"'+actor_rollout_ref.rollout.custom={{replay_sample_support: true}}' {TOP_K}",
        "+actor_rollout_ref.actor.fsdp_config.router_replay={mode:R3}",
        f"{ROUTING[:-4]}1 actor_rollout_ref.rollout.temperature=inf trainer.use_v1=1",
        "actor_rollout_ref.rollout.temperature=nan trainer.use_v1=False",
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=false",
        "actor_rollout_ref.rollout.top_k=0x14 +actor_rollout_ref.rollout.custom.replay_sample_support_slack=0b11",
        'trainer.experiment_name="my run" trainer.project_name=yes actor_rollout_ref.rollout.top_k=1e1',
        "~actor_rollout_ref.rollout.top_k",
        f"+actor_rollout_ref.rollout.custom=5 {SWITCH}",
        f"{SWITCH} ~actor_rollout_ref.rollout.custom.replay_sample_support",
        "actor_rollout_ref.rollout.top_k=${oc.env:RP_DOCTOR_TOP_K} trainer.experiment_name=@x",
        "++actor_rollout_ref.rollout.custom.Replay_Sample_Support=null actor_rollout_ref.rollout.name=sglang",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for line in lines:
            words = shlex.split(line)  # what the shell hands verl's main_ppo
            composed = _flat(OmegaConf.to_container(compose("ppo_trainer", overrides=words), resolve=True))
            keys = {w.lstrip("+~").partition("=")[0] for w in words}
            expected = {k: v for k, v in composed.items() if any(k == p or k.startswith(p + ".") for p in keys)}
            read = parse_config(line, "verl")
            assert read.keys() == expected.keys() and all(_same(read[k], v) for k, v in expected.items()), (
                line, read, expected,
            )  # fmt: skip


def test_doctor_judges_verl_values_as_verl_consumes_them():
    """Issue 41 item 8, the review's table (F5): each spelling gives the finding verl's reading
    calls for: the switch written as a Hydra dict, R3 as a dict, ``=1`` as true, ``inf`` a float,
    ``mode=false`` off, ``trainer.use_v1=1`` V1, ``0x14`` / ``0b11`` strings the server refuses; a
    misspelt ``replay_*`` key, a rollout other than vLLM and routes captured without R3 named."""
    need("verl", "vllm")
    from replay_plugin.core.errors import NotReplayable
    from replay_plugin.verl import switch

    rows_off = {"REPLAY_PLUGIN_VLLM_SAMPLER_ROWS": "0"}
    (dict_switch,) = verl_findings(
        f"+actor_rollout_ref.rollout.custom={{replay_sample_support:true}} {TOP_K}", **rows_off
    )
    assert "vllm.sampler_rows disabled" in dict_switch[0], dict_switch
    both_off = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "0", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}
    (dict_r3,) = verl_findings(f"+actor_rollout_ref.actor.fsdp_config.router_replay={{mode:R3}} {ROUTING}", **both_off)
    assert "silently: nothing refuses it" in dict_r3[0], dict_r3
    for typo in ("replay_sample_suport", "Replay_Sample_Support"):
        (unknown,) = verl_findings(f"+actor_rollout_ref.rollout.custom.{typo}=true {TOP_K}")
        assert f"custom.{typo} is not a key of replay-plugin's; did you mean {SWITCH[1:-5]}?" in unknown[0], unknown
    (sglang,) = verl_findings(f"{SWITCH} {TOP_K} actor_rollout_ref.rollout.name=sglang")
    assert "actor_rollout_ref.rollout.name=sglang" in sglang[0] and "vLLM server only" in sglang[0], sglang
    assert verl_findings(f"{SWITCH} {TOP_K} actor_rollout_ref.rollout.name=vllm") == []
    # no false alarms on verl's own spellings
    assert verl_findings(f"{R3} {ROUTING[:-4]}1") == []
    # inf and nan are floats for Hydra: the doctor judges them as the server's check judges the floats
    for spelling, temperature in (("inf", math.inf), ("nan", math.nan)):
        try:
            switch.check_rollout_config({"top_k": 20, "temperature": temperature})
            server = []
        except NotReplayable as exc:
            server = [str(exc)]
        found = verl_findings(f"{SWITCH} {TOP_K} actor_rollout_ref.rollout.temperature={spelling}")
        assert [problem for problem, _ in found] == server, (spelling, found, server)
    assert verl_findings("+actor_rollout_ref.actor.fsdp_config.router_replay.mode=false") == []
    # trainer.use_v1=1 is V1: the TransferQueue padding patch is needed
    (v1,) = verl_findings(f"{SWITCH} {TOP_K} trainer.use_v1=1", REPLAY_PLUGIN_VERL_ROLLOUT_SUPPORT_PADDING="0")
    assert "verl.rollout_support_padding disabled" in v1[0], v1
    # strings for Hydra: refused at the server's start, now named before it
    (hex_top_k,) = verl_findings(f"{SWITCH} actor_rollout_ref.rollout.top_k=0x14")
    assert "actor_rollout_ref.rollout.top_k > 1 (got '0x14')" in hex_top_k[0], hex_top_k
    (bin_slack,) = verl_findings(f"{SWITCH} {TOP_K} +actor_rollout_ref.rollout.custom.replay_sample_support_slack=0b11")
    assert "replay_sample_support_slack='0b11'" in bin_slack[0], bin_slack
    # routes captured that nothing replays, per strategy; R3 of the strategy's own key replays them
    megatron = "actor_rollout_ref.actor.strategy=megatron"
    for job, key in (
        (ROUTING, "actor_rollout_ref.actor.fsdp_config.router_replay.mode is disabled"),
        (f"{ROUTING} {megatron}", "actor_rollout_ref.actor.megatron.router_replay.mode is disabled"),
        (f"{ROUTING} {megatron} actor_rollout_ref.actor.megatron.router_replay.mode=disabled", "mode is disabled"),
        (f"{ROUTING} actor_rollout_ref.actor.strategy=torchtitan", "strategy torchtitan has no router replay"),
    ):
        (unreplayed,) = verl_findings(job)
        assert key in unreplayed[0] and "nothing replays them" in unreplayed[0], (job, unreplayed)
    assert verl_findings(f"{ROUTING} {megatron} actor_rollout_ref.actor.megatron.router_replay.mode=R3") == []


def test_doctor_names_the_toggle_value_set():
    """Issue 41 F11: a toggle that switches its patch off is named with the value set
    (``REPLAY_PLUGIN_VERL_FSDP_ROUTES=off``), not as ``=0`` whatever it holds; an empty one is
    never called ``=0`` either (named as set while settings read it as off, no finding once an
    empty toggle is unset)."""
    need("verl")
    for value in ("off", "no", "False"):
        env = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": value, "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}
        (silent,) = verl_findings(f"{R3} {ROUTING}", **env)
        assert f"verl.fsdp_routes disabled: REPLAY_PLUGIN_VERL_FSDP_ROUTES={value} " in silent[0], silent
    env = {"REPLAY_PLUGIN_VERL_FSDP_ROUTES": "", "REPLAY_PLUGIN_VERL_ENGINE_REPLAY_GUARD": "0"}
    for problem, _ in verl_findings(f"{R3} {ROUTING}", **env):
        assert "REPLAY_PLUGIN_VERL_FSDP_ROUTES=''" in problem and "REPLAY_PLUGIN_VERL_FSDP_ROUTES=0" not in problem
