"""Reward functions for TRL's GRPO: rubric LLM judge, char-span F1, RLMT reward-model scorers.

Every reward here follows TRL's reward-function interface, ``reward(prompts, completions, **dataset_columns) ->
list[float | None]`` (the rubric judge and the served reward model are async; TRL awaits them on its own event
loop), has a ``__name__`` for TRL's metric names, and accepts standard (string) and conversational (message list)
completions. So each plugs into `trl.GRPOTrainer` and `trl_ext.ExtGRPOTrainer` unchanged.

- `rubric`: `RubricJudgeReward`, an OpenAI-compatible judge scoring precision/recall 1–10 (docs/rubric_judge.md).
- `span_f1`: `char_span_f1` and `CharSpanF1Reward`, the verifiable baseline (docs/char_span_f1.md).
- `rlmt`: the RLMT formats, `split_thinking`, `RewardModelScorer`, `ServedRewardModelScorer`, DPO pairs
  (docs/rlmt.md).
- `metrics`: the same metrics as `evaluate` modules (`metric_path`).
"""

from .metrics import metric_path
from .rlmt import (
    INSTRUCT_SYSTEM_PROMPT,
    ORIGINAL_PROMPT_COLUMN,
    RLMT_FORMATS,
    ZERO_PROMPT_PREFIX,
    ZERO_STOP_STRING,
    RewardModelScorer,
    ServedRewardModelScorer,
    ThinkingSplit,
    build_dpo_pairs,
    original_prompt,
    rlmt_format_dataset,
    rlmt_prompt,
    sample_on_policy_pairs,
    select_dpo_pair,
    split_thinking,
    stop_token_cut,
    truncate_at_stop,
)
from .rubric import (
    DEFAULT_RUBRIC,
    RubricJudgeConfig,
    RubricJudgeReward,
    RubricJudgeStats,
    RubricParseError,
    RubricVerdict,
    mean_score_fraction,
    parse_rubric_scores,
)
from .span_f1 import (
    CharSpanF1Reward,
    SpanScores,
    char_span_f1,
    char_span_scores,
    parse_gold_spans,
    parse_predicted_spans,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "INSTRUCT_SYSTEM_PROMPT",
    "ORIGINAL_PROMPT_COLUMN",
    "RLMT_FORMATS",
    "ZERO_PROMPT_PREFIX",
    "ZERO_STOP_STRING",
    "CharSpanF1Reward",
    "RewardModelScorer",
    "RubricJudgeConfig",
    "RubricJudgeReward",
    "RubricJudgeStats",
    "RubricParseError",
    "RubricVerdict",
    "ServedRewardModelScorer",
    "SpanScores",
    "ThinkingSplit",
    "build_dpo_pairs",
    "char_span_f1",
    "char_span_scores",
    "mean_score_fraction",
    "metric_path",
    "original_prompt",
    "parse_gold_spans",
    "parse_predicted_spans",
    "parse_rubric_scores",
    "rlmt_format_dataset",
    "rlmt_prompt",
    "sample_on_policy_pairs",
    "select_dpo_pair",
    "split_thinking",
    "stop_token_cut",
    "truncate_at_stop",
]
