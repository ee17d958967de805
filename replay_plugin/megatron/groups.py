"""The tensor- and context-parallel process groups replay works with, from one source.

A model built with a custom ``pg_collection`` (megatron-core 0.16+: ``GPTModel(...,
pg_collection=...)``) communicates over those groups, not over ``parallel_state``'s; the route
driver (:mod:`replay_plugin.megatron.replay`) and sampler-support replay
(:mod:`replay_plugin.megatron.support`) must shard and reduce over the same ones. Both call
:func:`groups_of`: the model's ``pg_collection`` where it has one, ``parallel_state`` otherwise,
none for a single-process model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Groups", "groups_of"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """Tensor- and context-parallel groups (``None`` when the group has one rank) with sizes and
    this process's ranks; ``source`` says where they came from (``"pg_collection"``,
    ``"parallel_state"`` or ``"none"``)."""

    tp: Any
    tp_size: int
    tp_rank: int
    cp: Any
    cp_size: int
    cp_rank: int
    source: str


def _size_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _collection_of(model: Any) -> Any:
    """The first ``pg_collection`` (with ``tp`` and ``cp`` set) among ``model``'s modules:
    ``GPTModel`` / ``HybridModel`` keep the one they were built with (the default one is
    ``parallel_state``'s)."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    for module in modules:
        pg = getattr(module, "pg_collection", None)
        if pg is not None and getattr(pg, "tp", None) is not None and getattr(pg, "cp", None) is not None:
            return pg
    return None


def groups_of(model: Any = None, pg_collection: Any = None) -> Groups:
    """The groups of ``pg_collection``, else of ``model``'s ``pg_collection``, else Megatron's
    ``parallel_state`` (when initialised), else none.

    Args:
        model: a model chunk (any wrapper of a ``GPTModel``), a list of chunks (the first is
            used), or None.
        pg_collection: a ``ProcessGroupCollection`` (its ``tp`` and ``cp``), or None.
    """
    if isinstance(model, (list, tuple)):
        model = model[0] if model else None
    pg = pg_collection if pg_collection is not None else (_collection_of(model) if model is not None else None)
    if pg is not None:
        tp, cp, source = pg.tp, pg.cp, "pg_collection"
    else:
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            ps = None
        if ps is None or not ps.model_parallel_is_initialized():
            return Groups(None, 1, 0, None, 1, 0, "none")
        tp, cp, source = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(), "parallel_state"
    tp_size, tp_rank = _size_rank(tp)
    cp_size, cp_rank = _size_rank(cp)
    return Groups(tp if tp_size > 1 else None, tp_size, tp_rank, cp if cp_size > 1 else None, cp_size, cp_rank, source)
