"""What every quickstart trainer run shares: cold-start SFT with TRL's `SFTTrainer` (`cold_start_sft`), a trained
policy copied for a second RL run (`fresh_copy`), the trainer's progress bar without its log printing
(`quiet_progress`), the adapter and trainer state saved in the output directory (`save_adapter_and_state`), the
metrics plot (`save_plot`), and a miniature run trained (`train_miniature`), saved and read back as a
`QuickstartResult` (`save_miniature_run`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trl_ext.run_info import PLOT_FILE

from .report import QuickstartResult, result_from_history
from .settings import MINIATURE_LORA, QuickstartSettings

ADAPTER_DIR = "adapter"


def cold_start_sft(
    model: Any,
    tokenizer: Any,
    rows: Any,
    folder: Path,
    *,
    epochs: float,
    learning_rate: float,
    batch_size: int,
    seed: int,
    progress: bool,
    scheduler: str = "cosine",
    max_length: int = 1024,
) -> Any:
    """Full fine-tuning of ``model`` on prompt/completion ``rows`` with TRL's `SFTTrainer` on the CPU (the loss on
    the completions only); the trained model, in eval mode."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(folder),
        num_train_epochs=epochs,
        learning_rate=learning_rate,
        lr_scheduler_type=scheduler,
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        activation_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        seed=seed,
        disable_tqdm=not progress,
    )
    rows = rows.select_columns(["prompt", "completion"])
    trainer = SFTTrainer(model, train_dataset=rows, processing_class=tokenizer, args=args)
    quiet_progress(trainer)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    return model


def fresh_copy(model: Any) -> Any:
    """A new model of ``model``'s class and config with its weights and generation config, in eval mode, for a second
    RL run from the same policy. Not `copy.deepcopy`: after a `Trainer` has run it, Accelerate has set the model's
    ``forward`` as an instance attribute bound to that very model, so a deep copy would keep running the original's
    forward (and a LoRA adapter injected into the copy would never be used)."""
    import copy

    clone = type(model)(copy.deepcopy(model.config))
    clone.load_state_dict(model.state_dict())
    clone.generation_config = copy.deepcopy(model.generation_config)
    clone.eval()
    return clone


def quiet_progress(trainer: Any) -> None:
    """Keep the trainer's progress bar but not its printing of every log dict, with or without bars (the logs still
    reach the trainer state, the monitors and the plot)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class BarOnlyProgress(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return None

    if any(type(cb) is ProgressCallback for cb in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(BarOnlyProgress())
    if any(type(cb) is PrinterCallback for cb in trainer.callback_handler.callbacks):  # disable_tqdm=True
        trainer.remove_callback(PrinterCallback)


def save_adapter_and_state(trainer: Any, output: Path) -> Path:
    """Save the trained run: ``trainer_state.json`` (the log history the plot reads) and the adapter."""
    trainer.save_state()
    adapter_dir = output / ADAPTER_DIR
    trainer.save_model(str(adapter_dir))
    return adapter_dir


def train_miniature(
    trainer_class: type,
    model: Any,
    reward_funcs: Any,
    config: Any,
    dataset: Any,
    tokenizer: Any,
    monitors: list[Any],
) -> Any:
    """Build a miniature's trainer (LoRA `MINIATURE_LORA`, the ``monitors`` as callbacks, bars without log printing),
    train it and return it."""
    from peft import LoraConfig

    trainer = trainer_class(
        model,
        reward_funcs,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(**MINIATURE_LORA),
        callbacks=monitors,
    )
    quiet_progress(trainer)
    trainer.train()
    return trainer


def save_miniature_run(
    method: str,
    trainer: Any,
    monitors: Sequence[Any],
    output: Path,
    settings: QuickstartSettings,
    fast: bool,
    say: Callable[[str], None],
) -> QuickstartResult:
    """Save a trained miniature run, draw its plot and read its result from the log history."""
    adapter_dir = save_adapter_and_state(trainer, output)
    plot_file = save_plot(output, say)
    return result_from_history(
        method, output, settings, fast, trainer.state.log_history, monitors, adapter_dir, plot_file
    )


def save_plot(output: Path, say: Callable[[str], None]) -> Path | None:
    """The monitors' plot of the run in ``output`` (`plot_run`), or None without matplotlib (an optional extra)."""
    from trl_ext.callbacks import plot_run

    try:
        return Path(plot_run(output, out=output / PLOT_FILE))
    except ImportError as error:  # matplotlib is an optional extra
        say(f"(no plot: {error})")
        return None
