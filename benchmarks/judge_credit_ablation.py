"""Judge-credit ablation: does the span judge's credit help over the outcome reward alone?

The judge-credit miniature (`trl_ext.quickstart.judge_credit`): a digit-copy task with an exact-match outcome reward,
a tiny policy after a brief cold-start SFT, and a scripted judge that marks right digits ``key_progress`` and wrong
ones ``original_error`` / ``dependent_error`` from the reference answer it is sent. Per seed one SFT model; from it
one `JudgeCreditTrainer` run per λ (λ = 0: outcome-only, the judge in shadow mode), same data and seeds; held-out
exact match and per-digit accuracy (greedy) before and after RL. The section "Judge-credit ablation" of
benchmarks/RESULTS.md is written from it.

    python benchmarks/judge_credit_ablation.py                       # seeds 0-2 x λ 0, 0.25, 1 (about 5 min, 1 thread)
    python benchmarks/judge_credit_ablation.py --seeds 0 --lambdas 0 1 --no-write
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import machine, quiet_run, write_section  # noqa: E402

SECTION = "judge_credit_ablation"


def table(rows: list[dict]) -> str:
    lines = [
        "| seed | λ | exact match before | exact match after | digit acc before | digit acc after | RL + eval wall s "
        "| torch threads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['judge_lambda']:g} | {r['exact_match_before']:.3f} | {r['exact_match_after']:.3f} "
            f"| {r['digit_acc_before']:.3f} | {r['digit_acc_after']:.3f} | {r['rl_wall_s']:.0f} | {r['torch_threads']} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    """Per λ > 0: on how many seeds its held-out exact match beat outcome-only's (λ = 0)."""
    baseline = {r["seed"]: r["exact_match_after"] for r in rows if r["judge_lambda"] == 0}
    lines = []
    for lam in sorted({r["judge_lambda"] for r in rows if r["judge_lambda"] > 0}):
        runs = [r for r in rows if r["judge_lambda"] == lam and r["seed"] in baseline]
        wins = sum(r["exact_match_after"] > baseline[r["seed"]] for r in runs)
        ties = sum(r["exact_match_after"] == baseline[r["seed"]] for r in runs)
        lines.append(f"- λ = {lam:g}: above outcome-only on {wins} of {len(runs)} seeds ({ties} tied)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    quiet_run(args.threads)
    from trl_ext.quickstart.judge_credit import JudgeCreditSettings, judge_credit_ablation

    settings = JudgeCreditSettings.default()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        rows = judge_credit_ablation(args.seeds, args.lambdas, root, settings, log=print)
    total = time.perf_counter() - started
    body = "\n\n".join(
        [
            "## Judge-credit ablation",
            "Written by `benchmarks/judge_credit_ablation.py` "
            f"({machine(threads=False)}; {total:.0f} s in all, on a machine shared with other jobs). The judge-credit "
            f"miniature (`trl_ext.quickstart.judge_credit`, `JudgeCreditSettings.default()`): copy {settings.digits} "
            "digits, exact-match outcome reward; per seed one cold-start SFT model, then one `JudgeCreditTrainer` run "
            f"per λ from it ({settings.rl_steps} steps, {settings.prompts_per_step} prompts x "
            f"{settings.num_generations} rollouts at temperature {settings.temperature:g}, LoRA, IPO); λ = 0 is "
            "outcome-only (the judge runs in shadow mode). Held-out: "
            f"{settings.num_eval_examples} prompts never trained on, greedy.",
            table(rows),
            verdicts(rows),
        ]
    )
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
