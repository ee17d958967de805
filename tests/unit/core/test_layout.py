"""TokenMetadataLayout against a plain-Python reference, plus the SkyRL example values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.layout import TokenMetadataLayout

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# plain-Python reference


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def ref_sequences(mask: list[list[bool]], meta: list, next_token: bool, pad) -> list[list]:
    seqs = [[meta[i][s] for s, on in enumerate(row) if on] for i, row in enumerate(mask)]
    if next_token:
        seqs = [s[1:] + [pad] if s else [] for s in seqs]
    return seqs


def ref_align(mask, meta, pad, *, packed, align, next_token, cp_size=1, cp_rank=0) -> list:
    seqs = ref_sequences(mask, meta, next_token, pad)
    if not packed:
        width = _round_up(max(len(s) for s in seqs), align)
        return [s + [pad] * (width - len(s)) for s in seqs]
    out: list = []
    for s in seqs:
        padded = s + [pad] * (_round_up(len(s), align) - len(s))
        if cp_size == 1:
            out += padded
            continue
        h = len(padded) // (2 * cp_size)
        chunks = [padded[k * h : (k + 1) * h] for k in range(2 * cp_size)]
        out += chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]
    return [out]


def ref_restore(mask, values, pad, *, packed, align) -> list:
    """values: the unsharded layout as nested lists ([1][T] packed, [B][A] unpacked)."""
    lengths = [sum(row) for row in mask]
    out = []
    offset = 0
    for i, row in enumerate(mask):
        line = [pad] * (len(row) - 1)
        rank = 0
        for s, on in enumerate(row):
            if not on:
                continue
            if rank < lengths[i] - 1:
                line[s] = values[0][offset + rank] if packed else values[i][rank]
            rank += 1
        offset += _round_up(lengths[i], align)
        out.append(line)
    return out


# ---------------------------------------------------------------------------------------
# strategies


@st.composite
def masks(draw) -> list[list[bool]]:
    batch = draw(st.integers(1, 4))
    seq = draw(st.integers(1, 11))
    rows = []
    for _ in range(batch):
        n = draw(st.integers(1, seq))  # empty rows excluded
        style = draw(st.sampled_from(["left", "right", "both", "holes"]))
        if style == "left":
            start = seq - n
        elif style == "right":
            start = 0
        else:
            start = draw(st.integers(0, seq - n))
        row = [start <= s < start + n for s in range(seq)]
        if style == "holes":
            positions = sorted(draw(st.lists(st.integers(0, seq - 1), min_size=n, max_size=n, unique=True)))
            row = [s in positions for s in range(seq)]
        rows.append(row)
    return rows


TRAILS = [(), (3,), (2, 4)]


@st.composite
def cases(draw):
    mask = draw(masks())
    packed = draw(st.booleans())
    cp_size = draw(st.sampled_from([1, 2, 4])) if packed else 1
    align = draw(st.sampled_from([a for a in (1, 2, 4, 8) if a % (2 * cp_size) == 0 or cp_size == 1]))
    trail = draw(st.sampled_from(TRAILS))
    next_token = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    return mask, packed, cp_size, align, trail, next_token, seed


def _meta(mask, trail, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (len(mask), len(mask[0]), *trail), generator=g)


def _pad(trail) -> torch.Tensor:
    return -1 - torch.arange(math.prod(trail)).reshape(trail)  # distinct per trailing element


def _as_lists(meta: torch.Tensor) -> list:
    return [[meta[i, s] for s in range(meta.shape[1])] for i in range(meta.shape[0])]


def _stack(nested: list, trail) -> torch.Tensor:
    rows = [torch.stack(r) if r else torch.empty((0, *trail), dtype=torch.int64) for r in nested]
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------
# properties


@SETTINGS
@given(cases())
def test_align_matches_reference_on_every_rank(case) -> None:
    mask, packed, cp_size, align, trail, next_token, seed = case
    meta = _meta(mask, trail, seed)
    pad = _pad(trail)
    mask_t = torch.tensor(mask)
    full = TokenMetadataLayout.build(mask_t, packed=packed, align=align).align(meta, pad, next_token=next_token)
    expected_full = _stack(
        ref_align(mask, _as_lists(meta), pad, packed=packed, align=align, next_token=next_token), trail
    )
    assert torch.equal(full, expected_full)

    shards = []
    for rank in range(cp_size):
        layout = TokenMetadataLayout.build(mask_t, packed=packed, align=align, cp_size=cp_size, cp_rank=rank)
        out = layout.align(meta, pad, next_token=next_token)
        ref = ref_align(
            mask, _as_lists(meta), pad, packed=packed, align=align, next_token=next_token, cp_size=cp_size, cp_rank=rank
        )
        assert torch.equal(out, _stack(ref, trail)), f"rank {rank}"
        assert out.shape[:2] == layout.output_shape
        shards.append(out)
    if packed:
        # The union of the shards is the unsharded tensor, slot for slot.
        assert torch.equal(layout.unshard(shards), full)
        assert sum(s.shape[1] for s in shards) == full.shape[1]


@SETTINGS
@given(cases())
def test_restore_matches_reference(case) -> None:
    mask, packed, cp_size, align, trail, _, seed = case
    layout = TokenMetadataLayout.build(torch.tensor(mask), packed=packed, align=align, cp_size=cp_size, cp_rank=0)
    g = torch.Generator().manual_seed(seed)
    leading = (1, layout.aligned_sequence_length) if packed else layout.output_shape
    values = torch.rand((*leading, *trail), generator=g, dtype=torch.float64)
    pad = torch.full(trail, -7.0, dtype=torch.float64)
    out = layout.restore(values, pad)
    nested = [[values[i, j] for j in range(values.shape[1])] for i in range(values.shape[0])]
    ref = ref_restore(mask, nested, pad, packed=packed, align=align)
    assert out.shape == (len(mask), len(mask[0]) - 1, *trail)
    for i, line in enumerate(ref):
        for s, v in enumerate(line):
            assert torch.equal(out[i, s], v), (i, s)


@SETTINGS
@given(cases())
def test_restore_inverts_align_for_tokens_with_a_target(case) -> None:
    mask, packed, _, align, trail, _, seed = case
    meta = _meta(mask, trail, seed)
    layout = TokenMetadataLayout.build(torch.tensor(mask), packed=packed, align=align)
    back = layout.restore(layout.align(meta, 0), -1)
    mask_t = torch.tensor(mask)
    has_target = mask_t.cumsum(1) < mask_t.sum(1, keepdim=True)  # valid and not the last
    keep = (has_target & mask_t)[:, :-1]
    assert torch.equal(back[keep], meta[:, :-1][keep])
    assert bool((back[~keep] == -1).all())


# ---------------------------------------------------------------------------------------
# the SkyRL example (research/skyrl.md section 1.3): align 4, attention [[0,1,1,1],[0,0,1,1]]

ATTN = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])


def test_skyrl_example_packed_routes_mask_and_cu_seqlens() -> None:
    layout = TokenMetadataLayout.build(ATTN, packed=True, align=4)
    routes = torch.tensor(
        [[[0, 0], [10, 11], [12, 13], [14, 15]], [[0, 0], [0, 0], [20, 21], [22, 23]]], dtype=torch.uint8
    )
    pad = torch.tensor([0, 1], dtype=torch.uint8)  # the padding route arange(K)
    out = layout.align(routes, pad)
    assert out.tolist() == [[[10, 11], [12, 13], [14, 15], [0, 1], [20, 21], [22, 23], [0, 1], [0, 1]]]
    assert out.dtype == torch.uint8
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert layout.cu_seqlens_padded.dtype == torch.int32
    # Router padding mask: sequence 0's last token has no captured route.
    router_padding = torch.tensor([[True, False, False, True], [True, True, False, False]])
    assert layout.align(router_padding, True).tolist() == [[False, False, True, True, False, False, True, True]]


def test_skyrl_example_next_token_and_restore() -> None:
    layout = TokenMetadataLayout.build(ATTN, packed=True, align=4)
    ids = torch.tensor([[0, 10, 11, 12], [0, 0, 20, 21]])
    assert layout.align(ids, -1, next_token=True).tolist() == [[11, 12, -1, -1, 21, -1, -1, -1]]
    assert layout.restore(torch.arange(1, 9)[None], 0).tolist() == [[0, 1, 2], [0, 0, 5]]


def test_skyrl_example_unpacked_and_context_parallel() -> None:
    ids = torch.tensor([[0, 10, 11, 12], [0, 0, 20, 21]])
    unpacked = TokenMetadataLayout.build(ATTN, packed=False, align=4)
    assert unpacked.align(ids, -1).tolist() == [[10, 11, 12, -1], [20, 21, -1, -1]]
    assert unpacked.align(ids, -1, next_token=True).tolist() == [[11, 12, -1, -1], [21, -1, -1, -1]]
    ranks = [TokenMetadataLayout.build(ATTN, packed=True, align=4, cp_size=2, cp_rank=r) for r in range(2)]
    shards = [layout.align(ids, -1) for layout in ranks]
    assert [s.tolist() for s in shards] == [[[10, -1, 20, -1]], [[11, 12, 21, -1]]]
    assert ranks[1].unshard(shards).tolist() == [[10, 11, 12, -1, 20, 21, -1, -1]]


# ---------------------------------------------------------------------------------------
# inputs and errors


def test_numpy_and_int_masks_are_accepted() -> None:
    layout = TokenMetadataLayout.build(ATTN.numpy(), packed=False)
    assert layout.attention_mask.dtype == torch.bool
    out = layout.align(np.arange(8).reshape(2, 4), -1)
    assert out.tolist() == [[1, 2, 3], [6, 7, -1]]
    assert layout.sequence_lengths == (3, 2)
    assert layout.aligned_sequence_length == 3


def test_bool_and_float_metadata_keep_their_dtype() -> None:
    layout = TokenMetadataLayout.build(ATTN, packed=True, align=2)
    f = layout.align(torch.ones(2, 4, dtype=torch.bfloat16), 0.5)
    assert f.dtype == torch.bfloat16 and f.tolist() == [[1, 1, 1, 0.5, 1, 1]]
    b = layout.align(torch.zeros(2, 4, dtype=torch.bool), True)
    assert b.tolist() == [[False, False, False, True, False, False]]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"packed": False, "align": 0}, "align"),
        ({"packed": False, "cp_size": 2}, "cp_size"),
        ({"packed": True, "align": 2, "cp_size": 2}, "align"),
        ({"packed": True, "align": 4, "cp_size": 2, "cp_rank": 2}, "cp_rank"),
        ({"packed": 1}, "packed"),
        ({"packed": True, "align": 2.0}, "align"),
    ],
)
def test_build_rejects_bad_arguments(kwargs, field) -> None:
    with pytest.raises((ReplayDataError, ReplayTypeError)) as info:
        TokenMetadataLayout.build(ATTN, **kwargs)
    assert info.value.field == field


def test_build_rejects_bad_masks() -> None:
    with pytest.raises(ReplayDataError, match="attention_mask"):
        TokenMetadataLayout.build(torch.ones(4, dtype=torch.bool), packed=True)
    with pytest.raises(ReplayDataError) as info:
        TokenMetadataLayout.build(torch.tensor([[1, 2]]), packed=True)
    assert (info.value.trajectory, info.value.token) == (0, 1)
    # one mask rule (core.inputs): 0/1 floats are a mask, 0.5 is not
    float_mask = TokenMetadataLayout.build(torch.tensor([[0.0, 1.0]]), packed=True)
    assert float_mask.attention_mask.tolist() == [[False, True]]
    with pytest.raises(ReplayDataError, match="holds 0.5") as info:
        TokenMetadataLayout.build(torch.tensor([[1.0, 0.5]]), packed=True)
    assert (info.value.trajectory, info.value.token) == (0, 1)
    with pytest.raises(ReplayTypeError):
        TokenMetadataLayout.build(torch.ones(2, 2, dtype=torch.complex64), packed=True)
    with pytest.raises(ReplayTypeError):
        TokenMetadataLayout.build([[1, 1]], packed=True)


def test_align_rejects_bad_metadata_and_padding() -> None:
    layout = TokenMetadataLayout.build(ATTN, packed=True, align=4)
    with pytest.raises(ReplayDataError, match="meta"):
        layout.align(torch.zeros(2, 5), 0)
    with pytest.raises(ReplayDataError, match="does not fit"):
        layout.align(torch.zeros(2, 4, dtype=torch.uint8), -1)  # would wrap to 255
    with pytest.raises(ReplayDataError, match="not integral"):
        layout.align(torch.zeros(2, 4, dtype=torch.int32), 0.5)
    with pytest.raises(ReplayDataError, match="broadcastable"):
        layout.align(torch.zeros(2, 4, 3), torch.zeros(2))
    with pytest.raises(ReplayDataError, match="overflows"):
        layout.align(torch.zeros(2, 4, dtype=torch.float16), 1e6)


def test_restore_requires_the_unsharded_layout() -> None:
    layout = TokenMetadataLayout.build(ATTN, packed=True, align=4, cp_size=2, cp_rank=0)
    shard = layout.align(torch.zeros(2, 4), 0)
    with pytest.raises(ReplayDataError, match="unshard"):
        layout.restore(shard, 0)
    with pytest.raises(ReplayDataError, match="2 shards"):
        layout.unshard([shard])
    with pytest.raises(ReplayDataError, match="unpacked"):
        TokenMetadataLayout.build(ATTN, packed=False).unshard([shard])


def test_empty_rows_are_allowed() -> None:
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    packed = TokenMetadataLayout.build(mask, packed=True, align=2)
    assert packed.cu_seqlens_padded.tolist() == [0, 0, 2]
    assert packed.align(torch.tensor([[1, 2, 3], [4, 5, 6]]), 0).tolist() == [[4, 5]]
    assert packed.restore(torch.tensor([[7, 8]]), 0).tolist() == [[0, 0], [7, 0]]
