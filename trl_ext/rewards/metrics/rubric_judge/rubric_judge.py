"""`evaluate` module: the rubric LLM judge of trl-ext (precision and recall 1-10, reward (p/10 + r/10) / 2).

Wraps `trl_ext.rewards.rubric.RubricJudgeReward`; the judge is any OpenAI-compatible chat endpoint. Inputs, one
entry per example: ``predictions`` (answers), ``references`` (ground truths) and ``queries``. The judge settings
are keyword arguments of ``compute`` (the fields of `RubricJudgeConfig`: ``base_url``, ``model``,
``api_key_env``, ``max_concurrency``, ``timeout``, ``rubric``, ``fallback_reward``, ...).

Returns ``rubric_reward`` (mean reward, failed judgements counted at ``fallback_reward``), the mean of every score
field over the judgements that parsed (``precision``, ``recall``), and the counts ``judged``, ``failed`` and
``unparseable``.
"""

import datasets
import evaluate

from trl_ext.rewards.rubric import RubricJudgeReward

_DESCRIPTION = "Rubric LLM judge: precision and recall (1-10) of a prediction against the ground truth."
_KWARGS_DESCRIPTION = """
Args:
    predictions: the predicted answers.
    references: the ground-truth answers.
    queries: the queries.
    **judge_kwargs: fields of trl_ext.rewards.RubricJudgeConfig (base_url, model, api_key_env, timeout, ...).
Returns:
    rubric_reward: mean reward; precision, recall: mean scores over parsed judgements;
    judged, failed, unparseable: counts.
Example:
    >>> metric = evaluate.load(trl_ext.rewards.metrics.metric_path("rubric_judge"))
    >>> metric.compute(predictions=["Paris"], references=["Paris"], queries=["Capital of France?"],
    ...                base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B")
"""
_CITATION = ""


class RubricJudge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Value("string"),
                    "queries": datasets.Value("string"),
                }
            ),
        )

    def _compute(self, predictions, references, queries, **judge_kwargs):
        if not predictions:
            raise ValueError("rubric_judge got no examples.")
        judge = RubricJudgeReward(**judge_kwargs)
        try:
            verdicts = judge.score(queries, references, predictions)
        finally:
            judge.close()
        rewards = [v.reward for v in verdicts if v.reward is not None]
        result = {
            "rubric_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "judged": len(verdicts),
            "failed": sum(v.status == "failed" for v in verdicts),
            "unparseable": sum(v.status == "unparseable" for v in verdicts),
        }
        parsed = [v for v in verdicts if v.ok]
        for name in judge.config.score_fields:
            result[name] = sum(v.scores[name] for v in parsed) / len(parsed) if parsed else float("nan")
        return result
