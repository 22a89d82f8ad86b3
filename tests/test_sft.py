"""Small-holdout cold start (docs/cold_start.md): the split, a scripted teacher over HTTP, filtering, stepwise SFT
rows, and TRL's SFTTrainer with LoRA on those rows."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_ext.judge.client import AsyncChatClient
from trl_ext.quickstart.scripted_server import ErrorReply, ScriptedChatServer
from trl_ext.rewards import CharSpanF1Reward
from trl_ext.rlm import RLMScaffoldConfig
from trl_ext.sft import (
    MessageCodec,
    filter_traces,
    generate_teacher_traces,
    split_cold_start,
    traces_to_sft_rows,
    warn_if_large_sft_set,
)
from trl_ext.testing import build_tiny_model_and_tokenizer

CONTEXT = "Notes. The cat sat on the mat. The dog slept."
GOLD = '["The cat sat on the mat."]'


# ----------------------------------------------------------------------------------------------------------------
# The split and the warning
# ----------------------------------------------------------------------------------------------------------------
def test_split_is_disjoint_complete_ordered_and_deterministic():
    dataset = Dataset.from_dict({"id": list(range(100))})
    sft, rl = split_cold_start(dataset, n=8, seed=0)
    sft_ids, rl_ids = list(sft["id"]), list(rl["id"])
    assert len(sft_ids) == 8 and len(rl_ids) == 92
    assert not set(sft_ids) & set(rl_ids)
    assert sorted(sft_ids + rl_ids) == list(range(100))
    assert sft_ids == sorted(sft_ids) and rl_ids == sorted(rl_ids)  # dataset order kept
    again_sft, again_rl = split_cold_start(dataset, n=8, seed=0)
    assert (list(again_sft["id"]), list(again_rl["id"])) == (sft_ids, rl_ids)
    assert list(split_cold_start(dataset, n=8, seed=1)[0]["id"]) != sft_ids
    # Stable across releases: the draw is random.Random(seed).sample, nothing global.
    assert sft_ids == sorted(__import__("random").Random(0).sample(range(100), 8))


@pytest.mark.parametrize("n", [0, 100, 150, -1, True, 2.0])
def test_split_rejects_bad_sizes(n):
    with pytest.raises(ValueError, match="1 <= n < len"):
        split_cold_start(Dataset.from_dict({"id": list(range(100))}), n=n)


def test_large_sft_sets_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_ext.sft"):
        assert not warn_if_large_sft_set(32, 1000)
        assert not caplog.records
        assert warn_if_large_sft_set(32, 200)  # 16 % of the RL set
        assert warn_if_large_sft_set(500, 100_000)  # more than 128 examples
        assert "entropy" in caplog.records[-1].getMessage()
        caplog.clear()
        split_cold_start(Dataset.from_dict({"id": list(range(20))}), n=10)
        assert any("split_cold_start(dataset, n=32)" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------------------------------
# Teacher traces over HTTP
# ----------------------------------------------------------------------------------------------------------------
def task_of(request):
    """The task restated in the fresh user message of a scaffold turn."""
    match = re.search(r"Task: (.*?)\n", request["messages"][-1]["content"])
    return match.group(1) if match else None


def teacher_script(request):
    task = task_of(request)
    turn = sum(m["role"] == "assistant" for m in request["messages"])
    if task == "good":
        return [
            "Let me look.\n```repl\nprint(context[:20])\n```",
            "```repl\nquote = rlm_query('Quote the sentence about the cat.', context)\nprint(quote)\n```",
            'FINAL(["The cat sat on the mat."])',
        ][turn]
    if task == "Quote the sentence about the cat.":  # the child rollout
        if turn == 0:
            return "```repl\nstart = context.find('The cat')\nprint(context[start:start + 23])\n```"
        return "FINAL(The cat sat on the mat.)"
    if task == "repl error":
        return "```repl\nprint(undefined_name)\n```" if turn == 0 else 'FINAL(["The cat sat on the mat."])'
    if task == "teacher down":
        return ErrorReply(500, "teacher overloaded")
    if task == "wrong":
        return 'FINAL(["The dog slept."])'
    if task == "stuck":
        return "```repl\nprint(len(context))\n```"
    raise AssertionError(f"unexpected request {request}")


TASKS = ["good", "repl error", "teacher down", "wrong", "stuck"]


@pytest.fixture(scope="module")
def traces_and_requests():
    dataset = Dataset.from_dict({"prompt": TASKS, "context": [CONTEXT] * len(TASKS), "evidence": [GOLD] * len(TASKS)})
    with ScriptedChatServer(teacher_script) as server:
        teacher = AsyncChatClient(server.base_url, "teacher", api_key_env=None, max_retries=0, timeout=30)
        traces = generate_teacher_traces(
            dataset, teacher, scaffold_config=RLMScaffoldConfig(max_turns=3, max_depth=1), request_params={"seed": 1}
        )
        requests = server.requests
    return traces, requests


def test_teacher_plays_the_policy_with_rebuilt_messages(traces_and_requests):
    traces, requests = traces_and_requests
    assert [t.example_index for t in traces] == list(range(len(TASKS)))
    good = traces[0]
    assert good.final_answer == '["The cat sat on the mat."]'
    assert [(s.node, s.turn, s.depth) for s in good.steps] == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 1), (1, 1, 1)]
    # The third root turn's prompt: system, (action, REPL output) x 2, fresh user message restating the task.
    messages = good.steps[2].messages
    assert [m["role"] for m in messages] == ["system", "assistant", "user", "assistant", "user", "user"]
    assert messages[2]["content"] == "REPL output:\nNotes. The cat sat o"  # context[:20]
    assert "REPL output:\nThe cat sat on the mat." in messages[4]["content"]
    assert "Task: good" in messages[5]["content"]
    # Exactly those messages went over the wire (and the teacher's request parameters with them).
    sent = [r["messages"] for r in requests]
    assert all(step.messages in sent for trace in traces for step in trace.steps if step.action)
    assert all(r["seed"] == 1 for r in requests)
    assert traces[1].repl_errors == 1 and "NameError" in traces[1].steps[0].repl_error
    assert traces[2].teacher_errors == 3  # every turn of the trace: the node keeps asking until max_turns
    assert traces[4].final_answer is None and len(traces[4].steps) == 3


def test_filter_drops_errors_wrong_answers_and_unfinished_traces(traces_and_requests):
    traces, _ = traces_and_requests
    kept, report = filter_traces(traces)
    assert [t.example_index for t in kept] == [0]
    assert kept[0].reward == 1.0
    assert report.dropped == {"teacher_error": 1, "repl_error": 1, "no_final_answer": 1, "zero_reward": 1}
    assert report.kept == 1 and report.examples_kept == 1
    assert traces[3].reward == 0.0  # "wrong" was scored: F1 of "The dog slept." against the gold quote


def test_filter_keeps_the_best_samples_and_accepts_any_reward(traces_and_requests):
    traces, _ = traces_and_requests
    good = traces[0]
    duplicate = type(good)(0, 1, good.tree, good.steps, 0, good.row)
    kept, _ = filter_traces([good, duplicate], max_per_example=None)
    assert len(kept) == 2
    kept, _ = filter_traces([good, duplicate])
    assert [t.sample for t in kept] == [0]

    async def always_half(prompts, completions, **kwargs):  # an async TRL-style reward
        return [0.5] * len(completions)

    kept, report = filter_traces([good], reward_fn=always_half, min_reward=0.6)
    assert kept == [] and report.dropped["zero_reward"] == 1
    strict_f1 = CharSpanF1Reward(gold_column="evidence", context_column="context")
    assert filter_traces([good], reward_fn=strict_f1, min_reward=0.99)[0] == [good]


def test_rows_are_one_per_turn_with_the_action_as_completion(traces_and_requests):
    traces, _ = traces_and_requests
    kept, _ = filter_traces(traces)
    rows = traces_to_sft_rows(kept)
    assert len(rows) == 5  # 3 root turns + 2 child turns
    assert rows[2]["prompt"] == kept[0].steps[2].messages
    assert rows[2]["completion"] == [{"role": "assistant", "content": 'FINAL(["The cat sat on the mat."])'}]
    assert list(rows["depth"]) == [0, 0, 0, 1, 1]
    assert len(traces_to_sft_rows(kept, include_children=False)) == 3
    saved = json.loads(json.dumps(kept[0].to_dict()))  # traces save as JSON
    assert saved["final_answer"] == '["The cat sat on the mat."]' and len(saved["steps"]) == 5
    with pytest.raises(ValueError, match="No SFT rows"):
        traces_to_sft_rows([])


def test_message_codec_round_trips():
    codec = MessageCodec()
    messages = [{"role": "user", "content": "héllo"}]
    ids = codec(codec.apply_chat_template(messages))["input_ids"]
    assert codec.messages(ids) == messages
    assert codec.decode([codec.encode_text("a"), codec.encode_text("b")]) == "ab"
    assert codec.encode_text("a") == codec.encode_text("a")


# ----------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer with LoRA on the rows
# ----------------------------------------------------------------------------------------------------------------
def test_sft_rows_train_the_tiny_model_with_lora_on_the_actions_only(tmp_path, traces_and_requests):
    from trl import SFTConfig, SFTTrainer

    traces, _ = traces_and_requests
    kept, _ = filter_traces(traces)
    rows = traces_to_sft_rows(kept, num_rl_examples=100)
    model, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    config = SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=2048,
    )
    trainer = SFTTrainer(
        model,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.args.completion_only_loss is not False
    # Loss on the action only: the labelled tokens are the action and its end-of-turn tokens, nothing of the prompt.
    example = trainer.train_dataset[2]
    labelled = [t for t in example["labels"] if t != -100]
    assert tokenizer.decode(labelled).strip() == 'FINAL(["The cat sat on the mat."])<|im_end|>'
    first = next(i for i, t in enumerate(example["labels"]) if t != -100)
    assert tokenizer.decode(example["input_ids"][:first]).endswith("<|im_start|>assistant\n")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
