"""Tiny random Hugging Face MoE models of every supported family, built locally from configs (no hub).

``build(family, seed)`` returns a float32 ``*ForCausalLM`` in eval mode with every parameter drawn
from N(0, 0.5) (routers included: transformers initialises some of them to zero, which would make
every token's top-k a tie) and at least one dense decoder layer where the family has them. Sizes
are the smallest each family accepts; every family has 8 experts and top-2 (``NUM_EXPERTS``,
``TOP_K``).
"""

from __future__ import annotations

from typing import Any

NUM_EXPERTS, TOP_K, VOCAB = 8, 2, 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs() -> dict[str, Any]:
    import transformers as T

    moe = dict(num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    return {
        # layer 1 dense (mlp_only_layers): rows of dense layers must be ignored
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **_COMMON,
            **moe,
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            **_COMMON,
            **moe,
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
        "qwen3_next": lambda: T.Qwen3NextConfig(
            **_COMMON,
            **moe,
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            norm_topk_prob=True,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=1,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        "olmoe": lambda: T.OlmoeConfig(
            **_COMMON, **moe, num_hidden_layers=2, intermediate_size=16, norm_topk_prob=False
        ),
        "mixtral": lambda: T.MixtralConfig(
            **_COMMON,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=16,
        ),
        "gpt_oss": lambda: T.GptOssConfig(
            **_COMMON,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 2},
            n_routed_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            intermediate_size=48,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        "glm4_moe": lambda: T.Glm4MoeConfig(
            **_COMMON,
            n_routed_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
        ),
        # layers 1 and 3 MoE (expert_layer_period 2, offset 1), 0 and 2 dense; attention in layer 1
        "jamba": lambda: T.JambaConfig(
            **_COMMON,
            **moe,
            num_hidden_layers=4,
            intermediate_size=16,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            use_mamba_kernels=False,
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=1,
            mamba_dt_rank=4,
        ),
        "dbrx": lambda: T.DbrxConfig(
            vocab_size=VOCAB,
            d_model=32,
            n_heads=2,
            n_layers=2,
            max_seq_len=128,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={
                "ffn_hidden_size": 32,
                "moe_num_experts": NUM_EXPERTS,
                "moe_top_k": TOP_K,
                "moe_normalize_expert_weights": 1.0,
            },
        ),
        "granitemoe": lambda: T.GraniteMoeConfig(
            **_COMMON,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            num_hidden_layers=2,
            intermediate_size=16,
        ),
    }


FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_next",
    "olmoe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "jamba",
    "dbrx",
    "granitemoe",
)


def config(family: str, **overrides: Any) -> Any:
    cfg = _configs()[family]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build(family: str, seed: int = 0, attn: str = "eager", experts: str | None = None, **overrides: Any) -> Any:
    """The family's ``*ForCausalLM`` (float32, eval mode); ``overrides`` are set on its config,
    ``experts`` picks the experts implementation (eager, batched_mm, grouped_mm)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_config(config(family, **overrides), attn_implementation=attn, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.float().eval()
