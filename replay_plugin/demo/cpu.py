"""CPU shims that let stock megatron-core run the demo's GPTModel on a machine without CUDA.

Applied by ``replay-plugin demo`` in its own process, after the vLLM rollout and before any
Megatron module is built; never by the plugin's activation (only the demo may carry CPU shims).
They map CUDA RNG and device calls to the CPU, define the ``te_general_gemm`` global that
0.16.x's router gating reads without Transformer Engine, and turn ``torch.compile`` off. Build
every transformers model before :func:`apply`: its rotary ``inv_freq`` would otherwise be zeros.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand")
_applied = False


def disable_torch_compile() -> None:
    """Must run before torch is imported to take effect for ``torch.compile``-decorated code."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _cpu_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def factory(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if (
            (isinstance(device, str) and device.startswith("cuda"))
            or (isinstance(device, torch.device) and device.type == "cuda")
            or (isinstance(device, int) and not isinstance(device, bool))
        ):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    factory.__wrapped__ = fn  # type: ignore[attr-defined]
    return factory


def apply() -> None:
    """Install the shims in this process (idempotent)."""
    global _applied
    if _applied:
        return
    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    for name in _FACTORIES:
        setattr(torch, name, _cpu_factory(getattr(torch, name)))

    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)

    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None
    _applied = True


def init_single_process() -> None:
    """A one-rank gloo group and Megatron's model-parallel state (TP = PP = 1)."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
