"""Harness: verl 0.9.1's real ``FSDPEngineWithLMHead`` on CPU, world size 1, gloo.

Test-harness only: the CPU shims below (a verl platform for device "cpu", a ``torch.cpu``
stand-in with no-op memory calls) live here, never in the shipped package, and no verl module is
replaced in ``sys.modules``. Everything else is verl's own code: its engine, configs, padding
functions, ``DataProto`` conversion and ``ppo_loss``.

API
---
``register_cpu_platform()``
    Idempotent. Registers :class:`CPUPlatform` (``PlatformRegistry.register("cpu")``) and makes it
    verl's platform (``set_platform``): device_name "cpu", communication backend "gloo",
    ``current_device() -> "cpu"`` (verl passes it to ``.to()``), no-op seeds, cache and profiler.
    Must run before ``verl.workers.engine`` is imported: ``transformer_impl`` reads the device
    name at import (raises if that already happened with another device).
``init_dist()``
    A world-1 gloo process group if none exists (MASTER_ADDR 127.0.0.1, a free port).
``save_tiny_model(directory, family="qwen3_moe", seed=0, vocab_size=128, **config_overrides)``
    ``tests/integration/fsdp/hf_moe_models.build(family, attn="sdpa", ...)`` saved with
    ``save_pretrained`` plus a local word-level tokenizer (ids 0/1/2 = pad/bos/eos as in
    hf_moe_models; no hub access). Returns ``directory``. Default qwen3_moe: hidden 32, 3 layers
    (layer 1 dense), 8 experts, top-2.
``build_engine(model_dir, *, use_remove_padding=True, gradient_checkpointing=False,
router_replay_mode=None, dtype="float32", micro_batch_size=2, lr=1e-3, attn_implementation="sdpa",
**engine_overrides)``
    An initialized ``FSDPEngineWithLMHead`` (strategy fsdp2, sdpa unless ``attn_implementation``
    says otherwise: ``"flash_attention_2"`` after ``cpu_flash_attn.install()`` for Ulysses SP,
    ``use_torch_compile=False``,
    fixed micro-batches of ``micro_batch_size`` for training and inference, params/compute in
    ``dtype``). ``router_replay_mode`` ("disabled", "R2", "R3") goes to
    ``FSDPEngineConfig.router_replay`` (``EngineRouterReplayConfig``); stock verl's FSDP engine
    does not read it. ``engine_overrides`` are further ``FSDPEngineConfig`` fields.
``make_batch(prompts, responses, pad_id, *, response_masks=None, temperature=1.0,
prompt_length=None, response_length=None, response_fields=(), **extra_fields)``
    The rollout batch as verl's agent loop builds it (prompts left-padded to ``prompt_length``,
    default the longest; responses right-padded; ``response_mask`` = ``response_masks`` times the
    response attention; ``position_ids`` by ``compute_position_id_with_mask``; non-tensor
    ``uid``, ``__num_turns__``, ``multi_modal_inputs``; meta ``temperature``,
    ``global_token_num``, ``images_seqlens``) as a ``DataProto``, then exactly what
    ``RayPPOTrainer`` does before calling a worker: ``DataProto.to_tensordict()`` and
    ``left_right_2_no_padding``. The result is the stage-independent part of the TensorDict the
    worker receives; :func:`log_prob_batch` / :func:`update_batch` add the stage's fields.
    ``extra_fields``: per-sample sequences (or an already padded ``[B, width, ...]`` tensor).
    Sequence-layout fields (anything not in ``RESPONSE_FIELDS`` / ``response_fields``, e.g.
    ``routed_experts`` with rows ``[P_i + R_i, L, K]``) are placed like the agent loop places
    ``routed_experts``: from the first real prompt token of the padded ``[B, P + R, ...]`` grid,
    zeros elsewhere (a sample may give fewer than ``P_i + R_i`` rows). verl's
    ``left_right_2_no_padding`` then nests ``routed_experts`` (and ``teacher_ids`` /
    ``teacher_logprobs``) to ``[B, j, ...]``; any other sequence-layout field stays padded
    ``[B, P + R, ...]``, as it would in verl. Response-layout fields (``old_log_probs``,
    ``advantages``, ...: rows ``R_i``) go right-padded into ``[B, R, ...]``. Values keep their
    dtype (verl's agent loop uses int16 for ``routed_experts``).
``log_prob_batch(batch, temperature=None, enable_routing_replay=None)`` /
``update_batch(batch, ...)``
    Shallow copies with the non-tensor fields ``_compute_old_log_prob`` (calculate_entropy=True,
    calculate_sum_pi_squared=False, compute_loss=False) resp. ``_update_actor`` (multi_turn,
    temperature, calculate_entropy, distillation flags, global/mini batch size, epochs, seed,
    dataloader_kwargs, compute_loss=True) add; ``enable_routing_replay`` is what the worker's
    ``_with_routing_replay_flag`` would set (stock verl sets nothing for FSDP: default None).
``infer(engine, batch, temperature=1.0, **kw)``
    The compute_log_prob path (``BatchData`` DP chunk, ``TrainingWorker.infer_batch``'s default
    keys, ``engine.eval_mode()``, ``engine.infer_batch(loss_function=None)``), outputs converted
    back with verl's ``no_padding_2_padding``: ``{"log_probs": [B, R], "entropy": [B, R]}``
    (float32, zeros beyond each response), ``"raw"`` (the engine's nested per-sequence outputs)
    and ``"batch"`` (the TensorDict handed to ``engine.infer_batch``).
``infer_logprobs(engine, batch, temperature=1.0, **kw)``
    Per-sample response log-probs: a list of 1-D tensors of length ``R_i``.
``train_step(engine, batch, *, old_log_probs=None, advantages=None, temperature=1.0,
mini_batch_size=None, actor_overrides=None, loss_function=None, enable_routing_replay=None)``
    One ``update_actor``: ``TrainingWorker.train_mini_batch`` (``tu.make_iterator``) and
    ``train_batch`` (default keys, ``engine.train_mode()``, ``engine.train_batch``, lr scheduler
    step) with ``partial(ppo_loss, config=FSDPActorConfig(..., **actor_overrides))``
    (``McoreActorConfig`` for a Megatron engine; its
    ``calculate_entropy`` / ``entropy_coeff``, ``ppo_epochs``, ``data_loader_seed``, ``shuffle``
    set the batch fields as ``_update_actor`` does). ``old_log_probs`` /
    ``advantages``: per-sample 1-D sequences or ``[B, R]``; defaults: the batch's own fields if
    present, else ``infer`` log-probs (on-policy, ratio 1) and advantages 1 on the response mask.
    Returns ``{"loss", "grad_norm", "lr", "metrics"}`` (floats; ``loss`` summed over
    micro-batches as the worker reports it).
``hf_response_logprobs(model, prompts, responses, temperature=1.0)``
    Reference: a plain HF forward per sample, ``log_softmax(logits / T)`` at the response tokens.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import types
from collections.abc import Sequence
from functools import partial
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
FSDP_DIR = os.path.join(TESTS, "integration", "fsdp")

#: fields with one row per response token ([B, R, ...]); every other extra field is per sequence
RESPONSE_FIELDS = (
    "old_log_probs",
    "advantages",
    "returns",
    "ref_log_prob",
    "rollout_log_probs",
    "rollout_is_weights",
    "token_level_scores",
    "token_level_rewards",
    "values",
    "rm_scores",
)

_TORCH_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16"}


# =======================================================================================
# platform and process group


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module (memory
    statistics, cache, RNG state), as no-ops or CPU equivalents."""

    def __init__(self) -> None:
        super().__init__("replay_tests_cpu_device")

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(*_a, **_k) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*_a, **_k) -> None:
        return None

    @staticmethod
    def mem_get_info(*_a, **_k) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def set_per_process_memory_fraction(*_a, **_k) -> None:
        return None

    @staticmethod
    def manual_seed(_seed: int) -> None:
        return None

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(*_a, **_k):
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *_a, **_k) -> None:
        import torch

        torch.set_rng_state(state)


_PLATFORM_CLS = None


def _platform_cls():
    global _PLATFORM_CLS
    if _PLATFORM_CLS is not None:
        return _PLATFORM_CLS
    from verl.plugin.platform import PlatformBase

    device_module = _CPUDeviceModule()

    class CPUPlatform(PlatformBase):
        """verl platform for device "cpu" (test harness only)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self):  # verl passes it to .to(): a device, not an index
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            return None

        def manual_seed_all(self, seed: int) -> None:
            return None

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "REPLAY_TESTS_CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    _PLATFORM_CLS = CPUPlatform
    return CPUPlatform


def register_cpu_platform():
    """Make verl's platform the CPU one (idempotent); returns the platform instance."""
    from verl.plugin.platform import PlatformRegistry, set_platform
    from verl.plugin.platform import platform_manager as pm

    cls = _platform_cls()
    if PlatformRegistry.get("cpu") is not cls:
        PlatformRegistry.register(platform="cpu")(cls)
    if not isinstance(pm._current_platform, cls):
        set_platform(cls())
    impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if impl is not None and getattr(impl, "device_name", "cpu") != "cpu":
        raise RuntimeError(
            "verl.workers.engine was imported before register_cpu_platform(): its FSDP engine "
            f"read device_name={impl.device_name!r} at import; call register_cpu_platform() first"
        )
    return pm._current_platform


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist() -> None:
    """A world-1 gloo process group, unless one exists."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))


# =======================================================================================
# tiny model


def _hf_moe_models():
    if FSDP_DIR not in sys.path:
        sys.path.insert(0, FSDP_DIR)
    import hf_moe_models

    return hf_moe_models


def save_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, then
    ``t3`` ... (whitespace-split), saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def save_tiny_model(
    directory: str, family: str = "qwen3_moe", seed: int = 0, vocab_size: int = 128, **config_overrides: Any
) -> str:
    """``hf_moe_models.build(family, seed, attn="sdpa", ...)`` and a tokenizer, saved to
    ``directory`` (float32 safetensors); returns ``directory``."""
    H = _hf_moe_models()
    model = H.build(family, seed=seed, attn="sdpa", vocab_size=vocab_size, **config_overrides)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory, vocab_size)
    return directory


# =======================================================================================
# engine


def build_engine(
    model_dir: str,
    *,
    use_remove_padding: bool = True,
    gradient_checkpointing: bool = False,
    router_replay_mode: str | None = None,
    dtype: str = "float32",
    micro_batch_size: int = 2,
    lr: float = 1e-3,
    attn_implementation: str = "sdpa",
    **engine_overrides: Any,
):
    """An initialized ``FSDPEngineWithLMHead`` on the CPU platform (module docstring)."""
    register_cpu_platform()
    init_dist()

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    precision = _TORCH_DTYPES[dtype]
    model_config = HFModelConfig(
        path=model_dir,
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
        override_config={"attn_implementation": attn_implementation},
    )
    engine_kwargs: dict[str, Any] = dict(
        strategy="fsdp2",
        use_torch_compile=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        infer_micro_batch_size_per_gpu=micro_batch_size,
        use_remove_padding=use_remove_padding,  # TrainingWorker copies the model config's flag
        model_dtype=precision,
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    if router_replay_mode is not None:
        engine_kwargs["router_replay"] = EngineRouterReplayConfig(mode=router_replay_mode)
    engine_kwargs.update(engine_overrides)
    engine = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=FSDPEngineConfig(**engine_kwargs),
        optimizer_config=FSDPOptimizerConfig(lr=lr),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


# =======================================================================================
# batches


def _as_rows(value: Any):
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return torch.as_tensor(value)


def _place(name: str, value: Any, starts: list[int], lengths: list[int], width: int):
    """Per-sample rows into a zero ``[B, width, ...]`` grid, sample i from ``starts[i]``."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == len(starts):
        if value.shape[1] != width:
            raise ValueError(f"{name}: padded tensor has width {value.shape[1]}, expected {width}")
        return value
    rows = [_as_rows(v) for v in value]
    if len(rows) != len(starts):
        raise ValueError(f"{name}: {len(rows)} samples, batch has {len(starts)}")
    tail = tuple(rows[0].shape[1:])
    out = torch.zeros((len(rows), width, *tail), dtype=rows[0].dtype)
    for i, (row, start, length) in enumerate(zip(rows, starts, lengths, strict=True)):
        if tuple(row.shape[1:]) != tail:
            raise ValueError(f"{name}: sample {i} rows have shape {tuple(row.shape[1:])}, sample 0 {tail}")
        if row.shape[0] > length:
            raise ValueError(f"{name}: sample {i} has {row.shape[0]} rows, more than its {length} tokens")
        out[i, start : start + row.shape[0]] = row
    return out


def make_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    *,
    response_masks: Sequence[Sequence[int]] | None = None,
    temperature: float = 1.0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    response_fields: Sequence[str] = (),
    **extra_fields: Any,
):
    """The rollout batch after ``DataProto.to_tensordict()`` and ``left_right_2_no_padding``."""
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(prompts)
    if len(responses) != B or B == 0:
        raise ValueError(f"{B} prompts, {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("verl needs a non-empty prompt per sample (no_padding_2_padding)")
    P = prompt_length or max(len(p) for p in prompts)
    R = response_length or max(len(r) for r in responses)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask_values = torch.zeros((B, R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) > P or len(r) > R:
            raise ValueError(f"sample {i}: prompt {len(p)} > {P} or response {len(r)} > {R}")
        prompt_ids[i, P - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        prompt_attn[i, P - len(p) :] = 1
        response_ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        response_attn[i, : len(r)] = 1
        mask = [1] * len(r) if response_masks is None else list(response_masks[i])
        if len(mask) != len(r):
            raise ValueError(f"sample {i}: response mask has {len(mask)} entries, response {len(r)}")
        response_mask_values[i, : len(r)] = torch.as_tensor(mask, dtype=torch.long)
    # as the agent loop: response_mask = mask * response attention; input = prompt ++ response
    response_mask = response_mask_values * response_attn
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    position_ids = compute_position_id_with_mask(attention_mask)

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    response_keys = set(RESPONSE_FIELDS) | set(response_fields)
    seq_starts = [P - len(p) for p in prompts]
    seq_lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    for name, value in extra_fields.items():
        if name in tensors:
            raise ValueError(f"{name} is built by make_batch")
        if name in response_keys:
            tensors[name] = _place(name, value, [0] * B, [len(r) for r in responses], R)
        else:
            tensors[name] = _place(name, value, seq_starts, seq_lengths, P + R)

    non_tensor = {
        "uid": np.array([f"uid-{i}" for i in range(B)], dtype=object),
        "__num_turns__": np.full(B, 2, dtype=np.int32),
        "multi_modal_inputs": np.array([{} for _ in range(B)], dtype=object),
    }
    meta_info = {
        "temperature": temperature,
        "global_token_num": attention_mask.sum(dim=-1).tolist(),
        "images_seqlens": [],
    }
    proto = DataProto(batch=TensorDict(tensors, batch_size=[B]), non_tensor_batch=non_tensor, meta_info=meta_info)
    return left_right_2_no_padding(proto.to_tensordict())


def _copy(batch):
    return batch.copy()  # shallow: new keys/non-tensor values do not reach the caller's batch


def log_prob_batch(batch, temperature: float | None = None, enable_routing_replay: bool | None = None):
    """``_compute_old_log_prob``'s fields (and the worker's routing-replay flag, if given)."""
    from verl.utils import tensordict_utils as tu

    td = _copy(batch)
    if temperature is not None:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    if enable_routing_replay is not None:
        tu.assign_non_tensor_data(td, "enable_routing_replay", enable_routing_replay)
    return td


def update_batch(
    batch,
    *,
    temperature: float | None = None,
    mini_batch_size: int | None = None,
    calculate_entropy: bool = False,
    epochs: int = 1,
    seed: int = 42,
    shuffle: bool = False,
    enable_routing_replay: bool | None = None,
):
    """``_update_actor``'s fields (ppo_mini_batch_size * rollout.n = ``mini_batch_size``,
    default the whole batch)."""
    from verl.utils import tensordict_utils as tu

    td = _copy(batch)
    mini = mini_batch_size or td.batch_size[0]
    tu.assign_non_tensor(td, multi_turn=False)
    if temperature is not None:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(
        td,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=epochs,
        seed=seed,
        dataloader_kwargs={"shuffle": shuffle},
        compute_loss=True,
    )
    if enable_routing_replay is not None:
        tu.assign_non_tensor_data(td, "enable_routing_replay", enable_routing_replay)
    return td


def _dp_chunk(engine, td):
    """What the worker group's nd-compute dispatch hands this rank (``BatchData.chunk``, then
    Ray's pickling)."""
    from verl.protocol import BatchData

    chunks = BatchData(td).chunk(chunks=engine.get_data_parallel_size())
    # Ray pickles the (locked, consolidated) chunk to the worker, which gets an unlocked copy
    return pickle.loads(pickle.dumps(chunks[engine.get_data_parallel_rank()]))


def _worker_defaults(engine, td, *, infer: bool) -> None:
    """The keys ``TrainingWorker.infer_batch`` / ``train_batch`` inject when absent."""
    from verl.utils import tensordict_utils as tu

    cfg = engine.engine_config
    defaults = dict(
        use_remove_padding=engine.model_config.get("use_remove_padding", False),
        use_dynamic_bsz=cfg.use_dynamic_bsz,
        max_token_len_per_gpu=cfg.infer_max_token_len_per_gpu if infer else cfg.max_token_len_per_gpu,
        micro_batch_size_per_gpu=cfg.infer_micro_batch_size_per_gpu if infer else cfg.micro_batch_size_per_gpu,
        use_fused_kernels=cfg.use_fused_kernels,
    )
    for key, val in defaults.items():
        if key not in td.keys():
            tu.assign_non_tensor(td, **{key: val})


def infer(
    engine,
    batch,
    temperature: float = 1.0,
    *,
    enable_routing_replay: bool | None = None,
    loss_function=None,
) -> dict:
    """compute_log_prob through ``engine.infer_batch``; padded ``log_probs`` / ``entropy``
    ``[B, R]`` and the engine's nested outputs as ``raw``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = _dp_chunk(engine, log_prob_batch(batch, temperature, enable_routing_replay))
    compute_loss = tu.get(td, key="compute_loss", default=True)
    disable_auto_offload = tu.get(td, key="disable_auto_offload", default=False)
    tu.pop(td, key="no_lora_adapter", default=False)
    _worker_defaults(engine, td, infer=True)
    with engine.eval_mode(disable_auto_offload=disable_auto_offload):
        output = engine.infer_batch(td, loss_function=loss_function if compute_loss else None)
    raw = output["model_output"]
    out = {key: no_padding_2_padding(raw[key], td).float() for key in ("log_probs", "entropy") if key in raw}
    out["raw"] = raw
    out["batch"] = td
    return out


def _response_lengths(batch) -> list[int]:
    P = batch["prompts"].shape[1]
    return batch["attention_mask"][:, P:].sum(dim=1).tolist()


def infer_logprobs(engine, batch, temperature: float = 1.0, **kwargs: Any) -> list:
    """Per-sample response log-probs (1-D, length ``R_i``) from ``engine.infer_batch``."""
    padded = infer(engine, batch, temperature, **kwargs)["log_probs"]
    return [padded[i, :n] for i, n in enumerate(_response_lengths(batch))]


def _response_tensor(name: str, value: Any, batch):
    import torch

    B, R = batch["responses"].shape
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (B, R):
        return value.float()
    return _place(name, value, [0] * B, _response_lengths(batch), R).float()


def _aggregate(metrics: dict) -> dict:
    from verl.utils.metric.utils import Metric

    out = {}
    for key, val in metrics.items():
        if isinstance(val, list) and val and isinstance(val[0], Metric):
            out[key] = float(Metric.aggregate_dp(val))
        elif isinstance(val, Metric):
            out[key] = float(val.aggregate())
        elif isinstance(val, list) and val:
            out[key] = float(sum(float(v) for v in val) / len(val))
        else:
            out[key] = val
    return out


def train_step(
    engine,
    batch,
    *,
    old_log_probs: Any = None,
    advantages: Any = None,
    temperature: float = 1.0,
    mini_batch_size: int | None = None,
    actor_overrides: dict | None = None,
    loss_function=None,
    enable_routing_replay: bool | None = None,
) -> dict:
    """One ``update_actor`` with verl's ``ppo_loss`` (module docstring)."""
    import torch
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    td = _copy(batch)
    if "old_log_probs" not in td.keys() or old_log_probs is not None:
        if old_log_probs is None:
            old_log_probs = infer(engine, batch, temperature)["log_probs"]
        td["old_log_probs"] = _response_tensor("old_log_probs", old_log_probs, td)
    if "advantages" not in td.keys() or advantages is not None:
        if advantages is None:
            advantages = td["response_mask"].float()
        td["advantages"] = _response_tensor("advantages", advantages, td)
    mini = mini_batch_size or td.batch_size[0]
    megatron = engine.engine_config.strategy == "megatron"
    actor_kwargs: dict[str, Any] = (
        {} if megatron else {"use_torch_compile": False, "use_remove_padding": engine.model_config.use_remove_padding}
    )
    actor_config = (McoreActorConfig if megatron else FSDPActorConfig)(
        strategy=engine.engine_config.strategy,
        ppo_mini_batch_size=mini,
        ppo_micro_batch_size_per_gpu=engine.engine_config.micro_batch_size_per_gpu,
        rollout_n=1,
        **actor_kwargs,
        **(actor_overrides or {}),
    )
    if loss_function is None:
        loss_function = partial(ppo_loss, config=actor_config)
    td = update_batch(
        td,
        temperature=temperature,
        mini_batch_size=mini,
        # as _update_actor: actor.calculate_entropy or actor.entropy_coeff != 0
        calculate_entropy=actor_config.calculate_entropy or actor_config.entropy_coeff != 0.0,
        epochs=actor_config.ppo_epochs,
        seed=actor_config.data_loader_seed,
        shuffle=actor_config.shuffle,
        enable_routing_replay=enable_routing_replay,
    )
    td = _dp_chunk(engine, td)

    # TrainingWorker.train_mini_batch
    disable_auto_offload = tu.pop(td, key="disable_auto_offload", default=False)
    mini_batch_size_ = tu.pop(td, key="mini_batch_size", default=None)
    tu.pop(td, key="num_mini_batch", default=None)
    epochs = tu.pop(td, key="epochs", default=1)
    seed = tu.pop(td, key="seed", default=42)
    dataloader_kwargs = tu.pop(td, key="dataloader_kwargs", default={})
    per_dp = mini_batch_size_ // engine.get_data_parallel_size()
    dataloader = tu.make_iterator(
        td,
        mini_batch_size=per_dp,
        epochs=epochs,
        seed=seed + engine.get_data_parallel_rank(),
        dataloader_kwargs=dataloader_kwargs,
    )
    total = td.shape[0] // per_dp * epochs
    results = []
    with engine.train_mode(disable_auto_offload=disable_auto_offload):
        for idx, mini_td in enumerate(dataloader):
            tu.assign_non_tensor(
                mini_td,
                global_token_num=NonTensorData(mini_td["input_ids"].offsets().diff().tolist()),
                update_lr_scheduler=idx == total - 1,
                disable_auto_offload=True,
            )
            # TrainingWorker.train_batch
            _worker_defaults(engine, mini_td, infer=False)
            with engine.train_mode(disable_auto_offload=True):
                output = engine.train_batch(mini_td, loss_function=loss_function)
            lr = engine.lr_scheduler_step() if tu.get(mini_td, key="update_lr_scheduler", default=False) else None
            metrics = output["metrics"]
            grad_norm = metrics.pop("grad_norm", None)
            results.append(
                {
                    "loss": float(torch.sum(torch.tensor(output["loss"]))),
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "lr": lr,
                    "metrics": _aggregate(metrics),
                }
            )
    return results[0] if len(results) == 1 else {"mini_batches": results, **results[-1]}


# =======================================================================================
# reference


def hf_response_logprobs(model, prompts, responses, temperature: float = 1.0) -> list:
    """``log_softmax(logits / T)`` of a plain HF forward at each sample's response tokens."""
    import torch

    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            ids = torch.as_tensor([list(p) + list(r)], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            n = len(p)
            out.append(logp[n - 1 : n - 1 + len(r)].gather(-1, torch.as_tensor(list(r))[:, None]).squeeze(-1))
    return out
