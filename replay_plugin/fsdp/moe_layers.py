"""The MoE layers of a Hugging Face model, found by module path, and the refusals that come first.

:class:`MoeModel` walks a model (possibly wrapped by FSDP, FSDP2 or PEFT) for the family's MoE
blocks (:mod:`replay_plugin.fsdp.hf_moe`), keys each by its decoder-layer index and refuses, naming
what it found, every model under which routed-expert replay would not reach the experts: an
unknown ``model_type``, remote-code classes, a block whose forward is not the one the plugin wraps
(hub kernels, transformers' mxfp4 ``mlp_forward``), a foreign module holding experts
(``Mxfp4GptOssMLP``), a block without router and experts modules (granitemoe before 5.16), the
family patch not applied.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import torch

from .. import states
from ..core.errors import ReplayDataError, ReplayTypeError
from ..patcher import patch_marker
from .hf_moe import FAMILIES, Family, family_of

__all__ = ["MoeBlock", "MoeModel", "UnsupportedModelError"]


class UnsupportedModelError(ReplayDataError):
    """A model, family or kernel path under which routed-expert replay would not reach the experts."""


@dataclasses.dataclass(frozen=True, eq=False)
class MoeBlock:
    """One MoE block: the module, its decoder-layer index and path, its router and experts."""

    block: Any
    index: int
    path: str
    router: Any
    experts: Any


class MoeModel:
    """The MoE layers of a model (:attr:`blocks`, sorted by decoder layer) and what replay needs
    to know about them; every refusal happens here, before anything is bound."""

    def __init__(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ReplayTypeError(
                "model", f"got {type(model).__name__}", expected="a torch.nn.Module (a Hugging Face model)"
            )
        root = _pretrained_root(model)
        config = root.config
        model_type = getattr(config, "model_type", None)
        family = family_of(model_type)
        if family is None:
            raise UnsupportedModelError(
                "model",
                f"model type {model_type!r} ({type(root).__name__}) is not a supported MoE family",
                expected=f"one of {', '.join(sorted(FAMILIES))}",
            )
        self.family, self.config, self.root = family, config, root
        self.num_layers = int(config.num_hidden_layers)
        self.num_experts = family.num_experts(config)
        self.top_k = family.top_k(config)
        _ensure_patch(family)
        block_cls = getattr(sys.modules.get(family.module), family.block, None)
        recorder = (getattr(type(root), "_can_record_outputs", None) or {}).get("router_logits")
        logits_index = getattr(recorder, "index", None)
        layers: list[MoeBlock] = []
        for name, module in model.named_modules():
            if block_cls is None or not isinstance(module, block_cls):
                if isinstance(getattr(module, family.experts, None), torch.nn.Module):
                    _refuse_foreign_block(module, name, family)
                continue
            index = _layer_index(model, name, self.num_layers)
            router = getattr(module, family.router, None)
            experts = getattr(module, family.experts, None)
            if not isinstance(router, torch.nn.Module) or not isinstance(experts, torch.nn.Module):
                import transformers

                raise UnsupportedModelError(
                    "model",
                    f"{name} ({type(module).__name__}) on transformers {transformers.__version__} has no "
                    f"{family.router!r} router and {family.experts!r} experts modules taking expert ids (granitemoe "
                    "before 5.16 dispatches through GraniteMoeTopKGating)",
                    expected="a transformers version where the block calls experts(hidden, top_k_index, top_k_weights)",
                )
            _check_forward(module, name, family)
            layers.append(MoeBlock(module, index, name, router, experts))
        if not layers:
            raise UnsupportedModelError(
                "model",
                f"{type(root).__name__} ({model_type}) has no {family.block} from {family.module} (a remote-code "
                "model class, or no MoE layer at all)",
                expected=f"transformers' own {family.block} blocks",
            )
        seen: dict[int, str] = {}
        for layer in layers:
            if layer.index in seen:
                raise UnsupportedModelError(
                    "model",
                    f"{seen[layer.index]} and {layer.path} share decoder layer {layer.index}",
                    expected="one MoE block per decoder layer",
                )
            seen[layer.index] = layer.path
        self.blocks = tuple(sorted(layers, key=lambda x: x.index))
        self.moe_layers = tuple(x.index for x in self.blocks)
        self.logits_index = logits_index


def _pretrained_root(model: Any) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "model_type") and hasattr(config, "num_hidden_layers"):
            return module
    raise UnsupportedModelError(
        "model",
        f"{type(model).__name__} holds no Hugging Face model (no submodule with a config)",
        expected="a transformers PreTrainedModel, possibly wrapped (FSDP, PEFT)",
    )


def _layer_index(model: Any, name: str, num_layers: int) -> int:
    """The decoder-layer index in ``name``: the last number whose parent is a ModuleList of
    ``num_hidden_layers`` entries (``model.layers.3.mlp``, ``transformer.blocks.3.ffn``; FSDP1
    and PEFT wrappers insert path components, not list levels)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            parent = model.get_submodule(".".join(parts[:i]))
            if isinstance(parent, torch.nn.ModuleList) and len(parent) == num_layers:
                return int(parts[i])
    raise UnsupportedModelError(
        "model",
        f"MoE block {name} is not inside a list of {num_layers} decoder layers",
        expected="<...>.layers.<i>.<...> with config.num_hidden_layers layers",
    )


def _ensure_patch(family: Family) -> None:
    st = states.get(family.patch)
    if st is None or st.state != "applied":
        import replay_plugin

        replay_plugin.activate()  # where no .pth ran (python -S): applies the patches of imported modules
        st = states.get(family.patch)
    if st is None or st.state != "applied":
        state, reason = (st.state, st.reason) if st is not None else ("not registered", "")
        raise UnsupportedModelError(
            "model",
            f"patch {family.patch} is {state}{': ' + reason if reason else ''}; without it the "
            f"{family.model_type} blocks route themselves",
            expected=f"the patch applied (replay-plugin status --import {family.module})",
        )


def _refuse_foreign_block(module: Any, name: str, family: Family) -> None:
    """A module holding experts that is not the family's block routes on its own (transformers
    5.24 swaps ``GptOssMLP`` for ``Mxfp4GptOssMLP`` with mxfp4 weights)."""
    raise UnsupportedModelError(
        "model",
        f"{name} is a {type(module).__module__}.{type(module).__qualname__} holding experts, not the "
        f"{family.block} the plugin wraps: it routes on its own (quantized or kernel MoE layers) and replay would not "
        "reach its experts",
        expected=f"transformers' {family.block} in every MoE layer (mxfp4 dequantized)",
    )


def _check_forward(block: Any, name: str, family: Family) -> None:
    forward = inspect.getattr_static(block, "forward")
    if patch_marker(forward) == family.patch:
        return
    target = getattr(forward, "__func__", forward)
    where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    own = "an instance attribute" if "forward" in vars(block) else f"class {type(block).__qualname__}"
    raise UnsupportedModelError(
        "model",
        f"{name} runs {where} ({own}), not the {family.block} forward the plugin wraps: its routing happens "
        "elsewhere (hub kernels such as MegaBlocks, Mxfp4GptOssExperts) and replay would not reach the experts",
        expected=f"transformers' {family.block}.forward (load without use_kernels / mxfp4 dequantized)",
    )
