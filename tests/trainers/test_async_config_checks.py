"""Bad settings of the asynchronous configs are refused at construction, each error naming the value and the fix;
a misspelt keyword of any trl-ext config names the closest fields; a config nobody set checkpointing on constructs
without transformers' deprecation warning."""

from __future__ import annotations

import inspect
import queue
import warnings

import pytest
from transformers import HfArgumentParser

from trl_ext.trainers import (
    AsyncJudgeCreditConfig,
    AsyncRLMTConfig,
    AsyncStepwiseRLMConfig,
    ExtAsyncGRPOConfig,
    ExtGRPOConfig,
    JudgeCreditConfig,
    RLMTConfig,
    StepwiseRLMConfig,
)

from ..utils import cpu_config_kwargs

JUDGE = {"judge_base_url": "http://127.0.0.1:1/v1", "judge_model": "m"}
ASYNC_CONFIGS = [ExtAsyncGRPOConfig, AsyncStepwiseRLMConfig, AsyncJudgeCreditConfig, AsyncRLMTConfig]
SYNC_CONFIGS = [ExtGRPOConfig, StepwiseRLMConfig, JudgeCreditConfig, RLMTConfig]


def make(config: type, tmp_path, **overrides):
    extra = JUDGE if config in (JudgeCreditConfig, AsyncJudgeCreditConfig) else {}
    return config(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **extra, **overrides)


# ----------------------------------------------------------------------------------------------------------------
# max_staleness, queue_maxsize, vllm_server_base_url
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ASYNC_CONFIGS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"max_staleness": -1},
            r"max_staleness=-1: max_staleness is how many policy versions a rollout sample may lag",
        ),
        ({"max_staleness": -2}, r"max_staleness=-2: .*cannot be negative\. Set max_staleness=0 to train on fresh"),
        ({"max_staleness": 1.5}, r"max_staleness=1\.5: .*a whole number of versions\. Set an int >= 0"),
        ({"max_staleness": True}, r"max_staleness=True: .*Set an int >= 0"),
        ({"queue_maxsize": -1}, r"queue_maxsize=-1: the bound of the rollout queue .* Set queue_maxsize=0 for an unb"),
        ({"queue_maxsize": 2.5}, r"queue_maxsize=2\.5: .*is an int >= 0"),
        ({"queue_maxsize": False}, r"queue_maxsize=False: .*is an int >= 0"),
        (
            {"vllm_server_base_url": "localhost:8000"},
            r"vllm_server_base_url='localhost:8000' is not an http:// or https:// URL with a host: .*"
            r"e\.g\. 'http://localhost:8000'",
        ),
        ({"vllm_server_base_url": "ftp://host:8000"}, r"'ftp://host:8000' is not an http:// or https:// URL"),
        ({"vllm_server_base_url": "http://"}, r"'http://' is not an http:// or https:// URL with a host"),
        ({"vllm_server_base_url": "http://host:port"}, r"'http://host:port' is not a valid URL"),
        (
            {"vllm_server_base_url": "http://127.0.0.1:8000/v1"},
            r"ends in /v1, the OpenAI API root: set the server's base URL, "
            r"vllm_server_base_url='http://127.0.0.1:8000'; TRL appends the paths itself",
        ),
        ({"vllm_server_base_url": "https://host/vllm/v1/"}, r"vllm_server_base_url='https://host/vllm'; TRL appends"),
    ],
)
def test_bad_async_settings_are_refused_naming_the_value_and_fix(tmp_path, config, overrides, message):
    with pytest.raises(ValueError, match=message):
        make(config, tmp_path, **overrides)


def test_good_async_settings_are_kept(tmp_path):
    import numpy as np

    config = make(ExtAsyncGRPOConfig, tmp_path, max_staleness=0, queue_maxsize=0)
    assert (config.max_staleness, config.queue_maxsize) == (0, 0)  # 0: strict discard, unbounded queue
    assert make(ExtAsyncGRPOConfig, tmp_path, max_staleness=np.int64(3)).max_staleness == 3
    assert make(ExtAsyncGRPOConfig, tmp_path).vllm_server_base_url == "http://localhost:8000"  # TRL's default
    for url, kept in [
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),  # a trailing / is dropped
        ("https://gpu-node.internal", "https://gpu-node.internal"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://host:8000/vllm", "http://host:8000/vllm"),  # behind a reverse proxy: a path that is not /v1
    ]:
        assert make(ExtAsyncGRPOConfig, tmp_path, vllm_server_base_url=url).vllm_server_base_url == kept


def test_queue_maxsize_zero_is_unbounded_and_documented():
    """0 is "no bound" for the queues both workers build from queue_maxsize: `queue.Queue` (trl-ext's threads) and
    `multiprocessing.Queue` (TRL's spawned worker); the field's help and the config's docstring say so."""
    import multiprocessing

    unbounded = queue.Queue(maxsize=0)
    for item in range(5000):
        unbounded.put_nowait(item)
    assert not unbounded.full()
    assert multiprocessing.get_context("spawn").Queue(maxsize=0)._maxsize >= 2**31 - 1
    help_text = ExtAsyncGRPOConfig.__dataclass_fields__["queue_maxsize"].metadata["help"]
    assert "0 means unbounded" in help_text
    assert ExtAsyncGRPOConfig.__dataclass_fields__["queue_maxsize"].default == 1024  # TRL's default, unchanged
    assert "queue_maxsize (`int`, *optional*, defaults to `1024`):" in ExtAsyncGRPOConfig.__doc__
    parser = HfArgumentParser(AsyncStepwiseRLMConfig)
    assert {a.dest: a.help for a in parser._actions}["queue_maxsize"] == help_text


# ----------------------------------------------------------------------------------------------------------------
# Unknown keywords
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", SYNC_CONFIGS + ASYNC_CONFIGS, ids=lambda c: c.__name__)
def test_a_misspelt_keyword_names_the_closest_fields(tmp_path, config):
    with pytest.raises(TypeError) as raised:
        make(config, tmp_path, learnig_rate=1e-5)
    assert str(raised.value) == (
        f"{config.__name__}.__init__() got an unexpected keyword argument 'learnig_rate' "
        "(did you mean 'learning_rate'?)"
    )


def test_the_async_misspelling_of_max_staleness_and_several_unknown_keywords(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_stalenes' \(did you mean 'max_staleness'"):
        ExtAsyncGRPOConfig(output_dir=str(tmp_path), max_stalenes=2)
    with pytest.raises(TypeError) as raised:
        make(StepwiseRLMConfig, tmp_path, max_turn=3, zzqx=1)
    message = str(raised.value)
    assert "got unexpected keyword arguments 'max_turn' (did you mean 'max_turns'" in message
    assert "'zzqx' (no field has a similar name; help(StepwiseRLMConfig) lists them)" in message


def test_unknown_keyword_check_keeps_the_signature_and_the_parser(tmp_path):
    for config in SYNC_CONFIGS + ASYNC_CONFIGS:
        assert "max_steps" in inspect.signature(config).parameters
        assert "Parameters:" in config.__doc__
    parser = HfArgumentParser(ExtAsyncGRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--max_staleness", "2", "--loss_type", "ipo"]
    )
    assert (config.max_staleness, config.loss_type) == (2, "ipo")
    # positional arguments (output_dir is the first field) still go through
    assert ExtGRPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none").output_dir == str(tmp_path)
    assert ExtAsyncGRPOConfig(**cpu_config_kwargs(str(tmp_path))).max_steps == 2


# ----------------------------------------------------------------------------------------------------------------
# No spurious deprecation warning
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", SYNC_CONFIGS + ASYNC_CONFIGS, ids=lambda c: c.__name__)
def test_a_config_with_default_checkpointing_does_not_warn(tmp_path, config):
    """TRL defaults the deprecated `gradient_checkpointing` to True; transformers warned about it on every
    construction. The default is now carried over to `activation_checkpointing`: same result, no warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = make(config, tmp_path)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert (made.activation_checkpointing, made.gradient_checkpointing) == (True, True)


def test_the_deprecated_name_set_by_the_caller_still_warns_and_is_honoured(tmp_path):
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        made = make(ExtAsyncGRPOConfig, tmp_path, gradient_checkpointing=False)
    assert (made.activation_checkpointing, made.gradient_checkpointing) == (False, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = make(ExtGRPOConfig, tmp_path, activation_checkpointing=False)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]
    assert (made.activation_checkpointing, made.gradient_checkpointing) == (False, False)
