"""RLMT on TRL's experimental asynchronous trainer (docs/rlmt.md, docs/async.md).

- `AsyncRLMTTrainer` / `AsyncRLMTConfig`: the trainer and its settings (`RLMTConfig`'s names).
- `RLMTRolloutWorker`: TRL's ``RolloutWorkerProtocol``: RLMT prompts, completions cut at the stop strings, scored
  in-process, in a thread.
- `ServedGroupGenerator`: a group's completions from ``vllm serve`` in one request (``n`` = group size, the stop
  strings as ``stop``).
- `cut_at_stop`, `scored_advantages`, `completion_sample`: the pure steps from completions to TRL's samples.
"""

from ..async_rlm.generator import ServedGroupGenerator, group_size
from .config import AsyncRLMTConfig
from .samples import completion_sample, cut_at_stop, scored_advantages
from .trainer import AsyncRLMTTrainer, reward_model_scorer
from .worker import RLMTRolloutWorker

__all__ = [
    "AsyncRLMTConfig",
    "AsyncRLMTTrainer",
    "RLMTRolloutWorker",
    "ServedGroupGenerator",
    "completion_sample",
    "cut_at_stop",
    "group_size",
    "reward_model_scorer",
    "scored_advantages",
]
