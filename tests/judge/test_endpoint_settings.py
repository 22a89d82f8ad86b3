"""`EndpointSettings`, the one home of the endpoint settings, and the one doc of every config field (`trl_ext.fields`)."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from transformers import HfArgumentParser
from trl import GRPOConfig
from trl.experimental.async_grpo import AsyncGRPOConfig

from trl_ext.judge import AsyncChatClient
from trl_ext.judge.endpoint import RETRIED_ERRORS, EndpointSettings
from trl_ext.rewards import RubricJudgeConfig, RubricJudgeReward, ServedRewardModelScorer
from trl_ext.trainers import AsyncJudgeCreditConfig, AsyncRLMTConfig, AsyncStepwiseRLMConfig
from trl_ext.trainers.judge_credit_config import JudgeCreditConfig
from trl_ext.trainers.rlmt_config import RLMTConfig
from trl_ext.trainers.stepwise_rlm_config import StepwiseRLMConfig

from ..utils import cpu_config_kwargs

CONFIGS = [
    EndpointSettings,
    RubricJudgeConfig,
    JudgeCreditConfig,
    RLMTConfig,
    StepwiseRLMConfig,
    AsyncJudgeCreditConfig,
    AsyncRLMTConfig,
    AsyncStepwiseRLMConfig,
]


def trl_ext_fields(config) -> list[str]:
    """The fields trl-ext declares for ``config`` (its own and its trl-ext bases'), not TRL's."""
    return [item.name for item in fields(config) if item.metadata.get("trl_ext")]


def judge_config(tmp_path, **overrides):
    settings = {"judge_base_url": "http://127.0.0.1:1/v1", "judge_model": "m", **overrides}
    return JudgeCreditConfig(**cpu_config_kwargs(str(tmp_path)), **settings)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config.__name__)
def test_every_config_field_has_one_doc(config):
    trl_fields = set(GRPOConfig.__dataclass_fields__) | set(AsyncGRPOConfig.__dataclass_fields__)
    ours = trl_ext_fields(config)
    intro, parameters = config.__doc__.split("    Parameters:\n")  # one section, written by document_fields
    for item in fields(config):
        if item.name in trl_fields and item.name not in ours:
            continue  # TRL's own fields, documented by TRL
        help_text = item.metadata.get("help")
        assert help_text, f"{config.__name__}.{item.name} has no help text"
        assert item.name in ours, item.name
        assert parameters.count(f"        {item.name} (`") == 1, item.name
        assert " ".join(help_text.split()) in " ".join(parameters.split()), item.name
        assert not re.search(rf"^\s+{item.name} \(`", intro, re.MULTILINE), f"{item.name} documented twice"


@pytest.mark.parametrize("config", CONFIGS[2:], ids=lambda c: c.__name__)
def test_configs_keep_their_command_line_help(config):
    parser = HfArgumentParser(config)
    helps = {action.dest: action.help for action in parser._actions}
    for name in trl_ext_fields(config):
        assert helps[name] == config.__dataclass_fields__[name].metadata["help"]


def test_the_judge_endpoint_fields_mirror_the_settings(tmp_path):
    config = judge_config(tmp_path, judge_max_tokens=64, judge_timeout=5.0)
    endpoint = config.judge_endpoint()
    assert endpoint == EndpointSettings(
        "http://127.0.0.1:1/v1", "m", timeout=5.0, request_params={"temperature": 0.0, "max_tokens": 64}
    )
    for name in ("api_key_env", "max_concurrency", "max_retries", "structured_output"):
        mirrored = JudgeCreditConfig.__dataclass_fields__[f"judge_{name}"]
        setting = EndpointSettings.__dataclass_fields__[name]
        assert mirrored.default == setting.default
        assert mirrored.metadata["help"].startswith(f"Judge endpoint: {setting.metadata['help']}")
    assert RETRIED_ERRORS in EndpointSettings.__dataclass_fields__["max_retries"].metadata["help"]
    client = AsyncChatClient.from_settings(endpoint)
    assert (client.base_url, client.model, client.timeout, client.request_params) == (
        "http://127.0.0.1:1/v1",
        "m",
        5.0,
        {"temperature": 0.0, "max_tokens": 64},
    )


def test_the_rubric_judge_and_the_served_scorer_derive_their_endpoint():
    config = RubricJudgeConfig(max_concurrency=4)
    assert config.endpoint() == EndpointSettings(
        "http://127.0.0.1:8000/v1", "judge", max_concurrency=4, request_params={"temperature": 0.0}
    )
    assert RubricJudgeReward(config).client.settings == config.endpoint()
    served = ServedRewardModelScorer("http://127.0.0.1:1", "rm", timeout=5)
    assert served.settings == EndpointSettings(
        "http://127.0.0.1:1", "rm", api_key_env=None, max_concurrency=16, timeout=5, max_retries=3
    )
    with pytest.raises(TypeError, match="structured_output"):
        ServedRewardModelScorer("http://127.0.0.1:1", "rm", structured_output="on")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url='127.0.0.1:8000/v1': set it"),
        ({"model": ""}, "model is not set"),
        ({"max_concurrency": 0}, "max_concurrency=0 must be >= 1"),
        ({"timeout": 0}, "timeout=0 must be > 0"),
        ({"max_retries": 1.5}, "max_retries=1.5 must be an integer"),
        ({"structured_output": "yes"}, "structured_output='yes': use one of"),
        ({"request_params": "temperature=0"}, "request_params='temperature=0' must be a dict"),
    ],
)
def test_bad_settings_are_named_as_the_user_set_them(tmp_path, overrides, message):
    settings = {"base_url": "http://127.0.0.1:1/v1", "model": "m", **overrides}
    with pytest.raises(ValueError, match=re.escape(message)):
        EndpointSettings(**settings)
    if "request_params" not in overrides:  # the judge config's request parameters are its temperature and max tokens
        with pytest.raises(ValueError, match=re.escape(f"judge_{message}")):
            judge_config(tmp_path, **{f"judge_{name}": value for name, value in settings.items()})
