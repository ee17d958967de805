"""The README's FSDP blocks run as written on a tiny Hugging Face Qwen3-MoE (CPU, one process, no
sequence parallelism: ``get_ulysses_sequence_parallel_group()`` returns None, as in verl without
Ulysses):

* ``fsdp-response-logprobs``: the remove-padding logprob function; its result equals the explicit
  reference of test_fsdp_replay.py (support rows gathered from the padded model's logits).
* ``hf-replay-routes``: routed-expert replay from vLLM-shaped per-trajectory routes; the experts
  receive the given routes in the forward and in the checkpointed recompute, and gradients reach
  the routers; ``record_routes`` then reports the model's own routing.
"""

from __future__ import annotations

import hf_moe_models as H
import pytest
import readme_blocks  # tests/readme_blocks.py (tests/ is on sys.path: support/__init__.py)
import test_fsdp_replay as F
from support.upstream import need
from test_hf_moe_replay import ExpertsSpy, _ids, _routers, random_routes

pytestmark = pytest.mark.timeout(300)


def test_response_logprobs_block_equals_the_explicit_reference():
    need("transformers")
    import torch

    model = H.build("qwen3_moe", attn="sdpa")
    batch = F.make_batch(H.VOCAB, 0, seed=3)
    ids, am = batch["input_ids"], batch["attention_mask"]
    packed, ppos, idx = F._packed(batch, slice(None))
    ns = readme_blocks.run(
        "fsdp-response-logprobs",
        {
            "model": model,
            "rows": batch["rows"],
            "response_ids": batch["responses"],
            "response_masks": batch["response_masks"],
            "S": F.S,
            "eos_id": 0,
            "num_actions": F.A,
            "input_ids": ids,
            "attention_mask": am,
            "input_ids_rmpad": packed,
            "position_ids_rmpad": ppos,
            "indices": idx,
            "temperature": F.TEMPERATURE,
            "get_ulysses_sequence_parallel_group": lambda: None,
        },
    )
    log_probs, loss_mask = ns["log_probs"], ns["loss_mask"]
    assert log_probs.shape == (F.B, F.A) and log_probs.dtype == torch.float32
    assert torch.equal(loss_mask, batch["loss_mask"])
    with torch.no_grad():
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    ref = F.explicit_reference(logits, batch, F.TEMPERATURE)
    lm = loss_mask.bool()
    assert torch.allclose(log_probs.detach()[lm], ref[lm].float(), atol=1e-4), (log_probs[lm], ref[lm])
    # and not the ordinary full-vocabulary logprobs the block replaces
    full = torch.log_softmax(logits[:, -F.A - 1 : -1] / F.TEMPERATURE, -1).gather(-1, ids[:, -F.A :, None])[..., 0]
    assert (log_probs.detach()[lm] > full[lm] + 1e-3).float().mean() > 0.5


def test_replay_routes_block_reaches_the_experts_forward_and_recompute():
    need("transformers")
    import torch

    family = "qwen3_moe"
    model = H.build(family, attn="sdpa")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    L = model.config.num_hidden_layers
    lengths, seq = [7, 5], 8
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    am = torch.zeros(len(lengths), seq, dtype=torch.long)
    route_arrays = []
    for b, n in enumerate(lengths):
        ids[b, seq - n :] = _ids(seed=30 + b, shape=(n,))
        am[b, seq - n :] = 1
        route_arrays.append(random_routes((n - 1,), L, seed=40 + b).numpy())  # vLLM: [P + T - 1, L, K]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    spy = ExpertsSpy(model, family)
    ns = readme_blocks.run(
        "hf-replay-routes",
        {
            "model": model,
            "route_arrays": route_arrays,
            "attention_mask": am,
            "input_ids": ids,
            "pos": pos,
            "loss_fn": lambda logits: logits.float().logsumexp(-1).mean(),
            "indices": am.reshape(-1).nonzero().squeeze(1),
            "sp_group": None,
        },
    )
    spy.remove()
    routes, rpm = ns["routes"], ns["router_padding_mask"]
    replayed = am.bool() & ~rpm
    want = torch.from_numpy(routes).long()
    moe = spy.layers()
    assert moe and replayed.sum() == sum(n - 1 for n in lengths)
    # the block's first forward and its recompute in backward got the given routes
    first = ExpertsSpy.__new__(ExpertsSpy)
    first.calls = [c for c in spy.calls if not c[1]][: len(moe)]
    forward = first.routes(L, (len(lengths), seq))
    first.calls = [c for c in spy.calls if c[1]]
    assert first.calls, "gradient checkpointing did not recompute inside the context"
    recompute = first.routes(L, (len(lengths), seq), backward=True)
    for got in (forward, recompute):
        assert torch.equal(got[replayed][:, moe], want[replayed][:, moe])
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in _routers(model, family))
    # record_routes after the contexts: the model's own routing, in the documented shape
    rec = ns["rec"].routes
    assert tuple(rec.shape) == (len(lengths), seq, L, H.TOP_K) and rec.dtype == torch.int64
    assert not torch.equal(rec[replayed][:, moe], want[replayed][:, moe])  # random routes are not its own
