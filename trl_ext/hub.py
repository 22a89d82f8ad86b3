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

from .run_info import RUN_INFO_FILE, RunInfo, is_setting_choice, read_run_info

logger = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "AdapterFiles",
    "HubUploadError",
    "MethodCard",
    "PushError",
    "build_model_card",
    "collect_adapter_files",
    "describe_hub_error",
    "find_adapter_dir",
    "public_run_info",
    "public_value",
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


class HubUploadError(PushError):
    """The upload itself failed; the message says whether the Hub was offline or unreachable, refused the token, or
    answered with another error (`describe_hub_error`)."""


_NETWORK_ERROR_NAMES = {"ConnectError", "ConnectTimeout", "NetworkError", "TimeoutException", "TransportError"}


def describe_hub_error(error: BaseException, endpoint: str | None = None) -> str:
    """One sentence on why a Hub call failed, with the fix: offline mode (``HF_HUB_OFFLINE``), the network (no
    connection to the endpoint), the token (HTTP 401/403) or another answer of the Hub.

    Args:
        error: what `huggingface_hub` raised.
        endpoint: the endpoint called (default: ``HF_ENDPOINT`` or huggingface.co).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    endpoint = endpoint or constants.ENDPOINT
    chain: list[BaseException] = []
    item: BaseException | None = error
    while item is not None and item not in chain:
        chain.append(item)
        item = item.__cause__ or item.__context__
    if any(isinstance(item, OfflineModeIsEnabled) for item in chain):
        return (
            "the Hub is offline for this process: HF_HUB_OFFLINE is set, so nothing can be uploaded. Unset it "
            "(`unset HF_HUB_OFFLINE` or HF_HUB_OFFLINE=0) on a machine with network access, then push again."
        )
    for item in chain:
        if isinstance(item, HfHubHTTPError) and getattr(item.response, "status_code", None) in (401, 403):
            status = item.response.status_code
            what = (
                "refused the token (HTTP 401: missing, invalid or expired)"
                if status == 401
                else "refused the upload (HTTP 403: the token cannot write to this repository)"
            )
            return (
                f"{endpoint} {what}. Set HF_TOKEN to a token with write access (or `hf auth login`), and check that "
                "the namespace of the repository id is yours or an organization you can write to."
            )
    if any(
        isinstance(item, (ConnectionError, TimeoutError))
        or {cls.__name__ for cls in type(item).__mro__} & _NETWORK_ERROR_NAMES
        for item in chain
    ):
        return (
            f"could not reach the Hub at {endpoint} ({type(error).__name__}: {error}). Check the network connection, "
            "a proxy, or HF_ENDPOINT; the token was not checked."
        )
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", "?")
        return f"the Hub at {endpoint} answered HTTP {status}: {error}"
    return f"the upload failed ({type(error).__name__}: {error})."


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


_WINDOWS_ABSOLUTE = re.compile(r"^[A-Za-z]:[\\/]")


def _is_local_path(value: Any) -> bool:
    """An absolute file-system path (``/home/me/run``, ``~/models/x``, ``C:\\runs\\x``): machine-specific, never
    published."""
    return (
        isinstance(value, str)
        and "\n" not in value
        and (value.startswith("~") or os.path.isabs(value) or bool(_WINDOWS_ABSOLUTE.match(value)))
    )


def _path_name(value: str) -> str:
    """The last component of a path (``/home/me/runs/sft_model/`` -> ``sft_model``)."""
    return re.split(r"[\\/]", value.rstrip("/\\"))[-1] or value


def public_value(value: Any) -> Any:
    """``value`` (JSON-like) with every absolute local path replaced by its last component: what a published file
    (the model card, the uploaded ``trl_ext_run.json``) may say about the machine the run was on."""
    if isinstance(value, str):
        return _path_name(value) if _is_local_path(value) else value
    if isinstance(value, Mapping):
        return {key: public_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_value(item) for item in value]
    return value


def public_run_info(info: RunInfo) -> RunInfo:
    """The run file as `push_adapter` uploads it: `public_value` of every field (local paths -> folder/file names)."""
    return RunInfo.from_dict(public_value(info.to_dict()))


def build_model_card(
    output_dir: str | os.PathLike[str],
    repo_id: str,
    files: AdapterFiles | None = None,
    *,
    license: str | None = None,  # noqa: A002 - the Hub's metadata key
) -> str:
    """The ``README.md`` of the adapter repository: TRL's model card with trl-ext's sections.

    The base is `trl.trainer.utils.generate_model_card` fed exactly as `trainer.create_model_card()` feeds it
    (the trainer's `_tag_names`, `_name` and `_paper`, from `METHODS`): YAML metadata (base model, tags, model name),
    training procedure, framework versions and citations. trl-ext changes what does not fit an adapter repository:

    - the metadata says ``library_name: peft`` and adds the tags ``peft``, ``lora`` (and ``ipo-loss``);
      ``base_model`` only when the base is a Hub model (a local folder has no Hub page, and its path stays local);
      ``license`` only when given (TRL's template writes the placeholder ``licence: license``);
    - the quick start loads the adapter with PEFT (TRL's ``pipeline(model=<repo>)`` cannot load an adapter whose
      base is not on the Hub): ``AutoPeftModelForCausalLM`` when the adapter config names the Hub base model, else
      the base model then ``PeftModel``; for a local base it says so instead of printing the path.

    Before the citations come trl-ext's sections, from ``trl_ext_run.json``: the method and its sources, the settings
    the run chose, the final metrics, the monitors' alerts, the REPL sandbox's isolation (when the run had REPLs)
    and the ``monitors.png`` curves. No absolute local path appears anywhere (`public_value`): a local base model,
    the recipe and local data files are named by their last component.

    Args:
        output_dir: the run's output directory.
        repo_id: the Hub repository, ``user/name``.
        files: `collect_adapter_files` of ``output_dir`` (computed when None).
        license: the license id for the metadata (e.g. ``apache-2.0``; usually the base model's), or None to leave
            it out.
    """
    from trl.trainer.utils import generate_model_card

    root = Path(output_dir)
    files = files if files is not None else collect_adapter_files(root)
    info = public_run_info(files.run_info) if files.run_info is not None else RunInfo(source="unknown")
    adapter = _adapter_config(files.adapter_dir)
    method = METHODS.get(info.method or "grpo", METHODS["grpo"])
    uses_ipo = info.config.get("loss_type") == "ipo"
    raw_base = (files.run_info.base_model if files.run_info else None) or adapter.get("base_model_name_or_path")
    base_on_hub = _on_hub(raw_base) and not _is_local_path(raw_base)
    tags = [*method.tag_names, "peft", "lora", *(["ipo-loss"] if uses_ipo else [])]
    dataset = info.dataset if _on_hub(info.dataset) else None

    card = generate_model_card(
        base_model=raw_base if base_on_hub else None,
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
    card.data.licence = None  # TRL's placeholder ("licence: license"): no license is known from the run
    if license:
        card.data.license = license
    text = str(card)
    local_base = None
    if raw_base and not base_on_hub:
        local_base = (
            f"a base model that is not on the Hub (`{raw_base}`)"  # a description, e.g. "tiny (in memory)"
            if " " in raw_base and not _is_local_path(raw_base)
            else f"a local base model (the folder `{_path_name(raw_base)}`, not on the Hub)"
        )
    if not base_on_hub:  # TRL's template links the base model whatever it is; a local one has no Hub page
        where = local_base or "an unknown base model (the adapter config does not name it)"
        text = text.replace(_TRL_NO_BASE, f"This model is a LoRA adapter for {where}", 1)
    has_tokenizer = any(name in files.files for name in TOKENIZER_FILES)
    quick_start = _quick_start(repo_id, raw_base if base_on_hub else None, local_base, adapter, has_tokenizer, method)
    head, found, rest = text.partition(_TRL_QUICK_START)
    _, after, rest = rest.partition(_TRL_TRAINING_PROCEDURE)
    if found and after:  # TRL's pipeline() quick start cannot load an adapter: ours loads it with PEFT
        text = f"{head}{_TRL_QUICK_START}\n{quick_start}\n\n{after}{rest}"
    else:  # another template: keep it, and add ours
        text = f"{text.rstrip()}\n\n## Loading the adapter\n\n{quick_start}\n"
    sections = "\n".join(_trl_ext_sections(root, files, info, adapter, method, uses_ipo))
    head, citations, tail = text.partition("\n## Citations")
    return f"{head.rstrip()}\n\n{sections}\n{citations}{tail}" if citations else f"{text.rstrip()}\n\n{sections}"


# What TRL's template writes when `base_model` is None (a local base model), and its quick start's bounds.
_TRL_NO_BASE = "This model is a fine-tuned version of [None](https://huggingface.co/None)"
_TRL_QUICK_START = "## Quick start\n"
_TRL_TRAINING_PROCEDURE = "## Training procedure"
_LOCAL_BASE_PLACEHOLDER = "path/to/the/base/model"


def _quick_start(
    repo_id: str,
    hub_base: str | None,
    local_base: str | None,
    adapter: Mapping[str, Any],
    has_tokenizer: bool,
    method: MethodCard,
) -> str:
    """The card's quick start (markdown): load the adapter with PEFT and generate one reply.

    ``AutoPeftModelForCausalLM`` when the adapter config names the Hub base model (it loads that base, then the
    adapter); the base by its Hub id then ``PeftModel`` when the adapter config names another one (a local copy);
    for a local or unknown base, a placeholder path and a sentence saying the same weights are needed.
    """
    intro = (
        f"A LoRA adapter trained with trl-ext, a plugin for [TRL](https://github.com/huggingface/trl): "
        f"{method.title}. This repository holds the adapter only, not merged weights: "
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


def _trl_ext_sections(
    root: Path,
    files: AdapterFiles,
    info: RunInfo,
    adapter: Mapping[str, Any],
    method: MethodCard,
    uses_ipo: bool,
) -> list[str]:
    """trl-ext's part of the card (markdown lines): method, configuration, metrics, alerts, sandbox, plot. ``info``
    is the public run file (`public_run_info`)."""
    lines = [f"## Method: {method.title}", "", method.description, ""]
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
        "recipe": _path_name(str(info.extra["recipe"])) if info.extra.get("recipe") else None,
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
    license: str | None = None,  # noqa: A002 - the Hub's metadata key
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
        license: the card's license metadata (e.g. ``apache-2.0``), or None to leave it out.

    Returns:
        `huggingface_hub.CommitInfo` of the commit.

    Raises:
        PushError: no adapter in ``output_dir``, or full weights.
        HubUploadError: the upload failed; the message tells offline mode, an unreachable Hub, a refused token and
            other Hub errors apart (`describe_hub_error`).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    if not isinstance(repo_id, str) or not _HUB_ID.match(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must look like 'user/name' or 'org/name'.")
    files = collect_adapter_files(output_dir)
    card = build_model_card(output_dir, repo_id, files, license=license)
    operations = []
    for name, path in sorted(files.files.items()):
        content: str | bytes = str(path)
        if name == RUN_INFO_FILE and files.run_info is not None:  # without the machine's paths, like the card
            content = public_run_info(files.run_info).to_json().encode("utf-8")
        elif name == ADAPTER_CONFIG and (adapter := _adapter_config(files.adapter_dir)) != public_value(adapter):
            # PEFT records the base as given: a local base folder becomes its name, as in the card.
            content = json.dumps(public_value(adapter), indent=2, sort_keys=True).encode("utf-8")
        operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=content))
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    logger.info("Pushing %s to %s", ", ".join(op.path_in_repo for op in operations), repo_id)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload LoRA adapter trained with trl-ext",
            revision=revision,
            repo_type="model",
        )
    except Exception as error:  # noqa: BLE001 - huggingface_hub's network, HTTP and offline errors: one clear line
        raise HubUploadError(
            f"pushing {output_dir} to {repo_id} failed: {describe_hub_error(error, endpoint)}"
        ) from error
