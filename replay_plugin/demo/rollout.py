"""The demo's rollout: real vLLM on CPU, with the plugin's sampler support and routed experts.

Runs in a child process (``python -m replay_plugin.demo.rollout SPEC OUT``) so that vLLM's
process state is gone before the demo process applies Megatron's CPU shims; it writes a pickle
of :class:`Trajectory` records. The job opts in to capture
(``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in``) and each request asks for
``replay_sample_support``; ``enable_return_routed_experts`` returns the routes.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Trajectory:
    """One rollout: ``prompt`` and ``response`` int32 token ids; ``support`` the plugin's
    ``SupportRows`` (one row per response token); ``routes`` ``[len(prompt) + len(response) - 1,
    layers, topk]`` compact (None when the engine returned none)."""

    prompt: np.ndarray
    response: np.ndarray
    support: object
    routes: np.ndarray | None


@dataclass
class RolloutSpec:
    model: str
    prompts: list[str]
    max_tokens: int
    top_k: int
    top_p: float
    temperature: float
    seed: int
    routes: bool = True


def _progress(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_in_child(spec: RolloutSpec, workdir: str) -> list[Trajectory]:
    """Run :func:`generate` in a fresh interpreter and load its trajectories."""
    spec_path = os.path.join(workdir, "rollout-spec.json")
    out_path = os.path.join(workdir, "rollout.pkl")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump(spec.__dict__, fh)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS"] = "opt-in"
    proc = subprocess.run(
        [sys.executable, "-m", "replay_plugin.demo.rollout", spec_path, out_path],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"the vLLM rollout failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    for line in proc.stderr.splitlines():
        if line.startswith("[demo "):
            print(line, file=sys.stderr, flush=True)
    with open(out_path, "rb") as fh:
        return pickle.load(fh)


def generate(spec: RolloutSpec) -> list[Trajectory]:
    """Generate one response per prompt with vLLM in this process."""
    from vllm import LLM, SamplingParams

    from ..vllm import support_of

    start = time.time()
    width = spec.top_k + 16
    llm = LLM(
        model=spec.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=spec.seed,
        enable_return_routed_experts=spec.routes,
        max_num_seqs=max(8, len(spec.prompts)),
        max_logprobs=max(128, width),
    )
    _progress(f"vLLM engine up in {time.time() - start:.1f} s")
    params = SamplingParams(
        temperature=spec.temperature,
        top_k=spec.top_k,
        top_p=spec.top_p,
        max_tokens=spec.max_tokens,
        seed=spec.seed,
        extra_args={"replay_sample_support": True},
    )
    start = time.time()
    outputs = llm.generate(spec.prompts, params, use_tqdm=False)
    trajectories = []
    for out in outputs:
        completion = out.outputs[0]
        support = support_of(completion)
        if support is None:
            raise RuntimeError(
                "vLLM returned no sample_support: is the vllm.sample_support patch applied? "
                "(replay-plugin status --import vllm)"
            )
        routes = getattr(completion, "routed_experts", None)
        trajectories.append(
            Trajectory(
                prompt=np.asarray(out.prompt_token_ids, dtype=np.int32),
                response=np.asarray(completion.token_ids, dtype=np.int32),
                support=support,
                routes=None if routes is None else np.asarray(routes),
            )
        )
    tokens = sum(len(t.response) for t in trajectories)
    _progress(f"rollout: {len(trajectories)} prompts, {tokens} tokens in {time.time() - start:.1f} s")
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - the engine dies with this process anyway
        pass
    return trajectories


def main(argv: list[str]) -> int:
    # Run as ``-m``, this file is ``__main__``: use the package module's classes so that the
    # pickle names ``replay_plugin.demo.rollout.Trajectory``.
    from replay_plugin.demo import rollout

    spec_path, out_path = argv
    with open(spec_path, encoding="utf-8") as fh:
        spec = rollout.RolloutSpec(**json.load(fh))
    trajectories = rollout.generate(spec)
    with open(out_path, "wb") as fh:
        pickle.dump(trajectories, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
