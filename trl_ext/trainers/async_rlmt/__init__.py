"""RLMT on TRL's experimental asynchronous trainer (docs/rlmt.md, docs/async.md).

- `AsyncRLMTTrainer` / `AsyncRLMTConfig`: the trainer and its settings (`RLMTConfig`'s names).
- `RLMTRolloutWorker`: TRL's ``RolloutWorkerProtocol``: RLMT prompts, completions cut at the stop strings, scored
  in-process, in a thread.
- `ServedGroupGenerator`: a group's completions from ``vllm serve`` in one request (``n`` = group size, the stop
  strings as ``stop``).
"""

from ...serving.served_policy import ServedGroupGenerator, group_size
from .config import AsyncRLMTConfig
from .trainer import AsyncRLMTTrainer
from .worker import RLMTRolloutWorker

__all__ = [
    "AsyncRLMTConfig",
    "AsyncRLMTTrainer",
    "RLMTRolloutWorker",
    "ServedGroupGenerator",
    "group_size",
]
