"""`ExtAsyncGRPOConfig`: every field of TRL's experimental `AsyncGRPOConfig`, plus the loss settings of
`LossArguments` (the same names and meaning as in `ExtGRPOConfig`), and the CPU precision rule of `ExtGRPOConfig`.

TRL's asynchronous trainer has one loss of its own: PPO-clip on the sampler's log-probs, normalised by the window's
tokens like ``"dapo"``. So ``loss_type`` takes ``"dapo"`` (TRL's loss, unchanged) or a loss trl-ext computes (a
`LossSpec` with a ``compute``: ``"ipo"``, or one registered from outside); TRL's other loss types fail here.

Settings TRL takes as given are checked here, each error naming the value and the fix: ``max_staleness`` and
``queue_maxsize`` are ints >= 0 (``queue_maxsize=0``: an unbounded rollout queue), ``vllm_server_base_url`` is the
``http://`` or ``https://`` base URL of ``vllm serve`` (not its ``/v1`` API root: TRL appends the paths itself).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from trl import GRPOConfig
from trl.experimental.async_grpo import AsyncGRPOConfig

from ..advantages import SCALE_REWARDS
from ..fields import document_fields, documented, mirror_field
from ..losses import LOSSES
from ..losses.arguments import LossArguments
from ..serving.weight_sync import WEIGHT_SYNC_CHOICES
from .ext_grpo_config import PrecisionArguments

__all__ = [
    "AsyncMethodConfig",
    "ExtAsyncGRPOConfig",
    "async_loss_types",
    "check_max_staleness",
    "check_queue_maxsize",
    "check_server_base_url",
]

QUEUE_MAXSIZE_HELP = (
    "Maximum number of rollout samples buffered between the rollout worker and the trainer; the worker waits while "
    "the queue is full. 0 means unbounded (Python's queue.Queue / multiprocessing.Queue with maxsize=0, in TRL's "
    "worker process and in trl-ext's worker threads alike): samples that wait too long are still dropped by "
    "max_staleness. An int >= 0."
)


def async_loss_types() -> list[str]:
    """The ``loss_type`` values the asynchronous trainer trains: TRL's own ``"dapo"``, then every registered loss
    trl-ext computes (``"ipo"``, and those registered from outside with a compute function)."""
    return ["dapo", *(name for name, spec in LOSSES.items() if spec.compute is not None)]


@document_fields
@dataclass
class ExtAsyncGRPOConfig(PrecisionArguments, LossArguments, AsyncGRPOConfig):
    r"""
    Configuration for [`ExtAsyncGRPOTrainer`]: every field of TRL's experimental
    `trl.experimental.async_grpo.AsyncGRPOConfig`, plus the loss registry's settings
    (`trl_ext.losses.arguments.LossArguments`: ``loss_type``, ``ipo_threshold``, ``ipo_ratio_cap``,
    ``ipo_ratio_band``, ``ipo_kl_tau``, ``loss_kwargs``, as in `ExtGRPOConfig`). ``loss_type`` is ``"dapo"`` (TRL's async loss) or a
    loss trl-ext computes (``"ipo"``, ...).

    TRL's ``dtype`` already defaults to ``"float32"``; ``bf16`` follows `ExtGRPOConfig`'s rule, so a CPU run needs
    neither set.

    Checked here, each error naming the value and the fix: ``max_staleness`` and ``queue_maxsize`` are ints >= 0
    (``queue_maxsize=0``: an unbounded rollout queue); ``vllm_server_base_url`` is the ``http://`` or ``https://``
    base URL of ``vllm serve``, without ``/v1`` (a trailing ``/`` is dropped).
    """

    queue_maxsize: int = documented(1024, QUEUE_MAXSIZE_HELP, section="Async rollout pipeline")
    weight_sync: str = documented(
        "auto",
        "How full weights (no PEFT adapter) reach the vLLM server: 'auto' (TRL's NCCL transfer where CUDA has NCCL, "
        "else 'disk'), 'nccl' (TRL's) or 'disk' (safetensors written under output_dir and reloaded by the server "
        "through vLLM's layerwise reload; the server needs VLLM_SERVER_DEV_MODE=1). A LoRA adapter is always synced "
        "over HTTP, as TRL does.",
        section="Weight sync",
    )

    def __post_init__(self):
        check_max_staleness(self.max_staleness)
        check_queue_maxsize(self.queue_maxsize)
        self.vllm_server_base_url = check_server_base_url(self.vllm_server_base_url)
        self.resolve_precision_and_checkpointing()
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


_GROUP = "Group advantage"


@document_fields
@dataclass
class AsyncMethodConfig(ExtAsyncGRPOConfig):
    r"""
    The settings every asynchronous method trainer (`AsyncStepwiseRLMConfig`, `AsyncJudgeCreditConfig`,
    `AsyncRLMTConfig`) adds to [`ExtAsyncGRPOConfig`]: its rollout worker scores each group itself, with
    `GRPOTrainer`'s ``scale_rewards`` and ``reward_weights`` (same names, same meaning).
    """

    scale_rewards: str = mirror_field(
        GRPOConfig,
        "scale_rewards",
        _GROUP,
        note="The rollout worker scores one group at a time, so 'batch' is not available here.",
        section=_GROUP,
    )
    reward_weights: list[float] | None = mirror_field(GRPOConfig, "reward_weights", "Rewards", section=_GROUP)

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # GRPOConfig's spellings: True = 'group', False = 'none'
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r}: the asynchronous rollout worker scores one group at a time; "
                "set 'group' (divide by the group's std) or 'none' (Dr. GRPO)."
            )
        super().__post_init__()


def _is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _has_host(url: str) -> bool:
    try:
        return bool(urlsplit(url).hostname)
    except ValueError:  # an unbalanced [ of an IPv6 address
        return False


def check_max_staleness(value: Any) -> None:
    """`ValueError`, naming ``value`` and the fix, unless ``max_staleness`` is an int >= 0."""
    meaning = (
        "max_staleness is how many policy versions a rollout sample may lag the policy it trains (0: only samples "
        "of the current policy; older samples are dropped)"
    )
    if not _is_int(value):
        raise ValueError(
            f"max_staleness={value!r}: {meaning}, a whole number of versions. Set an int >= 0, e.g. max_staleness=2."
        )
    if value < 0:
        raise ValueError(
            f"max_staleness={value!r}: {meaning}, so it cannot be negative. Set max_staleness=0 to train on fresh "
            "samples only, or a small int such as 2 to let generation run ahead of training."
        )


def check_queue_maxsize(value: Any) -> None:
    """`ValueError`, naming ``value`` and the fix, unless ``queue_maxsize`` is an int >= 0 (0: unbounded)."""
    if not _is_int(value) or value < 0:
        raise ValueError(
            f"queue_maxsize={value!r}: the bound of the rollout queue (the most samples buffered between the rollout "
            "worker and the trainer) is an int >= 0. Set queue_maxsize=0 for an unbounded queue, or a bound such as "
            "1024 (the default)."
        )


def check_server_base_url(url: Any) -> str:
    """``url`` without a trailing ``/``; `ValueError`, naming it and the fix, unless it is the ``http://`` or
    ``https://`` base URL of a server (a host, and no ``/v1`` API root: TRL appends ``/health``, ``/v1/...``)."""
    if not isinstance(url, str):
        raise ValueError(
            f"vllm_server_base_url={url!r}: set the base URL of your `vllm serve` as a string, e.g. "
            "'http://127.0.0.1:8000'."
        )
    stripped = url.strip().rstrip("/")
    try:
        parts = urlsplit(stripped)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as error:
        raise ValueError(
            f"vllm_server_base_url={url!r} is not a valid URL ({error}): write it as 'http://HOST:PORT', e.g. "
            "'http://127.0.0.1:8000'."
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = "http://127.0.0.1:8000"
        if stripped and ":/" not in url and _has_host(f"http://{stripped}"):  # "localhost:8000": the scheme left out
            example = f"http://{stripped}"
        raise ValueError(
            f"vllm_server_base_url={url!r} is not an http:// or https:// URL with a host: write the address of your "
            f"`vllm serve` with its scheme, e.g. {example!r}."
        )
    if parts.path.endswith("/v1"):
        base = stripped[: -len("/v1")]
        raise ValueError(
            f"vllm_server_base_url={url!r} ends in /v1, the OpenAI API root: set the server's base URL, "
            f"vllm_server_base_url={base!r}; TRL appends the paths itself (/health, /v1/completions, "
            "/v1/load_lora_adapter, ...)."
        )
    return stripped
