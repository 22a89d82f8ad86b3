"""`ServedPolicyGenerator`: a `trl_ext.rlm.Generator` against an OpenAI-compatible ``vllm serve``, asking for the
policy version the asynchronous trainer last published: what every asynchronous method's rollout worker samples from
(the RLM engine's turns, judged rollouts, RLMT groups).

TRL's asynchronous trainer publishes each LoRA sync as the adapter ``trl-policy-v{N}`` (``/v1/load_lora_adapter``);
in vLLM's API an adapter *is* a model name, and naming the base model while an adapter is loaded silently serves the
base model. So every request names the version the worker was last told (`update_model_version`); with LoRA sync off
(full-weight sync, or none) it names the base model.

Two ways to ask, both giving every completion its own draw (a ``/v1/completions`` request carries one ``seed`` for
all its prompts, so ``G`` copies of one prompt in one request would come back as ``G`` copies of one completion):

- one request per prompt, each with a seed of its own, sent concurrently (the default: RLM turns, judged rollouts);
- ``group_requests=True`` (RLMT): one request per call, the distinct prompts with ``n`` = the group size
  (`group_size`); vLLM seeds the ``j``-th completion ``seed + j``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from ..rlm.generators import Completion, SamplingSettings

__all__ = ["ServedGroupGenerator", "ServedPolicyGenerator", "group_size"]

MAX_CONCURRENT_REQUESTS = 64  # requests of one generator call in flight at once


def group_size(prompts: Sequence[Sequence[int]]) -> int:
    """``n`` when ``prompts`` is consecutive blocks of ``n`` identical prompts (the first block's length), else 1."""
    if not prompts:
        return 1
    first = list(prompts[0])
    size = 1
    while size < len(prompts) and list(prompts[size]) == first:
        size += 1
    if len(prompts) % size:
        return 1
    for start in range(0, len(prompts), size):
        block = [list(prompt) for prompt in prompts[start : start + size]]
        if any(prompt != block[0] for prompt in block):
            return 1
    return size


class ServedPolicyGenerator:
    """Sampling from ``vllm serve`` (``POST /v1/completions`` with token-id prompts): one call per wave, one request
    per prompt, sent concurrently (vLLM batches them); or, with ``group_requests``, one request per call with ``n``.

    Args:
        base_url: the server, e.g. ``"http://localhost:8000"``.
        model_name: the served base model's name (the request's ``model`` without LoRA sync).
        lora_name: the adapter prefix the trainer publishes (``"trl-policy"``), or None without LoRA sync.
        settings: the `SamplingSettings` (``generation_kwargs`` are sent as-is).
        timeout_s: one request's timeout.
        seed: seeds the per-request sampling seeds (so two workers of one seed sample the same).
        group_requests: one request per call, the distinct prompts with ``n`` = the group size (`group_size`).

    Attributes:
        model_version: the version requested (`update_model_version`); versions_used: the version of every call.
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        lora_name: str | None = None,
        settings: SamplingSettings | None = None,
        timeout_s: float = 120.0,
        seed: int = 0,
        group_requests: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.lora_name = lora_name
        self.settings = settings if settings is not None else SamplingSettings()
        self.timeout_s = timeout_s
        self.group_requests = group_requests
        self.model_version = 0
        self.versions_used: list[int] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._http = requests.Session() if group_requests else None  # one request at a time: a kept connection

    @classmethod
    def from_config(
        cls,
        args: Any,
        model_name: str,
        lora_name: str | None,
        *,
        group_requests: bool = False,
        generation_kwargs: dict[str, Any] | None = None,
    ) -> ServedPolicyGenerator:
        """The served policy of an asynchronous trainer's config: ``vllm_server_base_url``, the sampling fields
        (`SamplingSettings.from_trl`, ``generation_kwargs`` added), ``request_timeout`` and ``seed``."""
        return cls(
            args.vllm_server_base_url,
            model_name,
            lora_name=lora_name,
            settings=SamplingSettings.from_trl(args, generation_kwargs),
            timeout_s=args.request_timeout,
            seed=args.seed,
            group_requests=group_requests,
        )

    @property
    def request_model(self) -> str:
        """The ``model`` of the next request: ``<lora_name>-v<version>``, or the base model without LoRA sync."""
        return self.request_model_of(self.model_version)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """One completion per prompt, each its own draw (module docstring), in the order of ``prompts``.

        vLLM gives every prompt of one batched request the request's seed: the G identical first prompts of a task's
        trees would get G identical completions (and a group advantage of 0). One request per prompt, sent at once,
        keeps vLLM's batching (it batches concurrent requests) and gives each prompt its own draw.
        """
        if not prompts:
            return []
        if self.group_requests:
            return self._generate_groups(prompts)
        with self._lock:
            version = self.model_version
            seeds = [self._random.getrandbits(62) for _ in prompts]
            self.versions_used.append(version)
        model = self.request_model_of(version)
        with ThreadPoolExecutor(max_workers=min(len(prompts), MAX_CONCURRENT_REQUESTS)) as pool:
            return list(pool.map(lambda item: self._complete(model, *item), zip(prompts, seeds, strict=True)))

    def request_model_of(self, version: int) -> str:
        """The request's ``model`` for policy ``version``: ``<lora_name>-v<version>``, or the base model."""
        return self.model_name if self.lora_name is None else f"{self.lora_name}-v{version}"

    def _complete(self, model: str, prompt: Sequence[int], seed: int) -> Completion:
        choices = self._request(model, list(prompt), n=1, seed=seed)
        if len(choices) != 1:
            raise RuntimeError(f"vllm serve returned {len(choices)} completions for one prompt.")
        return _completion(choices[0])

    def _generate_groups(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """The distinct prompts in one request with ``n`` = `group_size`, completions prompt-major."""
        n = group_size(prompts)
        with self._lock:
            version, seed = self.model_version, self._random.getrandbits(62)
            self.versions_used.append(version)
        choices = self._request(self.request_model_of(version), [list(p) for p in prompts[::n]], n=n, seed=seed)
        choices = sorted(choices, key=lambda choice: choice["index"])  # prompt-major, then j
        if len(choices) != len(prompts):
            raise RuntimeError(f"vllm serve returned {len(choices)} completions for {len(prompts)} prompts.")
        return [_completion(choice) for choice in choices]

    def _request(self, model: str, prompt: list, *, n: int, seed: int) -> list[dict[str, Any]]:
        """``POST /v1/completions`` of ``prompt`` (one prompt's ids, or a list of them); the answer's ``choices``."""
        payload: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            **self.settings.vllm_fields(top_k_off=-1),
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed,
            **self.settings.generation_kwargs,
        }
        post = self._http.post if self._http is not None else requests.post
        response = post(f"{self.base_url}/v1/completions", json=payload, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(
                f"vllm serve at {self.base_url} answered {response.status_code} for model {model!r}: "
                f"{response.text[:500]}"
            )
        return response.json()["choices"]


class ServedGroupGenerator(ServedPolicyGenerator):
    """`ServedPolicyGenerator` with ``group_requests=True``: a group's completions in one request with ``n``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, group_requests=True, **kwargs)


def _completion(choice: dict[str, Any]) -> Completion:
    """A choice of ``/v1/completions`` as a `Completion` (its token ids and their log-probs)."""
    token_ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if token_ids is None or logprobs is None:
        raise RuntimeError(
            "vllm serve returned no token ids or log-probs: it must support return_token_ids and logprobs "
            "(vLLM >= 0.10)."
        )
    return Completion(token_ids=list(token_ids), logprobs=[float(v) for v in logprobs])
