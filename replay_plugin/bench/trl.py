"""``replay-plugin bench trl``: TRL's training step with the plugin's support logprob against TRL's
own fused LM head, on the same batch, in one process.

A real trl 1.16 ``GRPOTrainer`` (HF generate path, nothing generated) over a random-weight
Qwen3-MoE with a large vocabulary; one step is TRL's ``_compute_loss`` (its chunk loop, its
fused LM head: ``trainer/utils.py:add_fused_lm_head``) and the backward, float32. ``stock``: the
micro-batch without rows, TRL's code alone (the plugin's patches pass through). ``replay``: the
same micro-batch with ``replay_support`` ``[B, C, W]`` rows, as ``trl.rollout_batch`` puts them
in TRL's batch, so ``trl.support_logprobs`` renormalises the completion logprobs over the rows
from the backbone's hidden states.

What it shows: the pack keeps TRL's fused head (its full-vocabulary entropy and aux loss stay
TRL's) and adds the support logprob, so the replay step costs TRL's step plus the ``W``-wide
head: ``replay_overhead`` is that addition relative to TRL's step (a goal: under 10%).
``support_head_vs_fused_head`` compares the two heads alone (forward and backward of the
completion logprobs from the same hidden states): the plugin's scores ``W`` candidates where TRL's
scores the vocabulary. Time is the best of interleaved rounds.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from replay_plugin.bench import Result

BENCH = "trl"
FULL = {
    "batch": 8,
    "prompt": 64,
    "completion": 256,
    "vocab": 32768,
    "hidden": 256,
    "layers": 2,
    "experts": 8,
    "width": 36,
}
QUICK = {"batch": 4, "prompt": 16, "completion": 32, "vocab": 4096, "hidden": 64, "layers": 2, "experts": 4, "width": 8}
#: the replay step's time over TRL's, minus 1 (the goal: under 10% more than TRL's step)
OVERHEAD_GOAL = "<= 0.1"


def _model(shape: dict) -> Any:
    from .fsdp import _model as qwen3_moe

    return qwen3_moe(
        shape,
        head_dim=max(shape["hidden"] // 4, 16),
        max_position_embeddings=2 * (shape["prompt"] + shape["completion"]),
        attn_implementation=None,  # TRL's choice (transformers' default), as before
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _trainer(model: Any, out_dir: str) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ..demo.tiny_model import build_tiny_moe

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_moe())  # a local tokenizer; the ids are synthetic
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        beta=0.0,
        use_vllm=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        top_k=20,
        report_to=[],
        save_strategy="no",
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 8}),
        processing_class=tokenizer,
    )


def _batch(shape: dict) -> dict:
    """Left-padded prompts, right-padded completions, ``W``-wide rows holding the sampled token
    first (and ``-1`` past each completion), as ``trl.rollout_batch`` lays them out."""
    import torch

    b, p, c, v, w = shape["batch"], shape["prompt"], shape["completion"], shape["vocab"], shape["width"]
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1, v, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    for i in range(b):
        prompt_mask[i, : int(torch.randint(0, p // 2, (1,), generator=g))] = 0
    prompt_ids = prompt_ids * prompt_mask
    completion_ids = torch.randint(1, v, (b, c), generator=g)
    lengths = torch.randint(c // 2, c + 1, (b,), generator=g)
    completion_mask = (torch.arange(c)[None, :] < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask
    others = torch.stack([torch.randperm(v - 2, generator=g)[: w - 1] + 1 for _ in range(b * c)]).reshape(b, c, w - 1)
    sampled = completion_ids[..., None]
    others = torch.where(others >= sampled, others + 1, others)  # distinct, never the sampled id
    support = torch.cat([sampled, others], dim=-1).to(torch.int32)
    support[completion_mask == 0] = -1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.linspace(-1, 1, b),
        "num_items_in_batch": completion_mask.sum(),
        "replay_support": support,
    }


def run(quick: bool = False) -> list[Result]:
    """Measure and return the results (see the module docstring)."""
    try:
        import torch
        import trl.trainer.grpo_trainer  # noqa: F401 (the trl patches apply on this import)
    except ImportError as exc:
        return [Result(BENCH, "(not available)", None, note=f"trl 1.16 is required: {exc}")]
    from .. import states

    state = states.get("trl.support_logprobs")
    if state is None or state.state != "applied":
        return [
            Result(
                BENCH,
                "(not available)",
                None,
                note=f"trl.support_logprobs is {'not recorded' if state is None else state.state}",
            )
        ]
    shape = QUICK if quick else FULL
    repeats = 2 if quick else 3
    model = _model(shape)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trainer(model, out_dir)
        batch = _batch(shape)
        stock = {k: v for k, v in batch.items() if k != "replay_support"}
        model = trainer.model
        model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which does not run here

        def step(inputs: dict) -> None:
            model.zero_grad(set_to_none=True)
            loss = trainer._compute_loss(model, inputs)
            loss.backward()

        steps = {"stock": lambda: step(stock), "replay": lambda: step(batch)}
        grads = {}
        for name, fn in steps.items():
            fn()  # warm up
            grads[name] = model.lm_head.weight.grad.clone()
        if torch.equal(grads["stock"], grads["replay"]):  # the rows did not reach TRL's loss
            raise RuntimeError("bench trl: the replay step's gradient equals TRL's: trl.support_logprobs did not run")
        best = {name: float("inf") for name in steps}
        for _ in range(repeats):
            for name, fn in steps.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        heads = _heads(trainer, model, batch, shape, repeats)
    note = (
        f"B={shape['batch']} P={shape['prompt']} C={shape['completion']} V={shape['vocab']} H={shape['hidden']} "
        f"W={shape['width']} float32, TRL's _compute_loss + backward, best of {repeats} interleaved rounds"
    )
    return [
        Result(BENCH, "stock_step_time", best["stock"] * 1e3, "ms", note=note),
        Result(BENCH, "replay_step_time", best["replay"] * 1e3, "ms"),
        Result(
            BENCH,
            "replay_overhead",
            best["replay"] / best["stock"] - 1.0,
            "x",
            goal=OVERHEAD_GOAL,
            note="the pack adds the support head to TRL's fused head (TRL's entropy and aux loss kept)",
        ),
        Result(
            BENCH, "fused_head_time", heads["fused"] * 1e3, "ms", note="TRL's chunked full-vocabulary head, fwd+bwd"
        ),
        Result(BENCH, "support_head_time", heads["support"] * 1e3, "ms", note="support_logprobs_from_hidden, fwd+bwd"),
        Result(
            BENCH,
            "support_head_vs_fused_head",
            heads["support"] / heads["fused"],
            "x",
            goal="<= 1",
            note="W candidates instead of the vocabulary, same hidden states",
        ),
    ]


def _heads(trainer: Any, model: Any, batch: dict, shape: dict, repeats: int) -> dict[str, float]:
    """The two heads alone on the micro-batch's completion hidden states (forward and backward)."""
    import torch
    from trl.kernels import ChunkedLogProbFunction  # TRL's own head (add_fused_lm_head calls it)

    from ..core.logprobs import support_logprobs_from_hidden

    c = shape["completion"]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, -c - 1 : -1]
    hidden = hidden.contiguous()
    weight = model.lm_head.weight
    targets = batch["completion_ids"]
    has = batch["replay_support"][..., 0] >= 0
    temperature = float(trainer.temperature)

    def fused() -> None:
        h = hidden.detach().requires_grad_(True)
        # TRL's tiles over the vocabulary (logprobs only: entropy and the other outputs off)
        lp = ChunkedLogProbFunction.apply(h[has], weight, None, targets[has], temperature, 32768, None, 1.0, ())[0]
        lp.sum().backward()

    def support() -> None:
        h = hidden.detach().requires_grad_(True)
        lp, _ = support_logprobs_from_hidden(
            h[has], weight, targets[has], batch["replay_support"][has], temperature=temperature
        )
        lp.sum().backward()

    fns = {"fused": fused, "support": support}
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
