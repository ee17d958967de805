"""Hugging Face MoE families: where each one routes and how it weights the chosen experts.

Read from transformers 5.10.4, 5.16.1, 5.19.0, 5.24.0 and 5.25.0 (``models/<family>/modeling_<family>.py``;
5.25.0 is identical to 5.24.0 in every routing target).
What is stable across those versions, and what routed-expert replay relies on:

* every family has one MoE block class per decoder layer (:attr:`Family.block`); its forward calls
  the router module once (:attr:`Family.router`: returns the logits ``[N, E]`` alone, or a tuple
  holding them at the index the family's ``OutputRecorder(..., index=i)`` declares), then calls the
  experts module once as ``experts(hidden_states, top_k_index [N, K], top_k_weights [N, K])``;
  every experts implementation (eager, ``grouped_mm``, ``batched_mm``, ...) dispatches inside that
  call (``integrations/moe.py``, ``@use_experts_implementation``);
* the weights of the chosen experts are a function of the router logits and the chosen ids
  (:attr:`Family.weights`, written out below per family, each next to the upstream lines it
  mirrors). Bias terms, expert-score correction biases and group limits only decide *which*
  experts are chosen, never their weights.

What moved between versions (why the wrap point is the block, not the router): deepseek_v3 and
glm4_moe routed in ``<Block>.route_tokens_to_experts`` in 5.10 and in the router from 5.16; jamba's
router was an ``nn.Linear`` plus ``route_tokens_to_experts`` up to 5.19 and ``JambaTopKRouter`` in
5.24; granitemoe's router returned ``(index, weights, logits)`` in 5.16-5.19 and ``(logits, weights,
index)`` in 5.24, and in 5.10 it was ``GraniteMoeTopKGating``, which returns sorted dispatch data to
two ``GraniteMoeParallelExperts`` (no experts module takes expert ids there: refused).

The Switch load-balancing loss (``load_balancing_loss_func`` in every family module but
deepseek_v3 and glm4_moe) runs its own top-k on the recorded router logits;
:func:`load_balancing_loss` is the same loss counted over the experts actually used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FAMILIES", "Family", "family_of", "load_balancing_loss"]

Weights = Callable[[torch.Tensor, torch.Tensor, torch.dtype, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face MoE family (``config.model_type``).

    ``weights(logits [N, E], index [N, K] int64, hidden_dtype, config) -> [N, K]``: the weights the
    family gives experts ``index`` from the router's logits, dtype and all.
    """

    model_type: str
    block: str
    router: str
    weights: Weights
    num_experts: Callable[[Any], int]
    top_k: Callable[[Any], int]
    aux_loss: bool = True
    experts: str = "experts"

    @property
    def module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def patch(self) -> str:
        """The patch wrapping this family's block (``transformers.moe_router_replay.<model_type>``)."""
        return f"transformers.moe_router_replay.{self.model_type}"


# --------------------------------------------------------------------------- weights


def _softmax_topk(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # Qwen3MoeTopKRouter (and qwen2_moe, qwen3_next, olmoe):
    #   probs = softmax(logits, dtype=float); top = topk(probs); if norm_topk_prob: top /= top.sum(-1)
    #   top.to(logits.dtype)
    w = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, index)
    if config.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _mixtral(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # MixtralTopKRouter: softmax(logits.float()), top-k, always renormalised, left in float32
    w = F.softmax(logits.float(), dim=-1).gather(-1, index)
    return w / w.sum(dim=-1, keepdim=True)


def _softmax_of_top_logits(
    logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any
) -> torch.Tensor:
    # GptOssTopKRouter: top-k on the logits (router bias included), softmax over the K kept values
    top = logits.gather(-1, index)
    return F.softmax(top, dim=1, dtype=top.dtype)


def _sigmoid_group(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # DeepseekV3 / Glm4Moe (route_tokens_to_experts in 5.10, the router from 5.16): scores =
    # sigmoid(logits) (float32); e_score_correction_bias and the group limit choose, the weights are
    # scores.gather(index), renormalised with + 1e-20 if norm_topk_prob, times routed_scaling_factor
    w = logits.sigmoid().gather(1, index)
    if config.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * config.routed_scaling_factor


def _jamba(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # JambaSparseMoeBlock.route_tokens_to_experts (<= 5.19) / JambaTopKRouter (5.24): softmax in
    # float, top-k, not renormalised, cast to the hidden states' dtype
    return F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, index).to(hidden_dtype)


def _dbrx(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # DbrxFFN.route_tokens_to_experts: softmax in the logits' dtype, top-k, divided by its p-norm
    # when ffn_config.moe_normalize_expert_weights is set
    w = F.softmax(logits, dim=1, dtype=logits.dtype).gather(-1, index)
    p = config.ffn_config.moe_normalize_expert_weights
    if p is not None:
        w = w / torch.norm(w, p=p, dim=-1, keepdim=True)
    return w


def _granitemoe(logits: torch.Tensor, index: torch.Tensor, hidden_dtype: torch.dtype, config: Any) -> torch.Tensor:
    # GraniteMoeTopKRouter (>= 5.16): logits in float32, top-k on the logits, softmax over the K
    # kept values, cast to the hidden states' dtype
    return torch.softmax(logits.gather(-1, index), dim=-1).to(hidden_dtype)


def _get(*names: str) -> Callable[[Any], int]:
    def read(config: Any) -> int:
        for name in names:
            obj = config
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is not None:
                return int(obj)
        raise AttributeError(f"{type(config).__name__} has none of {', '.join(names)}")

    return read


_QWEN = dict(weights=_softmax_topk, num_experts=_get("num_experts"), top_k=_get("num_experts_per_tok"))
_DEEPSEEK = dict(
    weights=_sigmoid_group, num_experts=_get("n_routed_experts"), top_k=_get("num_experts_per_tok"), aux_loss=False
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", **_QWEN),  # type: ignore[arg-type]
        Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate", **_QWEN),  # type: ignore[arg-type]
        Family("qwen3_next", "Qwen3NextSparseMoeBlock", "gate", **_QWEN),  # type: ignore[arg-type]
        Family("olmoe", "OlmoeSparseMoeBlock", "gate", **_QWEN),  # type: ignore[arg-type]
        Family(
            "mixtral", "MixtralSparseMoeBlock", "gate", _mixtral, _get("num_local_experts"), _get("num_experts_per_tok")
        ),
        Family(
            "gpt_oss",
            "GptOssMLP",
            "router",
            _softmax_of_top_logits,
            _get("num_local_experts"),
            _get("num_experts_per_tok"),
        ),
        Family("deepseek_v3", "DeepseekV3MoE", "gate", **_DEEPSEEK),  # type: ignore[arg-type]
        Family("glm4_moe", "Glm4MoeMoE", "gate", **_DEEPSEEK),  # type: ignore[arg-type]
        Family("jamba", "JambaSparseMoeBlock", "router", _jamba, _get("num_experts"), _get("num_experts_per_tok")),
        Family("dbrx", "DbrxFFN", "router", _dbrx, _get("ffn_config.moe_num_experts"), _get("ffn_config.moe_top_k")),
        Family(
            "granitemoe", "GraniteMoeMoE", "router", _granitemoe, _get("num_local_experts"), _get("num_experts_per_tok")
        ),
    )
}


def family_of(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


# --------------------------------------------------------------------------- load-balancing loss


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    selected: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss of ``load_balancing_loss_func``, counted over the
    experts in ``selected`` instead of a top-k of the logits.

    ``num_experts * sum_e (count_e / rows) * (P_e / rows)``: ``rows`` tokens over all MoE layers,
    ``count_e`` the number of their ``rows * K`` assignments that go to expert ``e``, ``P_e`` the
    sum of ``e``'s router probability; only tokens the ``[B, S]`` attention mask keeps (all without
    one). Equal to upstream's value (5.10's one-hot means and 5.24's per-layer counts alike) when
    ``selected`` is the top-k of the logits.

    Args:
        router_logits: per MoE layer ``[B*S, E]`` (the model's ``outputs.router_logits``).
        selected: per MoE layer ``[B*S, K]`` expert ids, in the same order.
        attention_mask: ``[B, S]`` or None.
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: Any = 0.0
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits, index in zip(router_logits, selected):
        p = F.softmax(logits.to(device), dim=-1).float()
        index = index.to(device).reshape(-1, top_k).long()
        ones = torch.ones(index.numel(), dtype=torch.float32, device=device)
        if mask is None:
            counts = counts + torch.zeros_like(counts).scatter_add_(0, index.reshape(-1), ones)
            probs = probs + p.sum(dim=0)
            rows = rows + p.shape[0]
        else:
            counts = counts + torch.zeros_like(counts).scatter_add_(0, index.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (p * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return torch.sum((counts / rows) * (probs / rows)) * num_experts
