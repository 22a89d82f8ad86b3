"""`AsyncRLMTTrainer` on the CPU without vLLM: its rollout worker (`RLMT`) samples from a scripted generator whose
completions run past the stop string, scores them with a tiny reward model, and the weight sync is a no-op. Runs
against ``vllm serve`` are the ``vllm`` group's (tests/test_vllm_async_rlmt.py)."""

from __future__ import annotations

import itertools
import math
import queue

import pytest
import torch
from datasets import Dataset
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext.advantages import group_advantages
from trl_ext.rewards.rlmt import (
    INSTRUCT_SYSTEM_PROMPT,
    ORIGINAL_PROMPT_COLUMN,
    ZERO_PROMPT_PREFIX,
    RewardModelScorer,
    cut_at_stop,
)
from trl_ext.rewards.rlmt.method import RLMT
from trl_ext.rlm.generators import Completion
from trl_ext.serving.served_policy import group_size
from trl_ext.testing import build_tiny_reward_model, build_tiny_tokenizer
from trl_ext.trainers.async_rlmt import (
    AsyncRLMTConfig,
    AsyncRLMTTrainer,
)
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.rlmt_config import RLMTConfig

from ..utils import saved_tiny_model
from .test_ext_async_grpo import NoWeightSync

QUESTIONS = ["What is 2 + 3?", "Say hello.", "Name a colour.", "Count to five."]
# Well-formed "zero" completions, each followed by text sampled past the stop string.
ZERO_COMPLETIONS = [
    "<think> Let me plan. </think> <response> The answer is 5. </response> Thank you! junk",
    "<think> Plan the response first. </think> <response> Hello world! </response> more junk",
    "<think> A plan. </think> <response> The quick brown fox. </response>",  # only the eos follows
    "<think> Plan </think> <response> yes </response> no no no",
]
LOGPROB = -0.7


class CyclingGenerator:
    """Completions from a fixed list, in turn across calls (so a group's completions differ), each token with the
    log-prob `LOGPROB`; records the decoded prompts it saw."""

    def __init__(self, tokenizer, texts):
        self.tokenizer = tokenizer
        self.texts = itertools.cycle(texts)
        self.prompts: list[str] = []
        self.versions: list[int] = []

    def update_model_version(self, version: int) -> None:
        self.versions.append(version)

    def generate(self, prompts):
        completions = []
        for prompt in prompts:
            self.prompts.append(self.tokenizer.decode(list(prompt), skip_special_tokens=False))
            ids = list(self.tokenizer(next(self.texts), add_special_tokens=False)["input_ids"])
            ids.append(self.tokenizer.eos_token_id)
            completions.append(Completion(token_ids=ids, logprobs=[LOGPROB] * len(ids)))
        return completions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny_rlmt"))


@pytest.fixture(scope="module")
def reward_model():
    model, tokenizer = build_tiny_reward_model(seed=3, initializer_range=0.5)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, reward_model):
    directory = tmp_path_factory.mktemp("tiny_rm")
    model, tokenizer = reward_model
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def config(output_dir, **overrides) -> AsyncRLMTConfig:
    settings = dict(
        output_dir=str(output_dir), num_generations=4, max_inflight_tasks=4, per_device_train_batch_size=4,
        token_budget=0, max_staleness=100, max_steps=1, max_completion_length=64, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, gradient_checkpointing=False,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncRLMTConfig(**settings)


def make_trainer(model_dir, output_dir, reward_funcs=None, texts=ZERO_COMPLETIONS, **overrides):
    tokenizer = build_tiny_tokenizer()
    return AsyncRLMTTrainer(
        model_dir,
        reward_funcs,
        args=config(output_dir, **overrides),
        train_dataset=Dataset.from_dict({"prompt": QUESTIONS}),
        generator=CyclingGenerator(tokenizer, texts),
        weight_transfer=NoWeightSync(),
    )


def direct_score(reward_model, messages) -> float:
    model, tokenizer = reward_model
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def drain(metrics_queue) -> list[dict]:
    items = []
    while True:
        try:
            items.append(metrics_queue.get_nowait())
        except queue.Empty:
            return items


# ----------------------------------------------------------------------------------------------------------------
# Pure steps
# ----------------------------------------------------------------------------------------------------------------
def test_cut_at_stop_keeps_the_token_completing_the_stop_string():
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("<response> hi </response> Thank you!", add_special_tokens=False)["input_ids"]
    logprobs = [-float(index) for index in range(len(ids))]
    kept, kept_logprobs, cut = cut_at_stop(ids, logprobs, tokenizer, ["</response>"])
    assert cut and 0 < len(kept) < len(ids) and kept == ids[: len(kept)]
    assert kept_logprobs == logprobs[: len(kept)]
    assert tokenizer.decode(kept).endswith("</response>")
    assert "</response>" not in tokenizer.decode(kept[:-1])  # the last kept token completes the stop string
    assert cut_at_stop(ids, logprobs, tokenizer, []) == (ids, logprobs, False)
    assert cut_at_stop(ids[:3], logprobs[:3], tokenizer, ["</response>"]) == (ids[:3], logprobs[:3], False)
    with pytest.raises(ValueError, match="log-probs"):
        cut_at_stop(ids, logprobs[:-1], tokenizer, ["</response>"])


def test_group_size_finds_blocks_of_identical_prompts():
    assert group_size([[1, 2], [1, 2], [3], [3]]) == 2
    assert group_size([[1], [1], [1]]) == 3
    assert group_size([[1], [2], [3]]) == 1
    assert group_size([[1], [1], [2]]) == 1  # unequal blocks: one completion per prompt
    assert group_size([[1], [1], [2], [3]]) == 1


# ----------------------------------------------------------------------------------------------------------------
# The format, the cut, the reward
# ----------------------------------------------------------------------------------------------------------------
def test_zero_format_completions_are_cut_after_the_stop_string(model_dir, tmp_path, reward_model):
    seen = []

    def recorder(prompts, completions, completion_ids, **kwargs):
        seen.append((prompts, completions, completion_ids, kwargs[ORIGINAL_PROMPT_COLUMN]))
        return [0.0] * len(completions)

    scorer = RewardModelScorer(*reward_model, format="zero")
    trainer = make_trainer(model_dir, tmp_path, [scorer, recorder], rlmt_format="zero")
    assert trainer.args.stop_strings == ["</response>"]
    worker = trainer.rollout_worker
    row = trainer.train_dataset[0]
    assert row["prompt"].startswith(ZERO_PROMPT_PREFIX)
    assert row[ORIGINAL_PROMPT_COLUMN] == [{"role": "user", "content": QUESTIONS[0]}]
    samples = worker.rollout([row])
    tokenizer = worker.tokenizer

    # The policy saw the zero-format text prompt, without a chat template.
    assert worker.generator.prompts[0] == row["prompt"]
    prompt_ids = list(tokenizer(text=row["prompt"])["input_ids"])
    assert len(samples) == 4
    for sample, text in zip(samples, ZERO_COMPLETIONS, strict=True):
        completion_ids = sample.input_ids[len(prompt_ids) :].tolist()
        assert sample.input_ids[: len(prompt_ids)].tolist() == prompt_ids
        decoded = tokenizer.decode(completion_ids)
        # Everything up to the stop string, nothing after it (not even the eos the generator appended).
        assert decoded.startswith(text[: text.index("</response>")])
        assert decoded.endswith("</response>") and "junk" not in decoded
        assert sample.completion_mask.tolist() == [0] * len(prompt_ids) + [1] * len(completion_ids)
        assert sample.old_log_probs[len(prompt_ids) :].tolist() == pytest.approx([LOGPROB] * len(completion_ids))

    # The reward functions got the cut completions, the zero-format prompt and the original prompt.
    ((prompts, completions, completion_ids, originals),) = seen
    assert prompts == [row["prompt"]] * 4 and originals == [row[ORIGINAL_PROMPT_COLUMN]] * 4
    assert all(text.endswith("</response>") for text in completions)
    assert [len(ids) for ids in completion_ids] == [int(s.completion_mask.sum()) for s in samples]

    # The collated micro-batch trains exactly the kept tokens: nothing sampled past a stop string gets a loss.
    tree_row = TreeRow()
    for sample in samples:
        tree_row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": sample.metrics,
        })  # fmt: skip
    batch = DataCollatorForRollout(pad_token_id=0).torch_call([[tree_row]])
    assert int((batch["token_index"] >= 0).sum()) == sum(len(ids) for ids in completion_ids)

    metrics = drain(worker.metrics_queue)
    stop_cut = [item["rlmt/stop_cut_ratio"] for item in metrics if "rlmt/stop_cut_ratio" in item]
    assert stop_cut == [(4.0, 4.0)]  # every completion ran past </response>
    assert any("reward_model/response_score_mean" in item for item in metrics)


def test_the_reward_model_sees_the_original_prompt_and_the_response_only(model_dir, tmp_path, reward_model):
    texts = [
        "<think> Short plan. </think> The answer is 5.",
        "<think> A much longer plan, with 1 2 3 and many other words. </think> The answer is 5.",
        "<think> Short plan. </think> Hello world!",
        "No plan at all, just a response.",  # malformed: the lowest reward in strict mode
    ]
    scorer = RewardModelScorer(*reward_model)
    trainer = make_trainer(model_dir, tmp_path, scorer, texts=texts)
    row = trainer.train_dataset[0]
    assert row["prompt"][0] == {"role": "system", "content": INSTRUCT_SYSTEM_PROMPT}
    samples = trainer.rollout_worker.rollout([row])
    # The policy saw the RLMT instruction, through its chat template.
    assert INSTRUCT_SYSTEM_PROMPT in trainer.rollout_worker.generator.prompts[0]
    assert trainer.rollout_worker.generator.prompts[0].startswith("<|im_start|>system")
    rewards = [sample.metrics["reward"] for sample in samples]
    user = {"role": "user", "content": QUESTIONS[0]}
    responses = ["The answer is 5.", "The answer is 5.", "Hello world!"]
    expected = [direct_score(reward_model, [user, {"role": "assistant", "content": r}]) for r in responses]
    assert rewards[:3] == pytest.approx(expected, abs=1e-5)  # the plan changes nothing
    assert not math.isclose(rewards[0], rewards[2], abs_tol=1e-4)  # the response does
    assert rewards[3] == pytest.approx(min(rewards[:3]) - 1.0)  # strict mode, malformed_margin 1
    assert [s.metrics["rewards/reward_model"] for s in samples] == pytest.approx(rewards)
    assert [s.advantage for s in samples] == pytest.approx(group_advantages(rewards))


def test_async_reward_functions_are_awaited(model_dir, tmp_path):
    async def length_reward(completions, **kwargs):
        return [float(len(text)) for text in completions]

    trainer = make_trainer(model_dir, tmp_path, length_reward, rlmt_format="zero")
    samples = trainer.rollout_worker.rollout([trainer.train_dataset[1]])
    completions = [text for _, text, _ in trainer.rollout_worker.method.last_completions]
    assert [s.metrics["reward"] for s in samples] == [float(len(text)) for text in completions]


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def test_trains_two_steps_with_the_reward_model_of_the_config(model_dir, reward_model_dir, tmp_path):
    trainer = make_trainer(
        model_dir, tmp_path, rlmt_format="zero", max_steps=2, queue_maxsize=16,
        reward_model_name_or_path=reward_model_dir, reward_model_dtype="float32",
    )  # fmt: skip
    assert isinstance(trainer.rollout_worker, RolloutWorker) and isinstance(trainer.rollout_worker.method, RLMT)
    assert isinstance(trainer.rollout_worker.reward_funcs[0], RewardModelScorer)
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 2 and all(math.isfinite(entry["loss"]) for entry in history)
    logged = {key for entry in history for key in entry}
    assert {"reward", "rewards/reward_model", "rlmt/stop_cut_ratio", "reward_model/response_score_mean"} <= logged
    assert all(
        entry["reward_model/malformed_ratio"] == 0.0 for entry in history if "reward_model/malformed_ratio" in entry
    )
    assert any(not torch.equal(before[name], param) for name, param in trainer.model.named_parameters())
    assert trainer.rollout_worker._stop.is_set()


def test_a_failing_reward_function_stops_the_worker_with_the_cause(model_dir, tmp_path):
    def broken(completions, **kwargs):
        raise KeyError("the reward server went away")

    trainer = make_trainer(model_dir, tmp_path, broken)
    worker = trainer.rollout_worker
    worker.max_consecutive_errors = 2
    worker.start()
    worker._thread.join(timeout=120)
    with pytest.raises(RuntimeError, match="RLMT rollout worker stopped.*2 RLMT rollout runs failed"):
        worker.check_health(stale_after_s=300)
    assert worker.errors == 2 and worker.rollout_buffer.empty()
    assert sum(item.get("rlmt/worker_errors_total", 0.0) for item in drain(worker.metrics_queue)) == 2.0
    worker.stop()


# ----------------------------------------------------------------------------------------------------------------
# Config and refusals
# ----------------------------------------------------------------------------------------------------------------
def test_config_resolves_the_rlmt_settings_and_refuses_batch_scaling(tmp_path):
    config = AsyncRLMTConfig(output_dir=str(tmp_path))
    assert config.temperature == 0.7 and config.stop_strings == []
    assert AsyncRLMTConfig(output_dir=str(tmp_path), rlmt_format="zero").stop_strings == ["</response>"]
    assert AsyncRLMTConfig(output_dir=str(tmp_path), scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        AsyncRLMTConfig(output_dir=str(tmp_path), scale_rewards="batch")
    with pytest.raises(ValueError, match="'instruct'"):
        AsyncRLMTConfig(output_dir=str(tmp_path), rlmt_format="think")


def test_refuses_a_bare_reward_model_a_missing_reward_and_a_plain_config(model_dir, tmp_path, reward_model):
    dataset = Dataset.from_dict({"prompt": QUESTIONS})
    with pytest.raises(TypeError, match="RewardModelScorer"):
        AsyncRLMTTrainer(model_dir, reward_model[0], args=config(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="reward_model_name_or_path"):
        AsyncRLMTTrainer(model_dir, args=config(tmp_path), train_dataset=dataset)
    with pytest.raises(TypeError, match="AsyncRLMTConfig"):
        AsyncRLMTTrainer(model_dir, len, args=RLMTConfig(output_dir=str(tmp_path)), train_dataset=dataset)
