"""`trl_ext.losses` against hand-computed values (docs/ipo_loss.md)."""

import math
from dataclasses import dataclass

import pytest
import torch

from trl_ext.fields import documented
from trl_ext.losses import folded_advantages, ipo_keep_mask, ipo_loss, ppo_clip_flags, ppo_clip_loss, sampling_mismatch

# Two rollouts, three completion tokens; the last token of row 1 is padding.
P = torch.tensor([[0.5, 0.9, 0.1], [0.2, 0.05, 0.6]], dtype=torch.float64)
P_OLD = torch.tensor([[0.4, 0.5, 0.01], [0.2, 0.5, 0.7]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)
# |p - p_old| = [[0.1, 0.4, 0.09], [0.0, 0.45, 0.1]] -> kept (ε = 0.3): [[1, 0, 1], [1, 0, (pad)]]
# ρ = [[1.25, 1.8, 10], [1, 0.1, -]] -> ρ̂ (C = 8) = [[1.25, 1.8, 8], [1, 0.1, -]]
# -keep·A·ρ̂ = [[-1.25, 0, -8], [2, 0, -]] -> sum -7.25 over 5 loss tokens


def _logps():
    return P.log().requires_grad_(True), P_OLD.log()


def test_keep_mask_hand_computed():
    keep = ipo_keep_mask(P.log(), P_OLD.log(), threshold=0.3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[True, False, True], [True, False, True]]
    # the boundary is inclusive and the mask ignores advantages entirely
    assert ipo_keep_mask(torch.tensor([[0.5]]).log(), torch.tensor([[0.25]]).log(), threshold=0.25).item()


def test_ipo_ratio_band_stops_a_token_that_moved_as_far_as_its_advantage_asks():
    # p_old 0.2 for every token, all inside the probability region (|p − p_old| <= 0.06 < 0.3)
    p = torch.tensor([[0.14, 0.26, 0.26, 0.14, 0.19]], dtype=torch.float64)
    old = torch.full_like(p, 0.2).log()
    advantages = torch.tensor([[-1.0, -1.0, 2.0, 2.0, -1.0]], dtype=torch.float64)
    # ρ = 0.7 (A<0: below 1 − 0.2, dropped), 1.3 (A<0, moved against it: kept), 1.3 (A>0: above 1.2, dropped),
    # 0.7 (A>0, moved against it: kept), 0.95 (A<0, inside the band: kept)
    logps = p.log().requires_grad_()
    loss, metrics = ipo_loss(logps, old, advantages, torch.ones_like(p), ratio_band=0.2)
    assert loss.item() == pytest.approx(-(-1.0 * 1.3 + 2.0 * 0.7 - 1.0 * 0.95) / 5)
    loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, 1.3 / 5, 0.0, -1.4 / 5, 0.95 / 5])
    assert metrics["band_ratio"].item() == pytest.approx(2 / 5) and metrics["masked_ratio"].item() == pytest.approx(
        2 / 5
    )
    # the region alone trains every one of them
    region, region_metrics = ipo_loss(p.log(), old, advantages, torch.ones_like(p), ratio_band=None)
    assert region.item() == pytest.approx(-(-0.7 - 1.3 + 2.6 + 1.4 - 0.95) / 5)
    assert region_metrics["band_ratio"].item() == 0.0 and region_metrics["masked_ratio"].item() == 0.0
    with pytest.raises(ValueError, match="ratio_band"):
        ipo_loss(p.log(), old, advantages, torch.ones_like(p), ratio_band=1.0)


def test_ipo_ratio_band_stops_an_unlikely_token_the_region_lets_fall_to_zero():
    """A token with p_old <= ε stays in the probability region however low it falls: with a negative advantage
    only the band stops pushing it down."""
    old = torch.tensor([[0.25]], dtype=torch.float64).log()
    for p, region_trains, band_trains in ((0.24, True, True), (0.1, True, False), (1e-6, True, False)):
        logps = torch.tensor([[p]], dtype=torch.float64).log()
        assert bool(ipo_keep_mask(logps, old)) is region_trains
        _, metrics = ipo_loss(logps, old, torch.tensor([-1.0]), torch.ones(1, 1))
        assert (metrics["masked_ratio"].item() == 0.0) is band_trains


def test_keep_mask_nonfinite_and_validation():
    logps = torch.tensor([[-0.1, -0.1]])
    old = torch.tensor([[float("-inf"), float("nan")]])  # p_old = 0 (|Δ| = 0.905 > 0.3), and unscorable
    assert ipo_keep_mask(logps, old).tolist() == [[False, False]]
    assert ipo_keep_mask(logps, old, threshold=0.95).tolist() == [[True, False]]
    with pytest.raises(ValueError, match="threshold"):
        ipo_keep_mask(logps, logps, threshold=-0.1)
    with pytest.raises(ValueError, match="same shape"):
        ipo_keep_mask(logps, logps[:, :1])


def ipo_region_loss(*args, **kwargs):
    """`ipo_loss` with the probability-difference region alone (``ratio_band=None``): the tests below check that
    region by hand; the band has tests of its own."""
    return ipo_loss(*args, ratio_band=None, **kwargs)


def test_ipo_loss_hand_computed_value_and_metrics():
    logps, old = _logps()
    loss, metrics = ipo_region_loss(logps, old, ADV, MASK, threshold=0.3, ratio_cap=8.0)
    assert loss.item() == pytest.approx(-7.25 / 5)
    assert metrics["masked_ratio"].item() == pytest.approx(2 / 5)
    assert metrics["capped_ratio"].item() == pytest.approx(1 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx((1.25 + 1.8 + 10 + 1 + 0.1) / 5)
    assert metrics["num_tokens"].item() == 5


def test_ipo_loss_gradient_zero_on_masked_and_bounded_on_capped():
    logps, old = _logps()
    loss, _ = ipo_region_loss(logps, old, ADV, MASK)
    loss.backward()
    # d loss / d log p = -keep · A · min(ρ, C) / 5: the capped token gets exactly -A·C/5
    expected = torch.tensor([[-1.25 / 5, 0.0, -8.0 / 5], [2.0 / 5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected)


def test_ipo_loss_kl_tau_penalty():
    logps, old = _logps()
    loss, _ = ipo_region_loss(logps, old, ADV, MASK, kl_tau=0.1)
    penalty = sum(math.log(r) ** 2 for r in (1.25, 1.8, 10.0, 1.0, 0.1))
    assert loss.item() == pytest.approx((-7.25 + 0.1 * penalty) / 5)


def test_ipo_loss_token_advantages_equal_broadcast_row_advantages():
    logps, old = _logps()
    loss_row, _ = ipo_region_loss(logps, old, ADV, MASK)
    loss_tok, _ = ipo_region_loss(logps, old, ADV.unsqueeze(1).expand(2, 3).clone(), MASK)
    assert loss_row.item() == pytest.approx(loss_tok.item())
    # a per-token advantage changes exactly the tokens it touches: +0.5 on the kept, uncapped token (0, 0)
    token_adv = ADV.unsqueeze(1).expand(2, 3).clone()
    token_adv[0, 0] += 0.5
    loss_changed, _ = ipo_region_loss(logps, old, token_adv, MASK)
    assert loss_changed.item() == pytest.approx((-7.25 - 0.5 * 1.25) / 5)
    with pytest.raises(ValueError, match="advantages must have shape"):
        ipo_region_loss(logps, old, torch.ones(3), MASK)


def test_ipo_loss_ignores_garbage_old_logps_at_padding():
    logps, old = _logps()
    garbage = old.clone()
    garbage[1, 2] = float("-inf")
    loss_inf, _ = ipo_region_loss(logps, garbage, ADV, MASK)
    garbage[1, 2] = float("nan")
    loss_nan, _ = ipo_region_loss(logps, garbage, ADV, MASK)
    garbage[1, 2] = 1e30
    loss_big, _ = ipo_region_loss(logps, garbage, ADV, MASK, kl_tau=0.0)
    for loss in (loss_inf, loss_nan, loss_big):
        assert loss.item() == pytest.approx(-7.25 / 5)
    loss_nan.backward()
    assert torch.isfinite(logps.grad).all()


def test_ipo_loss_unscorable_token_inside_mask_is_masked_out():
    logps, old = _logps()
    old = old.clone()
    old[0, 0] = float("nan")  # e.g. a token vLLM could not score
    loss, metrics = ipo_region_loss(logps, old, ADV, MASK)
    assert loss.item() == pytest.approx((-7.25 + 1.25) / 5)
    assert metrics["masked_ratio"].item() == pytest.approx(3 / 5)


def test_ipo_loss_all_masked_rows():
    logps, old = _logps()
    loss, metrics = ipo_region_loss(logps, old, ADV, torch.zeros_like(MASK))
    assert loss.item() == 0.0
    assert metrics["masked_ratio"].item() == 0.0
    loss.backward()
    assert torch.count_nonzero(logps.grad) == 0
    # a row whose tokens are all outside the trust region contributes 0 but still counts in the normaliser
    far = torch.tensor([[0.9, 0.9], [0.5, 0.5]], dtype=torch.float64)
    near = torch.tensor([[0.1, 0.1], [0.5, 0.5]], dtype=torch.float64)
    loss, metrics = ipo_region_loss(far.log(), near.log(), torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    assert loss.item() == pytest.approx(-2.0 / 4)
    assert metrics["masked_ratio"].item() == pytest.approx(0.5)


def test_ipo_loss_underflowing_old_prob_is_capped_finitely():
    logps = torch.tensor([[math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[-200.0]])  # p_old underflows to 0 in float32: ρ would be inf
    loss, metrics = ipo_region_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 1), ratio_cap=8.0)
    assert loss.item() == pytest.approx(-8.0)
    loss.backward()
    assert logps.grad.item() == pytest.approx(-8.0)
    assert metrics["capped_ratio"].item() == 1.0


def test_ipo_loss_normalizer_and_validation():
    logps, old = _logps()
    loss, _ = ipo_region_loss(logps, old, ADV, MASK, normalizer=10.0)
    assert loss.item() == pytest.approx(-7.25 / 10)
    with pytest.raises(ValueError, match="ratio_cap must be > 1"):
        ipo_region_loss(logps, old, ADV, MASK, ratio_cap=1.0)
    with pytest.raises(ValueError, match="kl_tau"):
        ipo_region_loss(logps, old, ADV, MASK, kl_tau=-1.0)
    with pytest.raises(ValueError, match="must all be"):
        ipo_region_loss(logps, old, ADV, MASK[:, :2])


def test_sampling_mismatch_counts_only_the_trained_tokens():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-1.5, -2.0, float("nan")], [-0.2, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    ratio = torch.tensor([[0.6, 1.0, 1.0], [0.4, 1.0, 1.0]])
    stats = sampling_mismatch(old, sampling, mask, ratio)
    # |diff| over masked, non-NaN tokens: 0.5, 0.0, 0.8 (the NaN and the two masked tokens are left out)
    assert stats["logp_diff_mean"].item() == pytest.approx(1.3 / 3)
    assert stats["logp_diff_max"].item() == pytest.approx(0.8)
    # ratios over the 4 masked tokens: 0.6, 1.0, 1.0, 0.4
    assert [stats[k].item() for k in ("is_ratio_min", "is_ratio_mean", "is_ratio_max")] == pytest.approx(
        [0.4, 0.75, 1.0]
    )
    per_row = sampling_mismatch(old, sampling, mask, torch.tensor([[0.5], [2.0]]))  # sequence modes: one per row
    assert per_row["is_ratio_mean"].item() == pytest.approx(1.25)
    empty = sampling_mismatch(old, sampling, torch.zeros_like(mask), ratio)
    assert all(value.item() == 0.0 for key, value in empty.items() if key.startswith("logp"))


def test_ipo_loss_weights_multiply_each_tokens_whole_loss():
    """w·(−keep·A·ρ̂ + τ·(log ρ)²), summed over loss tokens: the weight reaches the τ term too."""
    logps, old = _logps()
    weights = torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, 7.0]], dtype=torch.float64)
    tau = 0.5
    loss, _ = ipo_region_loss(logps, old, ADV, MASK, kl_tau=tau, normalizer=1.0, weights=weights)
    policy = [[-1.25, 0.0, -8.0], [2.0, 0.0, 0.0]]  # -keep·A·ρ̂ (see the header), the padding token is out
    ratio = [[1.25, 1.8, 10.0], [1.0, 0.1, 1.0]]
    expected = sum(
        weights[b, t].item() * (policy[b][t] + tau * math.log(ratio[b][t]) ** 2)
        for b in range(2)
        for t in range(3)
        if MASK[b, t]
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # weights of 1 are no weights
    ones, _ = ipo_region_loss(logps, old, ADV, MASK, kl_tau=tau, weights=torch.ones_like(weights))
    plain, _ = ipo_region_loss(logps, old, ADV, MASK, kl_tau=tau)
    assert ones.item() == plain.item()
    with pytest.raises(ValueError, match=r"weights must be \(B, T\)"):
        ipo_region_loss(logps, old, ADV, MASK, weights=weights[:, :2])


# ---------------------------------------------------------------------------------------------- TRL's PPO-clip loss
# Six loss tokens, ε_low = 0.2, ε_high = 0.28: clip range [0.8, 1.28].
RHO = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.0, 2.0], dtype=torch.float64)
ADV_T = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0, 0.0], dtype=torch.float64)
# ρA = [1.5, -0.5, -1.5, 0.5, 2, 0]; clip(ρ)A = [1.28, -0.8, -1.28, 0.8, 2, 0]
# -min = [-1.28, 0.8, 1.5, -0.5, -2, 0] -> sum -1.48; the first two are clipped (high, low): no gradient there.
# d(-min)/d log p = -A·ρ where unclipped: [0, 0, 1.5, -0.5, -2, 0]


def test_ppo_clip_loss_hand_computed_value_flags_and_gradient():
    old = torch.tensor([-0.5, -1.0, -2.0, -0.1, -0.7, -3.0], dtype=torch.float64)
    logps = (old + RHO.log()).requires_grad_(True)
    loss, flags = ppo_clip_loss(logps, old, ADV_T, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.48 / 6)  # divided by the 6 tokens by default
    assert flags["high"].tolist() == [True, False, False, False, False, False]
    assert flags["low"].tolist() == [False, True, False, False, False, False]
    assert flags["region"].tolist() == [True, True, False, False, False, False]
    assert not any(flag.requires_grad for flag in flags.values())
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([0.0, 0.0, 1.5, -0.5, -2.0, 0.0], dtype=torch.float64) / 6)

    halved, _ = ppo_clip_loss(logps, old, ADV_T, epsilon_low=0.2, epsilon_high=0.28, normalizer=torch.tensor(12.0))
    assert halved.item() == pytest.approx(-1.48 / 12)
    with pytest.raises(ValueError, match="one shape"):
        ppo_clip_loss(logps, old, ADV_T[:5])


def test_ppo_clip_flags_are_strict_and_need_the_advantage_sign():
    ratio = torch.tensor([0.8, 1.28, 0.79, 1.29, 0.5, 2.0], dtype=torch.float64)
    advantages = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    flags = ppo_clip_flags(ratio, advantages, epsilon_low=0.2, epsilon_high=0.28)
    assert flags["low"].tolist() == [False, False, True, False, False, False]  # on the bound: not clipped
    assert flags["high"].tolist() == [False, False, False, True, False, False]  # A = 0: never clipped
    assert flags["region"].tolist() == [False, False, True, True, False, False]
    with pytest.raises(ValueError, match="one shape"):
        ppo_clip_flags(ratio, advantages[:2], epsilon_low=0.2, epsilon_high=0.2)


def test_loss_registry_names_the_choices():
    from trl_ext.losses import LOSSES, LossSpec, get_loss, register_loss

    assert get_loss("ipo").compute is ipo_loss and get_loss("dapo").compute is None
    assert {name for name, spec in LOSSES.items() if spec.normalization == "rows"} == {
        "grpo",
        "sapo",
        "luspo",
        "dr_grpo",
    }
    with pytest.raises(ValueError, match=r"Unknown loss_type='ppo'. Set loss_type to one of \['grpo'"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_loss(LossSpec("ipo", "rows"))
    with pytest.raises(ValueError, match="normalization"):
        register_loss(LossSpec("new_loss", "sequence"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- a loss's settings
def test_ipo_settings_own_their_defaults_validation_and_trust_region_metric():
    from trl_ext.losses import IPOSettings, get_loss, trust_region_label, trust_region_loss, trust_region_metrics

    assert IPOSettings() == IPOSettings(threshold=0.3, ratio_cap=8.0, kl_tau=0.0)
    for bad, message in (({"threshold": 0.0}, "ipo_threshold"), ({"ratio_cap": 1.0}, "ipo_ratio_cap")):
        with pytest.raises(ValueError, match=message):
            IPOSettings(**bad)
    with pytest.raises(ValueError, match="ipo_kl_tau"):
        IPOSettings(kl_tau=-0.1)
    ipo = get_loss("ipo")
    assert ipo.settings is IPOSettings and ipo.trust_region_metric == "ipo/masked_ratio"
    assert trust_region_metrics() == ("clip_ratio/region_mean", "ipo/masked_ratio")
    assert trust_region_loss("ipo/masked_ratio") is ipo and trust_region_loss("loss") is None
    assert trust_region_label("ipo/masked_ratio") == "IPO masked ratio"
    assert trust_region_label("clip_ratio/region_mean") == "clip rate (clip_ratio/region_mean)"


@dataclass(frozen=True)
class _ScaleSettings:
    scale: float = documented(1.0, "Multiplies the loss.")
    offset: float = documented(0.0, "Added to the loss.")

    def __post_init__(self):
        if self.scale <= 0:
            raise ValueError(f"scale={self.scale} must be > 0.")


def _scaled_loss(logps, old_logps, advantages, mask, *, normalizer, weights, scale, offset):
    return -(logps * mask).sum() / normalizer * scale + offset, {"num_tokens": mask.sum().float()}


@pytest.fixture
def outside_loss():
    from trl_ext.losses import LOSSES, LossSpec, register_loss

    spec = register_loss(LossSpec("test_scaled", "tokens", _scaled_loss, settings=_ScaleSettings))
    yield spec
    del LOSSES["test_scaled"]


def test_an_outside_loss_reads_its_settings_from_loss_kwargs(tmp_path, outside_loss):
    from tests.utils import cpu_config_kwargs
    from trl_ext.losses import get_loss
    from trl_ext.trainers.ext_grpo_config import ExtGRPOConfig

    def config(**overrides):
        return ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type="test_scaled", **overrides))

    assert outside_loss.settings_from(config()) == {"scale": 1.0, "offset": 0.0}
    assert outside_loss.settings_from(config(loss_kwargs={"scale": 2.0})) == {"scale": 2.0, "offset": 0.0}
    assert outside_loss.settings_from(config(loss_kwargs='{"offset": 0.5}')) == {"scale": 1.0, "offset": 0.5}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['scal'\] for loss_type='test_scaled'.*'scale'"):
        config(loss_kwargs={"scal": 2.0})
    with pytest.raises(ValueError, match="scale=-1.0 must be > 0"):
        config(loss_kwargs={"scale": -1.0})
    with pytest.raises(ValueError, match="is not JSON"):
        config(loss_kwargs="{scale: 2}")
    # the built-in losses read their own fields: loss_kwargs set for them is a mistake, named
    with pytest.raises(ValueError, match="loss_type='ipo' reads its settings from the config fields ipo_<name>"):
        ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type="ipo", loss_kwargs={"scale": 2.0}))
    with pytest.raises(ValueError, match="loss_type='dapo' takes no settings"):
        ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_kwargs={"scale": 2.0}))
    ipo = ExtGRPOConfig(**cpu_config_kwargs(str(tmp_path), loss_type="ipo", ipo_threshold=0.2))
    assert get_loss("ipo").settings_from(ipo) == {"threshold": 0.2, "ratio_cap": 8.0, "ratio_band": 0.2, "kl_tau": 0.0}


def test_register_loss_needs_a_settings_dataclass():
    from trl_ext.losses import LossSpec, register_loss

    with pytest.raises(TypeError, match="must be a dataclass whose fields are the loss's settings"):
        register_loss(LossSpec("test_bad", "tokens", _scaled_loss, settings={"scale": "ipo_ratio_cap"}))


def test_folded_advantages_weigh_each_tokens_advantage():
    weights = torch.tensor([[1.0, 0.5], [0.0, 2.0]])
    assert folded_advantages(torch.tensor([1.0, -2.0]), weights).tolist() == [[1.0, 0.5], [0.0, -4.0]]  # (B,)
    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    folded = folded_advantages(per_token, weights)
    assert folded.tolist() == [[1.0, 1.0], [0.0, 8.0]] and folded.dtype == torch.float64  # the advantages' dtype
