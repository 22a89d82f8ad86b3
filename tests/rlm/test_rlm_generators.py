"""Generators: transformers sampling with exact sampling log-probs, real tiny-model rollouts, vLLM adapters."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trl_ext.rlm import (
    CanonicalOrderGenerator,
    Completion,
    Generator,
    RLMEngine,
    RLMScaffoldConfig,
    RLMTask,
    SandboxLimits,
    ScriptedGenerator,
    TransformersGenerator,
    VLLMColocateGenerator,
    VLLMServerGenerator,
)
from trl_ext.rlm.generators import SamplingSettings, completion_from_vllm_sample, sampled_token_logprobs
from trl_ext.testing import EOS_TOKEN_ID, build_tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model_and_tokenizer(seed=0, initializer_range=0.5)


def _reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each completion token, by one teacher-forced forward pass without padding."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_transformers_generator_returns_the_sampling_logprobs(tiny):
    model, tokenizer = tiny
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=12, temperature=0.7)
    assert isinstance(generator, Generator)
    prompts = [
        tokenizer("What is 2 + 3?")["input_ids"],
        tokenizer("print(context[:100])\nx = len(context)")["input_ids"],
    ]
    torch.manual_seed(0)
    completions = generator.generate(prompts)
    assert len(completions) == 2
    for prompt, completion in zip(prompts, completions):
        assert 1 <= len(completion.token_ids) <= 12 and len(completion.logprobs) == len(completion.token_ids)
        if EOS_TOKEN_ID in completion.token_ids:
            assert completion.token_ids.index(EOS_TOKEN_ID) == len(completion.token_ids) - 1  # cut after eos
        reference = _reference_logprobs(model, prompt, completion.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(completion.logprobs), reference, atol=1e-4, rtol=1e-4)
    model.train()
    generator.generate(prompts[:1])
    assert model.training  # restored after generation in eval mode


def test_greedy_is_deterministic_and_batch_size_chunks(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer(text)["input_ids"] for text in ["Hello world!", "The quick brown fox", "0 1 2 3"]]
    one_batch = TransformersGenerator(model, tokenizer, max_new_tokens=6, temperature=0).generate(prompts)
    chunked = TransformersGenerator(model, tokenizer, max_new_tokens=6, temperature=0, batch_size=1).generate(prompts)
    assert [c.token_ids for c in one_batch] == [c.token_ids for c in chunked]
    for prompt, completion in zip(prompts, one_batch):
        reference = _reference_logprobs(model, prompt, completion.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), reference, atol=1e-4, rtol=1e-4)
        assert all(lp <= 0 for lp in completion.logprobs)
    assert TransformersGenerator(model, tokenizer).generate([]) == []
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        TransformersGenerator(model, tokenizer, max_new_tokens=0)


def test_engine_runs_real_rollouts_of_the_tiny_model(tiny):
    model, tokenizer = tiny
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=24, temperature=1.0)
    config = RLMScaffoldConfig(
        max_turns=2, sandbox=SandboxLimits(timeout_s=5), system_prompt="REPL. {context_description}{recursion_note}"
    )
    engine = RLMEngine(generator, tokenizer, config)
    torch.manual_seed(0)
    trees = engine.run([RLMTask("What is 2 + 3?", "2 + 3"), RLMTask("Count the words.", "a b c")])
    assert len(trees) == 2 and engine.stats.generator_calls == 2  # two turns, both roots in each call
    for tree in trees:
        assert tree.root.end_reason in ("final_answer", "max_turns")
        for sample in tree.turn_samples():
            turn = tree.root.turns[sample.turn]
            assert sample.weight == 1.0 and len(sample.action_ids) == len(sample.logprobs) >= 1
            assert all(math.isfinite(lp) and lp <= 0 for lp in sample.logprobs)
            assert turn.action == tokenizer.decode(turn.action_ids, skip_special_tokens=True)
            # the recorded log-probs are those of the recorded prompt and action under the policy
            reference = _reference_logprobs(model, sample.prompt_ids, sample.action_ids, temperature=1.0)
            torch.testing.assert_close(torch.tensor(sample.logprobs), reference, atol=1e-4, rtol=1e-4)
        assert tree.root.turns[0].prompt_ids[:1] == [tokenizer.convert_tokens_to_ids("<|im_start|>")]


def test_scripted_generator_records_calls():
    _, tokenizer = build_tiny_model_and_tokenizer()
    generator = ScriptedGenerator(lambda prompt: prompt[::-1][:3], tokenizer)
    completions = generator.generate([tokenizer("abc")["input_ids"], tokenizer("xyz")["input_ids"]])
    assert [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions] == ["cba", "zyx"]
    assert generator.batch_sizes == [2] and generator.prompts == ["abc", "xyz"]
    with pytest.raises(ValueError, match="one logprob per token"):
        Completion([1, 2], [0.0])


# ------------------------------------------------------------------------------ vLLM adapters (no vLLM here)
def test_sampled_token_logprobs_picks_the_sampled_token():
    # logprobs=0: one entry per position, the sampled token
    assert sampled_token_logprobs([5, 6], [[-0.5], [None]], [[5], [6]]) == [-0.5, -math.inf]
    # logprobs=2: the sampled token is not necessarily ranked first
    values = sampled_token_logprobs([7, 8], [[-0.1, -2.0, -3.0], [-0.2, -0.9]], [[1, 7, 3], [8, 4]])
    assert values == [-2.0, -0.2]
    assert sampled_token_logprobs([9], [[float("nan")]], None) == [-math.inf]
    with pytest.raises(ValueError, match="has no logprob entry"):
        sampled_token_logprobs([7], [[-0.1]], [[1]])
    with pytest.raises(ValueError, match="2 logprob positions for 1 completion tokens"):
        sampled_token_logprobs([7], [[-0.1], [-0.2]], None)


class _TRLServerClient:
    """Stands in for trl.generation.vllm_client.VLLMClient: its generate() signature and return format."""

    def __init__(self) -> None:
        self.kwargs: dict = {}

    def generate(
        self,
        prompts,
        n=1,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=16,
        logprobs=0,
        structured_outputs_regex=None,
        generation_kwargs=None,
    ):
        self.kwargs = dict(
            n=n,
            temperature=temperature,
            top_k=top_k,
            max_tokens=max_tokens,
            logprobs=logprobs,
            generation_kwargs=generation_kwargs,
            repetition_penalty=repetition_penalty,
        )
        completions = [[len(prompt), 2] for prompt in prompts]
        return {
            "prompt_ids": [list(prompt) for prompt in prompts],
            "completion_ids": completions,
            "logprobs": [[[-0.25], [-0.5]] for _ in prompts],
            "logprob_token_ids": [[[ids[0]], [ids[1]]] for ids in completions],
        }


def test_vllm_server_generator_parses_trl_client_output():
    client = _TRLServerClient()
    generator = VLLMServerGenerator(
        client, max_new_tokens=32, temperature=0.6, top_k=-1, generation_kwargs={"seed": 1}
    )
    completions = generator.generate([[1, 2, 3], [4]])
    assert completions == [Completion([3, 2], [-0.25, -0.5]), Completion([1, 2], [-0.25, -0.5])]
    assert client.kwargs == dict(
        n=1, temperature=0.6, top_k=0, max_tokens=32, logprobs=0, generation_kwargs={"seed": 1}, repetition_penalty=1.0
    )
    assert generator.generate([]) == []


def test_completion_from_a_vllm_sample():
    position = lambda token, value: {token: SimpleNamespace(logprob=value), 99: SimpleNamespace(logprob=-9.0)}  # noqa: E731
    sample = SimpleNamespace(token_ids=(4, 2), logprobs=[position(4, -0.3), position(2, -0.01)])
    assert completion_from_vllm_sample(sample) == Completion([4, 2], [-0.3, -0.01])
    with pytest.raises(ValueError, match="SamplingParams\\(logprobs=0\\)"):
        completion_from_vllm_sample(SimpleNamespace(token_ids=(4,), logprobs=None))


def _vllm_generation(mode: str, **overrides):
    settings = dict(
        mode=mode,
        tensor_parallel_size=1,
        enable_sleep_mode=False,
        max_completion_length=64,
        temperature=0.9,
        top_p=0.95,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=None,
        llm="LLM",
        vllm_client=_TRLServerClient(),
    )
    settings.update(overrides)
    return SimpleNamespace(vllm_generation=SimpleNamespace(**settings))


def test_from_trainer_reads_trl_settings_and_rejects_unsupported_modes():
    colocate = VLLMColocateGenerator.from_trainer(_vllm_generation("colocate"), max_new_tokens=8)
    assert colocate.llm == "LLM"
    assert colocate.sampling == dict(
        n=1, max_tokens=8, temperature=0.9, top_p=0.95, top_k=-1, min_p=0.0, repetition_penalty=1.0, logprobs=0
    )
    server = VLLMServerGenerator.from_trainer(_vllm_generation("server"))
    assert server.sampling["max_tokens"] == 64 and isinstance(server.client, _TRLServerClient)
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        VLLMColocateGenerator.from_trainer(_vllm_generation("server"))
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=1"):
        VLLMColocateGenerator.from_trainer(_vllm_generation("colocate", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        VLLMColocateGenerator.from_trainer(_vllm_generation("colocate", enable_sleep_mode=True))
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        VLLMServerGenerator.from_trainer(SimpleNamespace())


def test_one_sampling_settings_home_for_every_generator(tiny):
    """TRL's settings are read once (`SamplingSettings.from_trl`), and each backend gets them under its own names."""
    args = SimpleNamespace(
        max_completion_length=20,
        temperature=0.5,
        top_p=0.9,
        top_k=None,
        min_p=0.05,
        repetition_penalty=1.3,
        generation_kwargs={"no_repeat_ngram_size": 2},
    )
    settings = SamplingSettings.from_trl(args)
    assert settings == SamplingSettings(20, 0.5, 0.9, 0, 0.05, 1.3, {"no_repeat_ngram_size": 2})
    # TRL's AsyncGRPOConfig has no generation_kwargs: the extra request fields are the method's (RLMT's stop)
    async_args = SimpleNamespace(**{k: v for k, v in vars(args).items() if k != "generation_kwargs"})
    assert SamplingSettings.from_trl(async_args).generation_kwargs == {}
    assert SamplingSettings.from_trl(async_args, {"stop": ["</response>"]}).generation_kwargs == {
        "stop": ["</response>"]
    }
    model, tokenizer = tiny
    trainer = SimpleNamespace(
        args=args, model=model, processing_class=tokenizer, accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transformers = TransformersGenerator.from_trainer(trainer, batch_size=2, top_k=7)
    assert transformers.batch_size == 2 and transformers.settings == SamplingSettings(
        20, 0.5, 0.9, 7, 0.05, 1.3, {"no_repeat_ngram_size": 2}
    )
    config = transformers._generation_config()
    assert (config.max_new_tokens, config.temperature, config.top_p, config.top_k) == (20, 0.5, 0.9, 7)
    assert (config.min_p, config.repetition_penalty, config.no_repeat_ngram_size) == (0.05, 1.3, 2)
    greedy = TransformersGenerator(model, tokenizer, temperature=0)._generation_config()
    assert not greedy.do_sample and greedy.repetition_penalty in (None, 1.0) and greedy.min_p is None  # no-ops: unset
    colocate = VLLMColocateGenerator("LLM", settings=settings, top_k=4)
    assert colocate.settings.top_k == 4 and settings.top_k == 0  # a field passed by keyword wins; settings unchanged
    assert colocate.sampling == dict(
        n=1, max_tokens=20, temperature=0.5, top_p=0.9, top_k=4, min_p=0.05, repetition_penalty=1.3, logprobs=0,
        no_repeat_ngram_size=2,
    )  # fmt: skip
    server = VLLMServerGenerator(_TRLServerClient(), settings=settings)
    assert server.sampling == dict(
        max_tokens=20, temperature=0.5, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.3,
        generation_kwargs={"no_repeat_ngram_size": 2},
    )  # fmt: skip
    for make in (VLLMColocateGenerator, VLLMServerGenerator):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            make(None, temperature=-1.0)
        with pytest.raises(TypeError, match="max_tokens"):
            make(None, max_tokens=8)  # vLLM's name is not a setting: max_new_tokens is


def test_canonical_order_generator_is_order_independent():
    """The same multiset of prompts gets the same completion per prompt, whatever order they arrive in."""
    seen = []

    class Counting:
        def generate(self, prompts):
            seen.append([list(p) for p in prompts])
            return [Completion(token_ids=[i], logprobs=[0.0]) for i in range(len(prompts))]

    wrapped = CanonicalOrderGenerator(Counting())
    prompts = [[3, 1], [2], [1, 9, 9], [2, 5]]
    first = {tuple(p): c.token_ids for p, c in zip(prompts, wrapped.generate(prompts))}
    reordered = [prompts[i] for i in (2, 0, 3, 1)]
    second = {tuple(p): c.token_ids for p, c in zip(reordered, wrapped.generate(reordered))}
    assert first == second and seen[0] == seen[1]
