"""Patch ``verl.rollout_support_padding``: the synthetic samples verl's V1 trainer pads a batch with
carry another sample's support rows.

Gap (verl 0.9.1, ``verl/trainer/ppo/padding_utils.py``): when the number of trajectories in a V1
(TransferQueue) batch is not a multiple of the data-parallel and mini-batch sizes,
``PPOTrainer._balance_batch`` calls ``upsample_batch_to_divisible_size``, which appends no-op
samples built by ``construct_minimal_padding_template``: a copy of the batch's first sample with
the fields verl knows rebuilt for a one-token response (``responses``, ``response_mask`` 0,
``rollout_log_probs``, ``routed_experts``, ``teacher_*``). Any other per-token field keeps the first
sample's rows, so ``rollout_sample_support`` has ``R_0`` rows for a response of one token and the
engines refuse the whole batch (one row per response token). verl's failed groups stay sampleable
and are "padded downstream" by default, so this happens in ordinary runs.

The patch gives the template's ``rollout_sample_support`` one row of ``-1`` (no support: the token
bears no loss, its response mask is 0), in the field's dtype and width. Templates without the field
are untouched.
"""

from __future__ import annotations

from ..patcher import Patcher
from .switch import BATCH_SUPPORT_KEY


def _template(wrapped, instance, args, kwargs):
    sample, tag = wrapped(*args, **kwargs)
    rows = sample.get(BATCH_SUPPORT_KEY) if isinstance(sample, dict) else None
    if rows is not None:
        import numpy as np
        import torch

        length = len(sample["responses"])
        if isinstance(rows, torch.Tensor):
            sample[BATCH_SUPPORT_KEY] = rows.new_full((length, *rows.shape[1:]), -1)
        else:
            rows = np.asarray(rows)
            sample[BATCH_SUPPORT_KEY] = np.full((length, *rows.shape[1:]), -1, dtype=rows.dtype)
    return sample, tag


def install(patcher: Patcher) -> None:
    patcher.wrap("construct_minimal_padding_template", _template)
