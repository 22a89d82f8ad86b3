"""Step timing shared by the benchmarks: whole optimizer steps, and the training part without generation."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class GenerationTimer:
    """Trainer mixin: accumulates the time spent in generation and scoring (`_generate_and_score_completions`)."""

    generation_s = 0.0

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generation_s += time.perf_counter() - start


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
