"""Which model name serves the trainer's current policy on ``vllm serve``: the one piece of TRL's LoRA-sync state a
rollout worker of trl-ext's needs (``_lora_sync``, ``_lora_name``, set in ``AsyncGRPOTrainer.__init__``)."""

from __future__ import annotations

from typing import Any

from trl.trainer.utils import get_config_model_id

__all__ = ["served_policy_names"]


def served_policy_names(trainer: Any) -> tuple[str, str | None]:
    """``(base model name, adapter prefix or None)`` of an `AsyncGRPOTrainer`: with LoRA sync on, TRL publishes
    version N as ``<prefix>-v<N>``; without it (full-weight sync, or a custom ``weight_transfer``) requests name the
    base model."""
    base = get_config_model_id(trainer.accelerator.unwrap_model(trainer.model).config)
    return base, (trainer._lora_name if trainer._lora_sync else None)
