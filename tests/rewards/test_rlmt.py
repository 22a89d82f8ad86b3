"""RLMT (docs/rlmt.md): formats, `split_thinking`, reward-model scorers (local, served), DPO pairs, `RLMTTrainer`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_ext.rewards import (
    INSTRUCT_SYSTEM_PROMPT,
    ORIGINAL_PROMPT_COLUMN,
    ZERO_PROMPT_PREFIX,
    RewardModelScorer,
    ServedRewardModelScorer,
    build_dpo_pairs,
    original_prompt,
    rlmt_format_dataset,
    rlmt_prompt,
    sample_on_policy_pairs,
    select_dpo_pair,
    split_thinking,
    stop_token_cut,
    truncate_at_stop,
)
from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model, build_tiny_tokenizer

from ..utils import cpu_config_kwargs


# ----------------------------------------------------------------------------------------------------------------
# split_thinking
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "kwargs", "expected"),
    [
        ("<think>plan</think> answer", {}, ("plan", "answer", True)),
        ("\n <think>\nplan\n</think>\n\nanswer\n", {}, ("plan", "answer", True)),
        # TRL #6966: the template pre-filled <think>, so the completion starts inside the plan.
        ("plan</think> answer", {}, ("plan", "answer", True)),
        ("no tags at all", {}, ("", "no tags at all", False)),
        ("no tags at all", {"starts_in_thinking": True}, ("no tags at all", "", False)),
        ("<think>never closed", {}, ("never closed", "", False)),
        ("<think>plan</think>   ", {}, ("plan", "", False)),  # empty response
        ("<think></think> answer", {}, ("", "answer", False)),  # empty plan
        ("<think>a</think>b</think>c", {}, ("a</think>b", "c", False)),  # repeated close: response after the last
        ("<think>a</think><think>b</think>c", {}, ("a</think><think>b", "c", False)),
        ("<think>a</think> answer <think>again", {}, ("a", "answer", False)),  # a re-opened plan ends the response
        ("intro <think>a</think> answer", {}, ("intro <think>a", "answer", False)),  # <think> not at the start
        ("<think>p</think> <response> r </response>", {"format": "zero"}, ("p", "r", True)),
        ("<think>p</think><response>r", {"format": "zero"}, ("p", "r", True)),  # stop string cut by the generator
        ("<think>p</think> r", {"format": "zero"}, ("p", "r", False)),  # no <response> tag
        ("<think>p</think> <response>r</response> extra", {"format": "zero"}, ("p", "r", False)),
        ("<think>p</think> <response>r</response><response>s", {"format": "zero"}, ("p", "r", False)),
        ("<response>r</response>", {"format": "zero"}, ("", "r", False)),
    ],
)
def test_split_thinking(text, kwargs, expected):
    split = split_thinking(text, **kwargs)
    assert tuple(split) == expected
    thinking, response, well_formed = split  # unpacks as a 3-tuple
    assert (thinking, response, well_formed) == expected


def test_split_thinking_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'instruct'"):
        split_thinking("x", "chat")
    with pytest.raises(TypeError, match="str"):
        split_thinking(["x"])


def test_stop_helpers():
    assert truncate_at_stop("<response>hi</response> and more", ["</response>"]) == "<response>hi</response>"
    assert truncate_at_stop("a STOP b stop", ["stop", "STOP"]) == "a STOP"
    assert truncate_at_stop("nothing", ["</response>"]) == "nothing"
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("<response> yes </response> extra words", add_special_tokens=False)["input_ids"]
    keep = stop_token_cut(ids, tokenizer, ["</response>"])
    kept = tokenizer.decode(ids[:keep])
    assert kept.endswith("</response>") or kept.rstrip().endswith("</response>")
    assert "</response>" not in tokenizer.decode(ids[: keep - 1])  # the smallest prefix that holds the stop
    assert stop_token_cut(ids, tokenizer, ["absent"]) is None


# ----------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------
def test_instruct_format_round_trip_and_idempotence():
    formatted = rlmt_prompt("Say hello.")
    assert formatted == [
        {"role": "system", "content": INSTRUCT_SYSTEM_PROMPT},
        {"role": "user", "content": "Say hello."},
    ]
    assert rlmt_prompt(formatted) == formatted
    with_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    merged = rlmt_prompt(with_system)
    assert merged[0]["content"] == INSTRUCT_SYSTEM_PROMPT + "\n\nBe terse."
    assert original_prompt(merged) == with_system
    assert original_prompt(formatted) == [{"role": "user", "content": "Say hello."}]


def test_zero_format_prompt_and_round_trip():
    conversation = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Write a haiku\nabout rain."},
    ]
    prompt = rlmt_prompt(conversation, "zero")
    assert prompt.startswith(ZERO_PROMPT_PREFIX)
    assert "<think> </think> tags and the response is enclosed within <response> </response> tags" in prompt
    assert prompt.endswith("User: Write a haiku\nabout rain.\nAssistant:")
    assert rlmt_prompt(prompt, "zero") == prompt
    assert original_prompt(prompt, "zero") == conversation[1:]


def test_format_dataset_keeps_the_original_prompt():
    dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?", "Say hello."], "answer": ["5", "hello"]})
    zero = rlmt_format_dataset(dataset, "zero")
    assert zero[0]["prompt"].startswith(ZERO_PROMPT_PREFIX)
    assert zero[0][ORIGINAL_PROMPT_COLUMN] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert zero[1]["answer"] == "hello"
    instruct = rlmt_format_dataset(dataset)
    assert instruct[0]["prompt"][0] == {"role": "system", "content": INSTRUCT_SYSTEM_PROMPT}
    with pytest.raises(KeyError, match="question"):
        rlmt_format_dataset(dataset, prompt_column="question")


# ----------------------------------------------------------------------------------------------------------------
# RewardModelScorer: the response only
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_model():
    model, tokenizer = build_tiny_reward_model(seed=3, initializer_range=0.5)
    return model.eval(), tokenizer


def direct_score(reward_model, messages, max_length=None):
    model, tokenizer = reward_model
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_length is not None:
        ids = ids[-max_length:]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def test_scorer_scores_only_the_response(reward_model):
    model, tokenizer = reward_model
    scorer = RewardModelScorer(model, tokenizer, batch_size=4)
    prompts = ["Name a colour."] * 5
    completions = [
        "<think>Short plan.</think> The colour is blue.",
        "<think>A much longer plan, with 1 2 3 and many other words.</think> The colour is blue.",
        "Pre-filled template plan</think>The colour is blue.",  # TRL #6966 form
        [{"role": "assistant", "content": "<think>conversational</think> The colour is blue."}],
        "<think>Short plan.</think> Red, obviously!",
    ]
    scores = scorer(prompts=prompts, completions=completions)
    expected = direct_score(
        reward_model,
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is blue."}],
    )
    assert scores[:4] == pytest.approx([expected] * 4, abs=1e-5)  # changing the thinking changes nothing
    assert not math.isclose(scores[4], expected, abs_tol=1e-4)  # changing the response does


def test_scorer_batches_give_the_same_scores(reward_model):
    model, tokenizer = reward_model
    prompts = ["What is 2 + 3?", "Say hello.", "Count to five, please, slowly and clearly."]
    completions = ["<think>x</think> 5", "<think>y</think> Hello world!", "<think>z</think> 1 2 3 4 5"]
    one = RewardModelScorer(model, tokenizer, batch_size=1)(prompts=prompts, completions=completions)
    many = RewardModelScorer(model, tokenizer, batch_size=3)(prompts=prompts, completions=completions)
    assert many == pytest.approx(one, abs=1e-5)
    assert len(set(round(s, 6) for s in one)) == 3


def test_scorer_sees_the_users_prompt_not_the_rlmt_instruction(reward_model):
    model, tokenizer = reward_model
    scorer = RewardModelScorer(model, tokenizer)
    plain = scorer(prompts=["Say hello."], completions=["<think>p</think> Hello!"])
    formatted = scorer(prompts=[rlmt_prompt("Say hello.")], completions=["<think>p</think> Hello!"])
    # From the dataset column rlmt_format_dataset adds (takes precedence over the prompt).
    column = scorer(
        prompts=[rlmt_prompt("ignored")],
        completions=["<think>p</think> Hello!"],
        **{ORIGINAL_PROMPT_COLUMN: [[{"role": "user", "content": "Say hello."}]]},
    )
    zero = RewardModelScorer(model, tokenizer, format="zero")(
        prompts=[rlmt_prompt("Say hello.", "zero")], completions=["<think>p</think> <response>Hello!</response>"]
    )
    assert plain == pytest.approx(formatted, abs=1e-6)
    assert column == pytest.approx(plain, abs=1e-6)
    assert zero == pytest.approx(plain, abs=1e-6)


def test_strict_mode_gives_malformed_completions_the_lowest_reward(reward_model):
    model, tokenizer = reward_model
    completions = ["<think>a</think> Blue.", "<think>b</think> Green and yellow.", "no plan, just an answer"]
    prompts = ["Name a colour."] * 3
    logged = {}
    strict = RewardModelScorer(model, tokenizer)(
        prompts=prompts, completions=completions, log_metric=lambda name, value: logged.setdefault(name, value)
    )
    assert strict[2] == pytest.approx(min(strict[:2]) - 1.0)
    assert logged["reward_model/malformed_ratio"] == pytest.approx(1 / 3)
    fixed = RewardModelScorer(model, tokenizer, malformed_reward=-20.0)(prompts=prompts, completions=completions)
    assert fixed[2] == -20.0 and fixed[:2] == pytest.approx(strict[:2])
    lenient = RewardModelScorer(model, tokenizer, strict=False)(prompts=prompts, completions=completions)
    expected = direct_score(
        reward_model,
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "no plan, just an answer"}],
    )
    assert lenient[2] == pytest.approx(expected, abs=1e-5)
    all_bad = RewardModelScorer(model, tokenizer)(prompts=prompts[:2], completions=["x", "<think>y"])
    assert all_bad == [-1.0, -1.0]


def test_scorer_truncates_from_the_left_and_casts(reward_model):
    model, tokenizer = reward_model
    messages = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "The end."}]
    scorer = RewardModelScorer(model, tokenizer, max_length=12)
    [score] = scorer(prompts=[messages[:1]], completions=["<think>p</think> The end."])
    assert score == pytest.approx(direct_score(reward_model, messages, max_length=12), abs=1e-5)
    half = RewardModelScorer(build_tiny_reward_model(seed=3, initializer_range=0.5)[0], tokenizer, dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    assert half.device == torch.device("cpu")
    [low] = half(prompts=[messages[:1]], completions=["<think>p</think> The end."])
    assert low == pytest.approx(direct_score(reward_model, messages), abs=0.1)


def test_scorer_errors_name_the_fix(reward_model):
    model, _ = reward_model
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        RewardModelScorer(model, bare)
    with pytest.raises(ValueError, match="label_index"):
        RewardModelScorer(model, build_tiny_tokenizer(), label_index=2)
    with pytest.raises(ValueError, match="bfloat16"):
        RewardModelScorer(model, build_tiny_tokenizer(), dtype="float99")
    with pytest.raises(ValueError, match="'instruct'"):
        RewardModelScorer(model, build_tiny_tokenizer(), format="base")
    with pytest.raises(TypeError, match="batchsize"):
        RewardModelScorer(model, build_tiny_tokenizer(), batchsize=4)


def test_both_scorers_take_the_same_response_only_settings(reward_model):
    model, tokenizer = reward_model
    settings = dict(format="zero", strict=False, malformed_reward=-3.0, malformed_margin=2.0, starts_in_thinking=True)
    settings.update(system_prompt="Plan first.", original_prompt_column="question")
    local = RewardModelScorer(model, tokenizer, name="rm", **settings)
    served = ServedRewardModelScorer("http://127.0.0.1:1", "rm", name="served", **settings)
    for scorer in (local, served):
        assert {key: getattr(scorer, key) for key in settings} == settings
    assert (local.__name__, served.__name__) == ("rm", "served")
    assert (
        RewardModelScorer(model, tokenizer).format == ServedRewardModelScorer("http://h:1", "rm").format == "instruct"
    )
    for make in (
        lambda **kw: RewardModelScorer(model, tokenizer, **kw),
        lambda **kw: ServedRewardModelScorer("http://h:1", "m", **kw),
    ):
        with pytest.raises(ValueError, match="malformed_margin"):
            make(malformed_margin=-1.0)
        with pytest.raises(ValueError, match="'instruct'"):
            make(format="base")


# ----------------------------------------------------------------------------------------------------------------
# ServedRewardModelScorer against a local /classify server backed by the tiny reward model
# ----------------------------------------------------------------------------------------------------------------
class ClassifyServer:
    """A vLLM-style ``POST /classify`` server on 127.0.0.1: ``messages`` (chat template applied here) or ``input``."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.requests: list[dict] = []
        self.fail_with: int | None = None
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                if self.path != "/classify" or server.fail_with:
                    self._send(server.fail_with or 404, {"error": {"message": "nope"}})
                    return
                if "messages" in body:
                    texts = [server.tokenizer.apply_chat_template(body["messages"], tokenize=False)]
                else:
                    texts = body["input"]
                data = []
                for index, text in enumerate(texts):
                    ids = server.tokenizer(text, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                    with server.lock, torch.no_grad():
                        logit = server.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
                    probs = [logit] if body.get("use_activation") is False else [1 / (1 + math.exp(-logit))]
                    data.append({"index": index, "label": "LABEL_0", "probs": probs, "num_classes": 1})
                self._send(200, {"id": "classify-1", "object": "list", "data": list(reversed(data))})

            def _send(self, status, payload):
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("request_mode", ["messages", "text"])
def test_served_scorer_matches_the_local_scorer(reward_model, request_mode):
    model, tokenizer = reward_model
    prompts = ["Name a colour.", "Say hello.", "Count to five."]
    completions = ["<think>a</think> Blue.", "<think>b</think> Hello!", "malformed"]
    local = RewardModelScorer(model, tokenizer)(prompts=prompts, completions=completions)
    with ClassifyServer(model, tokenizer) as server:
        served = ServedRewardModelScorer(
            server.base_url, "tiny-rm", request_mode=request_mode, tokenizer=tokenizer, batch_size=2, max_retries=0
        )
        scores = asyncio.run(served(prompts=prompts, completions=completions))
        requests = server.requests
    assert scores == pytest.approx(local, abs=1e-5)
    assert all(r["model"] == "tiny-rm" and r["use_activation"] is False for r in requests)
    if request_mode == "messages":  # one request per well-formed completion, server-side template
        responses = sorted(r["messages"][-1]["content"] for r in requests)
        assert responses == ["Blue.", "Hello!"]
    else:  # rendered here, batched
        assert len(requests) == 1 and requests[0]["add_special_tokens"] is False and len(requests[0]["input"]) == 2


def test_served_scorer_failures_get_the_fallback_and_are_counted(reward_model):
    model, tokenizer = reward_model
    with ClassifyServer(model, tokenizer) as server:
        server.fail_with = 500
        served = ServedRewardModelScorer(server.base_url, "tiny-rm", max_retries=1, timeout=5, fallback_reward=-3.0)
        scores = asyncio.run(served(prompts=["q", "q"], completions=["<think>a</think> x", "<think>b</think> y"]))
        attempts = len(server.requests)
    assert scores == [-3.0, -3.0]
    assert served.stats.failed == 2
    assert attempts == 4  # two requests, each retried once
    with pytest.raises(ValueError, match="tokenizer"):
        ServedRewardModelScorer("http://127.0.0.1:1", "rm", request_mode="text")
    with pytest.raises(ValueError, match="server root"):
        ServedRewardModelScorer("127.0.0.1:8000", "rm")


# ----------------------------------------------------------------------------------------------------------------
# On-policy DPO pairs
# ----------------------------------------------------------------------------------------------------------------
def test_select_dpo_pair_rules():
    assert select_dpo_pair([0.1, 0.9, -0.5, 0.3]) == (1, 2)
    assert select_dpo_pair([0.9, 0.9, 0.1, 0.1]) == (0, 2)  # ties: the earliest sample, for both ends
    assert select_dpo_pair([0.5, 0.5]) is None  # no preference
    assert select_dpo_pair([0.5, None, float("nan")]) is None  # fewer than two valid scores
    assert select_dpo_pair([0.0, 0.2], min_margin=0.25) is None
    assert select_dpo_pair([0.0, 0.3], min_margin=0.25) == (1, 0)


def test_build_dpo_pairs_groups_by_prompt():
    prompts = ["A"] * 3 + ["B"] * 3 + ["C"] * 2
    completions = ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2"]
    scores = [0.2, 0.9, -0.1, 0.4, 0.4, 0.4, 1.0, None]
    pairs = build_dpo_pairs(prompts, completions, scores)
    assert pairs.column_names == ["prompt", "chosen", "rejected", "chosen_score", "rejected_score"]
    assert pairs.to_list() == [
        {"prompt": "A", "chosen": "a2", "rejected": "a3", "chosen_score": 0.9, "rejected_score": -0.1}
    ]  # B: all tied, C: one valid score
    conversational = build_dpo_pairs(
        [[{"role": "user", "content": "Hi"}]] * 2,
        ["<think>p</think> Hello!", "<think>q</think> Go away."],
        [1.0, -1.0],
    )
    assert conversational[0]["chosen"] == [{"role": "assistant", "content": "<think>p</think> Hello!"}]
    assert conversational[0]["rejected"] == [{"role": "assistant", "content": "<think>q</think> Go away."}]
    with pytest.raises(ValueError, match="one score per completion"):
        build_dpo_pairs(["A"], ["a", "b"], [1.0, 2.0])


def test_no_dpo_pair_is_an_error_that_says_why_and_skipped_prompts_are_counted(caplog):
    with pytest.raises(ValueError, match="No on-policy DPO pair: none of the 2 prompt") as caught:
        build_dpo_pairs(["A", "A", "B", "B"], ["a", "a", "b1", "b2"], [0.5, 0.5, 1.0, 1.0])
    message = str(caught.value)
    assert "2 had all their scores equal (1 of them with identical samples: raise temperature" in message
    assert "TRL's DPOTrainer cannot train on an empty dataset" in message
    with pytest.raises(ValueError, match="1 had fewer than two valid scores.*check the scorer"):
        build_dpo_pairs(["A", "A"], ["a1", "a2"], [0.5, None])
    with pytest.raises(ValueError, match=r"all their scores within min_margin=0\.5.*lower min_margin"):
        build_dpo_pairs(["A", "A"], ["a1", "a2"], [0.5, 0.75], min_margin=0.5)
    assert len(build_dpo_pairs(["A", "A"], ["a1", "a2"], [0.5, 0.5], allow_empty=True)) == 0

    with caplog.at_level(logging.WARNING, logger="trl_ext.rewards.rlmt.dpo"):
        pairs = build_dpo_pairs(["A", "A", "B", "B"], ["a1", "a2", "b1", "b2"], [0.0, 1.0, 0.3, None])
    assert len(pairs) == 1
    assert "1 pair(s) from 2 prompt(s); 1 prompt(s) gave no pair (1 had fewer than two valid scores" in caplog.text


def test_on_policy_sampling_with_a_constant_scorer_fails_before_dpo():
    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)

    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match="none of the 2 prompt\\(s\\) of 4 sample\\(s\\).*a constant score"):
        sample_on_policy_pairs(policy, tokenizer, ["Say hi.", "Say no."], constant, num_samples=2, max_new_tokens=4)


def test_on_policy_pairs_train_with_trl_dpo(tmp_path, reward_model):
    from trl import DPOConfig, DPOTrainer

    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    rm, rm_tokenizer = reward_model
    scorer = RewardModelScorer(rm, rm_tokenizer, strict=False)
    prompts = [rlmt_prompt(p) for p in ["Name a colour.", "Say hello.", "What is 2 + 3?", "Count to five."]]
    torch.manual_seed(0)
    pairs = sample_on_policy_pairs(policy, tokenizer, prompts, scorer, num_samples=4, max_new_tokens=12)
    assert len(pairs) == 4
    assert all(row["chosen_score"] > row["rejected_score"] for row in pairs)
    config = DPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPOTrainer(
        policy,
        args=config,
        train_dataset=pairs.remove_columns(["chosen_score", "rejected_score"]),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


# ----------------------------------------------------------------------------------------------------------------
# RLMTConfig / RLMTTrainer
# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    from trl_ext.trainers.rlmt import RLMTConfig

    config = RLMTConfig(**cpu_config_kwargs(str(tmp_path), rlmt_format="zero"))
    assert config.stop_strings == ["</response>"]
    assert (config.temperature, config.beta) == (0.7, 0.001)
    assert RLMTConfig(**cpu_config_kwargs(str(tmp_path))).stop_strings == []
    # With vLLM the stop string also goes to the sampling parameters (JSON-string generation_kwargs parsed first).
    vllm = RLMTConfig(
        **cpu_config_kwargs(str(tmp_path), rlmt_format="zero", use_vllm=True, generation_kwargs='{"top_k": 5}')
    )
    assert vllm.generation_kwargs == {"top_k": 5, "stop": ["</response>"]}
    with pytest.raises(ValueError, match="'instruct'"):
        RLMTConfig(**cpu_config_kwargs(str(tmp_path), rlmt_format="think"))


def test_trainer_refuses_a_bare_reward_model_and_a_missing_reward(tmp_path, reward_model):
    from trl_ext.trainers.rlmt import RLMTConfig, RLMTTrainer

    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    config = RLMTConfig(**cpu_config_kwargs(str(tmp_path)))
    dataset = Dataset.from_dict({"prompt": ["Say hello."] * 4})
    with pytest.raises(TypeError, match="RewardModelScorer"):
        RLMTTrainer(policy, reward_model[0], args=config, train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="reward_model_name_or_path"):
        RLMTTrainer(policy, args=config, train_dataset=dataset, processing_class=tokenizer)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_zero_format_run_cuts_completions_at_the_stop_string(tmp_path, reward_model):
    from trl_ext.trainers.rlmt import RLMTConfig, RLMTTrainer

    seen: list[list[int]] = []

    def recorder(prompts, completions, completion_ids, **kwargs):
        seen.extend(list(ids) for ids in completion_ids)
        return [0.0] * len(completions)

    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    rm, rm_tokenizer = reward_model
    scorer = RewardModelScorer(rm, rm_tokenizer, format="zero", strict=False)
    # A one-character stop string, so that the untrained policy hits it; "</response>" works the same way.
    config = RLMTConfig(
        **cpu_config_kwargs(str(tmp_path), rlmt_format="zero", stop_strings=["e"], max_completion_length=24)
    )
    dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?", "Say hello.", "Count to five.", "Name a colour."]})
    trainer = RLMTTrainer(
        policy, [scorer, recorder], args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=_lora()
    )
    assert trainer.train_dataset[0]["prompt"].startswith(ZERO_PROMPT_PREFIX)
    trainer.train()
    cut = [ids for ids in seen if "e" in tokenizer.decode(ids)]
    assert cut
    for ids in cut:  # each ends with the token that completes its first stop string: nothing was sampled after it
        assert "e" not in tokenizer.decode(ids[:-1]), tokenizer.decode(ids)
    logs = [h for h in trainer.state.log_history if "rlmt/stop_cut_ratio" in h]
    assert logs and all(0.0 < h["rlmt/stop_cut_ratio"] <= 1.0 for h in logs)
    assert all("reward_model/malformed_ratio" in h for h in logs)


def test_instruct_run_with_a_reward_model_path_trains_the_adapter(tmp_path):
    from trl_ext.trainers.rlmt import RLMTConfig, RLMTTrainer

    rm, rm_tokenizer = build_tiny_reward_model(seed=5, initializer_range=0.5)
    rm.save_pretrained(tmp_path / "rm")
    rm_tokenizer.save_pretrained(tmp_path / "rm")
    policy, tokenizer = build_tiny_model_and_tokenizer(seed=0)
    config = RLMTConfig(
        **cpu_config_kwargs(
            str(tmp_path / "out"),
            reward_model_name_or_path=str(tmp_path / "rm"),
            reward_model_dtype="float32",
            strict_format=False,  # the untrained policy never writes </think>: score its text
            max_completion_length=12,
        )
    )
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in ["Hi", "Say hello.", "2+3?", "Bye"]]}
    )
    trainer = RLMTTrainer(policy, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=_lora())
    assert trainer.train_dataset[0]["prompt"][0]["content"] == INSTRUCT_SYSTEM_PROMPT
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    logs = [h for h in trainer.state.log_history if "rewards/reward_model/mean" in h]
    assert logs and all(math.isfinite(h["rewards/reward_model/mean"]) for h in logs)
    assert all(h["reward_model/malformed_ratio"] == 1.0 for h in logs)
