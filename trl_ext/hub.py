"""Push a trained LoRA adapter to the Hugging Face Hub with a generated model card (``trl-ext push``).

Only the adapter goes up, never merged or full weights: ``adapter_config.json``, ``adapter_model.safetensors`` (or
``.bin``), the tokenizer files saved next to them (the chat template the adapter was trained with), the run's
``trl_ext_run.json`` and ``monitors.png``, and a ``README.md`` model card: TRL's card (`build_model_card`, from the
trainer's tags, name and paper, which come from `trl_ext.methods.METHODS`) with trl-ext's sections about the
method and its sources, the configuration, the final metrics, the monitor alerts and the REPL sandbox (their text:
`trl_ext.model_card`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .methods import METHODS
from .model_card import (
    HUB_ID,
    METHOD_TEXTS,
    is_local_path,
    on_hub,
    path_name,
    public_run_info,
    public_value,
    quick_start_text,
    trl_ext_sections,
)
from .run_info import PLOT_FILE, RUN_INFO_FILE, RunInfo, read_run_info

logger = logging.getLogger(__name__)

__all__ = [
    "AdapterFiles",
    "HubUploadError",
    "PushError",
    "build_model_card",
    "collect_adapter_files",
    "describe_hub_error",
    "find_adapter_dir",
    "push_adapter",
]

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


def build_model_card(
    output_dir: str | os.PathLike[str],
    repo_id: str,
    files: AdapterFiles | None = None,
    *,
    license: str | None = None,  # noqa: A002 - the Hub's metadata key
) -> str:
    """The ``README.md`` of the adapter repository: TRL's model card with trl-ext's sections.

    The base is `trl.trainer.utils.generate_model_card` fed exactly as `trainer.create_model_card()` feeds it
    (the trainer's tags, name and paper, from `METHODS`): YAML metadata (base model, tags, model name),
    training procedure, framework versions and citations. trl-ext changes what does not fit an adapter repository:

    - the metadata says ``library_name: peft`` and adds the tags ``peft``, ``lora`` (and the loss's, ``ipo-loss``);
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
    method = METHODS[info.method or "grpo"]
    loss_card = loss_card_of(info.config.get("loss_type"))
    raw_base = (files.run_info.base_model if files.run_info else None) or adapter.get("base_model_name_or_path")
    base_on_hub = on_hub(raw_base) and not is_local_path(raw_base)
    tags = [*method.tag_names, "peft", "lora", *([loss_card.tag] if loss_card else [])]
    dataset = info.dataset if on_hub(info.dataset) else None

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
            if " " in raw_base and not is_local_path(raw_base)
            else f"a local base model (the folder `{path_name(raw_base)}`, not on the Hub)"
        )
    if not base_on_hub:  # TRL's template links the base model whatever it is; a local one has no Hub page
        where = local_base or "an unknown base model (the adapter config does not name it)"
        text = text.replace(_TRL_NO_BASE, f"This model is a LoRA adapter for {where}", 1)
    has_tokenizer = any(name in files.files for name in TOKENIZER_FILES)
    text_of_method = METHOD_TEXTS[method.tag]
    quick_start = quick_start_text(
        repo_id, raw_base if base_on_hub else None, local_base, adapter, has_tokenizer, text_of_method.title
    )
    head, found, rest = text.partition(_TRL_QUICK_START)
    _, after, rest = rest.partition(_TRL_TRAINING_PROCEDURE)
    if found and after:  # TRL's pipeline() quick start cannot load an adapter: ours loads it with PEFT
        text = f"{head}{_TRL_QUICK_START}\n{quick_start}\n\n{after}{rest}"
    else:  # another template: keep it, and add ours
        text = f"{text.rstrip()}\n\n## Loading the adapter\n\n{quick_start}\n"
    sections = "\n".join(
        trl_ext_sections(root, info, adapter, text_of_method, loss_card, has_plot=PLOT_FILE in files.files)
    )
    head, citations, tail = text.partition("\n## Citations")
    return f"{head.rstrip()}\n\n{sections}\n{citations}{tail}" if citations else f"{text.rstrip()}\n\n{sections}"


# What TRL's template writes when `base_model` is None (a local base model), and its quick start's bounds.
_TRL_NO_BASE = "This model is a fine-tuned version of [None](https://huggingface.co/None)"
_TRL_QUICK_START = "## Quick start\n"
_TRL_TRAINING_PROCEDURE = "## Training procedure"


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

    if not isinstance(repo_id, str) or not HUB_ID.match(repo_id):
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


def loss_card_of(loss_type: Any) -> Any:
    """The `trl_ext.losses.LossCard` of a run's ``loss_type`` (None for TRL's losses, or one not registered here)."""
    from .losses import LOSSES

    spec = LOSSES.get(loss_type) if isinstance(loss_type, str) else None
    return spec.card if spec is not None else None
