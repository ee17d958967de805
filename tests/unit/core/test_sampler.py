"""check_replayable: which sampler and engine settings support replay can reproduce."""

from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace
from typing import Any

import pytest

from replay_plugin.core.sampler import check_replayable


@dataclasses.dataclass
class FakeSamplingParams:
    """The fields of ``vllm.SamplingParams`` (0.32) that matter here, with vLLM's defaults."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    allowed_token_ids: list | None = None
    bad_words: list | None = None
    min_tokens: int = 0
    seed: int | None = None
    structured_outputs: Any = None


BASE = {"temperature": 1.0, "top_k": 20}

ACCEPT = [
    {},
    {"top_p": 0.9},
    {"min_p": 0.05},
    {"top_p": 0.95, "min_p": 0.1, "temperature": 0.7},
    {"bad_words": ["foo"]},
    {"allowed_token_ids": [1, 2, 3]},
    {"min_tokens": 4, "seed": 3},
    {"logit_bias": {}},
    {"logit_bias": {5: 0.0}},
    {"top_k": 2},
    {"temperature": 0.01},
]

REFUSE = [
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": 0.005}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1}, "top_k"),
    ({"top_k": None}, "top_k"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -0.2}, "frequency_penalty"),
    ({"logit_bias": {5: 2.0}}, "logit_bias"),
]


@pytest.mark.parametrize("as_mapping", [True, False])
@pytest.mark.parametrize("extra", ACCEPT)
def test_accepted(extra, as_mapping):
    params = {**BASE, **extra}
    assert check_replayable(params if as_mapping else FakeSamplingParams(**params)) is None


@pytest.mark.parametrize("as_mapping", [True, False])
@pytest.mark.parametrize("extra,setting", REFUSE)
def test_refused_names_the_setting(extra, setting, as_mapping):
    params = {**BASE, **extra}
    with pytest.raises(ValueError, match=f"'{setting}'"):
        check_replayable(params if as_mapping else FakeSamplingParams(**params))


def test_mapping_defaults_are_vllm_defaults():
    with pytest.raises(ValueError, match="'top_k'"):  # vLLM's default top_k=0 is unbounded
        check_replayable({"temperature": 1.0})
    with pytest.raises(ValueError, match="'logits_processors'"):
        check_replayable({**BASE, "logits_processors": [object()]})


def test_width():
    assert check_replayable(BASE, width=32) is None
    with pytest.raises(ValueError, match="'top_k'.*width 16"):
        check_replayable(BASE, width=16)


class LogprobsMode(enum.Enum):
    PROCESSED = "processed_logprobs"
    RAW = "raw_logprobs"


GOOD_ENGINE = {"logprobs_mode": "processed_logprobs", "max_logprobs": 20, "speculative_config": None}

ENGINE_REFUSE = [
    ({"logprobs_mode": "raw_logprobs"}, "logprobs_mode"),
    ({"logprobs_mode": "processed_logits"}, "logprobs_mode"),
    ({"max_logprobs": 19}, "max_logprobs"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, "speculative_config"),
    ({"logits_processors": ["my.module:Proc"]}, "logits_processors"),
]


@pytest.mark.parametrize("extra,setting", ENGINE_REFUSE)
def test_engine_refused(extra, setting):
    with pytest.raises(ValueError, match=f"'{setting}'"):
        check_replayable(BASE, {**GOOD_ENGINE, **extra})


def test_engine_accepted_in_vllm_shapes():
    assert check_replayable(BASE, GOOD_ENGINE) is None
    assert check_replayable(BASE, {**GOOD_ENGINE, "max_logprobs": -1}) is None
    # VllmConfig-like: model settings on model_config, speculative config on the top object
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(logprobs_mode=LogprobsMode.PROCESSED, max_logprobs=64, logits_processors=None),
        speculative_config=None,
    )
    assert check_replayable(BASE, vllm_config) is None
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vllm_config))
    assert check_replayable(BASE, llm) is None
    vllm_config.model_config.logprobs_mode = LogprobsMode.RAW
    with pytest.raises(ValueError, match="'logprobs_mode'"):
        check_replayable(BASE, llm)
    vllm_config.model_config.logprobs_mode = LogprobsMode.PROCESSED
    vllm_config.speculative_config = SimpleNamespace(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="'speculative_config'"):
        check_replayable(BASE, llm)
