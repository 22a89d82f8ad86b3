"""`ExtGRPOConfig`: every field of `trl.GRPOConfig`, plus the loss settings (`LossArguments`: ``loss_type``, the IPO
loss's mirrored from `trl_ext.losses.IPOSettings`, ``loss_kwargs`` for a loss registered from outside), shared-prefix
packing, the prompt cap and the colocated vLLM engine's dtype. Each field's one doc is its help text
(`trl_ext.fields`). `PrecisionArguments` (``bf16`` and its rule, float32 where bf16 cannot run) is shared with
`ExtAsyncGRPOConfig`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trl import GRPOConfig

from ..fields import document_fields, documented
from ..losses.arguments import LossArguments

logger = logging.getLogger(__name__)

VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFIX_SHARING_MODES = ("auto", "on", "off")


@document_fields
@dataclass
class PrecisionArguments:
    """TRL's ``bf16`` with trl-ext's CPU rule (`resolve_precision`), shared by `ExtGRPOConfig` and
    `ExtAsyncGRPOConfig`."""

    bf16: bool | None = documented(
        None,
        "TRL's field, with one change: left unset (and fp16 off), it is False (float32 training) when training runs "
        "on the CPU (use_cpu=True, or no accelerator with bf16 support), and TRL's True otherwise. bf16=True where "
        "bf16 cannot run fails with the fix.",
        section="Precision",
    )

    def resolve_precision_and_checkpointing(self) -> None:
        """float32 where bf16 cannot run (`resolve_precision`), and TRL's checkpointing default under transformers'
        current name (`resolve_checkpointing`); called before TRL's ``__post_init__``."""
        resolve_precision(self)
        resolve_checkpointing(self)


@document_fields
@dataclass
class ExtGRPOConfig(PrecisionArguments, LossArguments, GRPOConfig):
    r"""
    Configuration for [`ExtGRPOTrainer`]: every field of `trl.GRPOConfig`, plus the loss registry's settings
    (`trl_ext.losses.arguments.LossArguments`: ``loss_type``, ``ipo_threshold``, ``ipo_ratio_cap``,
    ``ipo_ratio_band``, ``ipo_kl_tau``, ``loss_kwargs``), shared-prefix packing, the prompt cap and the colocated vLLM engine's dtype.
    """

    prefix_sharing: str = documented(
        "auto",
        "Shared-prefix packing of the log-prob passes (policy, old policy, reference, entropies): 'auto' encodes a "
        "prefix shared by several rows once (a GRPO prompt and its G completions, a stepwise node's history and its "
        "turns) when the model supports it (attention sdpa, eager or flex_attention, text only, one process or "
        "DDP) and it saves at least 20% of the tokens and 1,024 tokens; results equal the unpacked rows'. 'on': "
        "pack every pass the model supports, whatever it saves. 'off': TRL's rows.",
        section="Shared-prefix packing (docs/packing.md)",
    )
    max_packed_tokens: int = documented(
        8192,
        "Token budget of one packed row (a row longer than this gets a packed row of its own). Without gradients, "
        "packed rows run in forwards of at most this many tokens. >= 1.",
    )
    max_prompt_length: int | None = documented(
        None,
        "Longest tokenized prompt. A longer one is cut from the left (its end, where the question is, kept) and "
        "counted in the prompts/truncated_ratio metric; a prompt with images is never cut, it fails with the row's "
        "length. None: the model's positions minus max_completion_length (no cap when the model config does not "
        "say). TRL 1.16 has no prompt cap of its own.",
        section="Prompts",
    )
    vllm_dtype: str = documented(
        "auto",
        "The dtype of the colocated vLLM engine (vllm_mode='colocate'): 'auto' is vLLM's choice, which runs a "
        "float32 checkpoint in bfloat16, so its sampling log-probs differ from the trained policy's by the rounding "
        "(IPO masks, clipping and importance ratios see it); 'float32' matches a float32 policy exactly (what the "
        "CPU tests use); 'bfloat16'/'float16' pin the engine's precision. In server mode, pass --dtype to trl "
        "vllm-serve.",
        section="vLLM",
    )

    def __post_init__(self):
        self.resolve_precision_and_checkpointing()
        super().__post_init__()
        loss = self.check_loss_arguments()
        if self.prefix_sharing not in PREFIX_SHARING_MODES:
            raise ValueError(
                f"prefix_sharing={self.prefix_sharing!r}: use 'auto' (pack rows that share a prefix where the model "
                "supports it and it saves tokens), 'on' (pack wherever supported) or 'off' (TRL's rows)."
            )
        if self.max_packed_tokens < 1:
            raise ValueError(f"max_packed_tokens={self.max_packed_tokens} must be >= 1 (default 8192).")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be >= 1 (None: the model's positions).")
        if self.vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r}: use one of {list(VLLM_DTYPES)}.")
        loss.check_config(self)  # its settings (ipo_<name> fields or loss_kwargs) and what it needs of the config


def resolve_precision(config: Any) -> None:
    """Train in float32 where bf16 cannot run, unless bf16/fp16 was asked for explicitly.

    TRL turns an unset ``bf16`` into True, which `transformers.TrainingArguments` then refuses on a machine
    without a bf16-capable accelerator: every config would fail on a CPU-only machine. Here an unset ``bf16``
    (and ``fp16`` off) becomes False, with one log line, when training runs on the CPU (``use_cpu=True``, or no
    accelerator with bf16 support); TRL's bf16 default is kept everywhere else. An explicit ``bf16=True`` that
    cannot run fails with the fix.
    """
    if config.fp16 or config.bf16 is False:
        return
    if config.bf16 is None:
        if config.use_cpu or not bf16_accelerator_available():
            config.bf16 = False
            where = "use_cpu=True" if config.use_cpu else "no accelerator with bf16 support was found"
            logger.info("bf16 not set and %s: training in float32 (set bf16=True or fp16=True to change it).", where)
        return
    if not config.use_cpu and not bf16_accelerator_available():
        raise ValueError(
            "bf16=True, but this machine has no accelerator with bf16 support (no CUDA, XPU, NPU, MPS, HPU or "
            "TPU device found, or a GPU older than Ampere): set bf16=False to train in float32 (leaving bf16 "
            "unset does the same on such a machine), or run on a GPU with bf16 support."
        )


def resolve_checkpointing(config: Any) -> None:
    """Carry TRL's activation-checkpointing default over to transformers' current name, so that a config nobody set
    it on does not warn.

    TRL 1.16 (``trl.trainer.base_config._BaseConfig``) defaults ``gradient_checkpointing`` to True, and transformers 5
    renamed that field ``activation_checkpointing``, keeping the old name as a deprecated alias: its
    ``TrainingArguments.__post_init__`` warns "`gradient_checkpointing` is deprecated" whenever the old name is set
    and the new one is not, so every TRL config warned at construction though nothing was set. Here an unset
    ``activation_checkpointing`` takes TRL's default (True) while ``gradient_checkpointing`` holds it; the result is
    the same (checkpointing on, both names True). ``gradient_checkpointing=False`` (the old name, away from TRL's
    default) is left to transformers, which still warns about the old name and honours it; so is an
    ``activation_checkpointing`` the caller set.
    """
    if getattr(config, "activation_checkpointing", False) is None and config.gradient_checkpointing is True:
        config.activation_checkpointing = True


def bf16_accelerator_available() -> bool:
    """Whether an accelerator that trains in bf16 is present (the check `transformers.TrainingArguments` makes)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()
