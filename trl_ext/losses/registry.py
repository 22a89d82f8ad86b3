"""The registry a config picks its loss from (docs/ipo_loss.md): `LOSSES`, the ``loss_type`` values, TRL's own
(computed by TRL) and trl-ext's (a pure per-token function of `trl_ext.losses.policy`).

A trainer looks its loss up with `get_loss`; `register_loss` adds one. Each `LossSpec` owns its settings (a
dataclass such as `IPOSettings`: defaults, help texts, validation), its constraints on a trainer config
(``check_config``) and names its trust-region metric, which the monitors, the plot and the model card ask for
(`trust_region_metrics`, `trust_region_loss`, `trust_region_label`) instead of knowing any loss by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any, Literal

from torch import Tensor

from ..fields import documented
from .policy import ipo_loss

__all__ = [
    "LOSSES",
    "IPOSettings",
    "LossCard",
    "LossSpec",
    "get_loss",
    "register_loss",
    "trust_region_label",
    "trust_region_loss",
    "trust_region_metrics",
]


@dataclass(frozen=True)
class IPOSettings:
    """The settings of the IPO loss (`ipo_loss`'s keywords); a trainer config mirrors them as ``ipo_<name>`` fields.

    Raises:
        ValueError: a setting out of its range, naming the range and the default.
    """

    threshold: float = documented(
        0.3,
        "ε, the largest probability change |p − p_old| of a token that still gets a gradient (tokens beyond it are "
        "masked, whatever the advantage sign). 0.3 is the judge blog's run setting; prime-rl's own default is 0.1.",
    )
    ratio_cap: float = documented(8.0, "C, the cap on the importance ratio p / p_old (value ≤ C, gradient ≤ C). > 1.")
    ratio_band: float | None = documented(
        0.2,
        "δ: a token whose ratio p / p_old moved beyond 1 ± δ in the direction of its advantage (below 1 − δ with a "
        "negative advantage, above 1 + δ with a positive one) also stops getting a gradient, as in PPO-clip. In "
        "(0, 1); None: the probability-difference region alone (prime-rl's IPO), which on the quickstart's RLM task "
        "let the final answers of failed rollouts fall to 0 and the policy die on 3 of 3 seeds (docs/ipo_loss.md).",
    )
    kl_tau: float = documented(0.0, "τ, weight of the (log p/p_old)² penalty on every loss token. >= 0.")

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(
                f"ipo_threshold={self.threshold} is not a probability difference: set it in (0, 1] "
                "(the judge blog's runs use 0.3, prime-rl's default is 0.1; smaller is a tighter trust region)."
            )
        if not self.ratio_cap > 1.0:
            raise ValueError(
                f"ipo_ratio_cap={self.ratio_cap} would cap even unchanged tokens (ratio 1): set it > 1 (default 8.0)."
            )
        if self.kl_tau < 0:
            raise ValueError(f"ipo_kl_tau={self.kl_tau} must be >= 0 (0 disables the penalty).")
        if self.ratio_band is not None and not 0.0 < self.ratio_band < 1.0:
            raise ValueError(
                f"ipo_ratio_band={self.ratio_band} is not a ratio band: set it in (0, 1) (default 0.2, PPO-clip's "
                "epsilon), or None for the probability-difference region alone."
            )


def _check_ipo_config(config: Any) -> None:
    """What the IPO loss needs of a trainer config besides its settings: token-level ratios, no entropy bonus."""
    if config.importance_sampling_level != "token":
        raise ValueError(
            "loss_type='ipo' masks single tokens: set importance_sampling_level='token' "
            f"(got {config.importance_sampling_level!r})."
        )
    if config.entropy_coef != 0.0 or config.use_adaptive_entropy:
        raise ValueError(
            "loss_type='ipo' does not support TRL's entropy bonus: set entropy_coef=0.0 and "
            "use_adaptive_entropy=False, or use a TRL loss type."
        )


@dataclass(frozen=True)
class LossCard:
    """What a model card says of a loss trl-ext brings (TRL's own losses need none: the card cites TRL).

    Attributes:
        text: the card's sentence on the policy loss.
        source: ``(citation, url)`` of the loss's source, listed under the card's sources.
        tag: the Hub tag the card adds (``"ipo-loss"``).
    """

    text: str
    source: tuple[str, str]
    tag: str


@dataclass(frozen=True)
class LossSpec:
    """One ``loss_type``: who computes it, what it divides by, its settings and its trust-region metric.

    Attributes:
        name: the ``loss_type`` value.
        normalization: ``"tokens"``: a sum over tokens divided by the loss tokens of the whole accumulation window
            (all ranks), so a per-token weight is exact; ``"rows"``: a mean over rows (a zero-loss padding row
            dilutes it); ``"local"``: divided by this micro-batch's own token count.
        compute: None for TRL's own losses (TRL computes them); else a pure function
            ``compute(logps, old_logps, advantages, mask, *, normalizer, weights, **settings) -> (loss, metrics)``
            with the shapes of `ipo_loss`; its 0-dim metrics are logged as ``<name>/<metric>`` (``num_tokens``
            weights their mean).
        settings: for ``compute``: a dataclass whose fields are its keyword settings, each with its default, its
            help text (``metadata["help"]``) and its validation (``__post_init__``), e.g. `IPOSettings`; None when
            it takes none.
        config_prefix: where a trainer config holds the settings: ``"ipo_"`` reads the fields ``ipo_<setting>``
            (mirrored from ``settings``, see `trl_ext.fields.mirror_field`); None reads the config's ``loss_kwargs``
            dict (a loss registered from outside).
        config_check: called with a trainer config that picks this loss; raises a ValueError naming the fix when
            the config cannot train it (e.g. IPO needs ``importance_sampling_level="token"``).
        trust_region_metric: the logged key of the fraction of loss tokens the loss's trust region acts on (TRL's
            clip rate ``clip_ratio/region_mean``, IPO's masked ratio ``ipo/masked_ratio``), which `ClipRateMonitor`
            watches and ``trl-ext plot`` draws; None when the loss logs none.
        trust_region_label: how alert texts name that metric (``"IPO masked ratio"``); empty: ``clip rate (<key>)``.
        trust_region_related: other fractions the loss logs, drawn next to its trust-region metric by the plot.
        measured_against_sampler: the trust-region metric compares the policy with the sampler's log-probs (the
            generator's when it returns them), so it is non-zero in a vLLM run even when the trainer is on-policy.
        trust_region_floor: a trust-region metric near 0 through an off-policy run means the updates barely move
            the policy (PPO-style clipping, whose healthy clip rate is a few percent), so `ClipRateMonitor`'s
            ``clip_rate_low`` and ``clip_rate_stuck_zero`` watch it. False where the trust region acts only on
            outlier tokens and 0 is its healthy state (IPO: a token is masked only when its probability moved by
            more than ε; measured healthy runs mask 0-0.1 %).
        description: one line for errors and docs.
        card: what the model card says of the loss (`LossCard`); None: nothing beyond TRL's citation.
    """

    name: str
    normalization: Literal["tokens", "rows", "local"]
    compute: Callable[..., tuple[Tensor, dict[str, Tensor]]] | None = None
    settings: type | None = None
    description: str = ""
    config_prefix: str | None = None
    config_check: Callable[[Any], None] | None = None
    trust_region_metric: str | None = None
    trust_region_label: str = ""
    trust_region_related: tuple[str, ...] = ()
    measured_against_sampler: bool = False
    trust_region_floor: bool = True
    card: LossCard | None = None

    def settings_for(self, config: Any) -> Any | None:
        """The ``settings`` object a trainer config describes (from its ``<config_prefix><name>`` fields or its
        ``loss_kwargs``), validated by the settings class; None when the loss takes no settings.

        Raises:
            ValueError: ``loss_kwargs`` names a setting the loss does not have or lacks a required one, or the
                settings class rejects a value.
        """
        if self.settings is None:
            return None
        names = [item.name for item in fields(self.settings)]
        if self.config_prefix is not None:
            return self.settings(**{name: getattr(config, self.config_prefix + name) for name in names})
        values = dict(getattr(config, "loss_kwargs", None) or {})
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(
                f"loss_kwargs has unknown key(s) {unknown} for loss_type={self.name!r}: its settings "
                f"({self.settings.__name__}) are {names}."
            )
        required = [item.name for item in fields(self.settings) if _is_required(item)]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(
                f"loss_type={self.name!r} needs loss_kwargs {missing} (no default in {self.settings.__name__})."
            )
        return self.settings(**values)

    def settings_from(self, config: Any) -> dict[str, Any]:
        """The keyword arguments of ``compute`` for a trainer config: `settings_for`'s fields as a dict."""
        settings = self.settings_for(config)
        return {} if settings is None else {item.name: getattr(settings, item.name) for item in fields(settings)}

    def check_config(self, config: Any) -> None:
        """Raise a ValueError naming the fix when a trainer config that picks this loss cannot train it: its
        settings (`settings_for`), a ``loss_kwargs`` the loss does not read, and ``config_check``."""
        loss_kwargs = getattr(config, "loss_kwargs", None)
        if loss_kwargs and (self.settings is None or self.config_prefix is not None):
            where = (
                "takes no settings"
                if self.settings is None
                else f"reads its settings from the config fields {self.config_prefix}<name>"
            )
            raise ValueError(
                f"loss_kwargs={loss_kwargs!r} is set, but loss_type={self.name!r} {where}: remove loss_kwargs "
                "(it is for a loss registered from outside with a settings class)."
            )
        self.settings_for(config)
        if self.config_check is not None:
            self.config_check(config)


def _is_required(item: Field) -> bool:
    return item.default is MISSING and item.default_factory is MISSING


LOSSES: dict[str, LossSpec] = {}


def register_loss(spec: LossSpec) -> LossSpec:
    """Add ``spec`` to `LOSSES` (a config's ``loss_type`` may then name it); returns it.

    A loss registered from outside keeps its settings in a dataclass of its own (``settings``) and a config sets
    them with ``loss_kwargs``::

        @dataclass(frozen=True)
        class ScaleSettings:
            scale: float = documented(1.0, "Multiplies the loss.")

        register_loss(LossSpec("scaled", "tokens", scaled_loss, settings=ScaleSettings))
        config = ExtGRPOConfig(..., loss_type="scaled", loss_kwargs={"scale": 2.0})
    """
    if spec.normalization not in ("tokens", "rows", "local"):
        raise ValueError(f"normalization={spec.normalization!r} must be 'tokens', 'rows' or 'local'.")
    if spec.settings is not None and not (isinstance(spec.settings, type) and is_dataclass(spec.settings)):
        raise TypeError(
            f"LossSpec {spec.name!r}: settings={spec.settings!r} must be a dataclass whose fields are the loss's "
            "settings (e.g. IPOSettings), or None; a config sets them with loss_kwargs."
        )
    if spec.name in LOSSES and LOSSES[spec.name] != spec:
        raise ValueError(f"loss_type {spec.name!r} is already registered; pick another name.")
    LOSSES[spec.name] = spec
    return spec


def get_loss(name: str) -> LossSpec:
    """The registered `LossSpec` of ``loss_type=name``; a ValueError naming the choices otherwise."""
    if name not in LOSSES:
        raise ValueError(f"Unknown loss_type={name!r}. Set loss_type to one of {list(LOSSES)}.")
    return LOSSES[name]


def trust_region_metrics() -> tuple[str, ...]:
    """The trust-region metric of every registered loss, once each, in registration order (TRL's
    ``clip_ratio/region_mean`` first): the keys a reader of a log that does not know its loss looks for."""
    return tuple(dict.fromkeys(spec.trust_region_metric for spec in LOSSES.values() if spec.trust_region_metric))


def trust_region_loss(metric: str) -> LossSpec | None:
    """The first registered loss whose trust-region metric is the logged key ``metric``, or None."""
    return next((spec for spec in LOSSES.values() if spec.trust_region_metric == metric), None)


def trust_region_label(metric: str) -> str:
    """How alert texts name the logged key ``metric``: its loss's ``trust_region_label``, else ``clip rate (<key>)``."""
    spec = trust_region_loss(metric)
    return spec.trust_region_label if spec is not None and spec.trust_region_label else f"clip rate ({metric})"


# TRL's own losses (TRL computes them) and what each divides by, in the order `get_loss` names them.
_TRL_LOSSES = {
    "grpo": "rows",
    "sapo": "rows",
    "luspo": "rows",
    "dr_grpo": "rows",
    "bnpo": "local",
    "dapo": "tokens",
    "cispo": "tokens",
    "vespo": "tokens",
}
_TRL_CLIP_RATE_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL logs clip_ratio/region_mean for these
_DIVIDES_BY = {"rows": "a mean over rows", "local": "this micro-batch's tokens", "tokens": "the window's loss tokens"}
for _name, _normalization in _TRL_LOSSES.items():
    register_loss(
        LossSpec(
            _name,
            _normalization,
            description=f"TRL's {_name!r} loss ({_DIVIDES_BY[_normalization]}).",
            trust_region_metric="clip_ratio/region_mean" if _name in _TRL_CLIP_RATE_LOSSES else None,
        )
    )
register_loss(
    LossSpec(
        "ipo",
        "tokens",
        compute=ipo_loss,
        settings=IPOSettings,
        description="IPO masking loss: probability-difference trust region and ratio cap (docs/ipo_loss.md).",
        config_prefix="ipo_",
        config_check=_check_ipo_config,
        trust_region_metric="ipo/masked_ratio",
        trust_region_label="IPO masked ratio",
        trust_region_related=("ipo/capped_ratio",),
        measured_against_sampler=True,
        trust_region_floor=False,
        card=LossCard(
            text="Policy loss: the IPO masking loss (a token is kept when |p − p_old| ≤ ε; the ratio is capped), "
            '`loss_type="ipo"`.',
            source=(
                "prime-rl `ipo` loss (PrimeIntellect-ai/prime-rl, `src/prime_rl/trainer/rl/loss.py`)",
                "https://github.com/PrimeIntellect-ai/prime-rl",
            ),
            tag="ipo-loss",
        ),
    )
)
