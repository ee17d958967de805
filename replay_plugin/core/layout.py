"""Token metadata layout: from a padded ``[batch, seq]`` batch to the model's input layout.

Per-token metadata (routes, router padding masks, support rows, sampled ids) arrives in the
trainer's padded ``[B, S]`` grid; the model consumes tokens unpacked ``[B, A]``, packed (THD)
``[1, T]``, or packed and cut for context parallelism ``[1, T / cp]`` (Megatron's load-balanced
chunk order), optionally shifted to the *next* token (metadata of a logit's target).
:meth:`TokenMetadataLayout.build` computes the index maps once; ``align`` and ``restore`` are
then one gather / one scatter on the mask's device, for any trailing shape and dtype.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import torch

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.inputs import as_mask

__all__ = ["TokenMetadataLayout"]

TensorLike: TypeAlias = "torch.Tensor | np.ndarray"


def _round_up(x: torch.Tensor, align: int) -> torch.Tensor:
    return (x + align - 1) // align * align


def _to_tensor(x: Any, field: str, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only arrays are only read
                t = torch.from_numpy(np.ascontiguousarray(x))
        except TypeError as exc:
            raise ReplayTypeError(field, f"dtype {x.dtype}: {exc}", expected="a dtype torch supports") from None
        return t if device is None else t.to(device)
    raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a torch tensor or numpy array")


def _bool_mask(attention_mask: Any) -> torch.Tensor:
    mask = _to_tensor(attention_mask, "attention_mask")
    if mask.dim() != 2:
        raise ReplayDataError("attention_mask", f"shape {tuple(mask.shape)}", expected="[batch, seq]")
    return as_mask(mask, "attention_mask")  # bool, or 0/1 numbers (core.inputs)


def _check_int(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ReplayTypeError(field, f"got {type(value).__name__}", expected="an int")
    if value < minimum:
        raise ReplayDataError(field, f"got {value}", expected=f">= {minimum}")
    return int(value)


def _padding(padding_value: Any, dtype: torch.dtype, trail: torch.Size, device: torch.device) -> torch.Tensor:
    """``padding_value`` as a tensor of ``dtype`` broadcastable to ``trail``; never wraps."""
    try:
        p = torch.as_tensor(np.asarray(padding_value) if isinstance(padding_value, np.ndarray) else padding_value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ReplayTypeError("padding_value", f"{padding_value!r}: {exc}", expected="a number or an array") from None
    try:
        if torch.broadcast_shapes(p.shape, trail) != trail:
            raise RuntimeError
    except RuntimeError:
        raise ReplayDataError(
            "padding_value", f"shape {tuple(p.shape)}", expected=f"broadcastable to the trailing shape {tuple(trail)}"
        ) from None
    if not (dtype.is_floating_point or dtype.is_complex):
        if p.dtype.is_floating_point and not bool(torch.all(p == p.round())):
            raise ReplayDataError("padding_value", f"{padding_value!r} is not integral", expected=f"a value of {dtype}")
        q = p.to(dtype)
        if not bool(torch.all(q.to(torch.float64) == p.to(torch.float64))):
            raise ReplayDataError(
                "padding_value", f"{padding_value!r} does not fit {dtype}", expected=f"a value of {dtype}"
            )
    else:
        q = p.to(dtype)
        if bool(torch.any(torch.isinf(q) & ~torch.isinf(p.to(torch.float64)))):
            raise ReplayDataError(
                "padding_value", f"{padding_value!r} overflows {dtype}", expected=f"a value of {dtype}"
            )
    return q.to(device)


def _check_build_args(packed: Any, align: Any, cp_size: Any, cp_rank: Any) -> tuple[int, int, int]:
    """``(align, cp_size, cp_rank)`` as ints, checked against each other and ``packed``."""
    if not isinstance(packed, bool):
        raise ReplayTypeError("packed", f"got {type(packed).__name__}", expected="a bool")
    align = _check_int(align, "align", 1)
    cp_size = _check_int(cp_size, "cp_size", 1)
    cp_rank = _check_int(cp_rank, "cp_rank", 0)
    if cp_rank >= cp_size:
        raise ReplayDataError("cp_rank", f"got {cp_rank}", expected=f"< cp_size {cp_size}")
    if cp_size > 1 and not packed:
        raise ReplayDataError(
            "cp_size", f"{cp_size} with an unpacked layout", expected="packed=True for context parallelism"
        )
    if cp_size > 1 and align % (2 * cp_size):
        raise ReplayDataError(
            "align", f"{align} with cp_size {cp_size}", expected=f"a multiple of 2 * cp_size = {2 * cp_size}"
        )
    return align, cp_size, cp_rank


class _Slots(NamedTuple):
    """Where the valid tokens go in the unsharded model input."""

    #: int64 ``[N]``: each valid token's index in the flattened unsharded ``[rows, length]``.
    slot: torch.Tensor
    #: ``A`` (unpacked) or ``T`` (packed, all CP ranks together).
    aligned_length: int
    #: this rank's ``(rows, length)``.
    output_shape: tuple[int, int]
    #: packed only: padded sequence lengths int64 ``[B]``.
    padded: torch.Tensor | None
    #: packed only: their cumulative sums int64 ``[B + 1]``, starting at 0.
    cu: torch.Tensor | None


def _packed_slots(lengths: torch.Tensor, row: torch.Tensor, rank: torch.Tensor, align: int, cp_size: int) -> _Slots:
    """THD slots: the sequences (``lengths`` ``[B]``) back to back, each padded to a multiple of
    ``align``; ``row`` / ``rank`` ``[N]`` are each valid token's sequence and index in it."""
    padded = _round_up(lengths, align)
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(padded, dim=0, out=cu[1:])
    total = int(cu[-1])
    slot = cu[row] + rank  # unsharded packed slot of each valid token
    return _Slots(slot, total, (1, total // cp_size), padded, cu)


def _unpacked_slots(lengths: torch.Tensor, row: torch.Tensor, rank: torch.Tensor, align: int) -> _Slots:
    """``[B, A]`` slots: each row's valid tokens left-justified, ``A`` the longest row rounded
    up to a multiple of ``align``."""
    batch = lengths.shape[0]
    aligned = int(_round_up(lengths.max(), align)) if batch else 0
    return _Slots(row * aligned + rank, aligned, (batch, aligned), None, None)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenMetadataLayout:
    """Where each valid token of a ``[B, S]`` batch goes in the model's input layout.

    Build with :meth:`build`. Public attributes:

    Attributes:
        attention_mask: ``[B, S]`` bool, valid tokens True (any pattern: left, right or
            both-side padding, even holes; valid tokens are taken in order).
        sequence_lengths: ``len_i`` per row.
        packed: packed (THD) or unpacked layout.
        alignment: the ``align`` it was built with: every padded sequence (packed) or the
            row length (unpacked) is a multiple of it.
        aligned_sequence_length: unpacked ``A = round_up(max len_i, align)``; packed ``T =
            sum_i round_up(len_i, align)`` (all CP ranks together).
        padded_sequence_lengths: packed only, ``P_i = round_up(len_i, align)``.
        cu_seqlens_padded: packed only, ``[B + 1]`` int32 ``[0, P_0, P_0 + P_1, ...]``
            (unsharded, as Megatron's ``PackedSeqParams`` takes it), on the mask's device.
        cp_size, cp_rank: context parallelism (packed only when ``cp_size > 1``).
        output_shape: the leading shape :meth:`align` returns: ``(B, A)`` unpacked,
            ``(1, T // cp_size)`` packed.
    """

    attention_mask: torch.Tensor
    sequence_lengths: tuple[int, ...]
    packed: bool
    alignment: int
    aligned_sequence_length: int
    padded_sequence_lengths: tuple[int, ...] | None
    cu_seqlens_padded: torch.Tensor | None
    cp_size: int
    cp_rank: int
    output_shape: tuple[int, int]
    # Gathers: out.flat[dst] = meta.flat[src] (rows of [B*S, ...] -> rows of output_shape).
    _same: tuple[torch.Tensor, torch.Tensor] = dataclasses.field(repr=False, compare=False)
    _next: tuple[torch.Tensor, torch.Tensor] = dataclasses.field(repr=False, compare=False)
    # restore: out.flat[dst] over [B*(S-1)] = values.flat[src] over the unsharded layout.
    _restore: tuple[torch.Tensor, torch.Tensor] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def build(
        cls,
        attention_mask: TensorLike,
        *,
        packed: bool,
        align: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
    ) -> TokenMetadataLayout:
        """Compute the layout of a ``[B, S]`` batch.

        Args:
            attention_mask: ``[B, S]`` bool or 0/1 (tensor on any device, or numpy).
            packed: THD packing (sequences back to back) or unpacked rows.
            align: >= 1. Megatron uses ``tp`` unpacked and ``tp * cp * 2`` packed with CP
                (``lcm(..., 16)`` / ``lcm(..., 16 * cp)`` with fp8).
            cp_size: context-parallel size; > 1 requires ``packed`` and ``align`` a multiple
                of ``2 * cp_size`` (every padded sequence must split into ``2 * cp_size``
                equal chunks).
            cp_rank: this rank, ``0 <= cp_rank < cp_size``.

        Raises:
            ReplayTypeError / ReplayDataError naming the bad argument.
        """
        align, cp_size, cp_rank = _check_build_args(packed, align, cp_size, cp_rank)
        mask = _bool_mask(attention_mask)
        seq = mask.shape[1]
        lengths = mask.sum(dim=1)  # [B] int64
        # Valid tokens in row-major order: flat source index, row, rank within the row.
        flat_src = mask.reshape(-1).nonzero().squeeze(1)  # [N]
        row = flat_src // max(seq, 1)
        rank = (mask.cumsum(dim=1) - 1).reshape(-1)[flat_src]
        lengths_list = tuple(int(v) for v in lengths.tolist())
        if packed:
            slots = _packed_slots(lengths, row, rank, align, cp_size)
        else:
            slots = _unpacked_slots(lengths, row, rank, align)

        has_next = rank >= 1
        same = (flat_src, slots.slot)
        nxt = (flat_src[has_next], slots.slot[has_next] - 1)
        if cp_size > 1:
            assert slots.cu is not None and slots.padded is not None  # cp_size > 1 requires packed
            to_local = cls._cp_local_slots(slots.cu, slots.padded, slots.aligned_length, cp_size, cp_rank)
            same = cls._keep_local(same, to_local)
            nxt = cls._keep_local(nxt, to_local)

        # restore: tokens with a next token, from their unsharded slot to [row, position].
        has_target = rank < (lengths[row] - 1)
        position = flat_src - row * seq
        restore = (slots.slot[has_target], row[has_target] * max(seq - 1, 0) + position[has_target])

        return cls(
            attention_mask=mask,
            sequence_lengths=lengths_list,
            packed=packed,
            alignment=align,
            aligned_sequence_length=slots.aligned_length,
            padded_sequence_lengths=None if slots.padded is None else tuple(int(v) for v in slots.padded.tolist()),
            cu_seqlens_padded=None if slots.cu is None else slots.cu.to(torch.int32),
            cp_size=cp_size,
            cp_rank=cp_rank,
            output_shape=slots.output_shape,
            _same=same,
            _next=nxt,
            _restore=restore,
        )

    # -----------------------------------------------------------------------------------
    # context parallel

    @staticmethod
    def _cp_slot_owner(
        cu: torch.Tensor, padded: torch.Tensor, total: int, cp_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For every unsharded packed slot: the CP rank holding it and its slot on that rank."""
        device = cu.device
        g = torch.arange(total, device=device)
        seq_of = torch.repeat_interleave(torch.arange(padded.numel(), device=device), padded)
        j = g - cu[seq_of]
        half = (padded // (2 * cp_size))[seq_of]  # chunk length of the slot's sequence
        chunk = j // half
        front = chunk < cp_size
        owner = torch.where(front, chunk, 2 * cp_size - 1 - chunk)
        # On its rank a sequence occupies [cu_i / c, cu_i / c + 2 * half): front chunk first.
        local = cu[seq_of] // cp_size + torch.where(front, j - chunk * half, half + j - chunk * half)
        return owner, local

    @classmethod
    def _cp_local_slots(
        cls, cu: torch.Tensor, padded: torch.Tensor, total: int, cp_size: int, cp_rank: int
    ) -> torch.Tensor:
        owner, local = cls._cp_slot_owner(cu, padded, total, cp_size)
        return torch.where(owner == cp_rank, local, torch.full_like(local, -1))

    @staticmethod
    def _keep_local(
        pair: tuple[torch.Tensor, torch.Tensor], to_local: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = pair
        local = to_local[dst]
        keep = local >= 0
        return src[keep], local[keep]

    # -----------------------------------------------------------------------------------
    # mapping

    def _meta(self, meta: Any, field: str) -> torch.Tensor:
        t = _to_tensor(meta, field, self.attention_mask.device)
        if t.dim() < 2 or tuple(t.shape[:2]) != tuple(self.attention_mask.shape):
            raise ReplayDataError(
                field,
                f"shape {tuple(t.shape)}",
                expected=f"[{', '.join(map(str, self.attention_mask.shape))}, ...] like attention_mask",
            )
        if t.device != self.attention_mask.device:
            raise ReplayDataError(field, f"on {t.device}", expected=f"the layout's device {self.attention_mask.device}")
        return t

    def align(self, meta: TensorLike, padding_value: Any, *, next_token: bool = False) -> torch.Tensor:
        """Map per-token metadata from the batch grid to this layout.

        Args:
            meta: ``[B, S, *trail]`` any dtype (tensor on the mask's device, or numpy,
                which is moved there).
            padding_value: fills every slot without a token: a scalar, or an array/tensor
                broadcastable to ``trail`` (e.g. the padding route row ``arange(K)`` for
                ``[B, S, L, K]`` routes). Must be representable in ``meta``'s dtype.
            next_token: slot ``j`` of each sequence takes token ``j + 1``'s metadata; the
                last token slot is padding. Applied before the CP cut.

        Returns:
            ``[*output_shape, *trail]``, ``meta``'s dtype and device: ``[B, A, *trail]``
            unpacked, ``[1, T // cp_size, *trail]`` packed (this rank's shard under CP).

        Raises:
            ReplayDataError / ReplayTypeError: wrong leading shape or device, a padding value
            of the wrong shape or not representable.
        """
        m = self._meta(meta, "meta")
        trail = m.shape[2:]
        pad = _padding(padding_value, m.dtype, trail, m.device)
        src, dst = self._next if next_token else self._same
        rows = self.output_shape[0] * self.output_shape[1]
        out = torch.empty((rows, *trail), dtype=m.dtype, device=m.device)
        out[...] = pad
        flat = m.reshape(-1, *trail)
        out.index_copy_(0, dst, flat.index_select(0, src))
        return out.reshape(*self.output_shape, *trail)

    def restore(self, values: TensorLike, padding_value: Any) -> torch.Tensor:
        """Per-slot values back to the batch grid, at the position of the predicting token.

        Args:
            values: the unsharded layout's values ``[1, T, *trail]`` packed (all CP shards
                gathered, in packed order; see :meth:`unshard`) or ``[B, A, *trail]``
                unpacked; slot ``j`` of a sequence belongs to its token ``j`` (e.g. the
                logprob of token ``j + 1``).
            padding_value: fills positions without a value (padding, each sequence's last
                token); a scalar or broadcastable to ``trail``.

        Returns:
            ``[B, S - 1, *trail]``: position ``s`` holds the value of the slot of the token
            at ``s`` when that token has a next token in its row, else ``padding_value``.
        """
        v = _to_tensor(values, "values", self.attention_mask.device)
        batch, seq = self.attention_mask.shape
        expected = (1, self.aligned_sequence_length) if self.packed else self.output_shape
        if v.dim() < 2 or tuple(v.shape[:2]) != expected:
            hint = " (gather every CP shard first, see unshard())" if self.cp_size > 1 else ""
            raise ReplayDataError(
                "values", f"shape {tuple(v.shape)}", expected=f"[{expected[0]}, {expected[1]}, ...]{hint}"
            )
        if v.device != self.attention_mask.device:
            raise ReplayDataError(
                "values", f"on {v.device}", expected=f"the layout's device {self.attention_mask.device}"
            )
        trail = v.shape[2:]
        pad = _padding(padding_value, v.dtype, trail, v.device)
        src, dst = self._restore
        out = torch.empty((batch * max(seq - 1, 0), *trail), dtype=v.dtype, device=v.device)
        out[...] = pad
        out.index_copy_(0, dst, v.reshape(-1, *trail).index_select(0, src))
        return out.reshape(batch, max(seq - 1, 0), *trail)

    def unshard(self, shards: Sequence[TensorLike]) -> torch.Tensor:
        """Reassemble the CP shards of a packed tensor into packed order.

        Args:
            shards: ``cp_size`` tensors ``[1, T // cp_size, *trail]``, rank order (what an
                all-gather over the CP group returns).

        Returns:
            ``[1, T, *trail]``, the tensor :meth:`align` would return with ``cp_size=1``.
        """
        if not self.packed:
            raise ReplayDataError("shards", "unshard() on an unpacked layout", expected="a packed layout")
        if isinstance(shards, (torch.Tensor, np.ndarray)) or len(shards) != self.cp_size:
            got = type(shards).__name__ if isinstance(shards, (torch.Tensor, np.ndarray)) else f"{len(shards)} shards"
            raise ReplayDataError("shards", f"got {got}", expected=f"a sequence of {self.cp_size} shards in rank order")
        parts = [_to_tensor(s, "shards", self.attention_mask.device) for s in shards]
        local = self.aligned_sequence_length // self.cp_size
        trail = parts[0].shape[2:]
        for r, p in enumerate(parts):
            if p.dim() < 2 or tuple(p.shape[:2]) != (1, local) or p.shape[2:] != trail or p.dtype != parts[0].dtype:
                raise ReplayDataError(
                    "shards",
                    f"shard {r} has shape {tuple(p.shape)} {p.dtype}",
                    expected=f"[1, {local}, *{tuple(trail)}] {parts[0].dtype}",
                )
        if self.cp_size == 1:
            return parts[0]
        assert self.cu_seqlens_padded is not None and self.padded_sequence_lengths is not None
        cu = self.cu_seqlens_padded.to(torch.int64)
        padded = torch.tensor(self.padded_sequence_lengths, dtype=torch.int64, device=cu.device)
        owner, slot = self._cp_slot_owner(cu, padded, self.aligned_sequence_length, self.cp_size)
        stacked = torch.stack([p.reshape(local, *trail) for p in parts])  # [c, T/c, *trail]
        return stacked[owner, slot].reshape(1, self.aligned_sequence_length, *trail)
