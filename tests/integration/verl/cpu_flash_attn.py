"""Test-harness shim: a pure-torch CPU "flash_attention_2" for transformers 5.10.4, so that verl's
Ulysses sequence parallelism (which patches transformers' flash-attention path only:
``verl/models/transformers/monkey_patch.py``) runs on gloo ranks without a GPU. Never shipped.

Two attribute-level hooks in ``transformers.modeling_flash_attention_utils`` (no module is
replaced in sys.modules, no verl code is touched):

1. ``FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"]``: the one callable
   ``PreTrainedModel._check_and_adjust_attn_implementation`` / ``_flash_attn_import_error``
   consult to accept ``attn_implementation="flash_attention_2"`` at model ``__init__`` (the
   device check only runs with ``is_init_check=False``, i.e. ``set_attn_implementation``).
   With it True, no hub-kernel fallback is attempted and ``get_correct_attn_implementation``
   keeps "flash_attention_2".
2. ``_lazy_imports``: the loader ``lazy_import_flash_attention`` calls (a module global looked
   up at call time) for the kernel functions. For "flash_attention_2" it returns the pure-torch
   ``flash_attn_func`` / ``flash_attn_varlen_func`` below and transformers' own
   ``_pad_input`` / ``_unpad_input``; every other implementation goes to the original.
   transformers then derives its kwarg support map from our varlen signature itself
   (``_lazy_define_process_function``).

Everything above the kernel stays upstream: ``flash_attention_forward`` (the
``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]`` entry), the module global
``transformers.integrations.flash_attention._flash_attention_forward`` that verl's
``apply_monkey_patch`` replaces with ``_ulysses_flash_attention_forward`` (all-to-all over the
SP group, position_ids all-gather), and transformers' ``_flash_attention_forward`` (the
padding-free branch: ``_is_packed_sequence`` -> ``prepare_fa_kwargs_from_position_ids`` ->
``flash_varlen_fn(cu_seqlens...)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS = {"varlen": 0, "dense": 0, "varlen_shapes": []}
#: (total_q, heads, len(cu_seqlens) - 1) of the varlen calls, distinct, in order


def _attend(q, k, v, softmax_scale, causal):
    """One sequence: q [Lq, H, d], k/v [Lk, Hk, d] -> [Lq, H, d]; GQA by head groups, causal
    bottom-right aligned as flash-attn >= 2.1."""
    h, hk = q.shape[1], k.shape[1]
    if h != hk:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    mask = None
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=softmax_scale
    )
    return out.transpose(0, 1)


def _check(dropout_p, window_size, softcap):
    if dropout_p:
        raise NotImplementedError(f"cpu flash shim: dropout_p={dropout_p}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"cpu flash shim: window_size={window_size}")
    if softcap:
        raise NotImplementedError(f"cpu flash shim: softcap={softcap}")


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
):  # fmt: skip
    """flash_attn 2's varlen API: q [total_q, H, d], k/v [total_k, Hk, d], int32 cu_seqlens."""
    _check(dropout_p, window_size, softcap)
    CALLS["varlen"] += 1
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    shape = [int(q.shape[0]), int(q.shape[1]), len(cq) - 1]
    if shape not in CALLS["varlen_shapes"]:
        CALLS["varlen_shapes"].append(shape)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q {cq} / cu_seqlens_k {ck}")
    outs = [
        _attend(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], softmax_scale, causal)
        for i in range(len(cq) - 1)
    ]
    return torch.cat(outs, dim=0)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    deterministic=False,
):  # fmt: skip
    """flash_attn 2's dense API: q [B, Lq, H, d], k/v [B, Lk, Hk, d]."""
    _check(dropout_p, window_size, softcap)
    CALLS["dense"] += 1
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


_INSTALLED = False


def install() -> None:
    """Idempotent; call before the model is built (``from_pretrained``)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import transformers.modeling_flash_attention_utils as fau

    original = fau._lazy_imports

    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation == "flash_attention_2":
            return flash_attn_func, flash_attn_varlen_func, None, fau._pad_input, fau._unpad_input
        return original(implementation, attention_wrapper, allow_all_kernels=allow_all_kernels)

    fau.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"] = lambda *a, **k: True
    fau._lazy_imports = _lazy_imports
    _INSTALLED = True
