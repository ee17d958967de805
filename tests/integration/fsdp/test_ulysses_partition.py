"""``ulysses.nd_partition`` (verl 0.9.1) and ``ulysses.nd_partition_skyrl`` (skyrl 0.4.0) on the
real upstream helpers.

verl: with the patch off, ``[batch, seq, ...]`` input fails in ``ulysses_pad`` and in
``ulysses_pad_and_slice_inputs`` (and the probe says so); with the patch on, on 4 real gloo ranks,
the shards of SP = 2 (two groups) and SP = 4 concatenate back to the input padded along the
sequence with the caller's value, trailing dimensions kept, positional and keyword ``pad_value``,
verl's 3-tuple return, position ids and 2-D behaviour unchanged, gradients flow to this rank's
slice; ``deactivate()`` brings the upstream failure back.

skyrl: 0.4.0 already pads N-D input (probe: not-needed, nothing wrapped, shards concatenate back
on 2 ranks); the probe flags a 2-D-only variant of the helper, and the plugin's wrapper makes that
variant give skyrl's own N-D result.
"""

from __future__ import annotations

import json

import fsdp_harness
import pytest
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(400)

N, W = 7, 3  # sequence length (not a multiple of 2 or 4) and trailing width


def _inputs():
    import torch

    support = torch.arange(N * W, dtype=torch.int32).reshape(1, N, W)
    routes = (torch.arange(N * 4, dtype=torch.uint8) % 5).reshape(1, N, 2, 2)
    positions = torch.arange(N, dtype=torch.int64).unsqueeze(0)
    return support, routes, positions


def _tolist(t) -> list:
    return t.detach().tolist()


# --------------------------------------------------------------------------- verl


def test_verl_gap_with_patch_off():
    """Patch off: verl 0.9.1 rejects [batch, seq, ...] input; the probe sees it both ways."""
    need("verl")
    code = r"""
import json, torch
import verl.utils.ulysses as U
import replay_plugin
from replay_plugin.patcher import patch_marker
from replay_plugin.fsdp.ulysses_nd_partition import probe_function

support = torch.arange(21, dtype=torch.int32).reshape(1, 7, 3)
positions = torch.arange(7).unsqueeze(0)
calls = {
    "ulysses_pad": lambda: U.ulysses_pad(support, None, sp_size=2, pad_value=-1),
    "ulysses_pad_positions": lambda: U.ulysses_pad(support, positions, sp_size=2, pad_value=-1),
    "ulysses_pad_and_slice_inputs": lambda: U.ulysses_pad_and_slice_inputs(support, None, sp_size=2, pad_value=-1),
}
errors = {}
for name, call in calls.items():
    try:
        call()
        errors[name] = None
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"

def nd_capable(input_ids_rmpad, position_ids_rmpad=None, sp_size=1, pad_value=0):
    # what the patch makes of verl's ulysses_pad: pads dim 1 with pad_value
    n = input_ids_rmpad.size(1)
    pad = (sp_size - n % sp_size) % sp_size
    shape = (input_ids_rmpad.shape[0], pad, *input_ids_rmpad.shape[2:])
    fill = torch.full(shape, pad_value, dtype=input_ids_rmpad.dtype)
    if position_ids_rmpad is not None:
        position_ids_rmpad = torch.cat([position_ids_rmpad, torch.arange(pad).unsqueeze(0)], dim=-1)
    return torch.cat([input_ids_rmpad, fill], dim=1), position_ids_rmpad, pad

probes = {name: probe_function(getattr(U, name), "pad_value").__dict__
          for name in ("ulysses_pad", "ulysses_pad_and_slice_inputs")}
probes["nd_capable"] = probe_function(nd_capable, "pad_value").__dict__
state = {s["name"]: s["state"] for s in replay_plugin.status()}
print(json.dumps({"errors": errors, "probes": probes, "state": state.get("ulysses.nd_partition"),
                  "marker": patch_marker(U.ulysses_pad)}))
"""
    proc = run_python(code, env={"REPLAY_PLUGIN_ULYSSES_ND_PARTITION": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    obs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert obs["state"] == "disabled" and obs["marker"] is None
    # The gap: `_, total_seq_len = x.shape` and, with position ids, the size(-1) assert.
    assert obs["errors"]["ulysses_pad"].startswith("ValueError: too many values to unpack"), obs
    assert obs["errors"]["ulysses_pad_and_slice_inputs"].startswith("ValueError: too many values to unpack"), obs
    assert obs["errors"]["ulysses_pad_positions"].startswith("AssertionError"), obs
    assert obs["probes"]["ulysses_pad"]["needed"] and obs["probes"]["ulysses_pad_and_slice_inputs"]["needed"]
    assert "rejects [batch, seq, ...] input" in obs["probes"]["ulysses_pad_and_slice_inputs"]["reason"]
    assert not obs["probes"]["nd_capable"]["needed"], obs["probes"]["nd_capable"]


def verl_partition(rank: int, world: int) -> dict:
    """4 ranks: SP = 2 (groups {0,1} and {2,3}) and SP = 4 (all), patch on, then deactivated."""
    import inspect

    import torch
    import torch.distributed as dist
    import verl.utils.ulysses as U

    import replay_plugin
    from replay_plugin.patcher import patch_marker

    support, routes, positions = _inputs()
    obs: dict = {
        "state": {s["name"]: s["state"] for s in replay_plugin.status()}.get("ulysses.nd_partition"),
        "markers": [patch_marker(U.ulysses_pad), patch_marker(U.ulysses_pad_and_slice_inputs)],
    }
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group(list(range(world)))
    original = inspect.unwrap(U.ulysses_pad_and_slice_inputs)
    for sp, group in ((2, pairs[rank // 2]), (4, everyone)):
        U.set_ulysses_sequence_parallel_group(group)
        out, pos, pad = U.ulysses_pad_and_slice_inputs(support, positions, sp_size=sp, pad_value=-1)
        # verl's argument order: (input, position_ids, sp_size, skip_position_ids_rmpad, pad_value)
        routes_out = U.ulysses_pad_and_slice_inputs(routes, None, sp, False, 255)
        tokens = U.ulysses_pad_and_slice_inputs(support[..., 0], positions, sp_size=sp, pad_value=-1)
        tokens_upstream = original(support[..., 0], positions, sp_size=sp, pad_value=-1)
        hidden = torch.randn(1, N, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
        h_out, _, _ = U.ulysses_pad_and_slice_inputs(hidden, None, sp_size=sp)
        h_out.sum().backward()
        obs[f"sp{sp}"] = {
            "out": _tolist(out),
            "dtype": str(out.dtype),
            "pos": _tolist(pos),
            "pad": pad,
            "returned": len(routes_out) if isinstance(routes_out, tuple) else None,
            "routes": _tolist(routes_out[0]),
            "routes_dtype": str(routes_out[0].dtype),
            "routes_pos": routes_out[1],
            "tokens_equal_upstream": all(
                (a is None and b is None) or (a == b if isinstance(a, int) else bool(torch.equal(a, b)))
                for a, b in zip(tokens, tokens_upstream)
            ),
            "hidden_grad_rows": _tolist(hidden.grad[0].abs().sum(dim=1) > 0),
        }
    padded, ppos, psize = U.ulysses_pad(support, positions, sp_size=4, pad_value=-1)
    _, ppos_2d, _ = inspect.unwrap(U.ulysses_pad)(support[..., 0], positions, sp_size=4, pad_value=-1)
    same, _, zero = U.ulysses_pad(support, None, sp_size=1, pad_value=-1)
    obs["pad_only"] = {
        "shape": list(padded.shape),
        "tail": _tolist(padded[0, N:]),
        "head_equal": bool(torch.equal(padded[:, :N], support)),
        "pos_equal_2d": bool(torch.equal(ppos, ppos_2d)),
        "pad": psize,
        "sp1_identity": same is support and zero == 0,
    }
    replay_plugin.deactivate()
    try:
        U.ulysses_pad_and_slice_inputs(support, None, sp_size=2, pad_value=-1)
        obs["after_deactivate"] = None
    except Exception as exc:  # noqa: BLE001
        obs["after_deactivate"] = f"{type(exc).__name__}: {exc}"
    return obs


def _concat(parts: list) -> list:
    """Concatenate per-rank [1, part, ...] lists along dim 1."""
    return [sum((p[0] for p in parts), [])]


def test_verl_nd_partition_on_four_ranks():
    need("verl")
    import torch

    results = fsdp_harness.run_ranks(verl_partition, 4)
    support, routes, positions = _inputs()
    padded = torch.cat([support, torch.full((1, 1, W), -1, dtype=torch.int32)], dim=1)
    padded_routes = torch.cat([routes, torch.full((1, 1, 2, 2), 255, dtype=torch.uint8)], dim=1)
    padded_pos = torch.cat([positions, torch.zeros(1, 1, dtype=torch.int64)], dim=1)
    for r in results:
        assert r["state"] == "applied" and r["markers"] == ["ulysses.nd_partition"] * 2
        assert r["after_deactivate"] is not None and r["after_deactivate"].startswith("ValueError"), r[
            "after_deactivate"
        ]
        p = r["pad_only"]
        assert p["shape"] == [1, N + 1, W] and p["tail"] == [[-1] * W] and p["head_equal"] and p["pos_equal_2d"]
        assert p["pad"] == 1 and p["sp1_identity"]
    for sp, groups in ((2, [[0, 1], [2, 3]]), (4, [[0, 1, 2, 3]])):
        for group in groups:
            shards = [results[i][f"sp{sp}"] for i in group]
            for s in shards:
                assert s["pad"] == 1 and s["returned"] == 3 and s["routes_pos"] is None
                assert s["dtype"] == "torch.int32" and s["routes_dtype"] == "torch.uint8"
                assert s["tokens_equal_upstream"]
                assert torch.tensor(s["out"]).shape == (1, (N + 1) // sp, W)  # trailing dims kept
            assert torch.equal(torch.tensor(_concat([s["out"] for s in shards]), dtype=torch.int32), padded)
            assert torch.equal(torch.tensor(_concat([s["routes"] for s in shards]), dtype=torch.uint8), padded_routes)
            assert torch.equal(torch.tensor(_concat([s["pos"] for s in shards])), padded_pos)
            # each rank's gradient reaches exactly the rows of its own slice
            part = (N + 1) // sp
            for k, s in enumerate(shards):
                rows = [part * k <= i < part * (k + 1) for i in range(N)]
                assert s["hidden_grad_rows"] == rows


# --------------------------------------------------------------------------- skyrl


def slice_input_tensor(x, dim, padding=True, group=None):
    from skyrl.backends.skyrl_train.distributed.ulysses import utils

    return utils.slice_input_tensor(x, dim, padding=padding, group=group)


def skyrl_two_d_only(
    input_ids_rmpad, position_ids_rmpad=None, attention_mask_rmpad=None, sp_size=1, input_padding_value=0
):
    """skyrl's helper written as verl 0.9.1 writes its own: [batch, seq] input only."""
    import torch

    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, attention_mask_rmpad, 0
    _, total_seq_len = input_ids_rmpad.shape
    pad_size = (sp_size - total_seq_len % sp_size) % sp_size
    if pad_size > 0:
        input_ids_rmpad = torch.nn.functional.pad(input_ids_rmpad, (0, pad_size), value=input_padding_value)
        if position_ids_rmpad is not None:
            pad_pos = torch.arange(pad_size).unsqueeze(0).repeat(position_ids_rmpad.size(0), 1)
            position_ids_rmpad = torch.cat((position_ids_rmpad, pad_pos), dim=-1)
    input_ids_rmpad = slice_input_tensor(input_ids_rmpad, dim=1, padding=False)
    if position_ids_rmpad is not None:
        position_ids_rmpad = slice_input_tensor(position_ids_rmpad, dim=1, padding=False)
    return input_ids_rmpad, position_ids_rmpad, attention_mask_rmpad, pad_size


def skyrl_partition(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.distributed.ulysses import utils as S

    import replay_plugin
    from replay_plugin.fsdp.ulysses_nd_partition import _nd_wrapper, probe_function
    from replay_plugin.patcher import PluginWrapper, patch_marker

    support, routes, positions = _inputs()
    state = {s["name"]: (s["state"], s["reason"]) for s in replay_plugin.status()}
    obs: dict = {
        "state": state.get("ulysses.nd_partition_skyrl"),
        "marker": patch_marker(S.ulysses_pad_and_slice_inputs),
        "probe_real": probe_function(S.ulysses_pad_and_slice_inputs, "input_padding_value").__dict__,
        "probe_two_d_only": probe_function(skyrl_two_d_only, "input_padding_value").__dict__,
    }
    S.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    native = S.ulysses_pad_and_slice_inputs(support, positions, None, sp_size=world, input_padding_value=-1)
    native_routes = S.ulysses_pad_and_slice_inputs(routes, sp_size=world, input_padding_value=255)[0]
    # the plugin's wrapper (what install_skyrl would apply), on skyrl's real helper and on the
    # 2-D-only variant: both must give skyrl's own N-D result
    wrapped_real = PluginWrapper(S.ulysses_pad_and_slice_inputs, _nd_wrapper("input_padding_value"), "test")
    wrapped_variant = PluginWrapper(skyrl_two_d_only, _nd_wrapper("input_padding_value"), "test")
    try:
        skyrl_two_d_only(support, positions, sp_size=world, input_padding_value=-1)
        obs["variant_unwrapped"] = None
    except Exception as exc:  # noqa: BLE001
        obs["variant_unwrapped"] = f"{type(exc).__name__}: {exc}"

    def same(a, b) -> bool:
        return len(a) == len(b) and all(
            (x is None and y is None) or (x == y if isinstance(x, int) else bool(torch.equal(x, y)))
            for x, y in zip(a, b)
        )

    obs["native"] = {
        "out": _tolist(native[0]),
        "pos": _tolist(native[1]),
        "pad": native[3],
        "routes": _tolist(native_routes),
    }
    obs["wrapper_real_equal"] = same(
        wrapped_real(support, positions, None, sp_size=world, input_padding_value=-1), native
    )
    obs["wrapper_variant_equal"] = same(
        wrapped_variant(support, positions, None, sp_size=world, input_padding_value=-1), native
    )
    obs["wrapper_variant_routes_equal"] = bool(
        torch.equal(wrapped_variant(routes, sp_size=world, input_padding_value=255)[0], native_routes)
    )
    return obs


def test_skyrl_helper_needs_no_patch_and_probe_detects_two_d_only():
    need("skyrl")
    import torch

    results = fsdp_harness.run_ranks(skyrl_partition, 2)
    support, routes, positions = _inputs()
    for r in results:
        assert r["state"][0] == "not-needed", r["state"]
        assert r["marker"] is None
        assert not r["probe_real"]["needed"], r["probe_real"]
        assert r["probe_two_d_only"]["needed"] and "ValueError" in r["probe_two_d_only"]["reason"]
        assert r["variant_unwrapped"].startswith("ValueError: too many values to unpack")
        assert r["wrapper_real_equal"] and r["wrapper_variant_equal"] and r["wrapper_variant_routes_equal"]
    padded = torch.cat([support, torch.full((1, 1, W), -1, dtype=torch.int32)], dim=1)
    padded_routes = torch.cat([routes, torch.full((1, 1, 2, 2), 255, dtype=torch.uint8)], dim=1)
    assert torch.equal(torch.tensor(_concat([r["native"]["out"] for r in results]), dtype=torch.int32), padded)
    assert torch.equal(
        torch.tensor(_concat([r["native"]["routes"] for r in results]), dtype=torch.uint8), padded_routes
    )
    assert [r["native"]["pad"] for r in results] == [1, 1]
