"""Push a trained LoRA adapter to the Hugging Face Hub with a generated model card (``trl-ext push``).

Only the adapter goes up, never merged or full weights: ``adapter_config.json``, ``adapter_model.safetensors`` (or
``.bin``), the tokenizer files saved next to them (the chat template the adapter was trained with), the run's
``trl_ext_run.json`` and ``monitors.png``, and a ``README.md`` model card: TRL's card (`build_model_card`, from the
trainer's `_tag_names`/`_name`/`_paper`, which come from `METHODS`) with trl-ext's sections about the method and its
sources, the configuration, the final metrics, the monitor alerts and the REPL sandbox.

The output directory is the one ``trl-ext quickstart`` or ``trl-ext train`` wrote: the adapter is in
``OUTPUT_DIR/adapter/`` (quickstart) or in ``OUTPUT_DIR`` itself (``trainer.save_model(output_dir)``). The upload is
one commit through `huggingface_hub.HfApi` (``create_repo`` then ``create_commit``), so ``HF_TOKEN``/``hf auth login``
and ``HF_ENDPOINT`` apply as usual.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .run_info import RUN_INFO_FILE, RunInfo, read_run_info

logger = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "AdapterFiles",
    "MethodCard",
    "PushError",
    "build_model_card",
    "collect_adapter_files",
    "find_adapter_dir",
    "push_adapter",
]

PLOT_FILE = "monitors.png"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Full-model weights: never uploaded by `push_adapter`, whatever the directory holds.
_FULL_WEIGHTS = re.compile(r"^(model|pytorch_model|tf_model|flax_model)([-.].*)?\.(safetensors|bin|h5|msgpack|pt)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, eq=False)
class MethodCard:
    """What the model card and TRL's card machinery say about one trl-ext method.

    The trainer classes take their TRL card attributes from here (``_tag_names = METHODS[...].tag_names``,
    ``_name``, ``_paper``), so `trainer.create_model_card()` / `trainer.push_to_hub()` and ``trl-ext push`` describe
    a method from the same entry.
    """

    tag: str  # the method's Hub tag and its name in trl_ext_run.json
    name: str  # TRL's `_name`: "This model was trained with <name>"
    trainer: str  # the trainer class
    title: str  # heading of the card's method section
    description: str
    paper: dict[str, str | None]  # TRL's `_paper`: {"title", "id" (arXiv id or None), "citation" (BibTeX)}
    sources: tuple[tuple[str, str], ...]  # (text, url or "") listed under the method

    @property
    def tag_names(self) -> list[str]:
        """TRL's `_tag_names`: the GRPO trainer's tags, ``trl-ext`` and the method tag."""
        return list(dict.fromkeys(["trl", "grpo", "trl-ext", self.tag]))


def _paper(title: str, arxiv_id: str | None, kind: str, key: str, **fields: str | int) -> dict[str, str | None]:
    """TRL's `_paper` of a method: its ``title``, ``id`` (the arXiv id, None when it is not on arXiv) and BibTeX
    ``citation`` (``@kind{key,``, the title, then ``fields`` in order: strings in braces, numbers bare)."""
    entries = {"title": f"{{{title}}}", **fields}
    lines = [
        f"    {name:<12} = {value if isinstance(value, int) else '{' + value + '}'},"
        for name, value in entries.items()
    ]
    return {"title": title, "id": arxiv_id, "citation": "\n".join([f"@{kind}{{{key},", *lines, "}"])}


_DEEPSEEKMATH = (
    'Z. Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", '
    "arXiv:2402.03300",
    "https://arxiv.org/abs/2402.03300",
)

# The one home of the method metadata: trainer attributes, the card's method section and its citations.
METHODS: dict[str, MethodCard] = {
    "stepwise-rlm": MethodCard(
        tag="stepwise-rlm",
        name="Stepwise RLM",
        trainer="StepwiseRLMTrainer",
        title="Stepwise Recursive-Language-Model RL",
        description="RLM rollouts over a persistent Python REPL; every turn of every root and child node is a "
        "training sample, children weighted 1/k per parent (`trl_ext.StepwiseRLMTrainer`).",
        paper=_paper(
            "Reinforcing Recursive Language Models",
            None,  # a blog post, not on arXiv
            "misc",
            "kim2026reinforcing",
            author="Kim and Ahmad",
            year=2026,
            howpublished="alphaXiv blog, May 2026",
        ),
        sources=(
            ('Kim & Ahmad, "Reinforcing Recursive Language Models", alphaXiv blog, 2026-05', ""),
            ("Zhang, Kraska, Khattab, the RLM scaffold, arXiv:2512.24601", "https://arxiv.org/abs/2512.24601"),
        ),
    ),
    "judge-credit": MethodCard(
        tag="judge-credit",
        name="Judge Credit",
        trainer="JudgeCreditTrainer",
        title="Token-span LLM-judge credit",
        description="An LLM judge marks token spans of each rollout (progress, errors, corrections); its credit, "
        "capped by λ, is added to the Dr. GRPO outcome advantage per token (`trl_ext.JudgeCreditTrainer`).",
        paper=_paper(
            "Dear diary, I judged rollouts: how your RL judge affects your model's reasoning",
            None,  # a blog post, not on arXiv
            "misc",
            "dear_diary_judge2026",
            year=2026,
            howpublished="blog post",
        ),
        sources=(
            ('"Dear diary, I judged rollouts: how your RL judge affects your model\'s reasoning", blog, 2026', ""),
        ),
    ),
    "rlmt": MethodCard(
        tag="rlmt",
        name="RLMT",
        trainer="RLMTTrainer",
        title="RLMT: reinforcement learning with model-rewarded thinking",
        description="The policy plans in `<think>` before its response; a reward model scores the response only "
        "(`trl_ext.RLMTTrainer`).",
        paper=_paper(
            "Language Models that Think, Chat Better",
            "2509.20357",
            "article",
            "bhaskar2025language",
            author="Bhaskar, Adithya and Ye, Xi and Chen, Danqi",
            year=2025,
            eprint="arXiv:2509.20357",
        ),
        sources=(
            (
                'Bhaskar, Ye, Chen, "Language Models that Think, Chat Better", arXiv:2509.20357',
                "https://arxiv.org/abs/2509.20357",
            ),
        ),
    ),
    "grpo": MethodCard(
        tag="grpo",
        name="GRPO",
        trainer="ExtGRPOTrainer",
        title="GRPO (trl-ext ExtGRPOTrainer)",
        description="Group-relative policy optimisation with trl-ext's per-token advantage hook "
        "(`trl_ext.ExtGRPOTrainer`).",
        paper=_paper(  # as `trl.GRPOTrainer._paper`
            "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
            "2402.03300",
            "article",
            "shao2024deepseekmath",
            author="Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and "
            "Y. K. Li and Y. Wu and Daya Guo",
            year=2024,
            eprint="arXiv:2402.03300",
        ),
        sources=(_DEEPSEEKMATH,),
    ),
}
_IPO_SOURCE = (
    "prime-rl `ipo` loss (PrimeIntellect-ai/prime-rl, `src/prime_rl/trainer/rl/loss.py`)",
    "https://github.com/PrimeIntellect-ai/prime-rl",
)
_TRL_SOURCE = ("Hugging Face TRL", "https://github.com/huggingface/trl")

# Metrics shown in the card, in this order, when the run logged them.
_CARD_METRICS = (
    "eval/reward_sft_only",
    "eval/reward_after_rl",
    "eval/rollouts",
    "train/reward_first",
    "train/reward_last",
    "train/ipo_masked_ratio_mean",
    "train/steps",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "ipo/masked_ratio",
    "ipo/capped_ratio",
    "clip_ratio/region_mean",
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


class PushError(RuntimeError):
    """Nothing pushable in the output directory (no adapter), or full weights where an adapter was expected."""


@dataclass
class AdapterFiles:
    """What `push_adapter` uploads: repo path -> local file, and the run's ``trl_ext_run.json`` (None without one)."""

    adapter_dir: Path
    files: dict[str, Path]
    run_info: RunInfo | None


def find_adapter_dir(output_dir: str | os.PathLike[str]) -> Path:
    """The folder holding the LoRA adapter of a run: ``OUTPUT_DIR/adapter`` or ``OUTPUT_DIR`` itself."""
    root = Path(output_dir)
    if not root.is_dir():
        raise PushError(f"{root} is not a directory; pass the output_dir of a trl-ext run.")
    for candidate in (root / "adapter", root):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    full = sorted(p.name for p in root.iterdir() if _FULL_WEIGHTS.match(p.name))
    hint = (
        f" It holds full model weights ({', '.join(full)}), which trl-ext push does not upload: train with a LoRA "
        "adapter (use_peft: true) or push the full model with huggingface_hub yourself."
        if full
        else " Train with a LoRA adapter (use_peft: true in a recipe; the quickstart always does)."
    )
    raise PushError(f"No LoRA adapter ({ADAPTER_CONFIG}) in {root} or {root / 'adapter'}.{hint}")


def collect_adapter_files(output_dir: str | os.PathLike[str]) -> AdapterFiles:
    """The files `push_adapter` uploads (without the card), checked: one adapter weight file, no full weights."""
    root = Path(output_dir)
    adapter_dir = find_adapter_dir(root)
    files: dict[str, Path] = {ADAPTER_CONFIG: adapter_dir / ADAPTER_CONFIG}
    weights = [name for name in ADAPTER_WEIGHTS if (adapter_dir / name).is_file()]
    if not weights:
        raise PushError(f"{adapter_dir} has {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}).")
    files[weights[0]] = adapter_dir / weights[0]
    for name in TOKENIZER_FILES:
        if (adapter_dir / name).is_file():
            files[name] = adapter_dir / name
    for name in (RUN_INFO_FILE, PLOT_FILE):
        for folder in (root, adapter_dir):
            if (folder / name).is_file():
                files[name] = folder / name
                break
    run_info = None
    if RUN_INFO_FILE in files:
        try:
            run_info = read_run_info(files[RUN_INFO_FILE])
        except (OSError, ValueError, TypeError) as error:
            logger.warning(
                "Could not read %s (%s); the model card will have less detail.", files[RUN_INFO_FILE], error
            )
    return AdapterFiles(adapter_dir, files, run_info)


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _alerts_from_state(root: Path) -> dict[str, int]:
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


def _on_hub(name: Any) -> bool:
    """A Hub id (``org/name``), not a local path: what the card may link and put in its metadata."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and not Path(name).exists()


def build_model_card(output_dir: str | os.PathLike[str], repo_id: str, files: AdapterFiles | None = None) -> str:
    """The ``README.md`` of the adapter repository: TRL's model card with trl-ext's sections.

    The base is `trl.trainer.utils.generate_model_card` fed exactly as `trainer.create_model_card()` feeds it
    (the trainer's `_tag_names`, `_name` and `_paper`, from `METHODS`): YAML metadata (base model, tags, model name,
    licence), TRL's quick start, training procedure, framework versions and citations. The metadata says
    ``library_name: peft`` (the repository holds an adapter) and adds the tags ``peft``, ``lora`` (and ``ipo-loss``).
    Before the citations come trl-ext's sections, from ``trl_ext_run.json``: how to load the adapter, the method
    and its sources, the non-default configuration, the final metrics, the monitors' alerts, the REPL sandbox's
    isolation (when the run had REPLs) and the ``monitors.png`` curves.
    """
    from trl.trainer.utils import generate_model_card

    root = Path(output_dir)
    files = files if files is not None else collect_adapter_files(root)
    info = files.run_info if files.run_info is not None else RunInfo(source="unknown")
    adapter = _adapter_config(files.adapter_dir)
    method = METHODS.get(info.method or "grpo", METHODS["grpo"])
    uses_ipo = info.config.get("loss_type") == "ipo"
    base_model = info.base_model or adapter.get("base_model_name_or_path")
    base_on_hub = _on_hub(base_model)
    tags = [*method.tag_names, "peft", "lora", *(["ipo-loss"] if uses_ipo else [])]
    dataset = info.dataset if _on_hub(info.dataset) else None

    card = generate_model_card(
        base_model=base_model if base_on_hub else None,
        model_name=repo_id.split("/")[-1],
        hub_model_id=repo_id,
        dataset_name=dataset,
        tags=tags,
        wandb_url=None,
        trackio_url=None,
        trainer_name=method.name,
        trainer_citation=method.paper.get("citation"),
        paper_title=method.paper.get("title"),
        paper_id=method.paper.get("id"),
    )
    card.data.library_name = "peft"  # an adapter repository: the Hub loads it with PEFT on top of base_model
    text = str(card)
    if not base_on_hub:  # TRL's template links the base model whatever it is; a local one has no Hub page
        where = (
            f"`{base_model}` (a local model, not on the Hub: you need the same weights to use this adapter)"
            if base_model
            else "an unknown base model (the adapter config does not name it)"
        )
        text = text.replace(_TRL_NO_BASE, f"This model is a LoRA adapter for {where}", 1)
    sections = "\n".join(_trl_ext_sections(root, repo_id, files, info, adapter, method, base_model, uses_ipo))
    head, citations, tail = text.partition("\n## Citations")
    return f"{head.rstrip()}\n\n{sections}\n{citations}{tail}" if citations else f"{text.rstrip()}\n\n{sections}"


# What TRL's template writes when `base_model` is None (a local base model).
_TRL_NO_BASE = "This model is a fine-tuned version of [None](https://huggingface.co/None)"


def _trl_ext_sections(
    root: Path,
    repo_id: str,
    files: AdapterFiles,
    info: RunInfo,
    adapter: Mapping[str, Any],
    method: MethodCard,
    base_model: str | None,
    uses_ipo: bool,
) -> list[str]:
    """trl-ext's part of the card (markdown lines): loading, method, configuration, metrics, alerts, sandbox, plot."""
    lines = ["## Loading the adapter", ""]
    lines.append(
        f"A LoRA adapter trained with trl-ext, a plugin for [TRL](https://github.com/huggingface/trl): "
        f"{method.title}. Only the adapter is in this repository, not merged weights: load it on top of the base model."
    )
    lines += [
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
    ]
    base_ref = base_model if base_model else "<base model>"
    lines.append(f'base = AutoModelForCausalLM.from_pretrained("{base_ref}")')
    tokenizer_source = repo_id if any(name in files.files for name in TOKENIZER_FILES) else base_ref
    lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer_source}")')
    lines.append(f'model = PeftModel.from_pretrained(base, "{repo_id}")')
    lines += ["```", ""]

    lines += [f"## Method: {method.title}", "", method.description, ""]
    if uses_ipo:
        lines.append(
            "Policy loss: the IPO masking loss (a token is kept when |p − p_old| ≤ ε; the ratio is capped), "
            '`loss_type="ipo"`.'
        )
        lines.append("")
    lines.append("Sources:")
    for text, url in [*method.sources, *([_IPO_SOURCE] if uses_ipo else []), _TRL_SOURCE]:
        lines.append(f"- {text}" + (f" — <{url}>" if url else ""))

    lines += ["", "## Training configuration", ""]
    details = {
        "trainer": info.trainer,
        "source": None if info.source == "unknown" else info.source,
        "recipe": info.extra.get("recipe"),
        "dataset": info.dataset,
        "reward functions": info.reward_funcs,
        "LoRA": {k: adapter.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules") if k in adapter}
        or info.peft,
        "steps": info.steps,
    }
    for key, value in details.items():
        if value:
            lines.append(f"- {key}: `{_short(value)}`")
    if info.config:
        lines += ["", "Settings that differ from the config class's defaults:", ""]
        lines += ["| parameter | value |", "|---|---|"]
        for key in sorted(info.config):
            lines.append(f"| `{key}` | `{_short(info.config[key])}` |")

    shown = [key for key in _CARD_METRICS if key in info.metrics]
    lines += ["", "## Final metrics", ""]
    if shown:
        lines += ["| metric | value |", "|---|---|"]
        for key in shown:
            lines.append(f"| `{key}` | {_number(info.metrics[key])} |")
    else:
        lines.append(f"None recorded (no {RUN_INFO_FILE} in the output directory).")

    alerts = {rule: count for rule, count in (info.alerts or _alerts_from_state(root)).items() if count}
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

    if PLOT_FILE in files.files:
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


def push_adapter(
    output_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
) -> Any:
    """Create ``repo_id`` (if needed) and upload the adapter files and the generated card in one commit.

    Args:
        output_dir: the run's output directory (see the module docstring).
        repo_id: ``user/name`` or ``org/name`` on the Hub.
        private: create the repository private (an existing repository keeps its visibility).
        token: a Hub token; default: ``HF_TOKEN`` or the stored login.
        revision: the branch to commit to (default: the main branch).
        commit_message: default ``"Upload LoRA adapter trained with trl-ext"``.
        endpoint: the Hub endpoint; default ``HF_ENDPOINT`` or huggingface.co.

    Returns:
        `huggingface_hub.CommitInfo` of the commit.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    if not isinstance(repo_id, str) or not _HUB_ID.match(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must look like 'user/name' or 'org/name'.")
    files = collect_adapter_files(output_dir)
    card = build_model_card(output_dir, repo_id, files)
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in sorted(files.files.items())
    ]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    logger.info("Pushing %s to %s", ", ".join(op.path_in_repo for op in operations), repo_id)
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message or "Upload LoRA adapter trained with trl-ext",
        revision=revision,
        repo_type="model",
    )
