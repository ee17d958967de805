"""``replay-plugin bench megatron``: what the Megatron side of replay costs.

1. **Scope wrapper overhead per schedule** (goal <= 50 microseconds): the
   ``megatron.router_replay_scope`` wrapper, exactly as the patch installs it (a
   ``PluginWrapper`` around the schedule function), against the unwrapped function, with 48
   ``RouterReplay`` instances in the registry (a 48-layer MoE model). Three cases: a training
   schedule; a forward-only schedule that writes no counts (a logprob pass under ``no_grad``:
   the wrapper snapshots 48 routers' expert-bias counts and restores nothing); and one that
   writes every router's counts (grad enabled: the wrapper restores them). Rounds alternate
   wrapped / unwrapped and the figure is the median of per-round differences.

   The wrapped function is a no-op with the schedules' keyword-only signature: megatron-core's
   schedules allocate a CUDA tensor unconditionally, so they cannot run on a CPU-only machine
   without shims, and the plugin carries none outside ``replay_plugin/demo`` by design. The
   wrapper never looks inside the schedule, so the difference is the same quantity; the
   Megatron tests time it around the real ``forward_backward_no_pipelining`` with their
   test-only CPU shims.

2. **int32 route bytes per rank with PP=2**: two gloo processes (CPU) each build their stage
   of a 4-layer MoE ``GPTModel`` and call :func:`replay_plugin.megatron.replay_routes` on
   ``[B, S, 4, K]`` uint8 routes. Every int32 tensor any torch op allocates during the call is
   counted (:func:`int32_bytes_during`, a ``TorchDispatchMode``), against the bytes of
   converting the global routes to int32 (what a driver that widens first materialises). Goal:
   each rank materialises exactly its share (2 of 4 layers), i.e. the ratio is 0.5.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

from replay_plugin.bench import Result

BENCH = "megatron"
NUM_ROUTERS = 48


def int32_bytes_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), bytes)``: bytes of every new int32 tensor storage a torch op allocated in ``fn``.

    Views and in-place results (outputs sharing storage with an input or an earlier output)
    are not counted.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            known = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs or {}))[0]
                     if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.int32:
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr not in known and ptr not in self.seen:
                        self.seen.add(ptr)
                        self.bytes += storage.nbytes()
            return out

    mode = _Count()
    with mode:
        value = fn()
    return value, mode.bytes


# ---------------------------------------------------------------------------------------
# 1. scope wrapper overhead


def _noop_schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                   decoder_seq_length=None, forward_only=False, collect_non_loss_data=False, first_val_step=None,
                   adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None, force_all_reduce=False):
    return []


def _routers_model(n: int):
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router_replay = RouterReplay()
            self.register_buffer("local_tokens_per_expert", torch.zeros(64))

    return torch.nn.ModuleList(Router() for _ in range(n))


def _interleaved_diff(a: Callable[[], Any], b: Callable[[], Any], *, calls: int, rounds: int) -> tuple[float, float, float, float]:
    """Seconds per call of ``a`` and ``b`` (medians over rounds), the median per-round
    difference ``a - b``, and the difference of the fastest rounds (robust to load from
    other processes, which only ever adds time)."""
    for _ in range(20):
        a()
        b()
    ta, tb, diffs = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            a()
        mid = time.perf_counter()
        for _ in range(calls):
            b()
        end = time.perf_counter()
        ta.append((mid - start) / calls)
        tb.append((end - mid) / calls)
        diffs.append(ta[-1] - tb[-1])
    return statistics.median(ta), statistics.median(tb), statistics.median(diffs), min(ta) - min(tb)


def _scope_overhead(quick: bool) -> list[Result]:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.megatron import router_replay_scope
    from replay_plugin.registry import PluginWrapper

    saved = list(RouterReplay.global_router_replay_instances)
    RouterReplay.global_router_replay_instances.clear()
    try:
        model = _routers_model(NUM_ROUTERS)
        schedule = _noop_schedule
        note = "wrapper as installed, around a no-op with the schedule's signature"
        counts = [m.local_tokens_per_expert for m in model]

        def counting_schedule(**kw):  # a grad-enabled forward-only pass adds to every router's counts
            for c in counts:
                c += 1.0
            return []

        results = []
        calls, rounds = (50, 15) if quick else (200, 41)
        cases = (
            ("training schedule", schedule, False),
            ("forward-only schedule, counts untouched (no_grad)", schedule, True),
            ("forward-only schedule, counts written (grad enabled)", counting_schedule, True),
        )
        for label, body, forward_only in cases:
            wrapped = PluginWrapper(body, router_replay_scope._scope, "megatron.router_replay_scope")
            kw = dict(forward_step_func=None, data_iterator=iter(()), model=[model], num_microbatches=1,
                      seq_length=1, micro_batch_size=1, forward_only=forward_only)
            with_, without, diff, best = _interleaved_diff(lambda: wrapped(**kw), lambda: body(**kw), calls=calls,
                                                           rounds=rounds)
            results.append(Result(BENCH, f"scope wrapper overhead, {label}", diff * 1e6, "us", "<= 50",
                                  f"{NUM_ROUTERS} routers; {note}; median wrapped {with_ * 1e6:.1f} us vs "
                                  f"{without * 1e6:.1f} us; fastest rounds differ by {best * 1e6:.1f} us"))
        return results
    finally:
        RouterReplay.global_router_replay_instances[:] = saved


# ---------------------------------------------------------------------------------------
# 2. int32 bytes per rank, PP=2

_B, _S, _L, _K, _E = 4, 256, 4, 8, 64


def _pp_rank(rank: int, world: int, port: int, queue) -> None:
    try:
        import numpy as np
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        from replay_plugin.core.layout import TokenMetadataLayout
        from replay_plugin.megatron import replay_routes

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(1, world)
        cfg = TransformerConfig(
            num_layers=_L, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=_E,
            moe_ffn_hidden_size=16, moe_router_topk=_K, moe_enable_routing_replay=True,
            moe_token_dispatcher_type="allgather", use_cpu_initialization=True, add_bias_linear=False,
            pipeline_model_parallel_size=world, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        )
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=_E, moe_grouped_gemm=False),
                         vocab_size=32, max_sequence_length=_S, pre_process=rank == 0, post_process=rank == world - 1)
        rng = np.random.default_rng(0)
        routes = np.argsort(rng.random((_B, _S, _L, _E)), axis=-1)[..., :_K].astype(np.uint8)
        attention = torch.ones(_B, _S, dtype=torch.bool)
        layout = TokenMetadataLayout.build(attention, packed=True, align=1)
        replay, local = int32_bytes_during(lambda: replay_routes(model, routes, ~attention, layout))
        _, global_ = int32_bytes_during(lambda: torch.from_numpy(routes).to(torch.int32))
        start = time.perf_counter()
        for _ in range(5):
            replay.switch_to_backward()
            replay = replay_routes(model, routes, ~attention, layout)
        seconds = (time.perf_counter() - start) / 5
        queue.put((rank, {"local": local, "global": global_, "layers": list(replay.layer_numbers), "seconds": seconds}))
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, {"error": repr(exc)}))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _pp_bytes() -> list[Result]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_pp_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in procs)
    for p in procs:
        p.join(60)
    results = []
    for rank in sorted(got):
        r = got[rank]
        if "error" in r:
            results.append(Result(BENCH, f"int32 route bytes, PP rank {rank}", None, note=r["error"]))
            continue
        share = len(r["layers"]) / _L
        results.append(Result(
            BENCH, f"int32 route bytes, PP rank {rank} / global conversion", r["local"] / r["global"], "ratio",
            f"== {share:g}",
            f"layers {r['layers']}: {r['local']} B materialised vs {r['global']} B for all {_L} layers "
            f"([{_B}, {_S}, {_L}, {_K}] uint8 routes); replay_routes {r['seconds'] * 1e3:.2f} ms",
        ))
    return results


def run(quick: bool = False) -> list[Result]:
    try:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return [Result(BENCH, "(not available)", None, note=f"needs the [megatron] extra: {exc}")]
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # for the spawned ranks: nothing here is compiled
    return _scope_overhead(quick) + _pp_bytes()
