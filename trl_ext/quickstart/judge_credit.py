"""The judge-credit miniature (``--method judge-credit``): `JudgeCreditTrainer` on one-digit additions, its span
judge a script (`ScriptedSpanJudge`) behind a `ScriptedChatServer` on 127.0.0.1, the outcome reward a toy verifier
(`last_number_reward`). It shows the trainer, the monitors and the outputs working end to end; it is not expected to
learn anything in a few steps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .report import QuickstartResult, history_mean
from .settings import QuickstartSettings, miniature_run_kwargs
from .training import save_miniature_run, train_miniature

_ARITHMETIC = [(a, b) for a in range(1, 10) for b in range(1, 10)]


def _arithmetic_dataset(num: int, seed: int) -> Any:
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [rng.choice(_ARITHMETIC) for _ in range(num)]
    return Dataset.from_dict(
        {"prompt": [f"What is {a} + {b}?" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


_NUMBER = re.compile(r"-?\d+")


def last_number_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the last number in the completion equals ``answer``; 0.1 for any number; else 0 (a toy verifier)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else str(completion[-1].get("content", ""))
        numbers = _NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.1 if numbers else 0.0)
    return rewards


class ScriptedSpanJudge:
    """The miniature judge: marks the completion's first line ``key_progress`` when the answer is right and
    ``original_error`` when it is wrong (confidence 0.8), quoting it. A `ScriptedChatServer` script."""

    _TRACE = re.compile(r"<<<(DATA-[0-9a-f]{16}) TRACE\n(.*?)\n\1>>>", re.DOTALL)
    _MARK = re.compile(r"⟦(\d+)⟧")

    def __call__(self, request: dict[str, Any]) -> str:
        text = "\n".join(str(m.get("content") or "") for m in request.get("messages", []) if m.get("role") == "user")
        match = self._TRACE.search(text)
        if match is None:
            return json.dumps({"spans": []})
        marked = match.group(2)
        parts = self._MARK.split(marked)
        segments = [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]
        visible = [(start, body) for start, body in segments if body.strip()]
        if not visible:
            return json.dumps({"spans": []})
        start, body = visible[0]
        following = [s for s, _ in segments if s > start]
        end = following[0] if following else start + 1
        correct = "verdict: correct" in text.lower() or "verifier verdict: 1" in text.lower()
        label = "key_progress" if correct else "original_error"
        span = {"start": start, "end": end, "label": label, "confidence": 0.8, "quote": body.strip()}
        return json.dumps({"spans": [span]})


def run_judge_credit(
    output: Path, settings: QuickstartSettings, fast: bool, progress: bool, say: Callable[[str], None]
) -> QuickstartResult:
    """The judge-credit miniature in ``output``; ``say`` gets one line per stage."""
    from trl_ext.callbacks import default_monitors
    from trl_ext.recipes import config_summary
    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers import JudgeCreditConfig, JudgeCreditTrainer

    from .scripted_server import ScriptedChatServer

    model, tokenizer = build_tiny_model_and_tokenizer(settings.seed, initializer_range=0.5)
    dataset = _arithmetic_dataset(64, settings.seed)
    judge = ScriptedSpanJudge()
    say("[1/2] scripted span judge on 127.0.0.1 (OpenAI-compatible); tiny policy, arithmetic prompts")
    with ScriptedChatServer(judge, model="scripted-span-judge") as server:
        config = JudgeCreditConfig(
            **miniature_run_kwargs(output, settings, fast, progress),
            max_completion_length=16,
            judge_base_url=server.base_url,
            judge_model="scripted-span-judge",
            judge_tools=[],
            judge_max_retries=0,
            judge_timeout=10.0,
            judge_lambda=0.25,
            marker_every=4,
        )
        monitors = default_monitors()
        say(f"[2/2] JudgeCreditTrainer: {config.max_steps} steps, IPO loss, λ = 0.25, LoRA, default monitors")
        # inside the `with`: the judge server must be up
        trainer = train_miniature(JudgeCreditTrainer, model, last_number_reward, config, dataset, tokenizer, monitors)
    result = save_miniature_run("judge-credit", trainer, monitors, output, settings, fast, say)
    history = trainer.state.log_history
    result.extra = {
        "base_model": "trl_ext.testing.build_tiny_model_and_tokenizer (in memory, not on disk)",
        "config": config_summary(config),
        "judge_share_mean": history_mean(history, "judge/share"),
        "judge_failure_ratio_mean": history_mean(history, "judge/failure_ratio"),
        "judge_requests": len(server.requests),
        "audit_log": str(output / "judge_audit.jsonl"),
    }
    return result
