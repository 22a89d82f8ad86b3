"""Generators: the batched policy calls the rollout engine makes (prompt token ids in, completions out).

A `Generator` is anything with ``generate(prompts) -> list[Completion]``: one `Completion` (sampled token ids
and the log-prob of each under the *sampling* distribution, i.e. after temperature and top-p/top-k) per
prompt, in order. Sampling settings belong to the generator, not to the engine. The engine calls `generate`
from one worker thread, one call at a time.

Implementations:

- `TransformersGenerator`: ``model.generate`` on an (unwrapped) transformers model; CPU or GPU. Used by tests.
- `VLLMColocateGenerator`: the colocated ``vllm.LLM`` a TRL trainer holds (``trainer.vllm_generation.llm``
  when ``vllm_mode="colocate"``).
- `VLLMServerGenerator`: TRL's vLLM server client (``trl.generation.vllm_client.VLLMClient``, ``trl vllm-serve``).
- `ScriptedGenerator`: fixed completions computed from the prompt text; for tests and benchmarks.
- `CanonicalOrderGenerator`: wraps any of them so that a batch's samples do not depend on the order its requests
  arrived in (the trainers use it: the same seed gives the same rollouts).

vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CanonicalOrderGenerator",
    "Completion",
    "Generator",
    "ScriptedGenerator",
    "TransformersGenerator",
    "VLLMColocateGenerator",
    "VLLMServerGenerator",
]


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: the sampled tokens (C,), the eos token included when it was sampled.
        logprobs: (C,) log-prob of each sampled token under the sampling distribution.
    """

    token_ids: list[int]
    logprobs: list[float]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"A Completion needs one logprob per token: got {len(self.token_ids)} tokens and "
                f"{len(self.logprobs)} logprobs"
            )


@runtime_checkable
class Generator(Protocol):
    """Batched sampling from the policy."""

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """One completion per prompt (B prompts of token ids -> B completions, same order)."""
        ...


# ---------------------------------------------------------------------------------------------- scripted
@dataclass
class ScriptedGenerator:
    """Completions chosen by a function of the decoded prompt: deterministic rollouts for tests and benchmarks.

    Args:
        respond: maps the decoded prompt (special tokens kept, so the chat roles are visible) to the completion
            text.
        tokenizer: encodes completions and decodes prompts.
        latency_s: sleep per `generate` call, whatever the batch size (a stand-in for a real engine's latency).
        append_eos: end every completion with the tokenizer's eos token, like a model that stopped by itself.

    Attributes:
        batch_sizes: the size of every `generate` call made so far.
        prompts: every decoded prompt seen, in call order.
    """

    respond: Callable[[str], str]
    tokenizer: Any
    latency_s: float = 0.0
    append_eos: bool = True
    batch_sizes: list[int] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        started = time.perf_counter()
        texts = [self.tokenizer.decode(list(prompt), skip_special_tokens=False) for prompt in prompts]
        completions = []
        for text in texts:
            ids = list(self.tokenizer(self.respond(text), add_special_tokens=False)["input_ids"])
            if self.append_eos and self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)
            completions.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids)))
        with self._lock:
            self.batch_sizes.append(len(prompts))
            self.prompts.extend(texts)
        remaining = self.latency_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return completions


# ----------------------------------------------------------------------------------------- transformers
class TransformersGenerator:
    """Sampling with ``model.generate`` of a transformers causal LM, with per-token sampling log-probs.

    The log-probs come from the *processed* scores ``generate`` samples from (temperature, top-k, top-p
    applied), the same quantity as vLLM's ``logprobs_mode="processed_logprobs"`` that TRL uses.

    Args:
        model: an unwrapped causal LM (``accelerator.unwrap_model(trainer.model)``), PEFT models included.
        tokenizer: gives the pad and eos ids (or pass them).
        max_new_tokens: completion length cap.
        temperature: 0 means greedy decoding.
        top_p / top_k: nucleus and top-k filtering (``top_k=0``: off).
        batch_size: prompts per ``generate`` call (None: all at once).
        pad_token_id / eos_token_id: override the tokenizer's; `eos_token_id` may be a list.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_size: int | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.pad_token_id is None:
            if not self.eos_token_ids:
                raise ValueError("Pass pad_token_id (or a tokenizer with a pad token): prompts are left-padded")
            self.pad_token_id = min(self.eos_token_ids)

    @classmethod
    def from_trainer(cls, trainer: Any, **overrides: Any) -> TransformersGenerator:
        """Sample with a TRL trainer's model and generation settings (``max_completion_length``, temperature...)."""
        args = trainer.args
        settings = {
            "max_new_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k or 0,
        }
        settings.update(overrides)
        model = trainer.accelerator.unwrap_model(trainer.model)
        return cls(model, trainer.processing_class, **settings)

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": sorted(self.eos_token_ids),
        }
        if self.temperature == 0:
            params["do_sample"] = False
        else:
            params.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0: off
        return GenerationConfig(**params)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if not prompts:
            return []
        step = self.batch_size or len(prompts)
        completions: list[Completion] = []
        for start in range(0, len(prompts), step):
            completions += self._generate_batch(prompts[start : start + step])
        return completions

    def _generate_batch(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        import torch

        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("Every prompt needs at least one token")
        width = max(len(prompt) for prompt in prompts)
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                output = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=self._generation_config(),
                    output_scores=True,
                    return_dict_in_generate=True,
                )
        finally:
            self.model.train(was_training)
        sequences = output.sequences[:, width:].cpu()  # (B, T)
        # scores[t]: (B, V) processed logits of step t; log-softmax one step at a time to keep memory at (B, V).
        logprobs = torch.stack(
            [
                torch.log_softmax(step_scores.float(), dim=-1)
                .gather(1, sequences[:, t : t + 1].to(step_scores.device))
                .squeeze(1)
                .cpu()
                for t, step_scores in enumerate(output.scores)
            ],
            dim=1,
        )  # (B, T)
        completions = []
        for row in range(len(prompts)):
            ids = sequences[row].tolist()
            length = len(ids)
            for position, token in enumerate(ids):
                if token in self.eos_token_ids:
                    length = position + 1  # keep the eos: it was sampled and is trained on
                    break
            completions.append(Completion(token_ids=ids[:length], logprobs=logprobs[row, :length].tolist()))
        return completions


# ------------------------------------------------------------------------------------------------- vLLM
def sampled_token_logprobs(
    completion_ids: Sequence[int],
    logprobs: Sequence[Sequence[float | None]],
    logprob_token_ids: Sequence[Sequence[int]] | None,
) -> list[float]:
    """The log-prob of each sampled token from TRL-style per-position top-logprob lists.

    TRL returns, per completion position, a list of log-probs sorted by rank and the matching token ids; with
    ``logprobs=0`` the list holds the sampled token only, with ``logprobs=N`` the sampled token is among the
    N+1 entries but not necessarily first. A missing value (vLLM's NaN, TRL's None) becomes ``-inf``.

    Args:
        completion_ids: (C,) the sampled tokens.
        logprobs: (C, K) log-probs per position.
        logprob_token_ids: (C, K) token ids per position, or None when K is 1 (the sampled token).
    """
    if len(logprobs) != len(completion_ids):
        raise ValueError(f"got {len(logprobs)} logprob positions for {len(completion_ids)} completion tokens")
    values = []
    for position, token in enumerate(completion_ids):
        candidates = logprobs[position]
        if logprob_token_ids is None:
            value = candidates[0]
        else:
            try:
                value = candidates[list(logprob_token_ids[position]).index(token)]
            except ValueError:
                raise ValueError(f"the sampled token {token} at position {position} has no logprob entry") from None
        values.append(-math.inf if value is None or math.isnan(value) else float(value))
    return values


class VLLMColocateGenerator:
    """Sampling with a colocated ``vllm.LLM`` (TRL's ``vllm_mode="colocate"``: ``trainer.vllm_generation.llm``).

    Each rank samples with its own engine, so ranks need not call in lockstep; tensor parallelism across ranks
    (which needs lockstep calls) is not supported. TRL creates the engine with
    ``logprobs_mode="processed_logprobs"``: the log-probs are those of the sampling distribution.

    Args:
        llm: a ``vllm.LLM``.
        max_new_tokens / temperature / top_p / top_k / min_p / repetition_penalty: vLLM sampling parameters
            (``top_k=0`` or ``-1``: off).
        generation_kwargs: more ``vllm.SamplingParams`` fields (e.g. ``{"seed": 0}``); they win over the above.
    """

    def __init__(
        self,
        llm: Any,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.llm = llm
        self.sampling = {
            "n": 1,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k and top_k > 0 else -1,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "logprobs": 0,  # the sampled token's log-prob only
            **(generation_kwargs or {}),
        }

    @classmethod
    def from_trainer(cls, trainer: Any, **overrides: Any) -> VLLMColocateGenerator:
        """The colocated engine of a TRL trainer, with its sampling settings (``overrides`` win)."""
        vllm_generation = getattr(trainer, "vllm_generation", None)
        if vllm_generation is None or vllm_generation.mode != "colocate":
            raise ValueError(
                "VLLMColocateGenerator.from_trainer needs a trainer with use_vllm=True, vllm_mode='colocate'"
            )
        if vllm_generation.tensor_parallel_size > 1:
            raise ValueError(
                "vllm_tensor_parallel_size > 1 needs every rank of a TP group to generate in lockstep, which "
                "independent rollout engines do not do; use vllm_tensor_parallel_size=1 or vllm_mode='server'."
            )
        if vllm_generation.enable_sleep_mode:
            raise ValueError(
                "vllm_enable_sleep_mode=True discards the engine's weights between generations; set it to False "
                "for RLM rollouts (they call the engine many times per step)."
            )
        return cls(vllm_generation.llm, **{**_trl_sampling(vllm_generation), **overrides})

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if not prompts:
            return []
        from vllm import SamplingParams

        outputs = self.llm.generate(
            [{"prompt_token_ids": list(prompt)} for prompt in prompts],
            sampling_params=SamplingParams(**self.sampling),
            use_tqdm=False,
        )
        return [completion_from_vllm_sample(output.outputs[0]) for output in outputs]


def completion_from_vllm_sample(sample: Any) -> Completion:
    """A `Completion` from a vLLM ``CompletionOutput`` generated with ``logprobs>=0``."""
    token_ids = [int(token) for token in sample.token_ids]
    if sample.logprobs is None:
        raise ValueError("vLLM returned no logprobs: sample with SamplingParams(logprobs=0)")
    logprobs = []
    for token, position in zip(token_ids, sample.logprobs, strict=True):
        value = position[token].logprob  # one dict per position: token id -> Logprob (sampled token always there)
        logprobs.append(-math.inf if value is None or math.isnan(value) else float(value))
    return Completion(token_ids=token_ids, logprobs=logprobs)


class VLLMServerGenerator:
    """Sampling through TRL's vLLM server client (``trl vllm-serve`` + ``trl.generation.vllm_client.VLLMClient``).

    Plain HTTP requests: every rank may own a client and call independently. The server's ``--logprobs-mode``
    decides what the log-probs are; run it with ``processed_logprobs`` so they match the sampling distribution.

    Args:
        client: a ``VLLMClient`` (or any object with its ``generate`` signature).
        max_new_tokens / temperature / top_p / top_k / min_p / repetition_penalty: sampling parameters.
        generation_kwargs: more sampling fields sent as-is (e.g. ``{"seed": 0}``).
    """

    def __init__(
        self,
        client: Any,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.sampling = {
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k and top_k > 0 else 0,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "generation_kwargs": generation_kwargs or {},
        }

    @classmethod
    def from_url(cls, base_url: str, *, connection_timeout: float = 240.0, **sampling: Any) -> VLLMServerGenerator:
        """Connect a new client (no weight-sync communicator: the trainer keeps syncing weights itself)."""
        from trl.generation.vllm_client import VLLMClient

        return cls(VLLMClient(base_url=base_url, connection_timeout=connection_timeout), **sampling)

    @classmethod
    def from_trainer(cls, trainer: Any, **overrides: Any) -> VLLMServerGenerator:
        """A TRL trainer's server and sampling settings; reuses the main process's client, connects on others."""
        vllm_generation = getattr(trainer, "vllm_generation", None)
        if vllm_generation is None or vllm_generation.mode != "server":
            raise ValueError("VLLMServerGenerator.from_trainer needs a trainer with use_vllm=True, vllm_mode='server'")
        settings = {**_trl_sampling(vllm_generation), **overrides}
        client = getattr(vllm_generation, "vllm_client", None)
        if client is not None:
            return cls(client, **settings)
        base_url = (
            vllm_generation.server_base_url or f"http://{vllm_generation.server_host}:{vllm_generation.server_port}"
        )
        return cls.from_url(base_url, connection_timeout=vllm_generation.server_timeout, **settings)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if not prompts:
            return []
        output = self.client.generate(prompts=[list(prompt) for prompt in prompts], n=1, logprobs=0, **self.sampling)
        completion_ids = output["completion_ids"]
        if len(completion_ids) != len(prompts):
            raise ValueError(f"the vLLM server returned {len(completion_ids)} completions for {len(prompts)} prompts")
        if output.get("logprobs") is None:
            raise ValueError("the vLLM server returned no logprobs; it must support logprobs=0")
        token_ids_per_position = output.get("logprob_token_ids")
        return [
            Completion(
                token_ids=list(ids),
                logprobs=sampled_token_logprobs(
                    ids, output["logprobs"][row], token_ids_per_position[row] if token_ids_per_position else None
                ),
            )
            for row, ids in enumerate(completion_ids)
        ]


def _trl_sampling(vllm_generation: Any) -> dict[str, Any]:
    """Sampling settings of TRL's ``VLLMGeneration`` (trl.generation.vllm_generation), as our keyword names."""
    return {
        "max_new_tokens": vllm_generation.max_completion_length,
        "temperature": vllm_generation.temperature,
        "top_p": vllm_generation.top_p,
        "top_k": vllm_generation.top_k or 0,
        "min_p": vllm_generation.min_p or 0.0,
        "repetition_penalty": vllm_generation.repetition_penalty,
        "generation_kwargs": dict(vllm_generation.generation_kwargs or {}),
    }


class CanonicalOrderGenerator:
    """Wraps a `Generator` so that a batch's samples do not depend on the order its requests arrived in.

    `RLMEngine` queues a wave's requests in the order the nodes finished their REPL cells, which varies from run to
    run; batched sampling gives row i the i-th random draw, so the same seed would give different rollouts. Sorting
    each call's prompts first makes the (prompt, completion) pairs of a wave a function of the seed alone. Nodes with
    identical prompts are interchangeable (same history, same REPL state), but which of them gets which completion
    can still vary: `trl_ext.rlm.canonical_rollout_order` puts the rollouts of each example in a canonical order.
    """

    def __init__(self, inner: Generator):
        self.inner = inner

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), tuple(prompts[i])))
        completions = self.inner.generate([prompts[i] for i in order])
        result: list[Any] = [None] * len(prompts)
        for position, index in enumerate(order):
            result[index] = completions[position]
        return result
