"""`ServedGroupGenerator`: `ServedPolicyGenerator` (the policy version TRL last published on ``vllm serve``) sampling
a group's completions as one request with ``n`` = the group size.

Why not one prompt per completion: a ``/v1/completions`` request carries one ``seed`` for all its prompts, so ``G``
copies of one prompt in one request come back as ``G`` copies of one completion (every advantage 0). With ``n = G``
vLLM seeds the ``j``-th completion ``seed + j``: distinct draws, reproducible for a seed.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import requests

from ...rlm.generators import Completion
from ..async_rlm.generator import ServedPolicyGenerator

__all__ = ["ServedGroupGenerator", "group_size"]


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


class ServedGroupGenerator(ServedPolicyGenerator):
    """Batched sampling from ``vllm serve`` (``POST /v1/completions``, token-id prompts), one request per call: the
    distinct prompts with ``n`` = the group size (`group_size`). The arguments are `ServedPolicyGenerator`'s; its
    ``settings.generation_kwargs`` (e.g. ``{"stop": ["</response>"]}``) are sent as-is."""

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, seed=seed, **kwargs)
        self._seeds = random.Random(seed)
        self._seed_lock = threading.Lock()
        self._http = requests.Session()

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        if not prompts:
            return []
        n = group_size(prompts)
        with self._seed_lock:
            version, seed = self.model_version, self._seeds.getrandbits(62)
            self.versions_used.append(version)
        payload: dict[str, Any] = {
            "model": self.request_model,
            "prompt": [list(prompt) for prompt in prompts[::n]],
            **self.settings.vllm_fields(top_k_off=-1),
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed,
            **self.settings.generation_kwargs,
        }
        response = self._http.post(f"{self.base_url}/v1/completions", json=payload, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(
                f"vllm serve at {self.base_url} answered {response.status_code} for model {payload['model']!r}: "
                f"{response.text[:500]}"
            )
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])  # prompt-major, then j
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
