"""``replay-plugin demo --trainer hf``: re-score with the Hugging Face model through the FSDP
replay path (``replay_plugin.fsdp.response_logprobs``), in one process without sharding.

Sampler-support settings only (``none`` and ``support``): routed-expert replay for HF models
does not exist yet, so ``route_agreement`` is reported as None.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def score_hf(
    model_dir: str,
    trajectories: list,
    pad_id: int,
    eos_id: int,
    precisions: list[str],
    temperature: float,
    progress: Callable[[str], None],
) -> tuple[list[dict], dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from ..core.support import dense_support_batch
    from ..fsdp import response_logprobs
    from . import report

    B = len(trajectories)
    S = max(len(t.prompt) + len(t.response) for t in trajectories)
    A = max(len(t.response) for t in trajectories)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention = torch.zeros(B, S, dtype=torch.bool)
    rollout = np.zeros((B, A), dtype=np.float32)
    for i, t in enumerate(trajectories):
        seq = np.concatenate([t.prompt, t.response])
        input_ids[i, S - len(seq) :] = torch.from_numpy(seq.astype(np.int64))
        attention[i, S - len(seq) :] = True
        rollout[i, A - len(t.response) :] = t.support.sampled_logprob
    dense = dense_support_batch(
        [t.support for t in trajectories],
        [t.response for t in trajectories],
        [np.ones(len(t.response), dtype=bool) for t in trajectories],
        S,
        eos_id,
    )
    support_ids = torch.from_numpy(np.asarray(dense.ids))
    loss_mask = torch.from_numpy(np.asarray(dense.loss_mask)[:, -A:])
    target = loss_mask.numpy()
    rollout_lp = rollout[target]
    position_ids = (attention.long().cumsum(-1) - 1).clamp(min=0)

    rows: list[dict] = []
    log_ratios: dict = {}
    for precision in precisions:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
        progress(f"loading the {precision} HF model")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.no_grad():
            logits = model(
                input_ids=input_ids, attention_mask=attention.long(), position_ids=position_ids, use_cache=False
            ).logits
        for setting, replay in (("none", False), ("support", True)):
            t0 = time.time()
            lp = response_logprobs(
                logits,
                input_ids,
                attention,
                A,
                support_ids=support_ids,
                loss_mask=loss_mask,
                replay=replay,
                temperature=temperature,
            )
            trainer = lp.numpy()[target]
            row = {"precision": precision, "replay": setting, **report.figures(trainer, rollout_lp, None)}
            rows.append(row)
            log_ratios[(precision, setting)] = trainer.astype("float64") - rollout_lp
            progress(
                f"scored {precision} / {setting} in {time.time() - t0:.1f} s: "
                f"mean|d|={row['mean_abs_delta']:.2e} mean ratio={row['mean_ratio']:.4f}"
            )
        del model, logits
    return rows, log_ratios
