"""Patches ``ulysses.nd_partition`` (verl) and ``ulysses.nd_partition_skyrl`` (skyrl): Ulysses
pad-and-slice for per-token metadata ``[batch, seq, ...]``.

Gap (verl 0.9.1, no upstream issue or fix): ``ulysses_pad`` unpacks a 2-D shape, pads the last
dimension and asserts on ``size(-1)``, so support rows, masks and trajectory ids cannot follow
the tokens through sequence parallelism. skyrl 0.4.0's copy already pads dim 1 with
``input_padding_value`` (its probe reports ``not-needed``; the spec catches a release that loses
it). The probe runs the unwrapped upstream on a ``[1, 5, 3]`` input; the wrapper leaves 2-D
input to upstream and partitions N-D input by running upstream on a position index and
gathering the metadata at the positions it returns. Remove when upstream pads N-D input.
"""

from __future__ import annotations

import inspect
import traceback
import types
from collections.abc import Callable
from typing import Any

from ..patcher import Patcher, patch_marker
from ..spec import PatchSpec, ProbeResult

VERL = "verl.utils.ulysses"
SKYRL = "skyrl.backends.skyrl_train.distributed.ulysses.utils"

#: the keyword each upstream uses for the padding value of the (first) input tensor
PAD_KEYWORD = {VERL: "pad_value", SKYRL: "input_padding_value"}

_PROBE_PAD = -7


# --------------------------------------------------------------------------- probe


class _StandInGroup:
    """Truthy placeholder for the Ulysses group while probing (never passed to torch.distributed)."""


def _keep_all(x, dim, padding=True, group=None):
    return x


def _with_stand_in_group(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` whose globals see a 2-rank stand-in SP group and do not slice.

    Globals the plugin has wrapped (e.g. verl's ``ulysses_pad`` once patched) are replaced by
    the upstream originals, so the probe judges upstream code only.
    """
    overlay = {
        name: inspect.unwrap(value)
        for name, value in fn.__globals__.items()
        if callable(value) and patch_marker(value) is not None
    }
    overlay.update(
        get_ulysses_sequence_parallel_group=lambda: _StandInGroup(),
        get_ulysses_sequence_parallel_world_size=lambda group=None: 2,
        get_ulysses_sequence_parallel_rank=lambda group=None: 0,
        slice_input_tensor=_keep_all,
    )
    clone = types.FunctionType(fn.__code__, {**fn.__globals__, **overlay}, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


def probe_function(fn: Callable[..., Any], pad_keyword: str, *, stand_in_group: bool = True) -> ProbeResult:
    """Whether ``fn`` pads a ``[1, 5, 3]`` input along the sequence to ``[1, 6, 3]`` with the
    ``pad_keyword`` value (``sp_size=2``), without and then with position ids ``[1, 5]``
    (which must come back ``[1, 6]``).

    ``fn`` is an upstream ``ulysses_pad`` or ``ulysses_pad_and_slice_inputs`` (not our wrapper).
    ``stand_in_group`` runs it with the stand-in SP group (needed by pad-and-slice; harmless for
    a function that never looks the group up).
    """
    import torch

    name = getattr(fn, "__qualname__", repr(fn))
    x = torch.arange(15, dtype=torch.int64).reshape(1, 5, 3)
    positions = torch.arange(5, dtype=torch.int64).unsqueeze(0)
    call = _with_stand_in_group(fn) if stand_in_group and isinstance(fn, types.FunctionType) else fn
    for with_positions in (False, True):
        try:
            out = call(
                x, position_ids_rmpad=positions if with_positions else None, sp_size=2, **{pad_keyword: _PROBE_PAD}
            )
        except Exception as exc:  # noqa: BLE001 - any failure on N-D input is the gap
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" at `{frames[-1].line}`" if frames and frames[-1].line else ""
            detail = f": {exc}" if str(exc) else ""
            also = " with position ids" if with_positions else ""
            return ProbeResult(
                True, f"{name} rejects [batch, seq, ...] input{also} ({type(exc).__name__}{detail}{where})"
            )
        padded = out[0] if isinstance(out, tuple) else out
        if not torch.is_tensor(padded) or tuple(padded.shape) != (1, 6, 3):
            shape = tuple(padded.shape) if torch.is_tensor(padded) else type(padded).__name__
            return ProbeResult(True, f"{name} pads [1, 5, 3] to {shape}, not [1, 6, 3] along the sequence")
        if not bool((padded[:, :5] == x).all()) or not bool((padded[:, 5] == _PROBE_PAD).all()):
            return ProbeResult(True, f"{name} does not pad the sequence dimension with the {pad_keyword} value")
        pos = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if with_positions and (pos is None or not torch.is_tensor(pos) or tuple(pos.shape) != (1, 6)):
            return ProbeResult(True, f"{name} does not pad the position ids along with [batch, seq, ...] input")
    return ProbeResult(False, f"{name} pads [batch, seq, ...] input along the sequence with {pad_keyword}")


def _probe_targets(spec: PatchSpec) -> ProbeResult:
    import importlib

    reasons = []
    for target in spec.targets:
        module_name, _, qualname = target.partition(":")
        fn = inspect.unwrap(getattr(importlib.import_module(module_name), qualname))
        result = probe_function(fn, PAD_KEYWORD[module_name])
        if result.needed:
            return result
        reasons.append(result.reason)
    return ProbeResult(False, "; ".join(reasons))


def probe(spec: PatchSpec) -> ProbeResult:
    return _probe_targets(spec)


# --------------------------------------------------------------------------- wrapper


def _nd_wrapper(pad_keyword: str) -> Callable[..., Any]:
    signatures: dict[Any, inspect.Signature] = {}

    def wrapper(wrapped, instance, args, kwargs):
        import torch

        sig = signatures.get(wrapped)
        if sig is None:
            sig = signatures[wrapped] = inspect.signature(wrapped)
        bound = sig.bind(*args, **kwargs)
        first = next(iter(sig.parameters))
        x = bound.arguments.get(first)
        if not torch.is_tensor(x) or x.dim() <= 2:
            return wrapped(*args, **kwargs)
        bound.apply_defaults()
        fill = bound.arguments.get(pad_keyword, 0)
        batch, seq = x.shape[0], x.shape[1]
        index = torch.arange(seq, device=x.device).expand(batch, seq).contiguous()
        bound.arguments[first] = index
        bound.arguments[pad_keyword] = -1
        out = wrapped(*bound.args, **bound.kwargs)
        out_index = out[0]
        if out_index is index:  # sp_size <= 1: upstream returned its input unchanged
            return (x, *out[1:])
        where = out_index[0]  # every row of the index is the same arange
        picked = x.index_select(1, where.clamp(min=0))
        missing = (where < 0).view(1, -1, *([1] * (x.dim() - 2)))
        # torch.full semantics for the fill value (as skyrl's _pad_tensor): converted to x's dtype
        value = torch.full((), fill, dtype=x.dtype, device=x.device)
        return (torch.where(missing, value, picked), *out[1:])

    return wrapper


def install_verl(patcher: Patcher) -> None:
    wrapper = _nd_wrapper(PAD_KEYWORD[VERL])
    for target in patcher.spec.targets:
        patcher.wrap(target, wrapper)


def install_skyrl(patcher: Patcher) -> None:
    wrapper = _nd_wrapper(PAD_KEYWORD[SKYRL])
    for target in patcher.spec.targets:
        patcher.wrap(target, wrapper)
