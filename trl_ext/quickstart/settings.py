"""The quickstart's knobs (`QuickstartSettings`) and the trainer configurations they become.

`toy_scaffold_config` and `toy_rl_config_kwargs` are the toy task's RLM scaffold and `StepwiseRLMConfig` arguments;
`cpu_run_kwargs` the fields every quickstart trainer shares (the CPU, no tracker, no checkpoints);
`miniature_run_kwargs` and `MINIATURE_LORA` the judge-credit and RLMT miniatures' settings. Only the standard library
is imported at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self


class ScaledSettings:
    """`default` and `fast` of a quickstart's frozen settings dataclass (a ``seed`` field): `fast`, for CI, changes the
    fields in ``FAST``."""

    FAST: ClassVar[dict[str, Any]] = {}

    @classmethod
    def default(cls, seed: int = 0) -> Self:
        return cls(seed=seed)

    @classmethod
    def fast(cls, seed: int = 0) -> Self:
        return cls(seed=seed, **cls.FAST)


@dataclass(frozen=True)
class QuickstartSettings(ScaledSettings):
    """Every knob of a quickstart run. `default` is what the README's numbers come from; `fast` is for CI.

    Data: ``parts_counts``, the toy task's parts per context (None: 2 or 3, the quickstart's; a tuple: each context
    draws its count from it, e.g. ``(1, 2, 5, 6)`` for deliberately uneven trees, benchmarks/uneven_trees.py),
    ``num_sft_examples`` held out for cold-start SFT (a few dozen: docs/cold_start.md), ``num_rl_examples``
    for RL (>= 10x the SFT set, so `split_cold_start` does not warn), ``num_eval_examples`` held-out tasks evaluated
    ``eval_samples`` times each.
    Policy: a Qwen2-architecture model with ``hidden_size`` and ``num_hidden_layers`` (``trl_ext.testing``).
    Teacher: how often a root delegates, and how often a child computes or takes the shortcut
    (`trl_ext.quickstart.toy_task.ToyTeacher`).
    SFT: epochs, learning rate, batch size (full fine-tuning: the model starts from random weights).
    RL: optimizer steps, learning rate and its schedule ``rl_lr_scheduler`` (a transformers ``lr_scheduler_type``;
    ``"cosine"`` decays it to 0 by the last step: at a constant rate the last passes over a generation batch could
    throw the policy off, docs/quickstart.md), ``rl_beta`` (KL to the SFT policy: it keeps the programs intact while the
    strategy shifts), prompts per generation × ``num_generations`` rollouts, ``num_iterations`` optimizer steps per
    generation (the later ones are off-policy, where the IPO mask acts), ``rl_micro_batches`` the generation batch is
    split into (gradient accumulation: the same optimizer step, a fraction of the activation memory), LoRA
    rank/alpha, ``max_completion_length`` tokens per action, ``max_turns`` per node (the task takes two: look at the
    context, then answer), ``max_children`` a root may start (one per part, at most 3 in the quickstart's data, with
    room for one more; benchmarks/uneven_trees.py raises it for its 5- and 6-part contexts), sampling
    ``temperature``, ``loss_type`` (``"ipo"``, or e.g. ``"dapo"`` for PPO-clip) and ``rlm_loss_normalization``
    (``"subtree"``: 1/k_g weights; ``"token"``: a plain token mean) — the last two are what the ablations change
    (docs/quickstart.md).
    """

    seed: int = 0
    parts_counts: tuple[int, ...] | None = None
    num_sft_examples: int = 32
    num_rl_examples: int = 480
    num_eval_examples: int = 48
    eval_samples: int = 2
    hidden_size: int = 64
    num_hidden_layers: int = 4
    delegate_fraction: float = 0.6
    compute_fraction: float = 0.45
    shortcut_fraction: float = 0.15
    sft_epochs: float = 24.0
    sft_learning_rate: float = 5e-3
    sft_batch_size: int = 8
    rl_steps: int = 28
    rl_learning_rate: float = 1e-3
    rl_lr_scheduler: str = "cosine"
    rl_beta: float = 0.2
    prompts_per_step: int = 4
    num_generations: int = 8
    num_iterations: int = 4
    rl_micro_batches: int = 4
    lora_r: int = 16
    lora_alpha: int = 32
    max_completion_length: int = 64
    max_turns: int = 2
    max_children: int = 4
    temperature: float = 1.0
    loss_type: str = "ipo"
    rlm_loss_normalization: str = "subtree"

    # `fast`: every stage, scaled down to well under a minute on two cores (for CI; it does not learn visibly)
    FAST: ClassVar[dict[str, Any]] = {
        "num_sft_examples": 16,
        "num_eval_examples": 8,
        "eval_samples": 2,
        "sft_epochs": 4.0,
        "rl_steps": 4,
        "prompts_per_step": 2,
        "num_generations": 4,
    }

    def validate(self) -> None:
        check_counts(
            self,
            (
                "num_sft_examples",
                "num_rl_examples",
                "num_eval_examples",
                "eval_samples",
                "rl_steps",
                "prompts_per_step",
                "num_iterations",
                "rl_micro_batches",
                "max_turns",
                "max_children",
            ),
        )
        rollouts = self.prompts_per_step * self.num_generations
        if rollouts % self.rl_micro_batches:
            raise ValueError(
                f"rl_micro_batches={self.rl_micro_batches} must divide the {rollouts} rollouts of a generation batch "
                "(prompts_per_step x num_generations)."
            )
        if not self.sft_epochs > 0:
            raise ValueError(f"sft_epochs must be > 0, got {self.sft_epochs!r}.")


def check_counts(settings: Any, names: tuple[str, ...]) -> None:
    """The checks every quickstart's settings share: each of ``names`` an int >= 1, and ``num_generations`` >= 2."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    if settings.num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2 (group advantages need a group), got {settings.num_generations}."
        )


def _toy_scaffold(settings: QuickstartSettings) -> dict[str, Any]:
    """The toy task's `RLMScaffoldConfig` settings: short prompts, children one level deep."""
    from .toy_task import TOY_FIRST_USER_PROMPT, TOY_SYSTEM_PROMPT, TOY_USER_PROMPT

    return dict(
        max_turns=settings.max_turns,
        max_depth=1,
        max_children=settings.max_children,
        max_total_children=settings.max_children,
        system_prompt=TOY_SYSTEM_PROMPT,
        first_user_prompt=TOY_FIRST_USER_PROMPT,
        user_prompt=TOY_USER_PROMPT,
    )


def toy_scaffold_config(settings: QuickstartSettings) -> Any:
    """The RLM scaffold of the toy task: short prompts, children one level deep, a cell's output cut to
    `TOY_OUTPUT_CHARS` (one part, not the whole context)."""
    from trl_ext.rlm import RLMScaffoldConfig, SandboxLimits

    from .toy_task import TOY_OUTPUT_CHARS

    return RLMScaffoldConfig(**_toy_scaffold(settings), sandbox=SandboxLimits(max_output_chars=TOY_OUTPUT_CHARS))


def toy_rl_config_kwargs(settings: QuickstartSettings, output: Path, progress: bool) -> dict[str, Any]:
    """`StepwiseRLMConfig` keyword arguments of the quickstart's RL stage (CPU, IPO, the toy scaffold)."""
    from trl_ext.rlm.scaffold import ScaffoldArguments

    from .toy_task import TOY_OUTPUT_CHARS

    # one optimizer step per pass over the generation batch (split into rl_micro_batches accumulated micro-batches),
    # num_iterations passes per generation: the later ones are off-policy (IPO acts)
    micro_batch = settings.prompts_per_step * settings.num_generations // settings.rl_micro_batches
    return {
        **cpu_run_kwargs(output, settings.seed, progress),
        "activation_checkpointing": False,  # a tiny model on the CPU: recomputing activations only costs time
        "loss_type": settings.loss_type,
        "rlm_loss_normalization": settings.rlm_loss_normalization,
        "learning_rate": settings.rl_learning_rate,
        "lr_scheduler_type": settings.rl_lr_scheduler,
        "beta": settings.rl_beta,  # KL to the SFT policy (the adapter disabled): keeps the programs intact
        "max_steps": settings.rl_steps,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": settings.rl_micro_batches,
        "num_generations": settings.num_generations,
        "num_iterations": settings.num_iterations,
        "max_completion_length": settings.max_completion_length,
        "temperature": settings.temperature,
        "repl_max_output_chars": TOY_OUTPUT_CHARS,
        **ScaffoldArguments.arguments_for(**_toy_scaffold(settings)),
    }


def cpu_run_kwargs(output: Path, seed: int, progress: bool) -> dict[str, Any]:
    """Config fields every quickstart trainer shares: the CPU, no tracker, ``seed``, a log line per step, no
    checkpoints (the adapter is saved at the end), bars only with ``progress``."""
    return {
        "output_dir": str(output),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "seed": seed,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": not progress,
    }


MINIATURE_LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def miniature_run_kwargs(output: Path, settings: QuickstartSettings, fast: bool, progress: bool) -> dict[str, Any]:
    """The judge-credit and RLMT miniatures' shared settings: at most 8 steps (2 with ``fast``), 2 prompts x 4
    completions per step, each batch used twice."""
    return {
        **cpu_run_kwargs(output, settings.seed, progress),
        "max_steps": min(2 if fast else settings.rl_steps, 8),
        "learning_rate": 5e-3,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "num_iterations": 2,
    }
