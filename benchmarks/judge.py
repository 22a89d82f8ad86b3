"""Span-judge throughput, and the judge's overhead on a training step (docs/judge_credit.md).

1. **Throughput.** 256 rollouts (synthetic math traces of ~300 tokens, tiny tokenizer) are judged by `SpanJudge`
   against a scripted OpenAI-compatible server that answers every call after 200 ms, at concurrency 32 and without
   tools (one call per rollout). Wall time is compared with the ideal ⌈256/32⌉ × 0.2 s = 1.6 s (target ≤ 1.2×).
   The server runs in a child process, like a real endpoint, so its request handling does not share the
   trainer's interpreter; the client side (markers excluded, timed separately) is what is measured.
2. **Step overhead.** Real training steps of the tiny model on CPU, 32 rollouts a step, with a fast verifier reward
   and a slow second reward (`time.sleep`, standing in for a reward model or a rubric LLM judge). Compared:
   `ExtGRPOTrainer` without a judge; `JudgeCreditTrainer` with the verdict taken from the verifier (the judge starts
   right after generation and overlaps the log-prob passes and the slow reward); and with ``"total"`` (the judge
   starts after all rewards: no overlap). The first step of each run is a warm-up and is not counted.

Prints a table and writes it into benchmarks/RESULTS.md between ``<!-- judge:start -->`` and ``<!-- judge:end -->``.

    python benchmarks/judge.py [--rollouts 256] [--concurrency 32] [--latency 0.2] [--repeats 5] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

TRACE_BLOCK = re.compile(r"<<<(DATA-[0-9a-f]{16}) TRACE\n(.*?)\n\1>>>", re.DOTALL)


# ----------------------------------------------------------------------------------------------------------------
# The judge endpoint (child process)
# ----------------------------------------------------------------------------------------------------------------
def judge_script(request: dict) -> object:
    """Answer after the delay named in the model id (``"delay=0.2"``) with one valid span: the first marked line."""
    from trl_ext.quickstart.scripted_server import TextReply

    delay = float(request.get("model", "delay=0").split("=", 1)[1])
    match = TRACE_BLOCK.search(request["messages"][1]["content"])
    spans = []
    if match:
        parts = re.split(r"⟦(\d+)⟧", match.group(2))
        for k in range(1, len(parts) - 2, 2):
            quote = parts[k + 1].strip()
            if quote:
                spans.append(
                    {"start": int(parts[k]), "end": int(parts[k + 2]), "label": "key_progress", "confidence": 0.8}
                    | {"quote": quote}
                )
                break
    return TextReply(json.dumps({"spans": spans}), delay=delay)


def serve() -> None:
    from trl_ext.quickstart.scripted_server import ScriptedChatServer

    with ScriptedChatServer(judge_script) as server:
        print(server.port, flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin


class ChildServer:
    def __enter__(self) -> ChildServer:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.base_url = f"http://127.0.0.1:{int(self.process.stdout.readline())}/v1"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


# ----------------------------------------------------------------------------------------------------------------
# 1. Throughput
# ----------------------------------------------------------------------------------------------------------------
def synthetic_trace(i: int) -> str:
    lines = [f"We need to compute {i} + {i + 1} and then multiply by 7."]
    for step in range(12):
        lines.append(f"Step {step}: {i} + {step} = {i + step}, so the value is {7 * (i + step)}.")
    lines.append(f"The answer is \\boxed{{{7 * (2 * i + 1)}}}.")
    return "\n".join(lines)


def throughput(base_url: str, rollouts: int, concurrency: int, latency: float, repeats: int) -> dict:
    from trl_ext.judge import AsyncChatClient, JudgeRequest, SpanJudge, build_marked_trace, extract_final_answer
    from trl_ext.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    ids = [tokenizer(synthetic_trace(i), add_special_tokens=False)["input_ids"] for i in range(rollouts)]
    started = time.perf_counter()
    traces = [build_marked_trace(tokenizer, row, every=64) for row in ids]
    marker_seconds = time.perf_counter() - started
    requests = [
        JudgeRequest(trace, "Compute the value.", extract_final_answer(trace.text), "accuracy = 1") for trace in traces
    ]
    walls, cpu, verdicts, peak = [], [], [], 0
    for _ in range(repeats):
        client = AsyncChatClient(base_url, f"delay={latency}", max_concurrency=concurrency, timeout=30, max_retries=0)
        judge = SpanJudge(client, tools=())

        async def run_all(judge: SpanJudge = judge) -> list:
            return await judge.judge_many(requests)

        started, cpu_started = time.perf_counter(), time.process_time()
        verdicts = asyncio.run(run_all())
        walls.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        peak = max(peak, client.peak_in_flight)
    ideal = math.ceil(rollouts / concurrency) * latency
    return {
        "rollouts": rollouts,
        "concurrency": concurrency,
        "latency": latency,
        "tokens": statistics.mean(len(row) for row in ids),
        "marker_seconds": marker_seconds,
        "walls": walls,
        "cpu_per_call": statistics.median(cpu) / rollouts,
        "ideal": ideal,
        "ok": sum(v.ok for v in verdicts),
        "spans": sum(len(v.spans) for v in verdicts),
        "peak": peak,
    }


# ----------------------------------------------------------------------------------------------------------------
# 2. Step overhead
# ----------------------------------------------------------------------------------------------------------------
def step_overhead(
    base_url: str, steps: int, rounds: int, slow_reward_s: float, judge_latencies: list[float]
) -> list[dict]:
    """Median step time of each setup; runs alternate over ``rounds`` (rotating order) so machine noise hits all."""
    from _timing import StepTimer
    from datasets import Dataset
    from transformers import PrinterCallback

    from trl_ext.testing import build_tiny_model_and_tokenizer
    from trl_ext.trainers.ext_grpo import ExtGRPOConfig, ExtGRPOTrainer
    from trl_ext.trainers.judge_credit import JudgeCreditConfig, JudgeCreditTrainer

    def verifier(completions, **kwargs):
        return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]

    def slow_reward(completions, **kwargs):
        time.sleep(slow_reward_s)
        return [len(set(text)) / 20 for text in completions]

    setups = [("ExtGRPOTrainer (no judge)", None, None)]
    for latency in judge_latencies:
        setups.append(("JudgeCreditTrainer, verdict from the verifier", "verifier", latency))
        setups.append(("JudgeCreditTrainer, verdict = total reward", "total", latency))
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i + 1}?" for i in range(64)]})
    collected = {index: {"steps": [], "wait": [], "blocking": [], "failures": []} for index in range(len(setups))}

    def run(index: int) -> None:
        name, verdict, latency = setups[index]
        model, tokenizer = build_tiny_model_and_tokenizer(0)
        timer = StepTimer()
        with tempfile.TemporaryDirectory() as output_dir:
            common = dict(
                output_dir=output_dir,
                use_cpu=True,
                bf16=False,
                report_to="none",
                per_device_train_batch_size=32,
                num_generations=8,
                max_completion_length=32,
                max_steps=steps,
                logging_steps=1,
                save_strategy="no",
                learning_rate=0.0,
                seed=0,
                disable_tqdm=True,
                loss_type="ipo",
                scale_rewards="none",
            )
            rewards = [verifier, slow_reward]
            if verdict is None:
                config = ExtGRPOConfig(**common)
                trainer = ExtGRPOTrainer(
                    model, rewards, args=config, train_dataset=dataset, processing_class=tokenizer
                )
            else:
                config = JudgeCreditConfig(
                    **common,
                    judge_base_url=base_url,
                    judge_model=f"delay={latency}",
                    judge_tools=[],
                    judge_max_concurrency=32,
                    judge_verdict_reward=verdict,
                    judge_audit_log=False,
                )
                trainer = JudgeCreditTrainer(
                    model, rewards, args=config, train_dataset=dataset, processing_class=tokenizer
                )
            trainer.add_callback(timer)
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        logs = [entry for entry in trainer.state.log_history if "judge/wait_s" in entry][1:]
        collected[index]["steps"] += timer.times[1:]
        collected[index]["wait"] += [entry["judge/wait_s"] for entry in logs]
        collected[index]["blocking"] += [entry["judge/blocking_s"] for entry in logs]
        collected[index]["failures"] += [entry["judge/failure_ratio"] for entry in logs]

    for round_index in range(rounds):
        order = list(range(len(setups)))
        for index in order[round_index % len(order) :] + order[: round_index % len(order)]:
            run(index)

    results = []
    for index, (name, _verdict, latency) in enumerate(setups):
        data = collected[index]
        results.append(
            {
                "name": name,
                "latency": latency,
                "steps_timed": len(data["steps"]),
                "all_steps": data["steps"],
                "step": statistics.median(data["steps"]),
                "best": min(data["steps"]),
                "wait": statistics.median(data["wait"]) if data["wait"] else None,
                "blocking": statistics.median(data["blocking"]) if data["blocking"] else None,
                "failures": max(data["failures"]) if data["failures"] else None,
            }
        )
    # Noise from other processes only ever adds time, so the fastest step of each setup is the cleanest comparison.
    base = results[0]["best"]
    for result in results:
        result["overhead"] = result["best"] - base
    return results


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def report(tp: dict, steps: list[dict] | None, argv: str, slow_reward_s: float) -> str:
    from _results import machine

    median_wall = statistics.median(tp["walls"])
    ratio = median_wall / tp["ideal"]
    lines = [
        "## Span judge: throughput and step overhead",
        "",
        f"`python benchmarks/judge.py {argv}` ({machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end: the CPUs were shared). Scripted OpenAI-compatible server in a child "
        "process; `SpanJudge` over `AsyncChatClient`, no tools (one call per rollout).",
        "",
        "| rollouts | concurrency | latency/call | tokens/rollout | ideal ⌈n/c⌉×latency | wall (median) | "
        "runs | ratio | peak in flight | verdicts ok | spans kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {tp['rollouts']} | {tp['concurrency']} | {tp['latency'] * 1000:.0f} ms | {tp['tokens']:.0f} | "
        f"{tp['ideal']:.2f} s | {median_wall:.2f} s | {', '.join(f'{w:.2f}' for w in tp['walls'])} | "
        f"**{ratio:.2f}×** | {tp['peak']} | {tp['ok']}/{tp['rollouts']} | {tp['spans']} |",
        "",
        f"**Wall / ideal = {ratio:.2f}×** (target ≤ 1.2×: {'meets' if ratio <= 1.2 else 'MISSES'}). Building the "
        f"markers of all {tp['rollouts']} rollouts took {tp['marker_seconds'] * 1000:.0f} ms (main thread, before "
        f"the calls). Client CPU per call (this process, median run): {tp['cpu_per_call'] * 1000:.2f} ms — the "
        "calls of a wave return together and are handled one after the other on one event loop, so this cost, "
        "times the concurrency, is what each wave adds to the ideal; CPU contention inflates it.",
    ]
    if steps:
        lines += [
            "",
            f"Training steps: tiny Qwen2 on CPU, 32 rollouts of up to 32 tokens a step, two rewards (a fast verifier "
            f"and a {slow_reward_s:g} s reward, a `time.sleep` standing in for a reward model or rubric judge), judge "
            "concurrency 32 (one wave a step). Runs alternate over rounds; the first step of every run is not "
            "counted; other processes shared the CPUs, and their noise only adds time, so the fastest step is the "
            "cleanest comparison. *Blocking* is the main-thread time the trainer spent on the judge in a step (metric "
            "`judge/blocking_s`: marking, starting the calls, waiting, credit, audit) — the judge's cost to the step, "
            "measured directly and so immune to the machine noise that moves whole step times.",
            "",
            "| trainer | judge latency/call | steps timed | median step | fastest step | fastest − no-judge fastest "
            "| waited for judge | blocking | judge failures |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for result in steps:
            latency = "—" if result["latency"] is None else f"{result['latency'] * 1000:.0f} ms"
            wait = "—" if result["wait"] is None else f"{result['wait'] * 1000:.0f} ms"
            blocking = "—" if result["blocking"] is None else f"**{result['blocking'] * 1000:.0f} ms**"
            failures = "—" if result["failures"] is None else f"{result['failures']:.0%}"
            lines.append(
                f"| {result['name']} | {latency} | {result['steps_timed']} | {result['step']:.2f} s | "
                f"{result['best']:.2f} s | {result['overhead'] * 1000:+.0f} ms | {wait} | {blocking} | {failures} |"
            )
        lines += [
            "",
            "With the verdict from the verifier, the judge calls start right after generation and run while TRL "
            "computes log-probs and the slow reward; the step only waits for what is left of them (latency − time "
            'to score). With `judge_verdict_reward="total"` the calls start after every reward, so their whole '
            "latency adds to the step.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each training setup, alternating")
    parser.add_argument("--slow-reward", type=float, default=0.5, help="seconds the slow reward takes")
    parser.add_argument("--skip-training", action="store_true", help="only the throughput part")
    parser.add_argument("--no-write", action="store_true", help="print only; do not touch RESULTS.md")
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    import logging

    logging.basicConfig(level=logging.WARNING)
    with ChildServer() as server:
        tp = throughput(server.base_url, args.rollouts, args.concurrency, args.latency, args.repeats)
        steps = None
        if not args.skip_training:
            steps = step_overhead(server.base_url, args.steps, args.rounds, args.slow_reward, [args.latency, 1.0])
    argv = " ".join(sys.argv[1:])
    table = report(tp, steps, argv, args.slow_reward)
    print(table)
    if not args.no_write:
        from _results import write_section

        write_section("judge", table)


if __name__ == "__main__":
    main()
