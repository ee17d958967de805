"""Routed-expert replay for Hugging Face MoE models (``replay_plugin.fsdp.record_routes`` /
``replay_routes``), single process, on real transformers classes of every supported family built
from tiny random configs (``hf_moe_models``).

What the experts of each MoE block receive is observed with plain torch forward pre-hooks on the
experts modules (:class:`ExpertsSpy`), not with plugin code: recorded routes equal what the experts
received; replayed routes reach the experts (dense-layer rows ignored), with gradients to the
router; replaying the model's own routes leaves logits and every gradient bit for bit unchanged;
gradient checkpointing recomputes with the same routes; padding-mask rows use the model's own
routing; the padded, remove-padding and packed layouts agree; vLLM-shaped routes go through
``core.routes.pad_batch``; the load-balancing loss counts the model's top-k (default) or the
replayed experts; every refusal is typed and names what is wrong.
"""

from __future__ import annotations

import json
import re

import hf_moe_models as H
import pytest
from support.procs import run_python
from support.upstream import need

pytestmark = pytest.mark.timeout(300)

B, S = 2, 7


@pytest.fixture(autouse=True)
def _transformers():
    need("transformers")


def _version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def _families() -> list:
    """granitemoe routes through GraniteMoeTopKGating (dispatch data) before 5.16: refused there."""
    out = []
    for family in H.FAMILIES:
        marks = []
        if family == "granitemoe":
            marks = [pytest.mark.skipif("_version() < (5, 16)", reason="refused before 5.16 (its own test)")]
        out.append(pytest.param(family, marks=marks))
    return out


FAMILIES = _families()

BLOCKS = {  # family -> MoE block class name (test-side knowledge, independent of the plugin's table)
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
    "qwen2_moe": "Qwen2MoeSparseMoeBlock",
    "qwen3_next": "Qwen3NextSparseMoeBlock",
    "olmoe": "OlmoeSparseMoeBlock",
    "mixtral": "MixtralSparseMoeBlock",
    "gpt_oss": "GptOssMLP",
    "deepseek_v3": "DeepseekV3MoE",
    "glm4_moe": "Glm4MoeMoE",
    "jamba": "JambaSparseMoeBlock",
    "dbrx": "DbrxFFN",
    "granitemoe": "GraniteMoeMoE",
}
ROUTERS = {"gpt_oss": "router", "jamba": "router", "dbrx": "router", "granitemoe": "router"}


class ExpertsSpy:
    """Forward pre-hooks on every MoE block's ``experts`` module: ``calls`` holds
    ``(layer, in_backward, top_k_index [N, K], top_k_weights [N, K])`` per call."""

    def __init__(self, model, family: str):
        import torch

        self.calls: list = []
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__ == BLOCKS[family]:
                layer = int(re.search(r"(?:layers|blocks)\.(\d+)\.", name + ".").group(1))
                self.handles.append(module.experts.register_forward_pre_hook(self._hook(layer, torch)))

    def _hook(self, layer: int, torch):
        def hook(module, args):
            backward = torch._C._current_graph_task_id() != -1
            self.calls.append((layer, backward, args[1].detach().clone(), args[2].detach().clone()))

        return hook

    def layers(self) -> list:
        return sorted({c[0] for c in self.calls})

    def routes(self, num_layers: int, shape: tuple, backward: bool = False):
        """``[*shape, L, K]`` int64 of the last forward (or recompute) calls; dense rows -1."""
        import torch

        k = self.calls[0][2].shape[-1]
        out = torch.full((*shape, num_layers, k), -1, dtype=torch.long)
        for layer, bwd, index, _ in self.calls:
            if bwd == backward:
                out[..., layer, :] = index.reshape(*shape, k)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def _ids(seed: int = 0, shape=(B, S)):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, H.VOCAB, shape, generator=g)


def random_routes(shape: tuple, num_layers: int, seed: int = 1, dtype=None):
    """``[*shape, L, K]`` distinct experts per token and layer (uint8)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    r = torch.rand(*shape, num_layers, H.NUM_EXPERTS, generator=g).argsort(-1)[..., : H.TOP_K]
    return r.to(dtype or torch.uint8)


def _with_router_logits(model):
    """``output_router_logits=True`` where the model records router logits. dbrx (before 5.19) and
    granitemoe (before 5.19) declare no ``router_logits`` recorder, and their ForCausalLM then
    crashes on ``0.to(...)`` with output_router_logits and labels (transformers 5.10.4, 5.16.1)."""
    model.config.output_router_logits = "router_logits" in (getattr(type(model), "_can_record_outputs", None) or {})
    return model


def _stock(model, family: str, ids, **kwargs):
    spy = ExpertsSpy(model, family)
    try:
        out = model(input_ids=ids, use_cache=False, **kwargs)
    finally:
        spy.remove()
    return out, spy


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _routers(model, family: str) -> list:
    return [getattr(m, ROUTERS.get(family, "gate")) for m in model.modules() if type(m).__name__ == BLOCKS[family]]


def _router_weight_grads(model, family: str) -> list:
    out = []
    for router in _routers(model, family):
        weight = router.weight if hasattr(router, "weight") else router.layer.weight  # dbrx: router.layer
        out.append(weight.grad)
    return out


# =======================================================================================
# per family


def test_family_table_matches_the_pack_and_the_matrix():
    from replay_plugin import compat
    from replay_plugin.fsdp.hf_moe import FAMILIES as TABLE
    from replay_plugin.fsdp.patches import MOE_FAMILIES, PATCHES

    assert tuple(TABLE) == MOE_FAMILIES == H.FAMILIES
    matrix = compat.load()
    for family in TABLE.values():
        assert family.patch in PATCHES and family.patch in matrix.patches
        assert matrix.patches[family.patch].targets[0] == f"{family.module}:{family.block}.forward"
        assert BLOCKS[family.model_type] == family.block


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_equal_what_the_experts_received(family):
    import torch

    from replay_plugin.fsdp import record_routes

    model = H.build(family)
    ids = _ids()
    with torch.no_grad():
        stock, _ = _stock(model, family, ids)
        spy = ExpertsSpy(model, family)
        with record_routes(model) as rec:
            out = model(input_ids=ids, use_cache=False)
        spy.remove()
    L = model.config.num_hidden_layers
    assert torch.equal(out.logits, stock.logits)  # recording changes nothing
    assert rec.routes.shape == (B, S, L, H.TOP_K) and rec.routes.dtype == torch.long
    assert list(rec.layers) == spy.layers() and 0 < len(rec.layers) <= L
    seen = spy.routes(L, (B, S))
    for layer in range(L):
        if layer in rec.layers:
            assert torch.equal(rec.routes[..., layer, :], seen[..., layer, :]), layer
        else:  # dense layer: no experts module ran; the row is the placeholder [0..K-1]
            assert (seen[..., layer, :] == -1).all()
            assert torch.equal(rec.routes[..., layer, :], torch.arange(H.TOP_K).expand(B, S, H.TOP_K))


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_routes_reach_the_experts_with_gradients_to_the_router(family):
    import torch

    from replay_plugin.fsdp import replay_routes

    model = H.build(family)
    ids = _ids()
    L = model.config.num_hidden_layers
    routes = random_routes((B, S), L)
    moe = [i for i in range(L) if i in {c[0] for c in _stock(model, family, ids)[1].calls}]
    dense = [i for i in range(L) if i not in moe]
    routes[..., dense, :] = 255  # rows of dense layers are ignored, whatever they hold
    stock, own = _stock(model, family, ids)
    assert not torch.equal(own.routes(L, (B, S))[..., moe, :], routes[..., moe, :].long())  # replay changes routing
    spy = ExpertsSpy(model, family)
    with replay_routes(model, routes):
        out = model(input_ids=ids, use_cache=False)
        out.logits.float().pow(2).mean().backward()
    spy.remove()
    got = spy.routes(L, (B, S))
    assert torch.equal(got[..., moe, :], routes[..., moe, :].long())
    assert (out.logits - stock.logits).abs().max() > 1e-3  # other experts, other logits
    for grad in _router_weight_grads(model, family):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_models_own_routes_changes_nothing(family):
    """Logits and every parameter gradient bit for bit, loss with the load-balancing term."""
    import torch

    from replay_plugin.fsdp import replay_routes

    model = _with_router_logits(H.build(family))
    ids = _ids()
    labels = _ids(seed=3)
    L = model.config.num_hidden_layers
    stock, spy = _stock(model, family, ids, labels=labels)
    stock.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    own = spy.routes(L, (B, S)).clamp(min=0).to(torch.uint8)
    with replay_routes(model, own):
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
    assert torch.equal(out.logits, stock.logits)
    assert torch.equal(out.loss, stock.loss)
    got = _grads(model)
    assert got.keys() == want.keys() and len(got) > 5
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", ["qwen3_moe", "jamba"])
def test_checkpointed_recompute_replays_the_same_routes(family, reentrant):
    import torch

    from replay_plugin.fsdp import replay_routes

    model = H.build(family)
    ids = _ids()
    L = model.config.num_hidden_layers
    routes = random_routes((B, S), L, seed=7)
    model.train()  # transformers checkpoints only in training mode
    with replay_routes(model, routes):
        model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    spy = ExpertsSpy(model, family)
    inputs_embeds = model.get_input_embeddings()(ids).detach().requires_grad_(reentrant)
    with replay_routes(model, routes):
        model(inputs_embeds=inputs_embeds, use_cache=False).logits.float().pow(2).mean().backward()
    spy.remove()
    moe = spy.layers()
    recomputed = [c for c in spy.calls if c[1]]
    assert sorted({c[0] for c in recomputed}) == moe  # every MoE layer ran again in backward
    assert torch.equal(spy.routes(L, (B, S), backward=True)[..., moe, :], routes[..., moe, :].long())
    got = _grads(model)
    for name in want:
        if name != "model.embed_tokens.weight":  # not reached through inputs_embeds
            assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name


def test_recompute_after_the_context_closed_is_refused():
    """The mistake the guard catches: backward outside the context recomputes checkpointed layers
    with the model's own router (silently other experts than the forward used)."""
    import torch

    from replay_plugin.fsdp import replay_routes
    from replay_plugin.fsdp.route_replay import ReplayStateError

    model = H.build("qwen3_moe")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    routes = random_routes((B, S), model.config.num_hidden_layers)
    with replay_routes(model, routes):
        loss = model(input_ids=_ids(), use_cache=False).logits.pow(2).mean()
    with pytest.raises(ReplayStateError, match="recomputed in backward after the replay_routes context"):
        loss.backward()
    # a new forward outside any context is stock again and trains normally
    model(input_ids=_ids(), use_cache=False).logits.pow(2).mean().backward()
    assert torch.isfinite(model.lm_head.weight.grad).all()


def test_padding_mask_rows_use_the_models_own_routing():
    import torch

    from replay_plugin.fsdp import replay_routes

    family = "qwen3_moe"
    model = H.build(family)
    ids = _ids()
    L = model.config.num_hidden_layers
    _, own_spy = _stock(model, family, ids)
    own = own_spy.routes(L, (B, S))
    routes = random_routes((B, S), L, seed=4)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, :3] = True
    mask[1, -1] = True
    routes[mask] = torch.tensor([5, 5], dtype=torch.uint8)  # placeholder rows: never replayed, never checked
    spy = ExpertsSpy(model, family)
    with torch.no_grad(), replay_routes(model, routes, mask):
        model(input_ids=ids, use_cache=False)
    spy.remove()
    got = spy.routes(L, (B, S))
    moe = spy.layers()
    # the masked tokens' routes depend on earlier layers' outputs, which replay changed: compare
    # the first MoE layer exactly, and every layer's masked rows against the model's own top-k
    first = moe[0]
    assert torch.equal(got[mask][:, first], own[mask][:, first])
    assert torch.equal(got[~mask][:, moe], routes[~mask][:, moe].long())


def test_layouts_padded_remove_padding_and_packed_agree():
    """One left-padded batch through the three layouts a trainer uses; routes from vLLM-shaped
    per-trajectory arrays ``[P + T - 1, L, K]`` (uint8) batched with ``core.routes.pad_batch``."""
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout
    from replay_plugin.core.routes import pad_batch
    from replay_plugin.fsdp import replay_routes

    family = "qwen3_moe"
    model = H.build(family, attn="sdpa")
    L = model.config.num_hidden_layers
    lengths = [7, 4, 6]
    seq = 8
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    am = torch.zeros(len(lengths), seq, dtype=torch.long)
    per_traj = []
    for b, n in enumerate(lengths):
        ids[b, seq - n :] = _ids(seed=10 + b, shape=(n,))
        am[b, seq - n :] = 1
        per_traj.append(random_routes((n - 1,), L, seed=20 + b).numpy())  # vLLM: no row for the last token
    routes, rpm = pad_batch(per_traj, am)
    assert routes.dtype.name == "uint8" and rpm[:, -1].all()
    pos = (am.cumsum(-1) - 1).clamp(min=0)

    results = {}
    with torch.no_grad():
        spy = ExpertsSpy(model, family)
        with replay_routes(model, routes, rpm):
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
        spy.remove()
        valid = am.bool()
        results["padded"] = (logits[valid], spy.routes(L, (len(lengths), seq))[valid])

        idx = am.reshape(-1).nonzero().squeeze(1)
        packed, ppos = ids.reshape(-1)[idx][None], pos.reshape(-1)[idx][None]
        spy = ExpertsSpy(model, family)
        with replay_routes(model, routes, rpm, indices=idx):
            logits = model(input_ids=packed, position_ids=ppos, use_cache=False).logits
        spy.remove()
        results["remove_padding"] = (logits[0], spy.routes(L, (1, idx.numel()))[0])

        layout = TokenMetadataLayout.build(am, packed=True, align=4)
        x = layout.align(ids, 0)
        xpos = layout.align(pos, 0)
        slot = layout.align(torch.arange(am.numel()).view(am.shape), -1)[0]
        spy = ExpertsSpy(model, family)
        with replay_routes(model, routes, rpm, layout=layout):
            logits = model(input_ids=x, position_ids=xpos, use_cache=False).logits
        spy.remove()
        keep = slot >= 0
        results["packed"] = (logits[0][keep], spy.routes(L, tuple(x.shape))[0][keep])

    moe = [i for i in range(L) if i != 1]
    base_logits, base_routes = results["padded"]
    replayed = ~rpm[am.bool()]
    want = torch.from_numpy(routes)[am.bool()].long()
    assert torch.equal(base_routes[replayed][:, moe], want[replayed][:, moe])
    for name in ("remove_padding", "packed"):
        got_logits, got_routes = results[name]
        assert torch.equal(got_routes[replayed][:, moe], want[replayed][:, moe]), name
        assert torch.allclose(got_logits, base_logits, atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_gets_the_replayed_routes(impl):
    import torch

    from replay_plugin.fsdp import replay_routes

    family = "qwen3_moe"
    model = H.build(family, experts=impl)
    assert model.config._experts_implementation == impl
    ids = _ids()
    L = model.config.num_hidden_layers
    stock, own_spy = _stock(model, family, ids)
    routes = random_routes((B, S), L, seed=9)
    spy = ExpertsSpy(model, family)
    with torch.no_grad():
        with replay_routes(model, own_spy.routes(L, (B, S)).clamp(min=0)):
            same = model(input_ids=ids, use_cache=False).logits
        with replay_routes(model, routes):
            model(input_ids=ids, use_cache=False)
    spy.remove()
    assert torch.equal(same, stock.logits)
    assert torch.equal(spy.routes(L, (B, S))[..., [0, 2], :], routes[..., [0, 2], :].long())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "jamba"])
def test_load_balancing_loss_model_default_or_replayed(family):
    """Default: upstream's loss (its own top-k of the router logits). ``aux_loss="replayed"``: the
    same Switch loss counted over the experts the tokens were sent to (checked against a count
    written out here)."""
    import torch

    from replay_plugin.fsdp import replay_routes

    model = H.build(family, output_router_logits=True)
    ids = _ids()
    am = torch.ones(B, S, dtype=torch.long)
    am[0, :2] = 0
    L = model.config.num_hidden_layers
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    upstream = module.load_balancing_loss_func.__wrapped__  # the unwrapped upstream function
    routes = random_routes((B, S), L, seed=11)
    with torch.no_grad():
        stock, own_spy = _stock(model, family, ids, attention_mask=am)
        own = own_spy.routes(L, (B, S)).clamp(min=0)
        with replay_routes(model, own, aux_loss="replayed"):
            own_replayed = model(input_ids=ids, attention_mask=am, use_cache=False)
        with replay_routes(model, routes):
            default = model(input_ids=ids, attention_mask=am, use_cache=False)
        with replay_routes(model, routes, aux_loss="replayed"):
            replayed = model(input_ids=ids, attention_mask=am, use_cache=False)
    assert torch.allclose(own_replayed.aux_loss, stock.aux_loss, rtol=1e-5)  # own routes: the same loss
    k, e = H.TOP_K, H.NUM_EXPERTS
    model_topk = upstream(default.router_logits, e, k, am)
    assert torch.allclose(default.aux_loss, model_topk)
    # written out: num_experts * sum_e (share of assignments to e) * (mean probability of e)
    moe = [i for i in range(L) if i in own_spy.layers()]
    keep = am.reshape(-1).bool()
    counts = torch.zeros(e)
    probs = torch.zeros(e)
    for layer, logits in zip(moe, replayed.router_logits):
        counts += torch.bincount(routes[..., layer, :].reshape(-1, k)[keep].reshape(-1).long(), minlength=e)
        probs += torch.softmax(logits.float(), dim=-1)[keep].sum(0)
    rows = keep.sum() * len(moe)
    want = e * ((counts / rows) * (probs / rows)).sum()
    assert torch.allclose(replayed.aux_loss.float(), want, rtol=1e-5)
    assert not torch.allclose(replayed.aux_loss, upstream(replayed.router_logits, e, k, am))


# =======================================================================================
# refusals


def test_route_data_errors_name_the_field_layer_and_token():
    import torch

    from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
    from replay_plugin.fsdp import replay_routes

    model = H.build("qwen3_moe")
    L = model.config.num_hidden_layers
    good = random_routes((B, S), L)
    with pytest.raises(ReplayDataError, match=r"expected \[\*tokens, 3, 2\]: config.num_hidden_layers"):
        replay_routes(model, good[..., :2, :])
    with pytest.raises(ReplayDataError, match=r"expected \[\*tokens, 3, 2\]"):
        replay_routes(model, torch.zeros(B, S, L, 3, dtype=torch.uint8))
    with pytest.raises(ReplayTypeError, match="integer expert ids"):
        replay_routes(model, good.float())
    bad = good.clone()
    bad[1, 4, 2] = torch.tensor([3, 8], dtype=torch.uint8)
    with pytest.raises(ReplayDataError, match=r"out of range in layer 2: \[3, 8\]") as info:
        replay_routes(model, bad)
    assert (info.value.trajectory, info.value.token) == (1, 4)
    negative = good.to(torch.int16)
    negative[0, 6, 0, 1] = -1
    with pytest.raises(ReplayDataError, match=r"out of range in layer 0: \[\d, -1\]") as info:
        replay_routes(model, negative)
    assert (info.value.trajectory, info.value.token) == (0, 6)
    dup = good.clone()
    dup[0, 2, 0] = torch.tensor([6, 6], dtype=torch.uint8)
    with pytest.raises(ReplayDataError, match="the same expert twice in layer 0") as info:
        replay_routes(model, dup)
    assert (info.value.trajectory, info.value.token) == (0, 2)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, 2] = True
    replay_routes(model, dup, mask)  # a masked row is a placeholder: not checked
    with pytest.raises(ReplayDataError, match="router_padding_mask"):
        replay_routes(model, good, mask[:, :3])
    with pytest.raises(ReplayDataError, match=r"layer 0 \(model.layers.0.mlp.*got tokens of shape \[1, 5\]"):
        with replay_routes(model, good):
            model(input_ids=_ids(shape=(1, 5)), use_cache=False)
    with pytest.raises(ReplayDataError, match="aux_loss"):
        replay_routes(H.build("deepseek_v3"), random_routes((B, S), 3), aux_loss="replayed")


def test_an_integer_router_padding_mask_is_refused_not_read_inverted():
    """An attention mask (1 = valid) passed where the router padding mask (True = no route)
    belongs would replay the padding and route every valid token itself: refused by dtype."""
    import torch

    from replay_plugin.core.errors import ReplayTypeError
    from replay_plugin.fsdp import replay_routes

    model = H.build("qwen3_moe")
    routes = random_routes((B, S), model.config.num_hidden_layers)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        attention = torch.ones(B, S, dtype=dtype)
        with pytest.raises(ReplayTypeError, match=rf"'router_padding_mask': dtype {dtype}.*pass ~mask.bool\(\)"):
            replay_routes(model, routes, attention)
    with replay_routes(model, routes, torch.zeros(B, S, dtype=torch.bool)):  # the bool mask still works
        model(input_ids=_ids(), use_cache=False)


def test_broken_routes_are_refused_or_reported_by_layer_and_trajectory():
    """All-zero routes (MoE kernels that return zeros where nothing was recorded) are refused
    naming the trajectory; a layer routing the whole batch to one expert set is reported."""
    import warnings

    import torch

    from replay_plugin.core.errors import ReplayDataError, RouteSanityWarning
    from replay_plugin.fsdp import replay_routes

    model = H.build("qwen3_moe")
    L = model.config.num_hidden_layers
    routes = random_routes((2, 8), L, seed=5)
    zero = routes.clone()
    zero[1] = 0
    with pytest.raises(ReplayDataError, match=r"every recorded route of the trajectory is expert 0") as info:
        replay_routes(model, zero)
    assert info.value.trajectory == 1
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1] = True  # placeholder rows only: not checked
    replay_routes(model, zero, mask)
    constant = routes.clone()
    constant[:, :, 2] = torch.tensor([6, 2], dtype=torch.uint8)  # layer 1 is dense (mlp_only_layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replay_routes(model, constant):
            model(input_ids=_ids(shape=(2, 8)), use_cache=False)
    assert [str(w.message) for w in caught if issubclass(w.category, RouteSanityWarning)] == [
        "replay_plugin: routes: layer 2 routes all 16 valid tokens of the batch to experts [2, 6]: recorded routes "
        "repeated for a whole batch, or a collapsed router"
    ]


def test_every_integer_route_dtype_placeholder_trajectories_and_top_k_equal_to_experts():
    """Issue 32 items 3 and 11. On 452e6a8: uint16/32/64 routes crashed check_routes with
    NotImplementedError (torch has no >= for them on CPU) although any integer dtype is the
    contract; a trajectory of placeholder routes [0, 1] among real ones was replayed as recorded;
    a model whose top-k equals its expert count warned on every layer."""
    import warnings

    import torch

    from replay_plugin.core.errors import ReplayDataError, RouteSanityWarning
    from replay_plugin.fsdp import record_routes, replay_routes

    model = H.build("qwen3_moe")
    L = model.config.num_hidden_layers
    ids = _ids(shape=(2, 8))
    routes = random_routes((2, 8), L, seed=9)
    with torch.no_grad(), replay_routes(model, routes):
        want = model(input_ids=ids, use_cache=False).logits
    for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.int64):
        with torch.no_grad(), replay_routes(model, routes.to(dtype)):
            got = model(input_ids=ids, use_cache=False).logits
        assert torch.equal(got, want), dtype
    big = routes.to(torch.uint32)
    big[0, 3, 0, 0] = 70_000
    with pytest.raises(ReplayDataError, match="expert id out of range") as info:
        replay_routes(model, big)
    assert (info.value.trajectory, info.value.token) == (0, 3)
    placeholder = routes.clone()
    placeholder[1] = torch.arange(H.TOP_K, dtype=torch.uint8)
    with pytest.raises(ReplayDataError, match=r"placeholder \[0, 1\]") as info:
        replay_routes(model, placeholder)
    assert info.value.trajectory == 1
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1] = True  # marked as rows without a route: routed by the model itself, no refusal
    replay_routes(model, placeholder, mask)

    every = H.build("qwen3_moe", num_experts_per_tok=H.NUM_EXPERTS)  # top-k = experts
    with torch.no_grad(), record_routes(every) as rec:
        every(input_ids=_ids(shape=(2, 12)), use_cache=False)
    own = rec.routes
    assert own.shape[-1] == H.NUM_EXPERTS
    with warnings.catch_warnings():
        warnings.simplefilter("error", RouteSanityWarning)
        with torch.no_grad(), replay_routes(every, own):
            every(input_ids=_ids(shape=(2, 12)), use_cache=False)


def test_padding_rows_keep_their_own_routing():
    """A left-padded batch whose padding rows hold pad_batch's placeholder route [0, 1]: without
    the router padding mask they are all replayed onto experts 0 and 1; with it they keep the
    model's own routing, so their per-expert counts are a stock forward's. (Identical pad tokens
    route identically in a stock forward too: how they spread is the model's, not replay's.)"""
    import torch

    from replay_plugin.core.routes import pad_batch
    from replay_plugin.fsdp import replay_routes

    family = "qwen3_moe"
    model = H.build(family)
    L = model.config.num_hidden_layers
    shape = (2, 12)
    attention = torch.ones(shape, dtype=torch.long)
    attention[0, :8] = 0  # 8 left-padding tokens
    ids = _ids(seed=3, shape=shape) * attention  # pad id 0
    recorded = random_routes(shape, L, seed=6)
    routes, mask = pad_batch([recorded[0, 8:].numpy(), recorded[1].numpy()], attention)
    routes = torch.as_tensor(routes)
    pad = ~attention.bool()
    assert torch.equal(torch.as_tensor(mask), pad) and (routes[pad] == torch.tensor([0, 1], dtype=routes.dtype)).all()
    _, stock = _stock(model, family, ids, attention_mask=attention)
    moe = stock.layers()

    def padding_counts(spy):
        got = spy.routes(L, shape)[pad]  # [8, L, K]: the padding rows
        return [torch.bincount(got[:, layer].flatten(), minlength=H.NUM_EXPERTS).tolist() for layer in moe]

    def replayed(router_padding_mask):
        spy = ExpertsSpy(model, family)
        with torch.no_grad(), replay_routes(model, routes, router_padding_mask):
            model(input_ids=ids, attention_mask=attention, use_cache=False)
        spy.remove()
        return spy

    dummy = [[8, 8] + [0] * (H.NUM_EXPERTS - 2)] * len(moe)
    assert padding_counts(replayed(None)) == dummy  # the problem: every padding row on experts 0 and 1
    with_mask = replayed(torch.as_tensor(mask))
    assert padding_counts(with_mask) == padding_counts(stock) != dummy
    first = moe[0]  # the first MoE layer's rows exactly as a stock forward routes them
    assert torch.equal(with_mask.routes(L, shape)[pad][:, first], stock.routes(L, shape)[pad][:, first])


def test_unknown_family_and_kernel_paths_are_refused_by_name():
    import types

    import torch
    import transformers

    from replay_plugin.fsdp import record_routes, replay_routes
    from replay_plugin.fsdp.route_replay import UnsupportedModelError

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(UnsupportedModelError, match="model type 'llama' .*not a supported MoE family"):
        record_routes(llama)
    phimoe = transformers.PhimoeForCausalLM(
        transformers.PhimoeConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    with pytest.raises(UnsupportedModelError, match="model type 'phimoe' \\(PhimoeForCausalLM\\)"):
        replay_routes(phimoe, torch.zeros(1, 2, 1, 2, dtype=torch.uint8))

    # gpt_oss with mxfp4 experts, as transformers' replace_with_mxfp4_linear leaves the model:
    # up to 5.19 it binds its own routing forward on each GptOssMLP, in 5.24 it swaps the block
    # for Mxfp4GptOssMLP
    from transformers.integrations import mxfp4

    model = H.build("gpt_oss")
    mlp = model.model.layers[1].mlp
    if hasattr(mxfp4, "mlp_forward"):
        mlp.forward = types.MethodType(mxfp4.mlp_forward, mlp)
        expected = r"model.layers.1.mlp runs transformers.integrations.mxfp4.mlp_forward \(an instance attribute"
    else:
        model.set_submodule(
            "model.layers.1.mlp", mxfp4.Mxfp4GptOssMLP(mlp.router, mxfp4.Mxfp4GptOssExperts(model.config))
        )
        expected = r"model.layers.1.mlp is a transformers.integrations.mxfp4.Mxfp4GptOssMLP holding experts"
    with pytest.raises(UnsupportedModelError, match=expected):
        replay_routes(model, random_routes((B, S), 2))

    # a subclass whose forward routes on its own (what a hub kernel layer does)
    model = H.build("qwen3_moe")
    block = model.model.layers[0].mlp

    class Kernel(type(block)):
        def forward(self, hidden_states):
            return hidden_states

    block.__class__ = Kernel
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp runs .*Kernel.forward \(class"):
        record_routes(model)


def test_granitemoe_before_5_16_is_refused():
    if _version() >= (5, 16):
        pytest.skip("granitemoe is replayed from 5.16 on (the family tests)")
    from replay_plugin.fsdp import replay_routes
    from replay_plugin.fsdp.route_replay import UnsupportedModelError

    model = H.build("granitemoe")
    with pytest.raises(UnsupportedModelError, match="GraniteMoeTopKGating"):
        replay_routes(model, random_routes((B, S), 2))


def test_contexts_do_not_nest_and_leave_nothing_behind():
    import torch

    from replay_plugin.fsdp import record_routes, replay_routes
    from replay_plugin.fsdp.route_replay import ReplayStateError, bound_layers

    model = H.build("qwen3_moe")
    ids = _ids()
    with torch.no_grad():
        stock = model(input_ids=ids, use_cache=False).logits
        routes = random_routes((B, S), 3)
        with replay_routes(model, routes):
            with pytest.raises(ReplayStateError, match="do not nest"):
                with replay_routes(model, routes):
                    pass
            with record_routes(model) as rec:  # recording inside a replay: what the experts got
                model(input_ids=ids, use_cache=False)
        assert torch.equal(rec.routes[..., [0, 2], :], routes[..., [0, 2], :].long())
        with pytest.raises(RuntimeError, match="boom"):
            with replay_routes(model, routes):
                model(input_ids=ids, use_cache=False)
                raise RuntimeError("boom")
        assert list(bound_layers()) == []
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, stock)


NATIVE = r"""
import hashlib, json, sys, torch
sys.path.insert(0, sys.argv[1])
import hf_moe_models as H
from replay_plugin import states
out = {}
for family in H.FAMILIES:
    model = H.build(family)
    model.config.output_router_logits = "router_logits" in (getattr(type(model), "_can_record_outputs", None) or {})
    ids = torch.randint(3, H.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    res = model(input_ids=ids, labels=ids, use_cache=False)
    res.loss.backward()
    h = hashlib.sha256(res.logits.detach().numpy().tobytes())
    for _, p in sorted(model.named_parameters()):
        h.update(p.grad.numpy().tobytes())
    st = states.get(f"transformers.moe_router_replay.{family}")
    out[family] = [h.hexdigest(), st.state if st else None]
print("RESULT" + json.dumps(out))
"""


def test_without_replay_the_models_compute_exactly_what_stock_transformers_computes():
    """The same script with the plugin active (every family patch applied) and with
    REPLAY_PLUGIN_DISABLE=1: logits, loss (with the load-balancing term) and every gradient equal."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    results = []
    for env in ({}, {"REPLAY_PLUGIN_DISABLE": "1"}):
        proc = run_python(NATIVE, env={"OMP_NUM_THREADS": "1", **env}, args=(here,))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][6:]))
    patched, stock = results
    for family in H.FAMILIES:
        assert patched[family][1] == "applied", (family, patched[family])
        assert stock[family][1] is None
        assert patched[family][0] == stock[family][0], family


def test_patch_switched_off_is_refused_naming_its_toggle():
    code = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import hf_moe_models as H
from replay_plugin.fsdp import replay_routes
from replay_plugin.fsdp.route_replay import UnsupportedModelError
try:
    replay_routes(H.build("olmoe"), torch.zeros(2, 3, 2, 2, dtype=torch.uint8))
except UnsupportedModelError as exc:
    print("REFUSED", exc)
"""
    import os

    proc = run_python(
        code,
        env={"REPLAY_PLUGIN_TRANSFORMERS_MOE_ROUTER_REPLAY_OLMOE": "0"},
        args=(os.path.dirname(os.path.abspath(__file__)),),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "transformers.moe_router_replay.olmoe is disabled" in proc.stdout
    assert "REPLAY_PLUGIN_TRANSFORMERS_MOE_ROUTER_REPLAY_OLMOE=0" in proc.stdout
