"""A tiny training run that can be killed with SIGKILL at a chosen point, and resumed (tests/trainers/test_resume.py).

    python tests/scripts/interrupted_run.py OUT_DIR [--trainer grpo|stepwise] [--kill-at POINT:K] [--resume]
        [--num-iterations N] [--gpu] [--full-determinism] [--seed S] [--drop-generation-buffer]
        [--model-size tiny|small]

Trains a tiny `ExtGRPOTrainer` (``--trainer stepwise``: a `StepwiseRLMTrainer` on the scripted depth-2 trees of
two children a root, one drawn to train) for `MAX_STEPS` optimizer steps, saving a checkpoint every step
into OUT_DIR. ``--kill-at`` kills the process (``kill -9`` of itself, no clean-up) at

- ``generation:K``: inside the K-th generation batch (from the reward function, the K-th time it is called);
- ``optimizer:K``: before the K-th optimizer step (``on_pre_optimizer_step``);
- ``saving:K``: while checkpoint-K is written: the model, optimizer and scheduler are there, ``rng_state.pth`` is
  half written and ``trainer_state.json`` (written last) is missing.

``--resume`` trains with ``resume_from_checkpoint=True``. A run that ends writes what the tests compare into OUT_DIR:
``final_params.pt`` (the model's state dict) and ``log_history.json``. The tests import `run` to train in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(Path(__file__).parents[2]) not in sys.path:  # run as a script: the repository root, for `tests` and `trl_ext`
    sys.path.insert(0, str(Path(__file__).parents[2]))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.utils import cpu_config_kwargs, digit_reward, toy_dataset  # noqa: E402
from trl_ext.testing import VariantGenerator, build_tiny_model_and_tokenizer, yes_reward  # noqa: E402
from trl_ext.trainers import ExtGRPOConfig, ExtGRPOTrainer, StepwiseRLMConfig, StepwiseRLMTrainer  # noqa: E402

MAX_STEPS = 4
KILL_POINTS = ("generation", "optimizer", "saving")


def kill_now() -> None:
    """``kill -9`` this process: no exception, no `finally`, no flushing."""
    os.kill(os.getpid(), signal.SIGKILL)


def parse_kill_at(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    point, _, step = text.partition(":")
    if point not in KILL_POINTS or not step.isdigit() or int(step) < 1:
        raise ValueError(f"--kill-at {text!r}: use POINT:K with POINT one of {KILL_POINTS} and K >= 1")
    return point, int(step)


class KillBeforeOptimizerStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:  # global_step counts the optimizer steps done
            kill_now()


class RecordStartStep(TrainerCallback):
    """Records the global step training starts from (the checkpoint's, when resuming)."""

    step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


class KillingReward:
    """A reward function that kills the process on its ``kill_call``-th call (None: never)."""

    def __init__(self, reward, kill_call: int | None):
        self.reward, self.kill_call, self.calls = reward, kill_call, 0
        self.__name__ = reward.__name__  # TRL names the reward metrics after it

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.kill_call:
            kill_now()
        return self.reward(*args, **kwargs)


class KillWhileSaving:
    """Mixin: kills the process while checkpoint-``kill_save_step`` is written, after its optimizer and scheduler,
    half-way through its RNG state, before ``trainer_state.json``."""

    kill_save_step: int | None = None

    def _save_rng_state(self, output_dir):
        if self.state.global_step != self.kill_save_step:
            return super()._save_rng_state(output_dir)
        buffer = io.BytesIO()
        torch.save({"python": "partial"}, buffer)
        with open(os.path.join(output_dir, "rng_state.pth"), "wb") as handle:
            handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        kill_now()


class KillableGRPOTrainer(KillWhileSaving, ExtGRPOTrainer):
    pass


class KillableStepwiseTrainer(KillWhileSaving, StepwiseRLMTrainer):
    pass


@contextlib.contextmanager
def one_thread():
    """One intra-op thread (as the subprocesses' OMP_NUM_THREADS=1): float sums do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


STEPWISE_SETTINGS = dict(
    max_depth=1,
    max_turns=3,
    loss_type="dapo",
    child_sampling="one",  # the trainer's own RNG picks which child trains
    save_rollout_trees=True,
    rlm_system_prompt="REPL.",  # short prompts: a cheap step
    rlm_first_user_prompt="Task: {task}\n\nTurn {turn} of",
    rlm_user_prompt="Task: {task}\n\nTurn {turn} of",
)
# Each root asks two children; "sub A" answers at once, "sub B" after a REPL cell, so which child is drawn changes
# the rows. A root answers "yes" when its first cell is variant 0 (`VariantGenerator`: variants alternate over the
# roots; 4 roots a step, so a resumed run, which counts from 0 again, plays the same variants).
SCRIPT = {
    "root task": ["```repl\nprint(rlm_query_batched(['sub A', 'sub B']))\n```", "FINAL({root})"],
    "sub A": ["FINAL(a)"],
    "sub B": ["```repl\nprint(1)\n```", "FINAL(b)"],
}


# --model-size: the tiny test model, or a ~102M-parameter one for GPU checks (benchmarks/resume_gpu.py)
MODEL_SIZES = {
    "tiny": {},
    "small": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
}


def build_trainer(
    output_dir: str | Path, trainer: str, kill_at: tuple[str, int] | None, model_size: str = "tiny", **overrides
):
    point, step = kill_at if kill_at is not None else (None, None)
    callbacks = [KillBeforeOptimizerStep(step)] if point == "optimizer" else []
    settings = dict(
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=1,
        num_iterations=1,
        beta=0.0,
        max_completion_length=6,
    )
    settings.update(overrides)
    if trainer == "grpo":
        model, tokenizer = build_tiny_model_and_tokenizer(0, **MODEL_SIZES[model_size])
        cls, args = KillableGRPOTrainer, ExtGRPOConfig(**cpu_config_kwargs(str(output_dir), **settings))
        reward, kwargs = digit_reward, {}
        dataset = toy_dataset(MAX_STEPS)  # one prompt (4 generations) a step
    elif trainer == "stepwise":
        model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2)
        settings = {**STEPWISE_SETTINGS, **settings}
        cls, args = KillableStepwiseTrainer, StepwiseRLMConfig(**cpu_config_kwargs(str(output_dir), **settings))
        reward, kwargs = yes_reward, {"generator": VariantGenerator(tokenizer, SCRIPT, roots=("root task",))}
        dataset = Dataset.from_dict({"prompt": ["root task"] * MAX_STEPS, "context": ["abcdefgh"] * MAX_STEPS})
    else:
        raise ValueError(f"--trainer {trainer!r}: use grpo or stepwise")
    result = cls(
        model,
        KillingReward(reward, step if point == "generation" else None),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        **kwargs,
    )
    result.kill_save_step = step if point == "saving" else None
    return result


def run(
    output_dir: str | Path,
    trainer: str = "grpo",
    kill_at: str | None = None,
    resume: bool = False,
    model_size: str = "tiny",
    **overrides,
):
    """Train (killed at ``kill_at``, resumed when ``resume``); write ``final_params.pt`` and ``log_history.json``.

    Returns the trainer; its ``start_step`` is the global step training started from."""
    with one_thread():
        result = build_trainer(output_dir, trainer, parse_kill_at(kill_at), model_size, **overrides)
        start = RecordStartStep()
        result.add_callback(start)
        result.train(resume_from_checkpoint=True if resume else None)
    result.start_step = start.step
    params = {name: value.detach().clone() for name, value in result.model.state_dict().items()}
    torch.save(params, Path(output_dir) / "final_params.pt")
    (Path(output_dir) / "log_history.json").write_text(json.dumps(result.state.log_history, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--trainer", choices=("grpo", "stepwise"), default="grpo")
    parser.add_argument("--kill-at", default=None, help="POINT:K, POINT one of generation, optimizer, saving")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="train on the GPU in bf16 (benchmarks/resume_gpu.py)")
    parser.add_argument("--full-determinism", action="store_true", help="transformers' full_determinism=True")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-size", choices=tuple(MODEL_SIZES), default="tiny")
    parser.add_argument(
        "--drop-generation-buffer", action="store_true", help="resume without the checkpoint's generation batch"
    )
    options = parser.parse_args(argv)
    if options.drop_generation_buffer:  # a control: what resuming did before the batch was checkpointed
        ExtGRPOTrainer.restore_generation_buffer = lambda self, checkpoint: False
    overrides = dict(max_steps=options.max_steps, num_iterations=options.num_iterations, seed=options.seed)
    if options.gpu:
        overrides.update(use_cpu=False, bf16=True)
    if options.full_determinism:
        overrides.update(full_determinism=True)
    run(options.output_dir, options.trainer, options.kill_at, options.resume, options.model_size, **overrides)


if __name__ == "__main__":
    main()
