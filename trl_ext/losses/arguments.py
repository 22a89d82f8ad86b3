"""`LossArguments`: the loss settings every trl-ext trainer config shares (``loss_type``, the IPO loss's
``ipo_<name>`` fields mirrored from `IPOSettings`, ``loss_kwargs`` for a loss registered from
outside), each field documented once (`trl_ext.fields`), and their checks.

`ExtGRPOConfig` (TRL's synchronous trainer) and `ExtAsyncGRPOConfig` (TRL's experimental asynchronous one) inherit
it; each calls `check_loss_arguments` from its ``__post_init__``, with the loss types its trainer can train.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..fields import document_fields, documented, mirror_field
from .registry import IPOSettings, LossSpec, get_loss

__all__ = ["LOSS_SECTION", "LossArguments", "parse_loss_kwargs"]

LOSS_SECTION = 'Loss (docs/ipo_loss.md; the ipo_<name> fields are used when `loss_type="ipo"`)'


def _ipo_setting(name: str) -> Any:
    return mirror_field(IPOSettings, name, "IPO loss", section=LOSS_SECTION)


@document_fields
@dataclass
class LossArguments:
    """The loss registry's settings as trainer-config fields: which loss (``loss_type``) and its settings."""

    loss_type: str = documented(
        "dapo",
        "A loss of the registry `trl_ext.losses.LOSSES`: TRL's ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', "
        "'luspo', 'vespo'), trl-ext's 'ipo' (keep a token iff |p − p_old| <= ipo_threshold and its ratio is not "
        "beyond 1 ± ipo_ratio_band in the direction of its advantage, cap the ratio at ipo_ratio_cap, normalise by "
        "the number of loss tokens as 'dapo') or one registered with `trl_ext.losses.register_loss`. The asynchronous trainer (ExtAsyncGRPOConfig) takes 'dapo' (TRL's own "
        "async loss: PPO-clip normalised by the window's tokens) or a loss trl-ext computes ('ipo', or a registered "
        "one with a compute function).",
        section=LOSS_SECTION,
    )
    ipo_threshold: float = _ipo_setting("threshold")
    ipo_ratio_cap: float = _ipo_setting("ratio_cap")
    ipo_ratio_band: float | None = _ipo_setting("ratio_band")
    ipo_kl_tau: float = _ipo_setting("kl_tau")
    loss_kwargs: dict | str | None = documented(
        None,
        "Settings of a loss registered from outside (`register_loss` with a settings class), as a dict or its JSON "
        "(e.g. '{\"scale\": 2.0}'), checked by that class. None: the class's defaults. trl-ext's and TRL's losses "
        "read their own fields instead.",
        section=LOSS_SECTION,
    )

    def check_loss_arguments(self, allowed: Collection[str] | None = None, why: str = "") -> LossSpec:
        """Check the loss fields; returns the `LossSpec` of ``loss_type``.

        ``loss_kwargs`` given as JSON is parsed in place; the ``ipo_<name>`` fields are checked whatever the loss.
        The caller runs the loss's own `LossSpec.check_config` once its other fields are checked. ``allowed``: the
        loss types this config's trainer can train (None: every registered one); ``why`` says why the others are
        refused.

        Raises:
            ValueError: an unknown or refused ``loss_type`` (naming the choices), a bad setting (naming the fix).
        """
        if allowed is not None and self.loss_type not in allowed:
            raise ValueError(
                f"loss_type={self.loss_type!r} is not available here: {why}Set loss_type to one of {list(allowed)}."
            )
        loss = get_loss(self.loss_type)  # an unknown loss_type fails here, naming the registered ones
        self.loss_kwargs = parse_loss_kwargs(self.loss_kwargs)
        get_loss("ipo").settings_for(self)  # the ipo_<name> fields are this config's: checked whatever the loss
        return loss


def parse_loss_kwargs(value: Any) -> dict | None:
    """``loss_kwargs`` as a dict (a JSON string is parsed: the command line passes one), or None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"loss_kwargs={value!r} is not JSON: pass a dict or e.g. '{{\"scale\": 2.0}}' ({error})."
            ) from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"loss_kwargs={value!r} must be a dict of the loss's settings, e.g. {{'scale': 2.0}}.")
    return value
