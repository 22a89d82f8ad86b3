"""RLMT: the model plans in ``<think>`` then responds; a reward model scores the response only (docs/rlmt.md).

"Language Models that Think, Chat Better" (Bhaskar, Ye, Chen; arXiv 2509.20357) trains chat models with GRPO to
write a plan ``z`` before the response ``y`` and maximises ``E[r(y, x)]`` where the reward model ``r`` never sees
the plan. This package holds the pieces that are not the trainer (`trl_ext.trainers.rlmt` wires them together):

- `formats`: the ``"instruct"`` and ``"zero"`` prompt formats (`rlmt_prompt`, `original_prompt`,
  `rlmt_format_dataset`) and their stop strings (`truncate_at_stop`, `stop_token_cut`, `cut_at_stop`);
- `thinking`: `split_thinking`, ``(thinking, response, well_formed)`` from a completion;
- `scorers`: `RewardModelScorer` (a local ``transformers`` reward model) and `ServedRewardModelScorer` (a vLLM-served
  one), TRL reward functions that score ``prompt + response`` only;
- `dpo`: on-policy DPO, `build_dpo_pairs` (best vs worst per prompt, rows for `trl.DPOTrainer`) and
  `sample_on_policy_pairs` (samples and scores them first).

Every public name is importable from here (``from trl_ext.rewards.rlmt import split_thinking``), as before the split.
"""

from .dpo import build_dpo_pairs, sample_on_policy_pairs, select_dpo_pair
from .formats import (
    INSTRUCT_SYSTEM_PROMPT,
    ORIGINAL_PROMPT_COLUMN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    RLMT_FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
    ZERO_PROMPT_PREFIX,
    ZERO_PROMPT_TEMPLATE,
    ZERO_STOP_STRING,
    Format,
    cut_at_stop,
    original_prompt,
    rlmt_format_dataset,
    rlmt_prompt,
    stop_token_cut,
    truncate_at_stop,
)
from .scorers import RewardModelScorer, ScorerStats, ServedRewardModelScorer
from .thinking import ThinkingSplit, split_thinking

__all__ = [
    "INSTRUCT_SYSTEM_PROMPT",
    "ORIGINAL_PROMPT_COLUMN",
    "RESPONSE_CLOSE",
    "RESPONSE_OPEN",
    "RLMT_FORMATS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "ZERO_PROMPT_PREFIX",
    "ZERO_PROMPT_TEMPLATE",
    "ZERO_STOP_STRING",
    "Format",
    "RewardModelScorer",
    "ScorerStats",
    "ServedRewardModelScorer",
    "ThinkingSplit",
    "build_dpo_pairs",
    "cut_at_stop",
    "original_prompt",
    "rlmt_format_dataset",
    "rlmt_prompt",
    "sample_on_policy_pairs",
    "select_dpo_pair",
    "split_thinking",
    "stop_token_cut",
    "truncate_at_stop",
]
