"""``replay-plugin demo --trainer hf``: re-score the rollout with the Hugging Face model through the
FSDP replay path, in one process without sharding.

One microbatch holds every trajectory, left-padded to ``[B, S]`` (the padded layout of an FSDP
trainer); four settings per precision, as the Megatron trainer's:

``none``     the model's own routing, the ordinary full-vocabulary logprob
``routes``   routed-expert replay (``replay_plugin.fsdp.replay_routes``, the engine's experts per
             token and decoder layer, batched with ``core.routes.pad_batch``)
``support``  sampler-support replay (``replay_plugin.fsdp.response_logprobs``)
``both``     both

Route agreement is measured from what the experts modules received
(``replay_plugin.fsdp.record_routes``), not from what was installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

SETTINGS = ("none", "routes", "support", "both")


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

    from . import report
    from .score import make_batch

    batch = make_batch(trajectories, pad_id, eos_id)
    if batch.num_inexact:
        progress(f"note: {batch.num_inexact} support rows were inexact (repaired)")
    if batch.routes is None:
        raise RuntimeError("routed-expert replay needs routes from the rollout (enable_return_routed_experts)")
    rows: list[dict] = []
    log_ratios: dict = {}
    for precision in precisions:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
        progress(f"loading the {precision} HF model")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        forwards: dict = {}
        for setting in SETTINGS:
            t0 = time.time()
            use_routes = setting in ("routes", "both")
            if use_routes not in forwards:
                forwards[use_routes] = _forward(model, batch, use_routes)
            logits, route_match = forwards[use_routes]
            logprobs, target = _logprobs(logits, batch, setting in ("support", "both"), temperature)
            rollout = batch.rollout_logprobs[:, -target.shape[1] :][target]
            row = {
                "precision": precision,
                "replay": setting,
                **report.figures(logprobs, rollout, route_match[:, -target.shape[1] - 1 : -1][target]),
            }
            rows.append(row)
            log_ratios[(precision, setting)] = logprobs.astype("float64") - rollout
            progress(
                f"scored {precision} / {setting} in {time.time() - t0:.1f} s: "
                f"mean|d|={row['mean_abs_delta']:.2e} mean ratio={row['mean_ratio']:.4f} "
                f"routes agree={100 * row['route_agreement']:.1f}%"
            )
        del model, forwards
    return rows, log_ratios


def _forward(model: Any, batch: Any, use_routes: bool) -> tuple[Any, np.ndarray]:
    """Logits ``[B, S, V]`` and ``[B, S]`` bool: the token at each position went to the rollout's
    experts (as sets) in every MoE layer."""
    import contextlib

    import torch

    from ..fsdp import record_routes, replay_routes

    ids = torch.from_numpy(batch.input_ids)
    attention = torch.from_numpy(batch.attention_mask).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    replay = replay_routes(model, batch.routes, batch.router_padding_mask) if use_routes else contextlib.nullcontext()
    with torch.no_grad(), replay, record_routes(model) as recorded:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
    layers = list(recorded.layers)
    used = recorded.routes[:, :, layers].sort(-1).values
    wanted = torch.from_numpy(batch.routes[:, :, layers].astype(np.int64)).sort(-1).values
    match = (used == wanted).all(-1).all(-1) & ~torch.from_numpy(batch.router_padding_mask)
    return logits, match.numpy()


def _logprobs(logits: Any, batch: Any, use_support: bool, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Per scored response token (row-major) its logprob, and the ``[B, A]`` scored mask."""
    import torch

    from ..fsdp import response_logprobs

    response = batch.response_mask
    num_actions = int(response.sum(axis=1).max())
    target = response[:, -num_actions:]
    lp = response_logprobs(
        logits,
        torch.from_numpy(batch.input_ids),
        torch.from_numpy(batch.attention_mask),
        num_actions,
        support_ids=torch.from_numpy(batch.support),
        loss_mask=torch.from_numpy(target),
        replay=use_support,
        temperature=temperature,
    )
    return lp.numpy()[target].astype(np.float32), target
