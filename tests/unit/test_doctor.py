"""Doctor rules that need no upstream: the Megatron configuration checks."""

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
