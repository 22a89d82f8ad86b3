"""`ServedPolicyGenerator`: the RLM engine's `trl_ext.rlm.Generator` against an OpenAI-compatible ``vllm serve``,
asking for the policy version the asynchronous trainer last published.

TRL's asynchronous trainer publishes each LoRA sync as the adapter ``trl-policy-v{N}`` (``/v1/load_lora_adapter``);
in vLLM's API an adapter *is* a model name, and naming the base model while an adapter is loaded silently serves the
base model. So every request names the version the worker was last told (`update_model_version`); with LoRA sync off
(full-weight sync, or none) it names the base model.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from ...rlm.generators import Completion, SamplingSettings

__all__ = ["ServedPolicyGenerator"]

MAX_CONCURRENT_REQUESTS = 64  # requests of one generator call in flight at once


class ServedPolicyGenerator:
    """Sampling from ``vllm serve`` (``POST /v1/completions`` with token-id prompts): one call per wave, one request
    per prompt, sent concurrently (vLLM batches them).

    Args:
        base_url: the server, e.g. ``"http://localhost:8000"``.
        model_name: the served base model's name (the request's ``model`` without LoRA sync).
        lora_name: the adapter prefix the trainer publishes (``"trl-policy"``), or None without LoRA sync.
        settings: the `SamplingSettings` (``generation_kwargs`` are sent as-is).
        timeout_s: one request's timeout.
        seed: seeds the per-request sampling seeds (so two workers of one seed sample the same).

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
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.lora_name = lora_name
        self.settings = settings if settings is not None else SamplingSettings()
        self.timeout_s = timeout_s
        self.model_version = 0
        self.versions_used: list[int] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    @property
    def request_model(self) -> str:
        """The ``model`` of the next request: ``<lora_name>-v<version>``, or the base model without LoRA sync."""
        return self.request_model_of(self.model_version)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """One completion per prompt, each from a request of its own with a seed of its own, sent concurrently.

        vLLM gives every prompt of one batched request the request's seed: the G identical first prompts of a task's
        trees would get G identical completions (and a group advantage of 0). One request per prompt, sent at once,
        keeps vLLM's batching (it batches concurrent requests) and gives each prompt its own draw.
        """
        if not prompts:
            return []
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
        payload: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt),
            **self.settings.vllm_fields(top_k_off=-1),
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed,
            **self.settings.generation_kwargs,
        }
        response = requests.post(f"{self.base_url}/v1/completions", json=payload, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(
                f"vllm serve at {self.base_url} answered {response.status_code} for model {model!r}: "
                f"{response.text[:500]}"
            )
        choices = response.json()["choices"]
        if len(choices) != 1:
            raise RuntimeError(f"vllm serve returned {len(choices)} completions for one prompt.")
        token_ids = choices[0].get("token_ids")
        logprobs = (choices[0].get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None:
            raise RuntimeError(
                "vllm serve returned no token ids or log-probs: it must support return_token_ids and logprobs "
                "(vLLM >= 0.10)."
            )
        return Completion(token_ids=list(token_ids), logprobs=[float(v) for v in logprobs])
