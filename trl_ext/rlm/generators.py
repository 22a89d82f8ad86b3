"""Generators: the batched policy calls the rollout engine makes (prompt token ids in, completions out).

A `Generator` is anything with ``generate(prompts) -> list[Completion]``: one `Completion` (sampled token ids
and the log-prob of each under the *sampling* distribution, i.e. after temperature and top-p/top-k) per
prompt, in order. Sampling settings belong to the generator, not to the engine: every generator below takes the
same `SamplingSettings` (as a ``settings=`` object or as its fields, keyword by keyword), read from a TRL trainer by
`SamplingSettings.from_trl`. The engine calls `generate` from one worker thread, one call at a time.

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

import dataclasses
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
    "SamplingSettings",
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


@dataclass(frozen=True)
class SamplingSettings:
    """How the policy samples, whatever the backend: the one home of the settings every generator shares.

    The names are TRL's sampling settings (``GRPOConfig``, ``VLLMGeneration``), ``max_completion_length`` being
    ``max_new_tokens`` here; `from_trl` reads them. Each generator turns them into its backend's parameters.
    """

    max_new_tokens: int = field(default=256, metadata={"help": "Completion length cap, in tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; 0 means greedy decoding."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set of this mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 (or negative): off."})
    min_p: float = field(default=0.0, metadata={"help": "Min-p filtering (relative to the top token); 0: off."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty; 1.0: off."})
    generation_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "More backend sampling fields, sent as-is (e.g. {'seed': 0}); they win over the above."},
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        object.__setattr__(self, "generation_kwargs", dict(self.generation_kwargs or {}))

    @classmethod
    def from_trl(cls, source: Any, generation_kwargs: dict[str, Any] | None = None) -> SamplingSettings:
        """The sampling settings of a TRL ``GRPOConfig`` (``trainer.args``), ``VLLMGeneration`` or ``AsyncGRPOConfig``,
        which share names; ``generation_kwargs``: the extra request fields (default: the source's; an
        ``AsyncGRPOConfig`` has none, so extra fields such as ``stop`` are the method's)."""
        if generation_kwargs is None:
            generation_kwargs = getattr(source, "generation_kwargs", None)
        return cls(
            max_new_tokens=source.max_completion_length,
            temperature=source.temperature,
            top_p=source.top_p,
            top_k=source.top_k or 0,
            min_p=source.min_p or 0.0,
            repetition_penalty=source.repetition_penalty,
            generation_kwargs=dict(generation_kwargs or {}),
        )

    @classmethod
    def resolve(cls, settings: SamplingSettings | None, fields: dict[str, Any]) -> SamplingSettings:
        """``settings`` (default: all defaults) with ``fields`` replaced: what a generator's ``__init__`` gets."""
        return dataclasses.replace(settings, **fields) if settings is not None else cls(**fields)

    @property
    def top_k_on(self) -> bool:
        return bool(self.top_k) and self.top_k > 0

    def vllm_fields(self, *, top_k_off: int) -> dict[str, Any]:
        """The fields under vLLM's names (``max_tokens``...), ``generation_kwargs`` apart; ``top_k_off`` means off."""
        return {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k_on else top_k_off,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }


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
        settings: the `SamplingSettings` (``temperature=0``: greedy decoding; ``generation_kwargs`` go to
            ``GenerationConfig``).
        batch_size: prompts per ``generate`` call (None: all at once).
        pad_token_id / eos_token_id: override the tokenizer's; `eos_token_id` may be a list.
        **sampling: `SamplingSettings` fields (``max_new_tokens``, ``temperature``, ...), over ``settings``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        settings: SamplingSettings | None = None,
        batch_size: int | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **sampling: Any,
    ) -> None:
        self.settings = SamplingSettings.resolve(settings, sampling)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.model = model
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
        """Sample with a TRL trainer's model and sampling settings (`SamplingSettings.from_trl` of its args)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        return cls(model, trainer.processing_class, settings=SamplingSettings.from_trl(trainer.args), **overrides)

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        settings = self.settings
        params: dict[str, Any] = {
            "max_new_tokens": settings.max_new_tokens,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": sorted(self.eos_token_ids),
            "output_scores": True,  # the processed scores give the log-probs (in the config: transformers deprecates
            "return_dict_in_generate": True,  # passing them next to a generation_config)
        }
        if settings.temperature == 0:
            params["do_sample"] = False
        else:
            top_k = settings.top_k if settings.top_k_on else 0  # transformers: 0 is off
            params.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=top_k)
            if settings.min_p > 0:
                params["min_p"] = settings.min_p
        if settings.repetition_penalty != 1.0:
            params["repetition_penalty"] = settings.repetition_penalty
        params.update(settings.generation_kwargs)
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
        settings: the `SamplingSettings`; ``generation_kwargs`` are more ``vllm.SamplingParams`` fields
            (e.g. ``{"seed": 0}``) and win over the others.
        **sampling: `SamplingSettings` fields (``max_new_tokens``, ``temperature``, ...), over ``settings``.
    """

    def __init__(self, llm: Any, *, settings: SamplingSettings | None = None, **sampling: Any) -> None:
        self.llm = llm
        self.settings = SamplingSettings.resolve(settings, sampling)
        self.sampling = {  # the keyword arguments of vllm.SamplingParams
            "n": 1,
            **self.settings.vllm_fields(top_k_off=-1),
            "logprobs": 0,  # the sampled token's log-prob only
            **self.settings.generation_kwargs,
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
        return cls(vllm_generation.llm, settings=SamplingSettings.from_trl(vllm_generation), **overrides)

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
        settings: the `SamplingSettings`; ``generation_kwargs`` are sent as-is (e.g. ``{"seed": 0}``).
        **sampling: `SamplingSettings` fields (``max_new_tokens``, ``temperature``, ...), over ``settings``.
    """

    def __init__(self, client: Any, *, settings: SamplingSettings | None = None, **sampling: Any) -> None:
        self.client = client
        self.settings = SamplingSettings.resolve(settings, sampling)
        self.sampling = {  # the sampling keyword arguments of VLLMClient.generate
            **self.settings.vllm_fields(top_k_off=0),
            "generation_kwargs": self.settings.generation_kwargs,
        }

    @classmethod
    def from_url(cls, base_url: str, *, connection_timeout: float = 240.0, **sampling: Any) -> VLLMServerGenerator:
        """Connect a new client (no weight-sync communicator: the trainer keeps syncing weights itself); ``sampling``:
        the keyword arguments of `VLLMServerGenerator` (``settings=`` and/or `SamplingSettings` fields)."""
        from trl.generation.vllm_client import VLLMClient

        return cls(VLLMClient(base_url=base_url, connection_timeout=connection_timeout), **sampling)

    @classmethod
    def from_trainer(cls, trainer: Any, **overrides: Any) -> VLLMServerGenerator:
        """A TRL trainer's server and sampling settings; reuses the main process's client, connects on others."""
        vllm_generation = getattr(trainer, "vllm_generation", None)
        if vllm_generation is None or vllm_generation.mode != "server":
            raise ValueError("VLLMServerGenerator.from_trainer needs a trainer with use_vllm=True, vllm_mode='server'")
        settings = SamplingSettings.from_trl(vllm_generation)
        client = getattr(vllm_generation, "vllm_client", None)
        if client is not None:
            return cls(client, settings=settings, **overrides)
        base_url = (
            vllm_generation.server_base_url or f"http://{vllm_generation.server_host}:{vllm_generation.server_port}"
        )
        return cls.from_url(
            base_url, connection_timeout=vllm_generation.server_timeout, settings=settings, **overrides
        )

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


class CanonicalOrderGenerator:
    """Wraps a `Generator` so that a batch's samples do not depend on the order its requests arrived in.

    Batched sampling gives row i the i-th random draw, so the same seed gives the same rollouts only if every request
    lands in the same row. `RLMEngine` already hands each call its requests in the order of their place in the
    rollouts (tree, node path, turn), not in the order the REPL cells finished; this wrapper also sorts a call's
    prompts (a stable sort: identical prompts keep the engine's order), so a caller that passes prompts in any order
    gets the same (prompt, completion) pairs. Identical prompts need that tie-break: two children given different
    contexts of one length see the same prompt (the context is in their REPL, not in the prompt) but are not
    interchangeable. `trl_ext.rlm.canonical_rollout_order` puts the rollouts of each example in a canonical order.
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
