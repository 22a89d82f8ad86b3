"""The monitor alerts as data: for every rule, what it means, what to check first, and its message template.

`ALERTS` is the one home of these texts; docs/troubleshooting.md has the same table for readers. A monitor turns a
`Finding` of a rule (`trl_ext.callbacks.rules`) into a `MonitorAlert` whose message is `format_alert` of the rule's
template with the rule's settings, the finding's facts and what the monitor knows about the run (learning rate,
training arguments); the clip-rate alerts name the watched metric as its loss does (`trl_ext.losses.trust_region_label`).
This module imports neither transformers nor matplotlib.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..losses import trust_region_label
from .configs import is_number

ALERT_KEY_PREFIX = "monitor/alerts/"


@dataclass(frozen=True)
class AlertText:
    """The texts of one rule's alert.

    Attributes:
        meaning: what the alert says about the run, in one line.
        check: the first things to look at.
        message: the logged message (what happened, likely causes, what to do), a `str.format` template over the
            fields described in `format_alert`.
        variants: templates of the ``{what}`` field for rules with several conditions, by `Finding.variant`.
    """

    meaning: str
    check: str
    message: str
    variants: Mapping[str, str] = field(default_factory=dict)


# The systematic generator/trainer log-prob mismatches, named by several clip-rate alerts.
MISMATCH_CAUSES = (
    "a systematic log-prob mismatch between the generator and the trainer: chat-template mismatch (the trainer "
    "re-tokenises a prompt the generator did not see, e.g. a different template or a missing generation prompt), "
    "LoRA adapter not synced to vLLM (the generator samples from the base model or a stale adapter), or a "
    "bf16/fp32 precision mismatch between generator and trainer (colocated vLLM runs a float32 checkpoint in "
    "bfloat16 unless vllm_dtype says otherwise)"
)

ALERTS: dict[str, AlertText] = {
    "clip_rate_high": AlertText(
        meaning="the clip rate (TRL's losses) or IPO masked ratio (loss_type ipo) stays above the healthy band "
        "(20 % by default): the trained policy is far from the one that sampled",
        check="learning rate vs num_iterations / steps_per_generation; with vLLM, "
        "sampling/sampling_logp_difference/mean",
        message="{label} {value:pct} has been above the healthy band ({healthy_min:pct}–{healthy_max:pct}) for "
        "{streak} observation(s): the trained policy is far from the one that sampled the tokens. Likely causes: "
        "{lr_text} too high for {passes} update pass(es) per generation batch{staleness_cause}; or "
        "{mismatch_causes}. What to do: "
        "lower the learning rate or num_iterations/steps_per_generation; with vLLM compare "
        "sampling/sampling_logp_difference/mean, check the adapter is pushed to vLLM after every optimizer step, "
        "and that trainer and generator use the same chat template and dtype (vllm_dtype for colocated vLLM, "
        "--dtype for trl vllm-serve).",
    ),
    "clip_rate_low": AlertText(
        meaning="below the healthy band (1 % by default) in an off-policy run: updates barely move the policy",
        check="learning_rate (warm-up?), grad_norm, frac_reward_zero_std",
        message="{label} {value:pct} has been below the healthy band ({healthy_min:pct}–{healthy_max:pct}) for "
        "{streak} observations in an off-policy run{policy_facts}: the updates barely move the policy. Likely "
        "causes: {lr_text} too low or still warming up, vanishing gradients (grad_norm near 0), advantages mostly "
        "0 (see frac_reward_zero_std). What to do: check learning_rate and grad_norm in the logs, raise the "
        "learning rate, or set start_step past the warm-up.",
    ),
    "clip_rate_stuck_zero": AlertText(
        meaning="exactly 0 although the run is off-policy: every ratio is 1",
        check="is the LoRA adapter in the optimizer (model.print_trainable_parameters())? does a custom "
        "rollout_func return the sampler's logprobs?",
        message="{label} has been exactly 0 for {streak} observations although the run is off-policy"
        "{policy_facts}, so every importance ratio is 1. Likely causes: the old log-probs are computed with the "
        "current weights instead of the sampling ones (custom rollout_func or loss returning the trainer's own "
        "log-probs; for IPO, the generator's logprobs missing so the trainer's are used), the policy does not move "
        "({lr_text} is 0 during warm-up or too small to move any token's probability past epsilon, or no parameter "
        "is trainable - LoRA adapter not attached to the optimizer), the advantages are all 0 "
        "(frac_reward_zero_std near 1), or the loss ignores the ratio. What to do: check that learning_rate and "
        "grad_norm are > 0 and frac_reward_zero_std < 1 in the logs, call model.print_trainable_parameters(), and "
        "check that rollout_func returns the sampler's logprobs.",
    ),
    "clip_rate_drop": AlertText(
        meaning="a sudden fall from an established level",
        check="did the generator reload other weights? did the schedule reach 0?",
        message="{label} fell from a rolling median of {reference:pct} to {value:pct} in one observation (below "
        "{drop_factor:g}x). A sudden drop usually means that the generator and the trainer changed how they score "
        "tokens relative to each other - {mismatch_causes} appeared or went away (e.g. the generator reloaded other "
        "weights) - or that the learning-rate schedule reached ~0. What to do: check the generator loaded the "
        "latest adapter, diff the templates used by trainer and generator, check dtypes, and check learning_rate "
        "in the logs.",
    ),
    "clip_rate_jump": AlertText(
        meaning="a step change that stays",
        check="the step in trl-ext plot; what changed there (resume, learning rate, vLLM restart)",
        message="{label} jumped from a rolling median of {reference:pct} to {value:pct} (>= {jump_factor:g}x) and "
        "stayed there for {streak} observations. A step change points to {mismatch_causes}, or to a learning-rate "
        "change ({lr_text}). What to do: find the step where it changed (trl-ext plot), compare the generator's "
        "and the trainer's log-probs on one batch, and check adapter sync and dtypes.",
    ),
    "entropy_collapse": AlertText(
        meaning="the policy's entropy fell below the floor (0.03 nats by default) or to a tenth of its early level",
        check="was the cold-start SFT done on the whole RL set (docs/cold_start.md)? learning rate? a hackable "
        "reward?",
        message="Entropy collapse: {what}. The policy now puts almost all mass on few tokens, so the completions "
        "of a group look alike, rewards stop varying and learning stalls. Likely causes: {lr_too_high}; cold-start "
        "SFT on the full RL dataset instead of a small held-out subset; a reward that repetition or one fixed "
        "answer can hack; sampling temperature too low. What to do: restart from a checkpoint before the drop with "
        "a lower learning rate, redo SFT on a few dozen held-out examples, inspect completions "
        "(log_completions=True), and consider epsilon_high=0.28 (clip-higher) or "
        "entropy_coef/use_adaptive_entropy.",
        variants={
            "floor": "entropy {entropy:.4g} nats has been below the floor {entropy_floor:g} for {streak} logs"
            "{early_level}",
            "drop": "entropy (median of the last {smoothing} logs) fell to {smoothed:.4g} nats, {drop_pct:.0f}% "
            "below its early level {baseline:.4g} (limit {max_drop:.0%})",
        },
    ),
    "kl_spike": AlertText(
        meaning="the KL to the reference jumped (above kl_max, 1 by default, or 5x its largest recent value); "
        "only with beta > 0",
        check="completions around that step, grad_norm, a batch with extreme advantages",
        message="KL spike: {what}. The policy moved abruptly away from the reference model. Likely causes: "
        "{lr_too_high} or a batch with extreme advantages; cold-start SFT on the full dataset (the entropy "
        "collapses and the KL spikes together); the reference scored differently from the policy (other chat "
        "template or dtype for the reference, LoRA reference = adapter disabled on a different base); reward "
        "hacking. What to do: look at the completions around this step, check grad_norm, lower the learning rate "
        "or raise beta, and check the entropy alert.",
        variants={
            "spike": "KL {value:.4g} is {ratio:.1f}x its largest value of the last logs ({reference:.4g})",
            "max": "KL {value:.4g} is above kl_max={kl_max:g} (for {streak} logs in a row)",
        },
    ),
    "reward_collapse": AlertText(
        meaning="the reward rose, then lost more than half of its gain, or fell below where it started",
        check="the entropy and KL alerts before it; the reward/judge endpoint's health; reward hacking in the "
        "completions; a reward whose sign or scale changed",
        message="Reward collapse: the reward (mean of the last {smoothing} logs) {what}. Likely causes: an entropy "
        "collapse or KL blow-up before it (see those alerts), learning rate too high, reward hacking that ends in degenerate outputs, the generator serving a stale or unsynced "
        "LoRA adapter, or a reward/judge endpoint that started failing. What to do: look at completions before and "
        "after the peak, check the entropy, KL and clip-rate alerts, and restart from the checkpoint at the peak "
        "with a lower learning rate.",
        variants={
            "": "rose from {low:.4g} to {peak:.4g} and has now been at {value:.4g} for {streak} logs, losing "
            "{lost_pct:.0f}% of the gain (limit {max_drop:.0%})",
            "below_start": "fell from {peak:.4g} to {value:.4g} and has been there for {streak} logs, below where it "
            "started ({low:.4g})",
        },
    ),
    "reward_no_signal": AlertText(
        meaning="in 90 % or more of the groups every completion got the same reward: advantages are 0",
        check="print completions with their rewards; does the reward parse the output format?",
        message="No learning signal: in {value:.0%} of the groups all completions got the same reward "
        "(frac_reward_zero_std >= {zero_std_max:g} for {streak} logs), so their advantages are 0. Likely causes: "
        "prompts too hard (all rewards 0) or too easy (all 1) for this model; the reward function fails to parse "
        "the outputs (answer format, stripped thinking, wrong chat template); too few generations per prompt; "
        "collapsed entropy or low temperature making the completions identical. What to do: print a few "
        "completions with their rewards, filter the dataset by pass rate, raise num_generations or the "
        "temperature.",
    ),
    "answer_rate_collapse": AlertText(
        meaning="the RLM policy stops giving final answers: a rollout without one gets reward 0, and once none "
        "answers, every group's rewards agree and nothing trains again",
        check="rlm/final_answer_rate, the last turns of unanswered rollouts, the trust region's masked or clipped "
        "share, the learning rate",
        message="Answers disappearing: the final-answer rate fell to {value:.0%}, below {answer_drop:.0%} of its "
        "peak {peak:.0%}, for {streak} observation(s) (a log, or logs pooled to {answer_min_roots} roots). "
        "Unanswered rollouts get reward 0; when no rollout answers, every group's rewards agree and the run trains "
        "nothing again (loss 0, grad norm 0). Likely causes: a reward that scores a wrong answer below no answer "
        "(silence pays), a learning rate too high for the off-policy passes (num_iterations > 1, stale samples), a "
        "loss whose trust region lets the answers of failed rollouts be pushed down without bound (loss_type='ipo' "
        "with ipo_ratio_band=None), or a max_completion_length that cuts the answers off. What to do: lower the "
        "learning rate, keep ipo_ratio_band (0.2) or use loss_type='dapo', add a KL term (beta), and restart from the "
        "last checkpoint where the rate was still high.",
    ),
    "judge_failure": AlertText(
        meaning="more than 20 % of rollouts got no judge verdict (judge credit only); the judge's share shrinks "
        "silently",
        check="the judge server's logs, judge_audit.jsonl, judge/failure_ratio",
        message="Judge failures: {value:.0%} of the judge calls failed (above {judge_failure_max:.0%} for {streak} "
        "logs), and a failed call gives that rollout no token credit, so the judge's share of the advantage "
        "silently shrinks. Likely causes: the judge endpoint times out or is rate limited, the judge's output is "
        "not valid span JSON, span quotes do not match the marked trace, or the trace exceeds the judge's context. "
        "What to do: check the judge server's logs, raise the timeout or lower the concurrency, and test the judge "
        "prompt on a few traces.",
    ),
    "judge_injection": AlertText(
        meaning="the policy writes verdict-shaped JSON or forged data delimiters for the judge to quote, or the "
        "judge's replies hold several different verdicts: reward hacking through the judge",
        check="the flagged rollouts in judge_audit.jsonl (injection_suspected), the completions, "
        "judge/injection_suspected",
        message="Suspected judge injection: {value:g} rollouts in this log (above {threshold:g} for {streak} "
        "logs) hold a forged verdict or data delimiter, or got a judge reply with several different verdicts. "
        "Forged verdicts are never credited (the judge's own verdict is read from its tool call, its structured "
        "output or its fenced section, a quote of the policy's text is dropped, and of several verdicts the least "
        "favourable to the policy is taken), but a policy that learns to write them is searching for a path to "
        "reward through the judge. What to do: read the flagged completions; if judge/text_verdicts is above 0, "
        "use a judge endpoint with structured output (judge_structured_output='on') so its verdict never travels "
        "as free text.",
    ),
    "stale_rollouts": AlertText(
        meaning="an asynchronous run throws away many rollouts as too old (more than half by default), or trains "
        "only on samples at the max_staleness limit while dropping others: generation is wasted",
        check="sample/dropped_stale_total, sample/staleness_mean vs max_staleness, sample/rollout_queue_size, "
        "sample/time_in_queue_s",
        message="Stale rollouts dominate: {what}. A sample more than {staleness_limit} policy versions old is "
        "dropped unread when the trainer takes it from the rollout queue, so the generation spent on it is lost, "
        "and the samples kept are as off-policy as the run allows. Likely causes: the rollout worker runs too far "
        "ahead of the trainer (max_inflight_tasks or queue_maxsize larger than what the trainer consumes within "
        "max_staleness steps: a full queue, high sample/rollout_queue_size, long sample/time_in_queue_s); a "
        "trainer step that slowed down (weight sync, checkpoints, longer batches); completions so long that one "
        "spans more than max_staleness optimizer steps; or max_staleness=0, which drops every sample whose policy "
        "changed during its generation. What to do: lower max_inflight_tasks (TRL's automatic value is "
        "max_staleness x the samples per step) or queue_maxsize so the worker does not run ahead, raise "
        "max_staleness if the loss tolerates older samples (the clipped and IPO losses bound their ratios), or "
        "make the trainer step faster.",
        variants={
            "dropped": "{dropped_share:.0%} of the rollouts that reached the trainer were dropped as stale (above "
            "max_dropped_share={max_dropped_share:g}) for {streak} logs",
            "pinned": "every sample trained was {staleness_limit} policy versions old (sample/staleness_mean "
            "{staleness_mean:.3g}) while {dropped_share:.0%} of the rollouts were dropped as stale, for {streak} "
            "logs",
        },
    ),
    "trainer_starved": AlertText(
        meaning="an asynchronous run's trainer waits for rollouts most of each step (90 % by default): "
        "generation sets the pace and the trainer idles",
        check="perf/rollout_wait_s vs perf/step_s, sample/rollout_queue_size (0 when starved), rollout/inflight, "
        "rollout/generated_tok_s, rollout/score_s",
        message="The rollout worker starves the trainer: it waited for rollouts {value:pct} of its step time "
        "(perf/rollout_wait_s / perf/step_s above max_wait_share={max_wait_share:g}) for {streak} logs, so the "
        "trainer idles and generation sets the pace. Likely causes: too few generation requests in flight "
        "(max_inflight_tasks; TRL's automatic value is max_staleness x the samples per step, so a small "
        "{staleness_limit} also limits generation), a vLLM server too small or shared for the load (compare "
        "rollout/generated_tok_s with what it serves alone), long completions, slow reward functions or tools "
        "(rollout/score_s), or a server that restarted or fails requests. What to do: raise max_inflight_tasks or "
        "max_staleness, give vLLM more capacity (more GPUs or replicas, a larger KV cache), lower "
        "max_completion_length, or speed up the reward functions. A test set-up whose generation is far slower "
        "than its training (vLLM on the CPU, a tiny model) is starved by construction: max_wait_share=None "
        "silences the rule.",
    ),
}


def format_pct(x: float) -> str:
    """A fraction as a percentage: two decimals below 10 %, one above (``0.0125 -> '1.25%'``, ``0.2 -> '20.0%'``)."""
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%"


class _AlertFormatter(string.Formatter):
    """`str.format` plus the ``pct`` format spec (`format_pct`)."""

    def format_field(self, value: Any, format_spec: str) -> str:
        return format_pct(value) if format_spec == "pct" else super().format_field(value, format_spec)


_FORMATTER = _AlertFormatter()


def _phrases(fields: Mapping[str, Any]) -> dict[str, str]:
    """The wording that depends on what is known about the run (an unknown learning rate, no training arguments)."""
    lr, metric, max_staleness = fields.get("learning_rate"), fields.get("metric"), fields.get("max_staleness")
    known_lr = is_number(lr)
    if is_number(max_staleness):  # TRL's asynchronous trainer: samples up to max_staleness policy versions old
        policy_facts = (
            f" (asynchronous run: max_staleness={max_staleness}, so samples up to {max_staleness} policy versions "
            "old are trained on, with the sampler's log-probs as the old ones)"
        )
    elif fields.get("gradient_accumulation_steps") is not None:
        policy_facts = (
            " (gradient_accumulation_steps={gradient_accumulation_steps}, steps_per_generation="
            "{steps_per_generation}, num_iterations={num_iterations}, use_vllm={use_vllm})"
        ).format(**fields)
    else:
        policy_facts = ""
    return {
        "label": trust_region_label(metric) if isinstance(metric, str) else "",
        "lr_text": f"learning_rate={lr:g}" if known_lr else "the learning rate",
        "lr_too_high": f"learning rate too high (learning_rate={lr:g})" if known_lr else "learning rate too high",
        "policy_facts": policy_facts,
        "staleness_limit": f"max_staleness={max_staleness}" if is_number(max_staleness) else "max_staleness",
        "staleness_cause": (
            f", or for samples up to max_staleness={max_staleness} policy versions old (asynchronous run: lower "
            "max_staleness)"
            if is_number(max_staleness) and max_staleness > 0
            else ""
        ),
        "passes": str(fields.get("num_iterations") or "the"),
        "early_level": f" (early level {fields['baseline']:.4g})" if fields.get("baseline") is not None else "",
        "mismatch_causes": MISMATCH_CAUSES,
    }


def format_alert(rule: str, fields: Mapping[str, Any], variant: str = "") -> str:
    """The message of ``rule``'s alert.

    Args:
        rule: a key of `ALERTS`.
        fields: the values the templates name: the monitor's settings (``healthy_max``, ``kl_max``, ...), the
            finding's ``value`` and facts (``streak``, ``reference``, ...), ``metric`` (the logged key) and the
            run facts the monitor knows (``learning_rate``, ``gradient_accumulation_steps``,
            ``steps_per_generation``, ``num_iterations``, ``use_vllm``, and ``max_staleness`` in an asynchronous
            run; absent or None when unknown).
        variant: the finding's variant, choosing the ``{what}`` wording of rules that have several.

    Raises:
        KeyError: unknown rule or variant, or a field the template needs is missing.
    """
    text = ALERTS[rule]
    values = {**fields, **_phrases(fields)}
    if text.variants:
        values["what"] = _FORMATTER.vformat(text.variants[variant], (), values)
    return _FORMATTER.vformat(text.message, (), values)


@dataclass(frozen=True)
class MonitorAlert:
    """One fired alert.

    Attributes:
        rule: name of the rule, e.g. ``"entropy_collapse"``; the log key is ``monitor/alerts/<rule>``.
        step: global step of the log that fired it.
        metric: the logged metric the rule watches, e.g. ``"entropy"``.
        value: the value that fired it (smoothed or aggregated when the rule smooths).
        action: ``"warn"``, ``"checkpoint"`` or ``"stop"``.
        message: what happened, the likely causes and what to do.
    """

    rule: str
    step: int
    metric: str
    value: float
    action: str
    message: str

    @property
    def log_key(self) -> str:
        return ALERT_KEY_PREFIX + self.rule

    @property
    def meaning(self) -> str:
        """What this rule's alert says about the run, in one line (`ALERTS`; empty for a rule not in it)."""
        text = ALERTS.get(self.rule)
        return text.meaning if text else ""

    @property
    def check(self) -> str:
        """The first things to look at for this rule (`ALERTS`; empty for a rule not in it)."""
        text = ALERTS.get(self.rule)
        return text.check if text else ""
