"""``replay-plugin bench megatron``: what the Megatron side of replay costs.

1. The ``megatron.router_replay_scope`` wrapper's overhead per schedule with 48 routers (goal
   <= 50 microseconds), around a no-op with the schedules' signature (the real schedules need
   CUDA or CPU shims the plugin does not carry).
2. int32 route bytes per rank of ``replay_routes`` with PP=2 (two gloo processes) against
   widening the global routes first (goal: ratio 0.5).
3. Peak bytes of live route tensors over a real schedule (Megatron's
   ``forward_backward_no_pipelining`` on CPU with the demo's CPU shims, in a subprocess) with 1
   and 8 microbatches: forward-only, training without recompute, with full recompute (goal:
   8 / 1 <= 1.1, memory bounded by the microbatches in flight).
4. ``replay_response_logprobs`` (from logits, fused, replay off) against Megatron's
   ``vocab_parallel_cross_entropy``, TP=2, forward + backward: time and peak memory per rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from replay_plugin.bench import Result
from replay_plugin.bench._memory import MALLOC_ENV, peak_delta

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
            known = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((args, kwargs or {}))[0]
                if isinstance(t, torch.Tensor)
            }
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


def _noop_schedule(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    seq_length,
    micro_batch_size,
    decoder_seq_length=None,
    forward_only=False,
    collect_non_loss_data=False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce=False,
):
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


def _interleaved_diff(
    a: Callable[[], Any], b: Callable[[], Any], *, calls: int, rounds: int
) -> tuple[float, float, float, float]:
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
    from replay_plugin.patcher import PluginWrapper

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
            kw = dict(
                forward_step_func=None,
                data_iterator=iter(()),
                model=[model],
                num_microbatches=1,
                seq_length=1,
                micro_batch_size=1,
                forward_only=forward_only,
            )
            with_, without, diff, best = _interleaved_diff(
                functools.partial(wrapped, **kw),
                functools.partial(body, **kw),
                calls=calls,
                rounds=rounds,
            )
            results.append(
                Result(
                    BENCH,
                    f"scope wrapper overhead, {label}",
                    diff * 1e6,
                    "us",
                    "<= 50",
                    f"{NUM_ROUTERS} routers; {note}; median wrapped {with_ * 1e6:.1f} us vs "
                    f"{without * 1e6:.1f} us; fastest rounds differ by {best * 1e6:.1f} us",
                )
            )
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
            num_layers=_L,
            hidden_size=16,
            num_attention_heads=2,
            ffn_hidden_size=32,
            num_moe_experts=_E,
            moe_ffn_hidden_size=16,
            moe_router_topk=_K,
            moe_enable_routing_replay=True,
            moe_token_dispatcher_type="allgather",
            use_cpu_initialization=True,
            add_bias_linear=False,
            pipeline_model_parallel_size=world,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=_E, moe_grouped_gemm=False),
            vocab_size=32,
            max_sequence_length=_S,
            pre_process=rank == 0,
            post_process=rank == world - 1,
        )
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
        results.append(
            Result(
                BENCH,
                f"int32 route bytes, PP rank {rank} / global conversion",
                r["local"] / r["global"],
                "ratio",
                f"== {share:g}",
                f"layers {r['layers']}: {r['local']} B materialised vs {r['global']} B for all {_L} layers "
                f"([{_B}, {_S}, {_L}, {_K}] uint8 routes); replay_routes {r['seconds'] * 1e3:.2f} ms",
            )
        )
    return results


# ---------------------------------------------------------------------------------------
# 3. route memory over a schedule's microbatches

_MEM = {"layers": 4, "experts": 8, "topk": 2, "seq": 64, "mbs": 2}
_MEM_CASES = (
    ("forward-only", dict(forward_only=True, recompute=False)),
    ("training, no recompute", dict(forward_only=False, recompute=False)),
    ("training, full recompute", dict(forward_only=False, recompute=True)),
)


class _LiveRoutes:
    """Bytes of the storages of the replay tensors ``replay_routes`` returned that are still
    alive (held by RouterReplay FIFOs and targets, the autograd graph, anything else); the peak
    over the polls."""

    def __init__(self) -> None:
        import weakref

        self._ref = weakref.ref
        self.refs: list = []
        self.peak = 0

    def add(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            self.refs.append((self._ref(t), storage.data_ptr(), storage.nbytes()))

    def poll(self) -> None:
        live = {ptr: n for ref, ptr, n in self.refs if ref() is not None}
        self.peak = max(self.peak, sum(live.values()))


def _peak_route_bytes(model, microbatches: int, forward_only: bool) -> int:
    """Peak live route bytes over one ``get_forward_backward_func()`` schedule of ``microbatches``
    identical microbatches (forward-only ones under ``no_grad``, as logprob passes run)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.megatron import replay_routes

    m = _MEM
    b, s = m["mbs"], m["seq"]
    attention = torch.ones(b, s, dtype=torch.bool)
    layout = TokenMetadataLayout.build(attention, packed=False, align=1)
    g = torch.Generator().manual_seed(0)
    routes = torch.rand(b, s, m["layers"], m["experts"], generator=g).argsort(-1)[..., : m["topk"]].to(torch.uint8)
    ids = torch.randint(0, 32, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    live = _LiveRoutes()

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        replay = replay_routes(chunk, routes, ~attention, layout)
        live.add(replay.replay_data)
        out = chunk(ids, pos, causal, padding_mask=replay.padding_mask)
        live.poll()
        return out, lambda o: (o.float().mean(), {})

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(microbatches)),
            model=[model],
            num_microbatches=microbatches,
            seq_length=s,
            micro_batch_size=b,
            forward_only=forward_only,
        )
    live.poll()
    return live.peak


def _route_memory_rank(queue) -> None:
    """One process: the demo's CPU shims, a tiny MoE GPTModel, Megatron's own schedule
    (``forward_backward_no_pipelining``) with ``replay_routes`` in ``forward_step``."""
    try:
        from replay_plugin.demo import cpu

        cpu.disable_torch_compile()
        import torch

        import replay_plugin

        replay_plugin.activate()
        cpu.apply()
        cpu.init_single_process()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        from replay_plugin.registry import get

        states = {name: get().apply(name).state for name in ("megatron.router_replay_scope",)}
        m = _MEM
        results = {}
        for label, case in _MEM_CASES:
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            cfg = TransformerConfig(
                num_layers=m["layers"],
                hidden_size=16,
                num_attention_heads=2,
                ffn_hidden_size=32,
                num_moe_experts=m["experts"],
                moe_ffn_hidden_size=16,
                moe_router_topk=m["topk"],
                moe_enable_routing_replay=True,
                moe_token_dispatcher_type="allgather",
                use_cpu_initialization=True,
                add_bias_linear=False,
                params_dtype=torch.float32,
                pipeline_dtype=torch.float32,
                **(recompute if case["recompute"] else {}),
            )
            model = GPTModel(
                config=cfg,
                transformer_layer_spec=get_gpt_layer_local_spec(num_experts=m["experts"], moe_grouped_gemm=False),
                vocab_size=32,
                max_sequence_length=m["seq"],
            )
            for n in (1, 8):
                results[f"{label}|{n}"] = _peak_route_bytes(model, n, case["forward_only"])
        queue.put({"peak": results, "states": states})
    except BaseException as exc:  # noqa: BLE001
        import traceback

        queue.put({"error": f"{exc!r}: {traceback.format_exc()[-800:]}"})


def _route_memory() -> list[Result]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_route_memory_rank, args=(queue,))
    proc.start()
    got = queue.get()
    proc.join(60)
    if "error" in got:
        return [Result(BENCH, "peak route bytes", None, note=got["error"])]
    m = _MEM
    per_mb = m["mbs"] * m["seq"] * m["layers"] * m["topk"] * 4
    note = (
        f"live int32 replay tensors of replay_routes, real forward_backward_no_pipelining on CPU (the demo's CPU "
        f"shims, in a subprocess); {m['layers']} MoE layers, {m['mbs']}x{m['seq']} tokens per microbatch "
        f"({per_mb} B of routes); scope patch {got['states']['megatron.router_replay_scope']}"
    )
    results = []
    for label, _ in _MEM_CASES:
        one, eight = got["peak"][f"{label}|1"], got["peak"][f"{label}|8"]
        results.append(Result(BENCH, f"peak route bytes, {label}, 1 microbatch", one, "B", note=note))
        results.append(Result(BENCH, f"peak route bytes, {label}, 8 microbatches", eight, "B", note=note))
        results.append(
            Result(
                BENCH,
                f"peak route bytes, {label}, 8 / 1 microbatches",
                eight / one if one else None,
                "x",
                "<= 1.1",
                "bounded by the microbatches in flight (one, without pipelining)",
            )
        )
    return results


# ---------------------------------------------------------------------------------------
# 4. support-renormalised response logprobs vs Megatron's full-vocabulary path, TP=2

_SUPPORT_FULL = {"batch": 4, "seq": 512, "vocab": 32768, "hidden": 64, "width": 32, "repeats": 3}
_SUPPORT_QUICK = {"batch": 2, "seq": 128, "vocab": 4096, "hidden": 32, "width": 8, "repeats": 1}
_SUPPORT_METHODS = ("megatron", "helper_logits", "helper_fused", "helper_off")


def _support_batch(shape: dict):
    """Left-padded ids ``[B, S]``, attention, response loss mask and support rows ``[B, S, W]``
    (random distinct ids containing the token; row 0's last token a synthetic EOS)."""
    import torch

    b, s, v, w = shape["batch"], shape["seq"], shape["vocab"], shape["width"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (b, s), generator=g)
    attention = torch.ones(b, s, dtype=torch.bool)
    attention[1:, : s // 8] = False  # rows 1.. left-padded
    loss = torch.zeros(b, s, dtype=torch.bool)
    loss[:, s // 2 :] = True
    support = torch.stack([torch.randperm(v, generator=g)[:w] for _ in range(b * s)]).view(b, s, w).to(torch.int32)
    has = (support == ids.unsqueeze(-1).to(torch.int32)).any(-1)
    support[..., -1] = torch.where(has, support[..., -1], ids.to(torch.int32))
    support[~loss] = -1
    support[0, -1] = -1
    return ids, attention, loss, support


def _support_rank(rank: int, world: int, port: int, shape: dict, queue) -> None:
    try:
        import gc

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        from megatron.core.transformer.transformer_config import TransformerConfig

        from replay_plugin.core.layout import TokenMetadataLayout
        from replay_plugin.megatron import replay_response_logprobs

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(world, 1)
        b, s, temperature = shape["batch"], shape["seq"], 0.8
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=shape["hidden"],
            num_attention_heads=2,
            ffn_hidden_size=2 * shape["hidden"],
            use_cpu_initialization=True,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=world,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=shape["vocab"],
            max_sequence_length=s,
        )
        ids, attention, loss, support = _support_batch(shape)
        layout = TokenMetadataLayout.build(attention, packed=False, align=world)
        x = layout.align(ids, 0)
        with torch.no_grad():
            pos = torch.arange(x.shape[1]).expand_as(x)
            hidden0 = model.decoder.final_layernorm(model.embedding(x, pos)).detach()  # [A, B, H]
        labels = layout.align(ids, 0, next_token=True)
        weight = model.output_layer.weight
        upstream = torch.randn(b, s - 1, generator=torch.Generator().manual_seed(1))
        upstream_ce = layout.align(torch.nn.functional.pad(upstream, (0, 1)), 0.0)  # [B, A]
        replay = dict(support_ids=support, loss_mask=loss, temperature=temperature)

        def step(method: str) -> None:
            hidden = hidden0.clone().requires_grad_()
            weight.grad = None
            if method == "megatron":
                logits, _ = model.output_layer(hidden)
                out = -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous() / temperature, labels)
                torch.autograd.backward(out, upstream_ce)
                return
            if method == "helper_logits":
                logits, _ = model.output_layer(hidden)
                out = replay_response_logprobs(logits.transpose(0, 1).contiguous(), ids, layout, **replay)
            elif method == "helper_fused":
                out = replay_response_logprobs(hidden, ids, layout, output_weight=weight, **replay)
            else:
                logits, _ = model.output_layer(hidden)
                out = replay_response_logprobs(
                    logits.transpose(0, 1).contiguous(), ids, layout, temperature=temperature
                )
            torch.autograd.backward(out, upstream)

        for method in _SUPPORT_METHODS:  # warm-up
            step(method)
        best = {m: float("inf") for m in _SUPPORT_METHODS}
        for _ in range(shape["repeats"]):
            for method in _SUPPORT_METHODS:
                dist.barrier()
                start = time.perf_counter()
                step(method)
                best[method] = min(best[method], time.perf_counter() - start)
        peak = {}
        for method in _SUPPORT_METHODS:
            weight.grad = None
            gc.collect()
            dist.barrier()
            measured = peak_delta(functools.partial(step, method))
            peak[method], reset = measured["peak_delta_bytes"], measured["hwm_reset"]
        queue.put((rank, {"seconds": best, "peak": peak, "hwm_reset": reset}))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        queue.put((rank, {"error": f"{exc!r}: {traceback.format_exc()[-500:]}"}))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _support_tp2(quick: bool) -> list[Result]:
    import socket

    import torch.multiprocessing as mp

    shape = _SUPPORT_QUICK if quick else _SUPPORT_FULL
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Every block of 64 KiB or more its own mapping, returned to the OS when freed: the ranks'
    # resident-set high-water marks then see each step's own allocations.
    saved = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    os.environ.update(MALLOC_ENV)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_support_rank, args=(r, 2, port, shape, queue)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(queue.get() for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors:
        return [Result(BENCH, "support logprobs TP=2", None, note=errors[0])]
    seconds = {m: max(r["seconds"][m] for r in got.values()) for m in _SUPPORT_METHODS}
    peak = {m: max(r["peak"][m] for r in got.values()) for m in _SUPPORT_METHODS}
    tokens = shape["batch"] * shape["seq"]
    note = (
        f"TP=2 gloo CPU, {shape['batch']}x{shape['seq']} tokens, V={shape['vocab']} ({shape['vocab'] // 2}/rank), "
        f"H={shape['hidden']}, W={shape['width']}, fwd+bwd, best of {shape['repeats']} after a warm-up"
    )
    labels = {
        "megatron": "Megatron full-vocab (output layer + vocab_parallel_cross_entropy)",
        "helper_logits": "replay_response_logprobs from logits",
        "helper_fused": "replay_response_logprobs fused (hidden + weight)",
        "helper_off": "replay_response_logprobs, replay off",
    }
    mem_note = "VmHWM - VmRSS around one step, larger rank" + (
        "" if all(r["hwm_reset"] for r in got.values()) else " (clear_refs not writable: includes earlier steps)"
    )
    results = []
    for m in _SUPPORT_METHODS:
        results.append(Result(BENCH, f"support TP=2 time, {labels[m]}", seconds[m] * 1e3, "ms", note=note))
        results.append(Result(BENCH, f"support TP=2 peak memory, {labels[m]}", peak[m] / 2**20, "MiB", note=mem_note))
    # Goals at full size only: the quick shapes measure fixed overheads.
    # From logits: one dense gradient and nothing of the logits saved (issue 13: 1.32x peak
    # memory before, from autograd's gather keeping its input and a second dense gradient).
    time_goals = {"helper_logits": "<= 1", "helper_fused": "<= 1", "helper_off": "<= 1.5"}
    memory_goals = {"helper_logits": "<= 1", "helper_fused": "<= 0.5"}
    for m in ("helper_logits", "helper_fused", "helper_off"):
        results.append(
            Result(
                BENCH,
                f"support TP=2 time ratio, {labels[m]} / Megatron",
                seconds[m] / seconds["megatron"],
                "x",
                None if quick else time_goals.get(m),
                note=f"{tokens} tokens",
            )
        )
        if peak["megatron"] > 0:
            results.append(
                Result(
                    BENCH,
                    f"support TP=2 peak memory ratio, {labels[m]} / Megatron",
                    peak[m] / peak["megatron"],
                    "x",
                    None if quick else memory_goals.get(m),
                )
            )
    return results


def run(quick: bool = False) -> list[Result]:
    try:
        import megatron.core  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return [Result(BENCH, "(not available)", None, note=f"needs the [megatron] extra: {exc}")]
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # for the spawned ranks: nothing here is compiled
    return _scope_overhead(quick) + _pp_bytes() + _route_memory() + _support_tp2(quick)
