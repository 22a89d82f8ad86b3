"""The model card's text: trl-ext's sections (the method and its sources, the configuration, the final metrics, the
monitor alerts, the REPL sandbox, the curves), the quick start that loads the adapter with PEFT, each method's card
prose (`METHOD_TEXTS`), and `public_value` / `public_run_info`: what a published file may say about the machine a run
was on. `trl_ext.hub.build_model_card` puts these into TRL's card.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .run_info import PLOT_FILE, RUN_INFO_FILE, RunInfo, is_setting_choice

if TYPE_CHECKING:
    from .losses import LossCard

__all__ = [
    "HUB_ID",
    "METHOD_TEXTS",
    "MethodText",
    "is_local_path",
    "on_hub",
    "path_name",
    "public_run_info",
    "public_value",
    "quick_start_text",
    "trl_ext_sections",
]


@dataclass(frozen=True)
class MethodText:
    """What the card says about a method: its section's heading, a description and the sources listed under it."""

    title: str
    description: str
    sources: tuple[tuple[str, str], ...]  # (text, url or "")


# method tag (`trl_ext.methods.METHODS`) -> its card prose
METHOD_TEXTS: dict[str, MethodText] = {
    "stepwise-rlm": MethodText(
        "Stepwise Recursive-Language-Model RL",
        "RLM rollouts over a persistent Python REPL; every turn of every root and child node is a training sample, "
        "children weighted 1/k per parent (`trl_ext.StepwiseRLMTrainer`).",
        (
            ('Kim & Ahmad, "Reinforcing Recursive Language Models", alphaXiv blog, 2026-05', ""),
            ("Zhang, Kraska, Khattab, the RLM scaffold, arXiv:2512.24601", "https://arxiv.org/abs/2512.24601"),
        ),
    ),
    "judge-credit": MethodText(
        "Token-span LLM-judge credit",
        "An LLM judge marks token spans of each rollout (progress, errors, corrections); its credit, capped by λ, "
        "is added to the Dr. GRPO outcome advantage per token (`trl_ext.JudgeCreditTrainer`).",
        (('"Dear diary, I judged rollouts: how your RL judge affects your model\'s reasoning", blog, 2026', ""),),
    ),
    "rlmt": MethodText(
        "RLMT: reinforcement learning with model-rewarded thinking",
        "The policy plans in `<think>` before its response; a reward model scores the response only "
        "(`trl_ext.RLMTTrainer`).",
        (
            (
                'Bhaskar, Ye, Chen, "Language Models that Think, Chat Better", arXiv:2509.20357',
                "https://arxiv.org/abs/2509.20357",
            ),
        ),
    ),
    "grpo": MethodText(
        "GRPO (trl-ext ExtGRPOTrainer)",
        "Group-relative policy optimisation with trl-ext's per-token advantage hook (`trl_ext.ExtGRPOTrainer`).",
        (
            (
                'Z. Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", '
                "arXiv:2402.03300",
                "https://arxiv.org/abs/2402.03300",
            ),
        ),
    ),
}
_TRL_SOURCE = ("Hugging Face TRL", "https://github.com/huggingface/trl")

# Where the losses' trust-region metrics go in `_CARD_METRICS` (each loss names its own: `trl_ext.losses`).
TRUST_REGION_SUMMARY, TRUST_REGION_METRICS = "<trust-region summaries>", "<trust-region metrics>"

# Metrics shown in the card, in this order, when the run logged them.
_CARD_METRICS = (
    "eval/reward_sft_only",
    "eval/reward_after_rl",
    "eval/rollouts",
    "train/reward_first",
    "train/reward_last",
    TRUST_REGION_SUMMARY,
    "train/steps",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    TRUST_REGION_METRICS,
    "entropy",
    "kl",
    "judge/share",
    "judge/failure_ratio",
    "rlm/turns_mean",
    "rlm/children_mean",
    "rlm/final_answer_rate",
    "repl/error_rate",
    "train_loss",
    "train_runtime",
)


def card_metrics() -> list[str]:
    """`_CARD_METRICS` with every registered loss's trust-region metrics (and their run-file summaries) in place."""
    from .losses import LOSSES, trust_region_metrics  # torch: only when a card is written
    from .run_info import trust_region_summary_key

    metrics = [*trust_region_metrics()]
    metrics += [key for spec in LOSSES.values() for key in spec.trust_region_related if key not in metrics]
    expanded = {
        TRUST_REGION_SUMMARY: [trust_region_summary_key(key) for key in metrics],
        TRUST_REGION_METRICS: metrics,
    }
    return [key for entry in _CARD_METRICS for key in expanded.get(entry, [entry])]


def alerts_from_state(root: Path) -> dict[str, int]:
    """Alert counts from ``trainer_state.json`` when the run file has none (``monitor/alerts/<rule>`` log keys)."""
    counts: dict[str, int] = {}
    candidate = root / "trainer_state.json"
    if candidate.is_file():
        try:
            history = json.loads(candidate.read_text(encoding="utf-8")).get("log_history", [])
        except (OSError, ValueError):
            return counts
        for entry in history:
            for key, value in entry.items():
                if key.startswith("monitor/alerts/") and value:
                    rule = key.split("/", 2)[2]
                    counts[rule] = counts.get(rule, 0) + 1
    return counts


# A Hub repository id, ``user/name`` or ``org/name``.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def on_hub(name: Any) -> bool:
    """A Hub id (``org/name``), not a local path: what the card may link and put in its metadata."""
    return isinstance(name, str) and bool(HUB_ID.match(name)) and not Path(name).exists()


_WINDOWS_ABSOLUTE = re.compile(r"^[A-Za-z]:[\\/]")


def is_local_path(value: Any) -> bool:
    """An absolute file-system path (``/home/me/run``, ``~/models/x``, ``C:\\runs\\x``): machine-specific, never
    published."""
    return (
        isinstance(value, str)
        and "\n" not in value
        and (value.startswith("~") or os.path.isabs(value) or bool(_WINDOWS_ABSOLUTE.match(value)))
    )


def path_name(value: str) -> str:
    """The last component of a path (``/home/me/runs/sft_model/`` -> ``sft_model``)."""
    return re.split(r"[\\/]", value.rstrip("/\\"))[-1] or value


def public_value(value: Any) -> Any:
    """``value`` (JSON-like) with every absolute local path replaced by its last component: what a published file
    (the model card, the uploaded ``trl_ext_run.json``) may say about the machine the run was on."""
    if isinstance(value, str):
        return path_name(value) if is_local_path(value) else value
    if isinstance(value, Mapping):
        return {key: public_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_value(item) for item in value]
    return value


def public_run_info(info: RunInfo) -> RunInfo:
    """The run file as `push_adapter` uploads it: `public_value` of every field (local paths -> folder/file names)."""
    return RunInfo.from_dict(public_value(info.to_dict()))


_LOCAL_BASE_PLACEHOLDER = "path/to/the/base/model"


def quick_start_text(
    repo_id: str,
    hub_base: str | None,
    local_base: str | None,
    adapter: Mapping[str, Any],
    has_tokenizer: bool,
    method_title: str,
) -> str:
    """The card's quick start (markdown): load the adapter with PEFT and generate one reply.

    ``AutoPeftModelForCausalLM`` when the adapter config names the Hub base model (it loads that base, then the
    adapter); the base by its Hub id then ``PeftModel`` when the adapter config names another one (a local copy);
    for a local or unknown base, a placeholder path and a sentence saying the same weights are needed.
    """
    intro = (
        f"A LoRA adapter trained with trl-ext, a plugin for [TRL](https://github.com/huggingface/trl): "
        f"{method_title}. This repository holds the adapter only, not merged weights: "
    )
    if hub_base is not None:
        intro += f"PEFT loads the base model [{hub_base}](https://huggingface.co/{hub_base}) and applies it."
    else:
        intro += (
            f"it was trained on {local_base or 'a base model the run did not record'}, so this card cannot name the "
            "base model: load the adapter on top of the same weights (replace the placeholder path)."
        )
    base_ref = hub_base or _LOCAL_BASE_PLACEHOLDER
    tokenizer_source = repo_id if has_tokenizer else base_ref
    lines = [intro, "", "```python"]
    if hub_base is not None and adapter.get("base_model_name_or_path") == hub_base:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}", device_map="auto")  # {hub_base} + adapter',
        ]
    else:
        comment = "" if hub_base is not None else "  # the weights the adapter was trained on"
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_ref}", device_map="auto"){comment}',
            f'model = PeftModel.from_pretrained(base, "{repo_id}")',
        ]
    lines += [
        f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer_source}")',
        "",
        'messages = [{"role": "user", "content": "What is the capital of France?"}]',
        "inputs = tokenizer.apply_chat_template(",
        '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True',
        ").to(model.device)",
        "outputs = model.generate(**inputs, max_new_tokens=128)",
        'print(tokenizer.decode(outputs[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
        "```",
    ]
    return "\n".join(lines)


def trl_ext_sections(
    root: Path,
    info: RunInfo,
    adapter: Mapping[str, Any],
    method: MethodText,
    loss_card: LossCard | None,
    has_plot: bool,
) -> list[str]:
    """trl-ext's part of the card (markdown lines): method, configuration, metrics, alerts, sandbox, plot. ``info``
    is the public run file (`public_run_info`) of the output directory ``root`` (whose ``trainer_state.json`` gives
    the alerts when the run file has none); ``has_plot``: the upload has ``monitors.png``."""
    lines = [f"## Method: {method.title}", "", method.description, ""]
    if loss_card is not None:
        lines += [loss_card.text, ""]
    lines.append("Sources:")
    for text, url in [*method.sources, *([loss_card.source] if loss_card else []), _TRL_SOURCE]:
        lines.append(f"- {text}" + (f" — <{url}>" if url else ""))

    lines += ["", "## Training configuration", ""]
    details = {
        "trainer": info.trainer,
        "source": None if info.source == "unknown" else info.source,
        "recipe": path_name(str(info.extra["recipe"])) if info.extra.get("recipe") else None,
        "dataset": info.dataset,
        "reward functions": info.reward_funcs,
        "LoRA": {k: adapter.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules") if k in adapter}
        or info.peft,
        "steps": info.steps,
    }
    for key, value in details.items():
        if value:
            lines.append(f"- {key}: `{_short(value)}`")
    chosen = {key: value for key, value in info.config.items() if is_setting_choice(key)}
    if chosen:
        lines += ["", "Settings chosen for this run (those that differ from the config class's defaults):", ""]
        lines += ["| parameter | value |", "|---|---|"]
        for key in sorted(chosen):
            lines.append(f"| `{key}` | `{_short(chosen[key])}` |")

    shown = [key for key in card_metrics() if key in info.metrics]
    lines += ["", "## Final metrics", ""]
    if shown:
        lines += ["| metric | value |", "|---|---|"]
        for key in shown:
            lines.append(f"| `{key}` | {_number(info.metrics[key])} |")
    else:
        lines.append(f"None recorded (no {RUN_INFO_FILE} in the output directory).")

    alerts = {rule: count for rule, count in (info.alerts or alerts_from_state(root)).items() if count}
    lines += ["", "## Monitor alerts", ""]
    if alerts:
        lines.append("trl-ext's monitors (clip rate / IPO mask, entropy and KL, reward) raised these alerts:")
        lines.append("")
        lines += ["| rule | times |", "|---|---|"]
        lines += [f"| `{rule}` | {count} |" for rule, count in sorted(alerts.items())]
        if info.alert_log:
            lines.append("")
            for record in info.alert_log[:20]:
                lines.append(
                    f"- step {record.get('step')}: `{record.get('rule')}` (value {_number(record.get('value'))}, "
                    f"action {record.get('action')})"
                )
    else:
        lines.append("None: no monitor rule fired during training.")

    if info.sandbox:
        lines += ["", "## Sandbox isolation", ""]
        backend = info.sandbox.get("repl/isolation")
        lines.append(
            "The Python REPLs that ran model-written code during training"
            + (f" used the `{backend}` backend." if backend else ".")
        )
        for label, key in (("isolated", "isolated"), ("left open", "open")):
            items = info.sandbox.get(key) or []
            if items:
                lines += ["", f"{label.capitalize()}:", ""]
                lines += [f"- {item}" for item in items]
            elif key == "open":
                lines += ["", "Left open: nothing."]

    if has_plot:
        lines += [
            "",
            "## Training curves",
            "",
            f"![reward, clip rate / IPO mask, entropy, KL and alerts]({PLOT_FILE})",
        ]
    return lines


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"
