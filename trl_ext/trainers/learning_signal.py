"""`LearningSignalWatch`: a warning once a run has trained on nothing but zero advantages for several steps.

A group whose completions all get the same reward has advantage 0 everywhere: its tokens add nothing to the
gradient. When that holds for every group of several optimizer steps in a row, the run trains nothing (loss 0,
grad norm 0) however long it goes on, and the logs look calm. Each trainer (`ExtGRPOTrainer` and the synchronous
trainers built on it, `ExtAsyncGRPOTrainer` and the asynchronous ones) reports, per micro-batch, whether any
loss token had a non-zero advantage (`saw`); the watch warns once after ``patience`` optimizer steps without one,
naming the likely causes, and again only after a step with signal has re-armed it. It is always on (no monitor
needed); the monitors' ``reward_no_signal`` rule (docs/monitoring.md) raises an alert for the same state.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["NO_SIGNAL_STEPS", "LearningSignalWatch", "no_signal_message"]

NO_SIGNAL_STEPS = 5  # optimizer steps without a non-zero advantage before the warning


def no_signal_message(steps: int, reward: float | None) -> str:
    """The warning after ``steps`` optimizer steps without a non-zero advantage (``reward``: the last mean reward
    logged, when known)."""
    seen = "" if reward is None else f" (mean reward {reward:.4g})"
    return (
        f"No loss token of the last {steps} optimizer steps had a non-zero advantage: in every group all completions "
        f"got the same reward{seen}, so nothing trains (loss 0, grad norm 0). Likely causes: the model never "
        "produces what the reward functions credit (call them on a few completions; for the RLM trainers watch "
        "rlm/final_answer_rate), max_completion_length cuts the answers off, num_generations too small for a rare "
        "reward, or a policy that collapsed (a learning rate too high). Start from a model that sometimes succeeds "
        "(a cold-start SFT, docs/cold_start.md) or make the reward denser."
    )


class LearningSignalWatch(TrainerCallback):
    """Counts the optimizer steps in a row whose loss tokens all had advantage 0; warns once at ``patience``.

    Args:
        patience: the steps in a row that trigger the warning (>= 1).

    Attributes:
        streak: the current run of steps without signal; warnings: how many warnings were given.
    """

    def __init__(self, patience: int = NO_SIGNAL_STEPS) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1 optimizer steps, got {patience}.")
        self.patience = patience
        self.streak = 0
        self.warnings = 0
        self._signal = False
        self._reward: float | None = None

    def saw(self, signal: bool) -> None:
        """Record one micro-batch: whether any of its loss tokens (all ranks) had a non-zero advantage."""
        self._signal = self._signal or bool(signal)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        reward = (logs or {}).get("reward")
        if isinstance(reward, (int, float)):
            self._reward = float(reward)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._signal:
            self.streak = 0
        else:
            self.streak += 1
            if self.streak == self.patience:
                self.warnings += 1
                logger.warning(no_signal_message(self.streak, self._reward))
        self._signal = False
