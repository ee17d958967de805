"""The plugin-disabled engine: run by conftest's ``stock_runs`` fixture in a fresh interpreter
(``python -c <this file> MODEL OUT_DIR ROUTES``) with ``REPLAY_PLUGIN_DISABLE=1`` and
``REPLAY_TESTS_DIR`` (this directory, for ``scenarios``).

Phase 1, nothing of the plugin active: the batches of ``scenarios.py`` as stock vLLM serves them,
and what the client helper says about an output that asked for replay. Phase 2, the plugin
activated in this process with the capture patch not in place (skipped for its version range,
then toggled off): what an opted-in request gets. Results are pickled to OUT_DIR/stock.pkl.
"""

from __future__ import annotations

import os
import pickle
import sys


def _flat_rows(flat):
    return [(list(flat.token_ids[s:e]), list(flat.logprobs[s:e])) for s, e in zip(flat.start_indices, flat.end_indices)]


def _refusal(llm, scenarios):
    """Send one opted-in request; report the patch state, the error and what the engine ran."""
    from vllm import SamplingParams

    from replay_plugin import states

    engine = llm.llm_engine
    try:
        llm.generate(scenarios.PROMPTS[:1], SamplingParams(top_k=5, max_tokens=4, extra_args=scenarios.OPT_IN))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = [type(exc).__name__, str(exc), getattr(exc, "setting", None)]
    st = states.get("vllm.sample_support")
    return {
        "state": st.state if st else None,
        "error": error,
        "unfinished": engine.get_num_unfinished_requests(),
        "guard": states.get("vllm.request_guard").state,
    }


def _matrix_without_this_version(path: str) -> str:
    """A copy of the installed compat_matrix.yaml whose vllm.sample_support range excludes the
    installed vLLM (what a newer vLLM than the plugin supports looks like)."""
    import yaml

    from replay_plugin import compat

    with open(compat.default_path()) as fh:
        data = yaml.safe_load(fh)
    entry = data["patches"]["vllm.sample_support"]
    entry["versions"] = ">=0.0.1,<0.0.2"
    entry.pop("fingerprints", None)
    entry.pop("untested", None)
    with open(path, "w") as fh:
        yaml.safe_dump(data, fh)
    return path


def main(model: str, out_dir: str, routes: bool) -> None:
    sys.path.insert(0, os.environ["REPLAY_TESTS_DIR"])
    import scenarios
    from vllm import LLM, SamplingParams

    import replay_plugin
    from replay_plugin.vllm.client import support_of

    assert os.environ.get("REPLAY_PLUGIN_DISABLE") == "1"
    llm = LLM(model=model, **scenarios.engine_kwargs(routes=routes, fitted_by_hand=True))
    results: dict = {}

    prompts, params, plain = scenarios.mixed_batch(stock=True)
    outs = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
    results["mixed"] = {i: pickle.dumps(outs[i]) for i in plain}

    prompts, params = scenarios.listed_ids_batch(stock=True)
    first, listed = (r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False))
    results["listed_ids"] = {"rows": _flat_rows(first.logprobs), "listed": pickle.dumps(listed)}

    prompts, params = scenarios.plain_beside_listed_batch()
    plain = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0]
    results["plain_beside_listed"] = {"rows": _flat_rows(plain.logprobs), "alone": _flat_rows(alone.logprobs)}

    out = llm.generate(prompts[:1], SamplingParams(top_k=5, max_tokens=4, extra_args=scenarios.OPT_IN))
    try:
        support_of(out[0].outputs[0])
        results["missing"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results["missing"] = [type(exc).__name__, str(exc)]

    # Phase 2: the plugin comes up in this process, its capture patch outside its version range.
    del os.environ["REPLAY_PLUGIN_DISABLE"]
    os.environ["REPLAY_PLUGIN_MATRIX"] = _matrix_without_this_version(os.path.join(out_dir, "matrix.yaml"))
    replay_plugin.activate()
    results["skipped-version"] = _refusal(llm, scenarios)
    replay_plugin.deactivate()
    os.environ["REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT"] = "0"
    replay_plugin.activate()
    results["disabled"] = _refusal(llm, scenarios)

    with open(os.path.join(out_dir, "stock.pkl"), "wb") as fh:
        pickle.dump(results, fh)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
