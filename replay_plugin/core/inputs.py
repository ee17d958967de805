"""Input rules shared by every trainer-side entry (core math, the Megatron driver, FSDP, metrics).

One rule per kind of argument, so that the same bad value gets the same typed error wherever it
is passed:

- **temperature**: a real number (Python or numpy, not bool), finite and > 0.
- **masks that select tokens** (loss, response, attention masks): bool, or numbers (integer or
  float) that are all 0 or 1 (1 = use the token). Any other value is refused, naming its position:
  0.5 is no answer and 2 is a bug upstream, not a yes (before, ``mask != 0`` read both as True in
  some entries while others refused every non-bool mask). A router padding mask means the opposite
  (True = no route) and is bool only, checked where it is taken.
- **support ids**: a signed integer dtype: ``-1`` is the padding id, and an unsigned dtype turns it
  into a large id that reads as a member (uint8: 255).
- **tensors**: torch tensors (numpy arrays only where an entry says so), on the device of the
  tensor they are combined with.

Everything here raises :class:`~replay_plugin.core.errors.ReplayTypeError` (wrong type or dtype) or
:class:`~replay_plugin.core.errors.ReplayDataError` (wrong value), naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError

__all__ = [
    "check_temperature",
    "check_tensor",
    "check_same_device",
    "check_support_dtype",
    "check_index",
    "mask_flags",
    "as_mask",
    "raise_bad_mask",
    "mask_value_text",
]

_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def check_temperature(temperature: Any, field: str = "temperature") -> float:
    """``temperature`` as a float: a real number, not bool, finite and > 0."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise ReplayTypeError(field, f"got {type(temperature).__name__}", expected="a real number > 0")
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ReplayDataError(field, f"got {value!r}", expected="a finite number > 0 (the sampling temperature)")
    return value


def check_index(value: Any, field: str, *, minimum: int = 0) -> int:
    """``value`` as an int ``>= minimum``: a Python or numpy integer, not bool (1.7 is refused,
    not truncated)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ReplayTypeError(field, f"got {type(value).__name__} {value!r}", expected=f"an int >= {minimum}")
    if value < minimum:
        raise ReplayDataError(field, f"got {int(value)}", expected=f"an int >= {minimum}")
    return int(value)


def check_tensor(x: Any, field: str, what: str = "") -> torch.Tensor:
    """``x`` itself, refused unless it is a torch tensor."""
    if not isinstance(x, torch.Tensor):
        got = f"{type(x).__name__} of dtype {x.dtype}" if hasattr(x, "dtype") else type(x).__name__
        raise ReplayTypeError(field, f"got {got}", expected=f"a torch tensor{' ' + what if what else ''}")
    return x


def check_same_device(x: torch.Tensor, field: str, reference: torch.Tensor, reference_field: str) -> None:
    """``x`` on ``reference``'s device (torch would raise an untyped error mid-computation)."""
    if x.device != reference.device:
        raise ReplayDataError(
            field, f"is on {x.device}", expected=f"the device of {reference_field}, {reference.device}"
        )


def check_support_dtype(dtype: Any, field: str = "support_ids") -> None:
    """Refuse a support-id dtype that is not a signed integer (torch or numpy dtype)."""
    if isinstance(dtype, torch.dtype):
        signed_int = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or dtype in _UNSIGNED)
        unsigned = dtype in _UNSIGNED
    else:
        kind = np.dtype(dtype).kind
        signed_int, unsigned = kind == "i", kind == "u"
    if signed_int:
        return
    if unsigned:
        raise ReplayTypeError(
            field,
            f"dtype {dtype} cannot hold the padding id -1 (a -1 written into it becomes a large id that reads as a "
            "member)",
            expected="a signed integer dtype (int32 by contract)",
        )
    raise ReplayTypeError(field, f"dtype {dtype}", expected="a signed integer dtype (int32 by contract)")


def mask_flags(mask: torch.Tensor, field: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(bool mask, bad)`` for a token-selecting mask, without a host sync: ``bad`` (same shape)
    flags values other than 0 and 1, NaN included (None for a bool mask). Complex numbers are
    refused here (their dtype says enough)."""
    check_tensor(mask, field, "(bool, or numbers 0/1)")
    if mask.dtype == torch.bool:
        return mask, None
    if mask.is_complex():
        raise ReplayTypeError(field, f"dtype {mask.dtype}", expected="bool, or numbers 0/1 (1 = the token counts)")
    if mask.dtype in _UNSIGNED[1:]:  # few kernels exist for uint16/32/64
        mask = mask.to(torch.int64)
    return mask != 0, (mask != 0) & (mask != 1)


def as_mask(mask: Any, field: str) -> torch.Tensor:
    """A token-selecting mask as bool (module rules); numpy arrays are taken too. Integer masks
    cost one host sync (their values are checked); bool masks none."""
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(np.ascontiguousarray(mask))
    out, bad = mask_flags(mask, field)
    if bad is not None and bool(bad.any()):
        raise_bad_mask(mask, bad, field)
    return out


def raise_bad_mask(mask: torch.Tensor, bad: torch.Tensor, field: str) -> None:
    """Raise for the first value of ``mask`` flagged in ``bad`` (``[B, S]``: trajectory and token;
    other shapes: the flat position as the token)."""
    pos = [int(v) for v in bad.nonzero()[0]]
    value = mask_value_text(float(mask[tuple(pos)]))
    trajectory, token = (pos[0], pos[1]) if len(pos) == 2 else (None, pos[-1] if pos else None)
    raise ReplayDataError(
        field, f"holds {value}", trajectory=trajectory, token=token, expected="0 or 1 (or a bool mask)"
    )


def mask_value_text(value: float) -> str:
    """How an error names a mask value: ``2`` for 2.0, ``0.5``, ``nan``."""
    return str(int(value)) if value.is_integer() else repr(value)
