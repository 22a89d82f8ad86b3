"""On-policy DPO pairs, the RLMT paper's DPO variant: per prompt, the best and the worst of its samples by
reward-model score become ``chosen`` and ``rejected`` (docs/rlmt.md)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .formats import truncate_at_stop

logger = logging.getLogger(__name__)


def select_dpo_pair(scores: Sequence[float | None], min_margin: float = 0.0) -> tuple[int, int] | None:
    """``(chosen, rejected)`` indices: the best and the worst score; ``None`` when no preference exists.

    Scores that are ``None`` or not finite are ignored. Ties break towards the earliest sample (for both the best
    and the worst). No pair when fewer than two scores are valid, or when ``best - worst <= min_margin`` (with the
    default 0, when all valid scores are equal).
    """
    _check_min_margin(min_margin)
    pair = _pair_or_reason(scores, min_margin)
    return pair if isinstance(pair, tuple) else None


def _check_min_margin(min_margin: float) -> None:
    if min_margin < 0:
        raise ValueError(f"min_margin={min_margin} must be >= 0.")


def _pair_or_reason(scores: Sequence[float | None], min_margin: float) -> tuple[int, int] | str:
    """`select_dpo_pair`'s pair, or why there is none: ``"too_few_valid"`` or ``"no_margin"``."""
    valid = [(i, float(s)) for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
    if len(valid) < 2:
        return "too_few_valid"
    best = max(valid, key=lambda item: (item[1], -item[0]))
    worst = min(valid, key=lambda item: (item[1], item[0]))
    if best[1] - worst[1] <= min_margin:
        return "no_margin"
    return best[0], worst[0]


def build_dpo_pairs(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    scores: Sequence[float | None],
    *,
    group_ids: Sequence[Any] | None = None,
    min_margin: float = 0.0,
    allow_empty: bool = False,
) -> Any:
    """On-policy DPO rows from scored samples: per prompt, chosen = best and rejected = worst by score.

    Samples are grouped by ``group_ids`` when given, else by equal prompts (groups keep the order in which they
    first appear). Groups without a preference (`select_dpo_pair`: fewer than two valid scores, or all tied within
    ``min_margin``) are skipped, counted in a warning with the reason. Completions are kept whole (plan and
    response): the policy learns to produce both, while the scores came from the response alone.

    Raises:
        ValueError: when no prompt gave a pair (unless ``allow_empty``), saying why and what to change: TRL's
            ``DPOTrainer`` cannot train on an empty dataset (it stops with a bare ``StopIteration``).

    Returns:
        A `datasets.Dataset` with ``prompt``, ``chosen``, ``rejected`` (the formats TRL's ``DPOTrainer`` reads:
        strings, or conversational prompts with lists of assistant messages) and ``chosen_score``,
        ``rejected_score``.
    """
    from datasets import Dataset

    if not len(prompts) == len(completions) == len(scores):
        raise ValueError(
            f"Got {len(prompts)} prompts, {len(completions)} completions and {len(scores)} scores: pass one prompt "
            "and one score per completion (repeat each prompt once per sample)."
        )
    if group_ids is not None and len(group_ids) != len(prompts):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(prompts)} samples.")
    groups: dict[Any, list[int]] = {}
    for i, prompt in enumerate(prompts):
        key = group_ids[i] if group_ids is not None else _prompt_key(prompt)
        groups.setdefault(key, []).append(i)
    _check_min_margin(min_margin)
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": [], "chosen_score": [], "rejected_score": []}
    too_few, no_margin, identical = 0, 0, 0
    for members in groups.values():
        pair = _pair_or_reason([scores[i] for i in members], min_margin)
        if pair == "too_few_valid":
            too_few += 1
            continue
        if pair == "no_margin":
            no_margin += 1
            identical += len({_prompt_key(completions[i]) for i in members}) == 1
            continue
        chosen, rejected = members[pair[0]], members[pair[1]]
        rows["prompt"].append(prompts[chosen])
        rows["chosen"].append(_as_dpo_completion(completions[chosen], prompts[chosen]))
        rows["rejected"].append(_as_dpo_completion(completions[rejected], prompts[chosen]))
        rows["chosen_score"].append(float(scores[chosen]))
        rows["rejected_score"].append(float(scores[rejected]))
    skipped = too_few + no_margin
    reasons = _skip_reasons(too_few, no_margin, identical, min_margin) if groups else "no samples were given"
    if not rows["prompt"] and not allow_empty:
        raise ValueError(
            f"No on-policy DPO pair: none of the {len(groups)} prompt(s) of {len(prompts)} sample(s) had a best and a "
            f"worst sample to pair ({reasons}). TRL's DPOTrainer cannot train on an empty dataset."
        )
    log = logger.warning if skipped else logger.info
    log(
        "On-policy DPO pairs: %d pair(s) from %d prompt(s); %d prompt(s) gave no pair%s.",
        len(rows["prompt"]),
        len(groups),
        skipped,
        f" ({reasons})" if skipped else "",
    )
    return Dataset.from_dict(rows)


def _skip_reasons(too_few: int, no_margin: int, identical: int, min_margin: float) -> str:
    """Why prompts gave no pair, and what to change, for the log and the error."""
    reasons = []
    if too_few:
        reasons.append(
            f"{too_few} had fewer than two valid scores: each prompt needs at least 2 samples (num_samples) and the "
            "scorer returned None or NaN for the others; check the scorer"
        )
    if no_margin:
        margin = f"within min_margin={min_margin:g}" if min_margin > 0 else "equal"
        text = f"{no_margin} had all their scores {margin}"
        if identical:
            text += f" ({identical} of them with identical samples: raise temperature or num_samples)"
        text += (
            ": lower min_margin, sample more (num_samples) or more diversely (temperature), or use a scorer that "
            "tells the samples apart (a constant score gives no preference, and a strict RewardModelScorer gives "
            "every malformed completion the same lowest score: check the format, or strict=False)"
        )
        reasons.append(text)
    return "; ".join(reasons)


def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _as_dpo_completion(completion: Any, prompt: Any) -> Any:
    """Conversational prompts need conversational completions in TRL's DPO format."""
    if isinstance(prompt, str) or not isinstance(completion, str):
        return completion if isinstance(completion, str) else [dict(m) for m in completion]
    return [{"role": "assistant", "content": completion}]


@torch.no_grad()
def sample_on_policy_pairs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    scorer: Callable[..., Any],
    *,
    num_samples: int = 8,
    max_new_tokens: int = 1024,
    temperature: float = 0.7,
    top_p: float = 1.0,
    stop_strings: Sequence[str] | None = None,
    min_margin: float = 0.0,
    generation_kwargs: dict[str, Any] | None = None,
    scorer_kwargs: dict[str, Sequence[Any]] | None = None,
    allow_empty: bool = False,
) -> Any:
    """Sample ``num_samples`` completions per prompt from the policy with ``transformers``, score them with
    ``scorer`` (any TRL-style reward function, e.g. a `RewardModelScorer`; async ones are awaited), and build the
    DPO pairs (`build_dpo_pairs`). For large runs, sample with vLLM instead and call `build_dpo_pairs` yourself.

    Conversational prompts are rendered with the tokenizer's chat template (generation prompt added); string
    prompts (the "zero" format) are used as they are. Completions are cut after the first stop string.
    ``scorer_kwargs`` holds per-prompt dataset columns for the scorer (repeated per sample here). When no prompt
    gives a pair, a `ValueError` says why (see `build_dpo_pairs`; ``allow_empty=True`` returns the empty dataset).
    """
    if num_samples < 2:
        raise ValueError(f"num_samples={num_samples}: a pair needs at least 2 samples per prompt (the paper uses 8).")
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    all_prompts, all_completions, group_ids = [], [], []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text = prompt
        else:
            text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=isinstance(prompt, str))["input_ids"]
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=torch.ones_like(input_ids).to(device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=pad_id,
            **(generation_kwargs or {}),
        )
        texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
        for text_out in texts:
            if stop_strings:
                text_out = truncate_at_stop(text_out, stop_strings)
            all_prompts.append(prompt)
            all_completions.append(
                text_out if isinstance(prompt, str) else [{"role": "assistant", "content": text_out}]
            )
            group_ids.append(index)
    columns = {key: [values[g] for g in group_ids] for key, values in (scorer_kwargs or {}).items()}
    scores = scorer(prompts=all_prompts, completions=all_completions, **columns)
    if inspect.isawaitable(scores):
        scores = asyncio.run(_await(scores))
    return build_dpo_pairs(
        all_prompts, all_completions, list(scores), group_ids=group_ids, min_margin=min_margin, allow_empty=allow_empty
    )


async def _await(awaitable: Any) -> Any:
    return await awaitable
