"""A tiny GRPO job on real TRL 1.16.0 (CPU): a locally built Qwen3-MoE, a word-level tokenizer, a
dataset of short prompts and a length reward (no hub access).

``save_tiny_model(dir)`` writes the model and tokenizer; ``make_trainer(dir, **config)`` builds a
``GRPOTrainer`` over them (HF generate by default: ``use_vllm=False``, ``use_cpu=True``,
``bf16=False``). The LM head is transformers' initialisation times ``HEAD_SCALE``: the top 8
tokens then hold about 0.79 of the mass (0.57-0.97 over random prefixes), so top-k / top-p
truncation removes real probability and the stock trainer/sampler gap is plain to see.
"""

from __future__ import annotations

import os
from typing import Any

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K_EXPERTS = 64, 32, 2, 8, 2
HEAD_SCALE = 20.0
#: the switch: TRL's own generation_kwargs (replay_plugin.trl.switch)
SUPPORT = {"extra_args": {"replay_sample_support": True}}


def save_tokenizer(directory: str, vocab_size: int = VOCAB) -> None:
    """Word-level tokenizer: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, then ``w3`` ... (whitespace-split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def save_tiny_model(directory: str, seed: int = 0, head_dim: int = 16, **overrides: Any) -> str:
    """A float32 Qwen3-MoE (``LAYERS`` layers, ``EXPERTS`` experts, top-2) saved to ``directory``."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    config = T.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K_EXPERTS,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    model = T.Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        # transformers may initialise routers to zero (every token's top-k a tie): draw them
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        model.lm_head.weight.mul_(HEAD_SCALE)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory


def dataset(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"w{3 + i} w{4 + i} w{5 + i}" for i in range(n)]})


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c.split())) for c in completions]


def config(output_dir: str, **overrides: Any):
    from trl import GRPOConfig

    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        top_k=8,
        top_p=0.9,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def make_trainer(model_dir: str, output_dir: str, **overrides: Any):
    from trl import GRPOTrainer

    return GRPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=config(output_dir, **overrides),
        train_dataset=dataset(),
    )


# --------------------------------------------------------------------------- a probed GRPO run


class SamplerProbe:
    """Test-harness probe (not shipped): while open, every ``GenerationMixin._get_logits_processor``
    list gets one more processor at its end that keeps the log-softmax of the scores it sees: the
    distribution transformers' sampler draws each token from (after its warpers). The class
    attribute is replaced for the probe's lifetime and restored after (the plugin's own wrapper,
    when there is one, is called inside)."""

    def __init__(self) -> None:
        self.steps: list = []

    def __call__(self, input_ids, scores):
        import torch

        self.steps.append(torch.log_softmax(scores.detach().float(), dim=-1).cpu())
        return scores

    def __enter__(self):
        from transformers.generation.utils import GenerationMixin

        self._orig = GenerationMixin.__dict__["_get_logits_processor"]
        probe = self

        def _get_logits_processor(model, *args, **kwargs):
            processors = probe._orig.__get__(model, type(model))(*args, **kwargs)
            processors.append(probe)
            return processors

        GenerationMixin._get_logits_processor = _get_logits_processor
        return self

    def __exit__(self, *exc) -> None:
        from transformers.generation.utils import GenerationMixin

        GenerationMixin._get_logits_processor = self._orig

    def logprobs(self, completion_ids):
        """``[B, C]``: the sampler's log-probability of each completion token (the steps of one
        generate call, ``completion_ids`` ``[B, C]`` right-padded)."""
        import torch

        steps = torch.stack(self.steps[: completion_ids.size(1)], dim=1)  # [B, C, V]
        return steps.gather(-1, completion_ids.cpu().unsqueeze(-1)).squeeze(-1)


def run_job(model_dir: str, output_dir: str, switch: bool, **overrides: Any) -> dict:
    """A whole ``GRPOTrainer.train()`` (2 optimizer steps, one generation of 16 completions; TRL
    scores the old policy right after generating because ``steps_per_generation`` (4) is not a
    divisor of ``gradient_accumulation_steps`` (2)); returns TRL's log history and, for the
    generation, the trainer's old-policy logprob of each completion token against the sampler's
    processed logprob (``SamplerProbe``)."""
    import torch
    from trl import GRPOTrainer

    class Probed(GRPOTrainer):
        batches: list = []

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.batches.append(out)
            return out

    overrides.setdefault("steps_per_generation", 4)
    if switch:
        overrides.setdefault("generation_kwargs", SUPPORT)
    trainer = Probed(
        model=model_dir,
        reward_funcs=length_reward,
        args=config(output_dir, **overrides),
        train_dataset=dataset(),
    )
    with SamplerProbe() as probe:
        trainer.train()
    (batch,) = trainer.batches
    mask = batch["completion_mask"].bool()
    old = batch["old_per_token_logps"].detach().cpu()
    sampler = probe.logprobs(batch["completion_ids"])
    diff = (old - sampler)[mask.cpu()]
    return {
        "log_history": trainer.state.log_history,
        "ratio_mean": torch.exp(diff).mean().item(),
        "ratio_min": torch.exp(diff).min().item(),
        "max_abs_diff": diff.abs().max().item(),
        "tokens": int(mask.sum()),
        "batch_keys": sorted(batch),
        "completion_ids": batch["completion_ids"].tolist(),
    }
