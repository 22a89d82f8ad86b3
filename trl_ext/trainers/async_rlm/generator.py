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
from typing import Any

import requests

from ...rlm.generators import Completion, SamplingSettings

__all__ = ["ServedPolicyGenerator"]


class ServedPolicyGenerator:
    """Batched sampling from ``vllm serve`` (``POST /v1/completions`` with token-id prompts), one call per wave.

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
        self._session = requests.Session()

    @property
    def request_model(self) -> str:
        """The ``model`` of the next request: ``<lora_name>-v<version>``, or the base model without LoRA sync."""
        return self.model_name if self.lora_name is None else f"{self.lora_name}-v{self.model_version}"

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if not prompts:
            return []
        with self._lock:
            version, seed = self.model_version, self._random.getrandbits(62)
            self.versions_used.append(version)
        payload: dict[str, Any] = {
            "model": self.request_model,
            "prompt": [list(prompt) for prompt in prompts],
            **self.settings.vllm_fields(top_k_off=-1),
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed,
            **self.settings.generation_kwargs,
        }
        response = self._session.post(f"{self.base_url}/v1/completions", json=payload, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(
                f"vllm serve at {self.base_url} answered {response.status_code} for model {payload['model']!r}: "
                f"{response.text[:500]}"
            )
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(prompts):
            raise RuntimeError(f"vllm serve returned {len(choices)} completions for {len(prompts)} prompts.")
        completions = []
        for choice in choices:
            token_ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if token_ids is None or logprobs is None:
                raise RuntimeError(
                    "vllm serve returned no token ids or log-probs: it must support return_token_ids and logprobs "
                    "(vLLM >= 0.10)."
                )
            completions.append(Completion(token_ids=list(token_ids), logprobs=[float(v) for v in logprobs]))
        return completions
