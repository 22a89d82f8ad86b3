"""The policy losses (docs/ipo_loss.md): pure tensor functions, the registry a config picks its loss from, and the
loss settings every trainer config shares.

- `policy`: the IPO loss (`ipo_loss`, `ipo_keep_mask`), TRL's asynchronous PPO-clip (`ppo_clip_loss`,
  `ppo_clip_flags`), loss weights folded into the advantages of a loss linear in them (`folded_advantages`), the importance-sampling ratio and the sampler/trainer mismatch, the per-token statistics of the
  asynchronous trainer (`policy_stat_sums`, `version_lags`);
- `registry`: `LOSSES`, `LossSpec`, `register_loss`, `get_loss`, `IPOSettings`, the trust-region metric of each loss;
- `arguments`: `LossArguments`, ``loss_type``, the ``ipo_<name>`` fields and ``loss_kwargs`` as trainer-config
  fields, declared once for the synchronous and the asynchronous config (as each method's arguments are).

Every public name is importable from here (``from trl_ext.losses import ipo_loss``).
"""

from .policy import (
    folded_advantages,
    importance_sampling_ratio,
    ipo_keep_mask,
    ipo_loss,
    policy_stat_sums,
    ppo_clip_flags,
    ppo_clip_loss,
    sampling_mismatch,
    version_lags,
)
from .registry import (
    LOSSES,
    IPOSettings,
    LossCard,
    LossSpec,
    get_loss,
    register_loss,
    trust_region_label,
    trust_region_loss,
    trust_region_metrics,
)

__all__ = [
    "LOSSES",
    "IPOSettings",
    "LossCard",
    "LossSpec",
    "folded_advantages",
    "get_loss",
    "importance_sampling_ratio",
    "ipo_keep_mask",
    "ipo_loss",
    "policy_stat_sums",
    "ppo_clip_flags",
    "ppo_clip_loss",
    "register_loss",
    "sampling_mismatch",
    "trust_region_label",
    "trust_region_loss",
    "trust_region_metrics",
    "version_lags",
]
