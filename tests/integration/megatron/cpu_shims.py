"""Test-only CPU shims that let stock megatron-core run a tiny MoE ``GPTModel`` on a machine
without CUDA (research/megatron.md section 4). Never imported by the plugin: the test files
and the subprocess scripts the tests start call :func:`apply` themselves.

What each shim clears, on megatron-core 0.16.1 and 0.19.2 with torch 2.13.0:

* ``model_parallel_cuda_manual_seed`` and the RNG tracker call ``torch.cuda.get_rng_state`` /
  ``set_rng_state`` / ``manual_seed`` and ``tensor_parallel.random._get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` (``AssertionError: Torch not compiled with CUDA enabled``): mapped
  to the CPU generator.
* ``TopKRouter.__init__`` registers its buffers on ``torch.cuda.current_device()`` and
  ``Router.gating`` moves the weight there: ``current_device`` returns ``"cpu"``.
* The schedules allocate ``torch.zeros([], device="cuda")`` and p2p communication calls
  ``torch.cuda.synchronize``: factories given a CUDA device allocate on the CPU, and
  synchronize is a no-op.
* 0.16.x only: ``RouterGatingLinearFunction`` reads a module global ``te_general_gemm`` that is
  undefined without Transformer Engine (``NameError``; 0.17 defaults it to None).

The alltoall dispatcher creates ``torch.cuda.Stream()`` and has no shim: use
``moe_token_dispatcher_type="allgather"``.

:func:`allow_sequence_parallel_norm` (separate, for the sequence-parallel test only): the local
layer spec's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` because a plain
torch LayerNorm's gradients are not all-reduced across tensor-parallel ranks; the norms that
support it need Transformer Engine or apex (GPU). The forward pass, which is what the test
checks, is the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand", "zeros_like", "empty_like")
_undo: list[Callable[[], None]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    missing = object()
    old = owner.__dict__.get(name, missing) if hasattr(owner, "__dict__") else getattr(owner, name, missing)
    setattr(owner, name, value)

    def undo() -> None:
        if old is missing:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, old)

    _undo.append(undo)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    factory.__wrapped__ = fn  # type: ignore[attr-defined]
    return factory


def apply() -> None:
    """Install the shims (idempotent). Call before building any Megatron module."""
    if _undo:
        return
    _set(torch.cuda, "current_device", lambda: "cpu")
    _set(torch.cuda, "synchronize", lambda device=None: None)
    _set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a lazy no-op without CUDA).
    _set(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    for name in _FACTORIES:
        _set(torch, name, _cpu_factory(getattr(torch, name)))

    from megatron.core.tensor_parallel import random as tp_random

    _set(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(tp_random, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state))

    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in moe_utils.__dict__:
        _set(moe_utils, "te_general_gemm", None)


def allow_sequence_parallel_norm() -> None:
    """Let the local spec's torch LayerNorm be built under ``sequence_parallel=True``."""
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original = cls.__new__

    def new(klass: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(config, "sequence_parallel", False):
            config = copy.copy(config)
            config.sequence_parallel = False
        return original(klass, config, *args, **kwargs)

    _set(cls, "__new__", staticmethod(new))


def revert() -> None:
    """Undo :func:`apply`."""
    while _undo:
        _undo.pop()()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(
    rank: int = 0, world_size: int = 1, port: int | None = None, *, pp: int = 1, tp: int = 1, vp: int | None = None
) -> None:
    """gloo process group on 127.0.0.1 and Megatron's model-parallel state (CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port or free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
    )
    model_parallel_cuda_manual_seed(1234)
