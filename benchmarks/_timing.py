"""Step timing shared by the benchmarks: whole optimizer steps, and the training part without generation."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class GenerationTimer:
    """Trainer mixin: accumulates the time spent generating and scoring batches (from trl-ext's `on_batch_start` to
    its `on_batch_end` hook: TRL's generation and scoring, and the trainer's `after_scoring`)."""

    generation_s = 0.0

    def on_batch_start(self, scope):
        self._generation_start = time.perf_counter()
        super().on_batch_start(scope)

    def on_batch_end(self, scope):
        try:
            super().on_batch_end(scope)
        finally:
            self.generation_s += time.perf_counter() - self._generation_start


class StepTimer(TrainerCallback):
    """Per optimizer step: ``times`` (the whole step) and, when the trainer is a `GenerationTimer` (set
    ``timer.trainer``), ``training_times`` (the step minus generation and scoring)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.training_times: list[float] = []
        self.trainer = None

    def _generation(self) -> float:
        return getattr(self.trainer, "generation_s", 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._generation_start = time.perf_counter(), self._generation()

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = time.perf_counter() - self._start
        self.times.append(elapsed)
        self.training_times.append(elapsed - (self._generation() - self._generation_start))
