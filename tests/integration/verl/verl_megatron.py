"""Harness: verl 0.9.1's real ``MegatronEngineWithLMHead`` on CPU (gloo), around a tiny MoE
``GPTModel`` of megatron-core 0.16.1.

verl builds its Megatron model with a bridge (mbridge / Megatron-Bridge) that asks for Transformer
Engine layer specs, which need a GPU. So the harness builds the model itself (megatron-core's local
layer spec, rope, the allgather dispatcher) and hands it to the engine in place of
``initialize()``: everything the engine runs afterwards is verl's own code (``forward_backward_batch``,
``prepare_micro_batches``, ``forward_step``, ``gptmodel_forward_model_engine`` with its THD / BSHD
layouts, ``_lm_head_logits_processor``, ``postprocess_batch_func``, its ``RouterReplay`` R3 and
Megatron's own schedule, optimizer and DDP). Test-harness shims only, never in the shipped package:

* megatron-core's CPU shims (``tests/integration/megatron/cpu_shims.py``) and verl's CPU platform
  (``verl_engine.register_cpu_platform``);
* attention: megatron-core's only attention without Transformer Engine (``DotProductAttention``)
  refuses ``packed_seq_params`` (THD) and expects a ``[B, 1, S, S]`` mask where verl's BSHD path
  passes a ``[B, S]`` padding mask. :func:`shim_attention` runs the same local attention with the
  mask each layout means: block-diagonal causal over the packed sequences (``cu_seqlens_q_padded``)
  for THD, causal and padding for BSHD.

API
---
``setup(rank, world, tp=1)``: the shims, verl's CPU platform, Megatron's model-parallel state on
the process group ``fsdp_harness`` made (with TP > 1 the local norms accept sequence parallelism,
which verl turns on with TP: ``cpu_shims.allow_sequence_parallel_norm``).
``build_model(dtype="float32", seed=0, r3=False, sharpness=6.0, router_scale=0.05,
sequence_parallel=None)``: the tiny
``GPTModel`` (vocabulary :data:`VOCAB`, 2 MoE layers of 8 experts, top-2); the same weights for
every ``dtype`` and TP size (CPU initialization, seeded); ``sharpness`` scales the output layer
(a peaked next-token distribution), ``router_scale`` the router weights (near-ties between experts,
which a bfloat16 trainer breaks differently from a float32 rollout). ``r3``: built after verl's
``apply_router_replay_patch`` with routing replay on, as verl's engine does for
``router_replay.mode`` R2/R3. ``sequence_parallel`` (default: TP > 1, as verl) must be False for
the model a rollout runs on (any sequence length).
``full_logits(model, seq)``: ``[L, V]`` float32 logits of one sequence (gathered over TP).
``rollout(model, prompts, response, top_k, width, temperature, seed)``: top-k sampling token by
token; per sample the response, the sampler's logprobs, its support rows ``[R, width]`` (the top-k
ids, ``-1`` padded) and the routes ``[P + R, L, K]`` of the float32 forward of the whole sequence.
``build_engine(model, model_dir, *, use_remove_padding=True, router_replay_mode="disabled",
micro_batch_size=2, optimizer=False, **engine_overrides)``: the engine around ``model`` (``model_dir`` holds the HF
config and tokenizer verl's ``HFModelConfig`` reads); ``optimizer``: wrap the model in Megatron's
``DistributedDataParallel`` and build verl's Megatron optimizer and LR scheduler, for ``train_batch``.
``response_logprobs(model, prompts, responses, temperature)``: full-vocabulary reference.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON_DIR = os.path.join(os.path.dirname(HERE), "megatron")

VOCAB = 128
LAYERS, EXPERTS, TOPK_EXPERTS = 2, 8, 2


def setup(rank: int = 0, world: int = 1, tp: int = 1) -> Any:
    """The shims and Megatron's parallel state; returns the ``verl_engine`` harness module."""
    for path in (MEGATRON_DIR, HERE):
        if path not in sys.path:
            sys.path.insert(0, path)
    import cpu_shims
    import verl_engine
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_shims.apply()
    if tp > 1:  # verl turns sequence parallelism on with TP; the local spec's norms refuse it
        cpu_shims.allow_sequence_parallel_norm()
    verl_engine.register_cpu_platform()
    verl_engine.init_dist()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
    shim_attention()
    return verl_engine


_SHIMMED = False


def shim_attention() -> None:
    """Local attention for verl's THD and BSHD layouts (module docstring). Idempotent."""
    global _SHIMMED
    if _SHIMMED:
        return
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            t = query.shape[0]
            segment = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long().cpu())
            i = torch.arange(t)
            allowed = (segment[:, None] == segment[None, :]) & (i[None, :] <= i[:, None])
            q, k, v = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            out = local(
                self, q, k, v, ~allowed[None, None], attn_mask_type=attn_mask_type, attention_bias=attention_bias
            )
            return out.reshape(t, -1)
        if attention_mask is not None and attention_mask.dim() == 2:  # verl's BSHD: [B, S], True = token
            s = attention_mask.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
            allowed = causal[None] & attention_mask.bool()[:, None, :]
            attention_mask = ~allowed[:, None]
        return local(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                     attention_bias=attention_bias, packed_seq_params=packed_seq_params)  # fmt: skip

    DotProductAttention.forward = forward
    _SHIMMED = True


# =======================================================================================
# model


def tf_config(dtype: str = "float32", r3: bool = False, sequence_parallel: bool | None = None):
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=32,
        moe_router_topk=TOPK_EXPERTS,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=r3,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_model(
    dtype: str = "float32",
    seed: int = 0,
    r3: bool = False,
    sharpness: float = 6.0,
    router_scale: float = 0.05,
    sequence_parallel: bool | None = None,
):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if r3:  # what verl's MegatronEngine.__init__ does before building the model
        from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

        apply_router_replay_patch()
    torch.manual_seed(seed)
    model = GPTModel(
        config=tf_config(dtype, r3, sequence_parallel),
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    with torch.no_grad():
        model.output_layer.weight.mul_(sharpness)
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(router_scale)
    return model


def full_logits(model, seq) -> Any:
    """``[L, V]`` float32 logits of the sequence ``seq`` (one forward, gathered over TP)."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids = torch.tensor([list(seq)])
    n = ids.shape[1]
    mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
    logits = model(ids, torch.arange(n)[None], mask)  # [1, L, V/tp]
    return gather_from_tensor_model_parallel_region(logits)[0].float()


class _Routes:
    """Each router's top-k experts of one forward: ``[L_tokens, layers, K]`` sorted ids."""

    def __init__(self, model) -> None:
        self.maps: dict[int, Any] = {}
        self.handles = [
            m.register_forward_hook(self._hook(m.layer_number))
            for _, m in model.named_modules()
            if hasattr(m, "router_replay") and hasattr(m, "routing")
        ]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.maps[layer] = output[1].detach().clone()

        return hook

    def routes(self, tokens: int) -> Any:
        import torch

        out = []
        for layer in sorted(self.maps):
            m = self.maps[layer][:tokens]
            out.append(m.float().topk(TOPK_EXPERTS, dim=-1).indices.sort(-1).values)
        return torch.stack(out, dim=1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def rollout(model, prompts, response: int, top_k: int, width: int, temperature: float, seed: int) -> dict:
    """Top-k sampling from ``model`` (module docstring)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, list] = {"responses": [], "logprobs": [], "support": [], "routes": []}
    model.eval()
    with torch.no_grad():
        for prompt in prompts:
            seq, lps, rows = list(prompt), [], []
            for _ in range(response):
                z = full_logits(model, seq)[-1] / temperature
                top = torch.topk(z, top_k)
                probs = torch.softmax(top.values, -1)
                j = int(torch.multinomial(probs, 1, generator=g))
                seq.append(int(top.indices[j]))
                lps.append(float(torch.log(probs[j])))
                rows.append(top.indices.tolist() + [-1] * (width - top_k))
            spy = _Routes(model)
            try:
                full_logits(model, seq)
                routes = spy.routes(len(seq)).to(torch.int16)
            finally:
                spy.close()
            out["responses"].append(seq[len(prompt) :])
            out["logprobs"].append(lps)
            out["support"].append(rows)
            out["routes"].append(routes)
    return out


def route_spy(model) -> _Routes:
    return _Routes(model)


def response_logprobs(model, prompts, responses, temperature: float) -> list:
    """``log_softmax(logits / T)`` over the whole vocabulary at each response token."""
    import torch

    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            logp = torch.log_softmax(full_logits(model, list(p) + list(r)) / temperature, -1)
            n = len(p)
            out.append(logp[n - 1 : n - 1 + len(r)].gather(-1, torch.as_tensor(list(r))[:, None]).squeeze(-1))
    return out


# =======================================================================================
# engine


def save_model_dir(directory: str) -> str:
    """The HF config (Qwen3-MoE shaped like the model) and the tokenizer verl's HFModelConfig reads."""
    import verl_engine
    from transformers import Qwen3MoeConfig

    os.makedirs(directory, exist_ok=True)
    Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, num_experts=EXPERTS, num_experts_per_tok=TOPK_EXPERTS, moe_intermediate_size=32,
        architectures=["Qwen3MoeForCausalLM"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ).save_pretrained(directory)  # fmt: skip
    verl_engine.save_tokenizer(directory, VOCAB)
    return directory


def build_engine(
    model,
    model_dir: str,
    *,
    use_remove_padding: bool = True,
    router_replay_mode: str = "disabled",
    micro_batch_size: int = 2,
    optimizer: bool = False,
    lr: float = 1e-3,
    **engine_overrides: Any,
):
    """verl's ``MegatronEngineWithLMHead`` around ``model`` (module docstring)."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = object.__new__(MegatronEngineWithLMHead)
    engine.model_config = HFModelConfig(path=model_dir, use_remove_padding=use_remove_padding)
    engine.engine_config = McoreEngineConfig(
        use_remove_padding=use_remove_padding,
        micro_batch_size_per_gpu=micro_batch_size,
        infer_micro_batch_size_per_gpu=micro_batch_size,
        use_dynamic_bsz=False,
        use_distributed_optimizer=False,
        tensor_model_parallel_size=model.config.tensor_model_parallel_size,
        router_replay=EngineRouterReplayConfig(mode=router_replay_mode),
        **engine_overrides,
    )
    engine.optimizer_config = McoreOptimizerConfig(lr=lr, total_training_steps=10, clip_grad=0.0)
    engine.tf_config = model.config
    engine.enable_routing_replay = router_replay_mode != "disabled"
    engine.mini_layer_topk_idx_list = []
    engine.mode = None
    engine._is_offload_param = engine._is_offload_optimizer = False
    engine.param_dtype = model.config.params_dtype
    engine.is_value_model = False
    if optimizer:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
            module=model,
        )
        engine.module = [ddp]
        engine.optimizer = engine._build_optimizer()
        engine.lr_scheduler = engine._build_lr_scheduler()
    else:
        engine.module = [model]
    return engine
