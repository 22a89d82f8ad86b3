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

from . import policy, registry
from .policy import *  # noqa: F403  (each module's __all__ is the one list of its names)
from .registry import *  # noqa: F403

__all__ = [*policy.__all__, *registry.__all__]
