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
(``replay_plugin.fsdp.record_routes``), not from what was installed; the figures come from
:func:`replay_plugin.demo.report.measure`, as the Megatron trainer's do.
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
) -> tuple[list[dict], list[dict], dict]:
    """The table's rows, every metric per row (``report.measure``) and the log-ratios per row."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import report
    from .score import make_batch

    batch = make_batch(trajectories, pad_id, eos_id)
    if batch.num_inexact:
        progress(f"note: {batch.num_inexact} support rows were inexact (repaired)")
    if batch.routes is None or batch.router_padding_mask is None:
        raise RuntimeError("routed-expert replay needs routes from the rollout (enable_return_routed_experts)")
    rows: list[dict] = []
    metric_rows: list[dict] = []
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
            logits, used, layers = forwards[use_routes]
            logprobs, target = _logprobs(logits, batch, setting in ("support", "both"), temperature)
            a = target.shape[1]  # column j scores token S - A + j with the output of the position before it
            scored = report.Scored(
                logprobs,
                batch.rollout_logprobs[:, -a:],
                target,
                trainer_routes=used[:, -a - 1 : -1],
                rollout_routes=batch.routes[:, -a - 1 : -1][:, :, layers],
                route_mask=~batch.router_padding_mask[:, -a - 1 : -1],
                route_layers=layers,
            )
            metrics = report.measure(scored)
            row = {"precision": precision, "replay": setting, **report.figures(metrics)}
            rows.append(row)
            metric_rows.append({"precision": precision, "replay": setting, **metrics})
            log_ratios[(precision, setting)] = scored.log_ratios()
            progress(
                f"scored {precision} / {setting} in {time.time() - t0:.1f} s: "
                f"mean|d|={row['mean_abs_delta']:.2e} mean ratio={row['mean_ratio']:.4f} "
                f"routes agree={100 * row['route_agreement']:.1f}%"
            )
        del model, forwards
    return rows, metric_rows, log_ratios


def _forward(model: Any, batch: Any, use_routes: bool) -> tuple[Any, np.ndarray, list[int]]:
    """Logits ``[B, S, V]``, the experts each token went to in every MoE layer ``[B, S, L, K]``
    (what the experts modules received) and those layers' indices."""
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
    return logits, recorded.routes[:, :, layers].numpy(), layers


def _logprobs(logits: Any, batch: Any, use_support: bool, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The trainer's logprobs ``[B, A]`` (0 where nothing is scored) and the scored mask ``[B, A]``."""
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
    return lp.numpy().astype(np.float32), target
