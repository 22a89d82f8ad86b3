"""Stepwise RLM training on TRL's experimental asynchronous trainer (docs/stepwise_rlm.md, docs/async.md).

- `AsyncStepwiseRLMTrainer` / `AsyncStepwiseRLMConfig`: the trainer and its settings (`StepwiseRLMConfig`'s names).
- `RLMRolloutWorker`: TRL's ``RolloutWorkerProtocol``: RLM trees in a thread, one sample per turn of every node.
- `ServedPolicyGenerator` (`trl_ext.serving.served_policy`): the generator every asynchronous method's worker
  samples from, against ``vllm serve`` (the latest published adapter).
"""

from ...serving.served_policy import ServedPolicyGenerator
from .config import AsyncStepwiseRLMConfig
from .trainer import AsyncStepwiseRLMTrainer
from .worker import RLMRolloutWorker

__all__ = [
    "AsyncStepwiseRLMConfig",
    "AsyncStepwiseRLMTrainer",
    "RLMRolloutWorker",
    "ServedPolicyGenerator",
]
