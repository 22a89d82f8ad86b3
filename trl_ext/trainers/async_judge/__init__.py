"""Token-span judge credit (docs/judge_credit.md) on TRL's experimental asynchronous trainer (docs/async.md).

- `AsyncJudgeCreditTrainer` / `AsyncJudgeCreditConfig`: the trainer and its settings (`JudgeCreditConfig`'s names).
- `JudgeRolloutWorker`: TRL's ``RolloutWorkerProtocol``: generation, rewards, group advantages and the judge's calls
  in a thread, one sample per rollout carrying its capped credit (`trl_ext.judge.method.JudgeCredit`).
"""

from .config import AsyncJudgeCreditConfig
from .trainer import AsyncJudgeCreditTrainer
from .worker import JudgeRolloutWorker

__all__ = [
    "AsyncJudgeCreditConfig",
    "AsyncJudgeCreditTrainer",
    "JudgeRolloutWorker",
]
