"""`ExtAsyncGRPOConfig`: every field of TRL's experimental `AsyncGRPOConfig`, plus the loss settings of
`LossArguments` (the same names and meaning as in `ExtGRPOConfig`), and the CPU precision rule of `ExtGRPOConfig`.

TRL's asynchronous trainer has one loss of its own: PPO-clip on the sampler's log-probs, normalised by the window's
tokens like ``"dapo"``. So ``loss_type`` takes ``"dapo"`` (TRL's loss, unchanged) or a loss trl-ext computes (a
`LossSpec` with a ``compute``: ``"ipo"``, or one registered from outside); TRL's other loss types fail here.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..fields import document_fields, documented
from ..losses import LOSSES
from .ext_grpo_config import BF16_HELP, resolve_precision
from .loss_arguments import LossArguments
from .weight_sync import WEIGHT_SYNC_CHOICES

__all__ = ["ExtAsyncGRPOConfig", "async_loss_types"]


def async_loss_types() -> list[str]:
    """The ``loss_type`` values the asynchronous trainer trains: TRL's own ``"dapo"``, then every registered loss
    trl-ext computes (``"ipo"``, and those registered from outside with a compute function)."""
    return ["dapo", *(name for name, spec in LOSSES.items() if spec.compute is not None)]


@document_fields
@dataclass
class ExtAsyncGRPOConfig(LossArguments, AsyncGRPOConfig):
    r"""
    Configuration for [`ExtAsyncGRPOTrainer`]: every field of TRL's experimental
    `trl.experimental.async_grpo.AsyncGRPOConfig`, plus the loss registry's settings
    (`trl_ext.trainers.loss_arguments.LossArguments`: ``loss_type``, ``ipo_threshold``, ``ipo_ratio_cap``,
    ``ipo_kl_tau``, ``loss_kwargs``, as in `ExtGRPOConfig`). ``loss_type`` is ``"dapo"`` (TRL's async loss) or a
    loss trl-ext computes (``"ipo"``, ...).

    TRL's ``dtype`` already defaults to ``"float32"``; ``bf16`` follows `ExtGRPOConfig`'s rule, so a CPU run needs
    neither set.
    """

    bf16: bool | None = documented(None, BF16_HELP, section="Precision")
    weight_sync: str = documented(
        "auto",
        "How full weights (no PEFT adapter) reach the vLLM server: 'auto' (TRL's NCCL transfer where CUDA has NCCL, "
        "else 'disk'), 'nccl' (TRL's) or 'disk' (safetensors written under output_dir and reloaded by the server "
        "through vLLM's layerwise reload; the server needs VLLM_SERVER_DEV_MODE=1). A LoRA adapter is always synced "
        "over HTTP, as TRL does.",
        section="Weight sync",
    )

    def __post_init__(self):
        resolve_precision(self)
        super().__post_init__()
        loss = self.check_loss_arguments(
            async_loss_types(),
            "TRL's asynchronous trainer computes one loss of its own, PPO-clip normalised by the window's tokens "
            "('dapo'); trl-ext adds the losses it computes ('ipo', and those registered with a compute function). ",
        )
        loss.check_config(self)
        if self.weight_sync not in WEIGHT_SYNC_CHOICES:
            raise ValueError(f"weight_sync={self.weight_sync!r}: use one of {list(WEIGHT_SYNC_CHOICES)}.")

    # What a loss's config check asks of a trainer config, answered for TRL's asynchronous trainer, which has no
    # setting for them: its importance ratio is per token, and it has no entropy bonus.
    @property
    def importance_sampling_level(self) -> str:
        """``"token"``: TRL's asynchronous trainer weighs every token by its own ratio p / p_old."""
        return "token"

    @property
    def entropy_coef(self) -> float:
        """0.0: TRL's asynchronous trainer adds no entropy bonus."""
        return 0.0

    @property
    def use_adaptive_entropy(self) -> bool:
        """False: TRL's asynchronous trainer adds no entropy bonus."""
        return False
