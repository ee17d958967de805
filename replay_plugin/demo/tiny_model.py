"""A tiny Qwen3-MoE checkpoint and tokenizer built locally (no hub access), deterministically.

Used by the demo and by the vLLM/FSDP tests. ``build_tiny_moe(directory)`` writes a Hugging Face
checkpoint that vLLM (float32, CPU) and transformers both load; the same arguments give the same
bytes, and a complete build with the same arguments is reused. ``head_dim=64`` because vLLM's
CPU attention supports only some head sizes (32, 64, 80, 96, 112, 128, ...); ``lm_head_scale``
sharpens the output distribution so that truncation matters, and ``tied_tokens`` /
``tie_group_size`` make groups of ids tie exactly at the logits.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

CORPUS = (
    "the router sends each token to its top experts and the trainer must replay them exactly. "
    "a sampler draws from the top k tokens after temperature and nucleus truncation. "
    "mixture of experts models route tokens through sparse feed forward blocks. "
    "reinforcement learning rolls out trajectories and scores them again in the trainer. "
    "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and symbols + - * / = ( ) [ ] "
    "questions: what is two plus two? how many experts does a layer have? which token comes next? "
)


@dataclass(frozen=True)
class TinyMoEConfig:
    vocab_size: int = 512  # upper bound for the BPE trainer; the model gets the tokenizer's size
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    seed: int = 0
    lm_head_scale: float = 20.0
    router_scale: float = 1.0
    #: groups of token ids whose lm_head rows are made identical (exact logit ties)
    tied_tokens: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    #: when > 1, every run of this many consecutive token ids (over the whole vocabulary, whose
    #: size is only known once the tokenizer is trained) shares one lm_head row: every logit
    #: value occurs that many times, so top-k with k not a multiple of it always cuts a tie
    tie_group_size: int = 0
    #: special tokens the tokenizer gets besides ``<|endoftext|>`` (chat markers, e.g. Qwen's
    #: ``<|im_start|>`` / ``<|im_end|>``, which verl's Qwen3 continuous-token builder requires)
    special_tokens: tuple[str, ...] = ()

    def key(self) -> str:
        fields = asdict(self)
        # Fields added later are hashed only when set, so earlier builds keep their cache keys.
        for name, default in _LATER_FIELDS.items():
            if fields.get(name) == default:
                fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


_LATER_FIELDS = {"tie_group_size": 0, "special_tokens": ()}


def default_cache_dir() -> str:
    return os.environ.get("REPLAY_TEST_MODEL_CACHE") or os.path.expanduser("~/.cache/replay-plugin/models")


def build_tokenizer(directory: str, vocab_size: int, special_tokens: tuple[str, ...] = ()) -> None:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it as a
    ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(directory)


def build_tiny_moe(directory: str | None = None, config: TinyMoEConfig | None = None) -> str:
    """Build (or reuse) the checkpoint; returns its directory."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = config or TinyMoEConfig()
    directory = directory or os.path.join(default_cache_dir(), f"tiny-qwen3-moe-{cfg.key()}")
    marker = os.path.join(directory, ".complete")
    if os.path.exists(marker):
        with open(marker) as fh:
            if fh.read().strip() == cfg.key():
                return directory
    os.makedirs(directory, exist_ok=True)
    build_tokenizer(directory, cfg.vocab_size, tuple(cfg.special_tokens))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    vocab = len(tokenizer)
    if vocab > cfg.vocab_size:
        raise ValueError(f"tokenizer has {vocab} tokens, more than vocab_size={cfg.vocab_size}")

    hf_config = Qwen3MoeConfig(
        vocab_size=vocab,  # the trained tokenizer's size (the small corpus may stop below cfg.vocab_size)
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(hf_config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(cfg.lm_head_scale)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight"):
                gate.weight.mul_(cfg.router_scale)
        groups = list(cfg.tied_tokens)
        if cfg.tie_group_size > 1:
            size = cfg.tie_group_size
            groups += [tuple(range(start, min(start + size, vocab))) for start in range(0, vocab, size)]
        for group in groups:
            first = model.lm_head.weight[group[0]].clone()
            for token in group[1:]:
                model.lm_head.weight[token].copy_(first)
    model.save_pretrained(directory, safe_serialization=True)
    with open(marker, "w") as fh:
        fh.write(cfg.key())
    return directory
