"""Load a Hugging Face Qwen3-MoE checkpoint into a Megatron-core ``GPTModel`` (local layer spec).

Supported: ``Qwen3MoeForCausalLM`` safetensors checkpoints with every layer MoE, untied
embeddings, no attention bias and default RoPE. Routing matches ``norm_topk_prob=True``: HF's
softmax, top-k, renormalise is the same distribution as Megatron's top-k then softmax.

Why not a bridge (checked 2026-12-01 on this CPU machine, megatron-core 0.16.1, transformers
5.10.4, torch 2.13.0 CPU): ``mbridge`` 0.15.1 (pure Python, has a Qwen3-MoE bridge) cannot build
or load the demo model on CPU without five workarounds, each an upstream assumption:
(1) ``LLMBridge._get_transformer_layer_spec`` hard-codes ``use_transformer_engine=True``
(``NameError: TENorm`` without Transformer Engine); (2) it reads ``hf_config.rope_theta``, which
transformers 5 moved into ``rope_parameters`` (``AttributeError``); (3) its ``TransformerConfig``
sets TE-only fusions (``persist_layer_norm``: "not supported by torch LayerNorm");
(4) ``Bridge.get_model`` calls ``.cuda()`` unconditionally ("Invalid device, must be cuda
device"); (5) with all of that bypassed, ``load_weights`` knows only TE parameter names and
refuses the local spec's (``NotImplementedError: Unsupported parameter name:
decoder.layers.0.input_layernorm.weight``). NVIDIA's ``megatron-bridge`` 0.3.1 requires
``transformer-engine`` (CUDA), ``transformers<5`` and ``megatron-core<0.17``. So the demo keeps
this converter; replace it by a bridge once one supports the local spec on CPU.
"""

from __future__ import annotations

import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


class UnsupportedCheckpointError(ValueError):
    """The checkpoint is not one this converter maps exactly; the message says which field."""


def read_hf_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"architectures={cfg.get('architectures')}: expected one of {SUPPORTED_ARCHITECTURES}"
        )
    checks = {
        "mlp_only_layers": (cfg.get("mlp_only_layers") or [], []),
        "decoder_sparse_step": (cfg.get("decoder_sparse_step", 1), 1),
        "tie_word_embeddings": (bool(cfg.get("tie_word_embeddings", False)), False),
        "attention_bias": (bool(cfg.get("attention_bias", False)), False),
        "norm_topk_prob": (bool(cfg.get("norm_topk_prob", True)), True),
    }
    for key, (value, expected) in checks.items():
        if value != expected:
            raise UnsupportedCheckpointError(f"{key}={value!r}: the converter supports {expected!r} only")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedCheckpointError(f"rope_type={rope.get('rope_type')!r}: only default RoPE is supported")
    return cfg


def rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def megatron_config(cfg: dict, dtype: Any, **overrides: Any):
    """The ``TransformerConfig`` equivalent to the HF config, for CPU (local layers,
    allgather dispatcher, no fusions), with routing replay enabled."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_moe_experts=cfg.get("num_experts") or cfg.get("num_local_experts"),
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(directory: str, dtype: Any, **overrides: Any):
    """A ``GPTModel`` holding the checkpoint's weights in ``dtype`` (eval mode)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from safetensors.torch import load_file

    cfg = read_hf_config(directory)
    config = megatron_config(cfg, dtype, **overrides)
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(cfg)),
        share_embeddings_and_output_weights=False,
    )
    hf = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            hf.update(load_file(os.path.join(directory, name)))
    state = convert_state_dict(hf, cfg)
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise UnsupportedCheckpointError(f"weights do not map: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, value in state.items():
            if own[key].shape != value.shape:
                raise UnsupportedCheckpointError(f"{key}: shape {tuple(value.shape)} != {tuple(own[key].shape)}")
            own[key].copy_(value.to(own[key].dtype))
    model.eval()
    return model


def convert_state_dict(hf: dict, cfg: dict) -> dict:
    """HF tensor names -> Megatron ``GPTModel`` state-dict names (dtype unchanged)."""
    import torch

    n_layers = cfg["num_hidden_layers"]
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    q_per_group = heads // groups
    n_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(n_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[src + "self_attn.q_proj.weight"].view(groups, q_per_group * head_dim, -1)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, head_dim, -1)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, head_dim, -1)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
        out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
        for j in range(n_experts):
            e = f"{src}mlp.experts.{j}."
            out[f"{dst}mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat(
                [hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]], dim=0
            )
            out[f"{dst}mlp.experts.local_experts.{j}.linear_fc2.weight"] = hf[e + "down_proj.weight"]
    return out
