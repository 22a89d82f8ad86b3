"""GPU check: does an `ExtGRPOTrainer` run killed with ``kill -9`` and resumed end where the uninterrupted run ends,
on CUDA in bf16? (On the CPU it does, bit for bit: tests/trainers/test_resume.py.)

    python benchmarks/resume_gpu.py            # on a machine with a CUDA GPU; writes its section of RESULTS.md

Every run is a subprocess of tests/scripts/interrupted_run.py with ``--gpu`` (Qwen2, bf16 autocast, 4 steps,
a checkpoint a step). For each arm (transformers' defaults; ``full_determinism=True``) it runs the uninterrupted
run twice (is the GPU run itself reproducible?), then each kill scenario, then resumes it, and compares the final
weights and the per-step logs with the first uninterrupted run. The runs of a phase run at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import machine, write_section  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "interrupted_run.py"
ARMS = {
    "tiny, bf16": [],
    "tiny, bf16 + full_determinism": ["--full-determinism"],
    "102M params, bf16": ["--model-size", "small"],
}
# scenario -> (--kill-at, num_iterations); checkpoints every step, 4 steps
SCENARIOS = {
    "killed in generation of step 3": ("generation:3", 1),
    "killed before optimizer step 3": ("optimizer:3", 1),
    "killed inside a generation batch (num_iterations 2, step 2)": ("optimizer:2", 2),
}


def start(output: Path, flags: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(output.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(output), "--gpu", *flags], env=env, stdout=log, stderr=log
    )


def wait(processes: dict[str, subprocess.Popen]) -> dict[str, int]:
    return {name: process.wait(timeout=900) for name, process in processes.items()}


def load(output: Path) -> tuple[dict, list[dict]]:
    params = torch.load(output / "final_params.pt", map_location="cpu")
    logs = [
        {k: v for k, v in entry.items() if k != "step_time"}
        for entry in json.loads((output / "log_history.json").read_text())
        if "loss" in entry
    ]
    return params, logs


def compare(run: Path, reference: Path) -> dict:
    if not (run / "final_params.pt").is_file():
        return {"finished": False}
    params, logs = load(run)
    reference_params, reference_logs = load(reference)
    diff = max((params[name].float() - value.float()).abs().max().item() for name, value in reference_params.items())
    return {
        "finished": True,
        "weights_identical": all(torch.equal(params[name], value) for name, value in reference_params.items()),
        "max_abs_weight_diff": diff,
        "logs_identical": logs == reference_logs,
        "steps": len(logs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/resume_gpu")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("resume_gpu.py needs a CUDA GPU.")
    work = Path(options.work)
    shutil.rmtree(work, ignore_errors=True)  # checkpoints of an earlier call would be resumed from
    work.mkdir(parents=True)
    began = time.perf_counter()
    phase1, phase2, outputs = {}, {}, {}
    for arm, flags in ARMS.items():
        slug = f"arm{list(ARMS).index(arm)}"
        for iterations in (1, 2):
            for copy in ("a", "b") if iterations == 1 else ("a",):
                name = f"{slug}-ref{iterations}{copy}"
                outputs[name] = work / name
                phase1[name] = start(outputs[name], [*flags, "--num-iterations", str(iterations)])
        for kill_at, iterations in SCENARIOS.values():
            name = f"{slug}-{kill_at.replace(':', '')}-it{iterations}"
            outputs[name] = work / name
            phase1[name] = start(outputs[name], [*flags, "--num-iterations", str(iterations), "--kill-at", kill_at])
    # Controls (first arm): a run of another seed, and a resume that throws the checkpoint's generation batch away
    # (what resuming inside a batch did before trl-ext saved it): both must show up as different.
    first = next(iter(ARMS))
    first_slug = "arm0"
    outputs["seed1"] = work / "seed1"
    phase1["seed1"] = start(outputs["seed1"], [*ARMS[first], "--seed", "1"])
    outputs["dropped"] = work / "dropped"
    phase1["dropped"] = start(outputs["dropped"], [*ARMS[first], "--num-iterations", "2", "--kill-at", "optimizer:2"])
    codes = wait(phase1)
    for arm, flags in ARMS.items():
        slug = f"arm{list(ARMS).index(arm)}"
        for kill_at, iterations in SCENARIOS.values():
            name = f"{slug}-{kill_at.replace(':', '')}-it{iterations}"
            phase2[name] = start(outputs[name], [*flags, "--num-iterations", str(iterations), "--resume"])
    phase2["dropped"] = start(
        outputs["dropped"], [*ARMS[first], "--num-iterations", "2", "--resume", "--drop-generation-buffer"]
    )
    resumed_codes = wait(phase2)

    results, rows = [], []
    for arm in ARMS:
        slug = f"arm{list(ARMS).index(arm)}"
        repeat = compare(outputs[f"{slug}-ref1b"], outputs[f"{slug}-ref1a"])
        results.append({"arm": arm, "case": "uninterrupted run, repeated", **repeat})
        rows.append((arm, "uninterrupted run, run again", "—", repeat))
        for scenario, (kill_at, iterations) in SCENARIOS.items():
            name = f"{slug}-{kill_at.replace(':', '')}-it{iterations}"
            reference = outputs[f"{slug}-ref{iterations}a"]
            result = compare(outputs[name], reference)
            killed = "SIGKILL" if codes[name] == -9 else f"exit {codes[name]}"
            results.append(
                {"arm": arm, "case": scenario, "killed": killed, "resume_exit": resumed_codes[name], **result}
            )
            rows.append((arm, f"{scenario}, resumed", killed, result))
    controls = [
        ("another seed (uninterrupted, seed 1)", "—", compare(outputs["seed1"], outputs[f"{first_slug}-ref1a"])),
        (
            "killed inside a generation batch, resumed without the saved batch (as before)",
            "SIGKILL" if codes["dropped"] == -9 else f"exit {codes['dropped']}",
            compare(outputs["dropped"], outputs[f"{first_slug}-ref2a"]),
        ),
    ]
    for case, killed, result in controls:
        results.append({"arm": first, "case": f"control: {case}", "killed": killed, **result})
        rows.append((first, f"control: {case}", killed, result))
    wall = time.perf_counter() - began

    def cell(result: dict) -> str:
        if not result.get("finished"):
            return "did not finish | — | —"
        same = "**identical**" if result["weights_identical"] else "differ"
        logs = "identical" if result["logs_identical"] else "differ"
        return f"{same} | {result['max_abs_weight_diff']:.3g} | {logs}"

    lines = [
        "## GPU figures: resume after `kill -9` on CUDA (bf16)",
        "",
        f"`python benchmarks/resume_gpu.py` on **{torch.cuda.get_device_name(0)}** (GPU figures; {machine(False)}, "
        f"CUDA {torch.version.cuda}, {wall:.0f} s in all). Qwen2 (tiny: hidden 32, 2 layers; 102M: hidden 768, 12 layers), "
        "`ExtGRPOTrainer` (dapo), bf16 autocast, 4 "
        "steps of one prompt × 4 generations, a checkpoint every step; each run a subprocess of "
        "`tests/scripts/interrupted_run.py --gpu` killing itself with SIGKILL, then resumed with "
        "`resume_from_checkpoint=True`. Compared with the uninterrupted run: final weights and per-step logs "
        "(`step_time` left out).",
        "",
        "| arm | run | killed | final weights vs uninterrupted | max abs weight diff | per-step logs |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {arm} | {case} | {killed} | {cell(result)} |" for arm, case, killed, result in rows]
    body = "\n".join(lines)
    print(body)
    write_section("resume_gpu", body)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
