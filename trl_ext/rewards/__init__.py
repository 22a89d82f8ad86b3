"""Reward functions for TRL's GRPO: rubric LLM judge, char-span F1, RLMT reward-model scorers.

Every reward here follows TRL's reward-function interface, ``reward(prompts, completions, **dataset_columns) ->
list[float | None]`` (the rubric judge and the served reward model are async; TRL awaits them on its own event
loop), has a ``__name__`` for TRL's metric names, and accepts standard (string) and conversational (message list)
completions. So each plugs into `trl.GRPOTrainer` and `trl_ext.ExtGRPOTrainer` unchanged.

- `rubric`: `RubricJudgeReward`, an OpenAI-compatible judge scoring precision/recall 1–10 (docs/rubric_judge.md);
  its settings in `rubric_config`, reading its replies in `rubric_parsing`.
- `span_f1`: `char_span_f1` and `CharSpanF1Reward`, the verifiable baseline (docs/char_span_f1.md).
- `rlmt`: the RLMT formats, `split_thinking`, `RewardModelScorer`, `ServedRewardModelScorer`, DPO pairs
  (docs/rlmt.md); every public name of `rlmt` is importable from here too.
- `metrics`: the same metrics as `evaluate` modules (`metric_path`).
"""

from . import rlmt
from .metrics import metric_path
from .rlmt import *  # noqa: F403 (every public RLMT name: `rlmt.__all__` is their one list)
from .rubric import RubricJudgeReward, RubricJudgeStats, RubricVerdict
from .rubric_config import DEFAULT_RUBRIC, RubricJudgeConfig
from .rubric_parsing import RubricParseError, mean_score_fraction, parse_rubric_scores
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
    "CharSpanF1Reward",
    "RubricJudgeConfig",
    "RubricJudgeReward",
    "RubricJudgeStats",
    "RubricParseError",
    "RubricVerdict",
    "SpanScores",
    "char_span_f1",
    "char_span_scores",
    "mean_score_fraction",
    "metric_path",
    "parse_gold_spans",
    "parse_predicted_spans",
    "parse_rubric_scores",
]
__all__ += rlmt.__all__
