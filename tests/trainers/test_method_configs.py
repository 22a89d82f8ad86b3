"""Each method's settings are declared once, in its own package, and the synchronous and asynchronous configs take
the very same fields (no copy that could drift in default, type or help text)."""

import dataclasses

import pytest
from trl import GRPOConfig

from trl_ext.judge.arguments import JudgeCreditArguments
from trl_ext.rewards.rlmt.arguments import RLMTArguments
from trl_ext.rlm.arguments import StepwiseArguments
from trl_ext.trainers import (
    AsyncJudgeCreditConfig,
    AsyncRLMTConfig,
    AsyncStepwiseRLMConfig,
    JudgeCreditConfig,
    RLMTConfig,
    StepwiseRLMConfig,
)
from trl_ext.trainers.ext_async_grpo_config import AsyncMethodConfig

METHODS = [
    (StepwiseArguments, StepwiseRLMConfig, AsyncStepwiseRLMConfig),
    (JudgeCreditArguments, JudgeCreditConfig, AsyncJudgeCreditConfig),
    (RLMTArguments, RLMTConfig, AsyncRLMTConfig),
]


@pytest.mark.parametrize(("arguments", "sync", "async_"), METHODS, ids=lambda cls: cls.__name__)
def test_sync_and_async_configs_take_the_methods_fields_as_declared(arguments, sync, async_):
    for field in dataclasses.fields(arguments):
        # The same Field object: one default, one type, one help text.
        assert sync.__dataclass_fields__[field.name] is field, field.name
        assert async_.__dataclass_fields__[field.name] is field, field.name
    for name in arguments.__annotations__:  # the fields the method declares: listed once in its docstring
        assert arguments.__doc__.count(f"        {name} (`") == 1, name


def test_the_async_group_fields_are_grpo_configs():
    for name in ("scale_rewards", "reward_weights"):
        ours, trls = AsyncMethodConfig.__dataclass_fields__[name], GRPOConfig.__dataclass_fields__[name]
        assert ours.default == trls.default and trls.metadata["help"][:60] in ours.metadata["help"]
    # The judge's default differs (Dr. GRPO), in both modes alike.
    assert (
        JudgeCreditConfig.__dataclass_fields__["scale_rewards"]
        is AsyncJudgeCreditConfig.__dataclass_fields__["scale_rewards"]
    )
