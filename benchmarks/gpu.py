"""GPU figures for every trainer: training step time, tokens/s, peak GPU memory and MFU of trl-ext's trainers next
to TRL's, on a Qwen3-0.6B-shaped model (random weights, bf16), with SDPA and FlexAttention.

    python benchmarks/gpu.py [--budget-s 420] [--json gpu.json]   # a CUDA GPU; writes RESULTS.md's GPU section
    python benchmarks/gpu.py --smoke    # tiny sizes on any device, under a minute on 2 CPU cores (CI runs it)

On one H200 (2026-12-04) the SDPA arms and the first FlexAttention arm took 382 s with ``--budget-s 330``, the
FlexAttention arm's warm-up (its compile) 82 s of it; the four FlexAttention arms left were skipped by the budget, so
the whole run needs about 10 minutes. ``--budget-s`` starts no arm after that many seconds, so a cut run still
reports the arms that ran.

Arms, all in one process, one after the other (the table lists them in this order):

- **GRPO** on long shared prompts (one prompt a step, G = 8 completions; 2,048-token prompt, 256-token completions):
  `trl.GRPOTrainer(loss_type="dapo")` on TRL's rows, `ExtGRPOTrainer(loss_type="ipo")` on the same rows
  (``prefix_sharing="off"``) and packed (``"on"``: the prompt once, the 8 completions as branches), each with
  ``attn_implementation="sdpa"`` (packed rows: a dense mask) and ``"flex_attention"`` (packed rows: a block mask);
- **judge credit**: `JudgeCreditTrainer` (ipo, packed, SDPA) with a scripted judge on 127.0.0.1 that marks every
  segment of every completion, against the `ExtGRPOTrainer` arm of the same settings;
- **stepwise RLM**: `StepwiseRLMTrainer` on scripted RLM trees (`trl_ext.testing.RLM_SCRIPT`'s depth-2
  trees, code actions lengthened; a real REPL runs them): packed, unpacked, and the same trees as one flattened
  row per node (benchmarks/stepwise.py's `FlatRows`), each in full fine-tuning and with LoRA (r = 16, all linear),
  with SDPA; packed and unpacked again with FlexAttention.

Completions are scripted (a ``rollout_func`` of random token ids; the trees' actions), so generation costs nothing
and every arm of a workload trains on the same rows. **Training time** is the optimizer step minus generation and
scoring (rollouts, rewards, judge calls, row building), synchronised with the GPU; the first steps of each arm are
a warm-up (FlexAttention compiles there). MFU = the transformer body's FLOPs (6N per token of a forward with
gradients, 4N with LoRA's frozen base, 2N without gradients; N = parameters outside the embedding and the LM
head) over the training time at the GPU's dense bf16 peak: attention and the LM head are left out, so it is a
lower bound. One arm failing is recorded in the table and the others still run; the JSON is written after each
arm (``--render`` turns a saved JSON into the table). How to run it on a GPU machine without internet:
docs/scaling.md, "Measuring on your GPU".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL-experimental
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402
from _gpu_arms import (  # noqa: E402
    ARMS,
    FULL,
    RATIOS,
    SMOKE,
    Arm,
    Sizes,
    build_model,
    every_segment_judge,
    make_trainer,
)
from _results import write_section  # noqa: E402
from _timing import GenerationTimer, StepTimer  # noqa: E402

# Dense bf16 peak (TFLOP/s) by the vendors' datasheets, for MFU; other GPUs: --peak-tflops.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


# ----------------------------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------------------------
class TokenCounter:
    """A forward pre-hook on the decoder: tokens of forwards with and without gradients (padding left out)."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.grad_tokens = self.nograd_tokens = 0
        self.handle = decoder.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.numel()
        if torch.is_grad_enabled():
            self.grad_tokens += tokens
        else:
            self.nograd_tokens += tokens


class LossTokens:
    """Trainer mixin: counts the tokens each loss trains on (completion mask x tool mask)."""

    loss_tokens = 0

    def _compute_loss(self, model, inputs):
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        self.loss_tokens += int(mask.sum())
        return super()._compute_loss(model, inputs)


class Snapshots(StepTimer):
    """`StepTimer` that synchronises with the GPU and keeps, per step, the counters of the trainer and the hook."""

    def __init__(self, counter: TokenCounter, synchronize) -> None:
        super().__init__()
        self.counter, self.synchronize, self.counts = counter, synchronize, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.synchronize()
        self.begin = (self.counter.grad_tokens, self.counter.nograd_tokens, self.trainer.loss_tokens)
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        self.synchronize()
        super().on_step_end(args, state, control, **kwargs)
        end = (self.counter.grad_tokens, self.counter.nograd_tokens, self.trainer.loss_tokens)
        self.counts.append([after - before for after, before in zip(end, self.begin)])


def body_parameters(model) -> int:
    """N of the MFU: the decoder's parameters less the token embedding (the LM head is tied to it)."""
    decoder = model.get_decoder()
    return sum(p.numel() for name, p in decoder.named_parameters() if "embed_tokens" not in name)


def run_arm(arm: Arm, sizes: Sizes, device: str, judge_url: str, body: int, peak_tflops: float | None) -> dict:
    """Train one arm; its measurements (medians over the timed steps) or the reason it did not run. ``body``: the
    model's body parameters (`body_parameters`), the N of the MFU."""
    from trl_ext.testing import build_tiny_tokenizer

    if arm.attention == "flex_attention" and device == "cpu":
        return {"status": "skipped", "reason": f"FlexAttention has no backward on the CPU (torch {torch.__version__})"}
    cuda = device.startswith("cuda")
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start_memory = torch.cuda.memory_allocated() if cuda else 0  # what earlier arms left behind (should be ~0)
    model = build_model(sizes, arm.attention, device, torch.bfloat16 if cuda else torch.float32)
    counter = TokenCounter(model.get_decoder())
    timer = Snapshots(counter, synchronize)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(
            arm,
            sizes,
            model,
            build_tiny_tokenizer(),
            output_dir,
            device,
            judge_url,
            mixins=(GenerationTimer, LossTokens),
            callbacks=[timer],
        )
        timer.trainer = trainer
        trainer.train()
        logs = trainer.state.log_history
    warm = sizes.warmup_steps
    training, steps, counts = timer.training_times[warm:], timer.times[warm:], timer.counts[warm:]
    grad_tokens, nograd_tokens, loss_tokens = (statistics.median(column) for column in zip(*counts))
    train_s = statistics.median(training)
    flops = (4 if arm.lora else 6) * body * grad_tokens + 2 * body * nograd_tokens
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = {
        "status": "ok",
        "train_ms": 1000 * train_s,
        "train_ms_range": [1000 * min(training), 1000 * max(training)],
        "step_ms": 1000 * statistics.median(steps),
        "steps_timed": len(training),
        "forward_tokens": grad_tokens,
        "nograd_tokens": nograd_tokens,
        "loss_tokens": loss_tokens,
        "tokens_per_s": grad_tokens / train_s,
        "loss_tokens_per_s": loss_tokens / train_s,
        "tflops": flops / train_s / 1e12,
        "mfu": flops / train_s / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() - start_memory) / 2**30 if cuda else None,
        "start_memory_gib": start_memory / 2**30,
        "trainable_params": trainable,
        "losses": [entry["loss"] for entry in logs if "loss" in entry],
        "entropies": [entry["entropy"] for entry in logs if "entropy" in entry],
        "judge_spans": [entry["judge/spans_per_rollout"] for entry in logs if "judge/spans_per_rollout" in entry],
    }
    counter.handle.remove()
    return result


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def ratios(results: dict[str, dict]) -> list[tuple[str, float, float]]:
    """``(label, training-time ratio, whole-step ratio)`` of each of RATIOS whose two arms both ran."""
    found = []
    for label, numerator, denominator in RATIOS:
        a, b = results.get(numerator, {}), results.get(denominator, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            found.append((label, a["train_ms"] / b["train_ms"], a["step_ms"] / b["step_ms"]))
    return found


def render(report: dict) -> str:
    """The RESULTS.md section of a report (``main``'s JSON)."""
    meta, results = report["meta"], report["results"]

    def cell(value, pattern: str) -> str:
        return "—" if value is None else format(value, pattern)

    lines = [
        "| arm | attention | median training ms/step (range) | whole step ms | forward tokens/step | forward tokens/s "
        "| trained tokens/s | peak GPU memory GiB | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        attention = {"flex_attention": "flex"}.get(r["attention"], r["attention"])
        if r["status"] != "ok":
            lines.append(f"| {name} | {attention} | {r['status']}: {r['reason']} | | | | | | | |")
            continue
        low, high = r["train_ms_range"]
        lines.append(
            f"| {name} | {attention} | {r['train_ms']:.0f} ({low:.0f}–{high:.0f}) | {r['step_ms']:.0f} | "
            f"{r['forward_tokens']:,.0f} | {r['tokens_per_s']:,.0f} | {r['loss_tokens_per_s']:,.0f} | "
            f"{cell(r['peak_memory_gib'], '.1f')} | {r['tflops']:.1f} | {cell(r['mfu'], '.1%')} |"
        )
    ratio_lines = [f"- {label}: **{train:.2f}** (whole step {step:.2f})" for label, train, step in ratios(results)]
    sizes = meta["sizes"]
    return "\n".join(
        [
            f"## GPU figures: every trainer on a {meta['model_label']}",
            "",
            f"`{meta['command']}` on **{meta['device_name']}** ({meta['versions']}, {meta['date']}, "
            f"{meta['wall_s']:.0f} s in all). Random weights in {meta['dtype']}, TRL's defaults otherwise "
            "(gradient checkpointing on, AdamW); learning rate 1e-6. GRPO arms: one prompt of "
            f"{sizes['prompt_tokens']:,} tokens a step, G = {sizes['group']} scripted completions of "
            f"{sizes['completion_tokens']} tokens. Stepwise arms: {4 * sizes['roots_per_micro_batch']} scripted RLM "
            "trees a step in 4 micro-batches (4 rollouts a prompt; the prompts alternate a 6-node tree of 14 turns "
            f"and a 1-node tree of 2), code actions lengthened by {sizes['action_pad_words']} words. Training "
            "time = the step minus generation and scoring, synchronised with the GPU; "
            f"{sizes['warmup_steps']} warm-up steps, medians over {sizes['timed_steps']} timed steps. Forward "
            "tokens: non-padding tokens of the forwards with gradients (packed: the shared prefix once); "
            "trained tokens: the tokens the loss trains on. MFU counts 6N FLOPs per forward token (4N with LoRA), N = "
            f"{meta['body_params'] / 1e6:.0f}M body parameters; attention and the LM head are left out (a lower "
            "bound); the peak is "
            f"{cell(meta['peak_tflops'], '.0f')} TFLOP/s dense bf16.",
            "",
            *lines,
            "",
            "Ratios of the training time (and of the whole step, generation and scoring included):",
            "",
            *ratio_lines,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device); never writes RESULTS.md")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--only", default=None, help="comma-separated arm names (default: all)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no arm after this many seconds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    parser.add_argument("--json", default=None, help="write the raw results here (after every arm)")
    parser.add_argument("--render", default=None, help="print and write RESULTS.md's section of a saved JSON")
    args = parser.parse_args()
    if args.render:
        section = render(json.loads(Path(args.render).read_text()))
        print(section)
        write_section("gpu", section)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and not device.startswith("cuda"):
        sys.exit("benchmarks/gpu.py at full size needs a CUDA GPU; --smoke runs the tiny sizes anywhere.")
    sizes = SMOKE if args.smoke else FULL
    arms = ARMS
    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = sorted(set(wanted) - {arm.name for arm in ARMS})
        if unknown:
            sys.exit(f"--only: unknown arm(s) {unknown}; the arms are {[arm.name for arm in ARMS]}.")
        arms = [arm for arm in ARMS if arm.name in wanted]
    section = render(run(arms, sizes, device, args))
    print(section)
    if not args.smoke:
        write_section("gpu", section)


def run(arms: list[Arm], sizes: Sizes, device: str, args: argparse.Namespace) -> dict:
    """Run ``arms`` one after the other; the report (``--json`` is rewritten after every arm)."""
    import platform
    from datetime import date

    import transformers
    import trl

    from trl_ext.quickstart.scripted_server import ScriptedChatServer

    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)
    body = body_parameters(build_model(sizes, "sdpa", "meta", torch.bfloat16))  # no memory, no time
    layers = sizes.model["num_hidden_layers"]
    report = {
        "meta": {
            "command": "python benchmarks/gpu.py" + (" --smoke" if args.smoke else ""),
            "device_name": device_name,
            "model_label": f"Qwen3-shaped model ({'0.6B' if not args.smoke else 'tiny'}: hidden "
            f"{sizes.model['hidden_size']}, {layers} layers, vocabulary {sizes.model['vocab_size']:,})",
            "versions": f"{platform.machine()}, torch {torch.__version__}"
            + (f", CUDA {torch.version.cuda}" if device.startswith("cuda") else "")
            + f", transformers {transformers.__version__}, trl {trl.__version__}",
            "date": str(date.today()),
            "dtype": "bf16" if device.startswith("cuda") else "float32",
            "peak_tflops": peak,
            "body_params": body,
            "sizes": {k: v for k, v in asdict(sizes).items() if k != "model"},
            "wall_s": 0.0,
        },
        "results": {},
    }
    began = time.perf_counter()
    with ScriptedChatServer(every_segment_judge) as judge:
        for arm in arms:
            elapsed = time.perf_counter() - began
            if args.budget_s is not None and elapsed > args.budget_s:
                result = {"status": "skipped", "reason": f"time budget ({args.budget_s:.0f} s) spent"}
            else:
                print(f"[{elapsed:5.0f} s] {arm.name}", file=sys.stderr, flush=True)
                try:
                    result = run_arm(arm, sizes, device, judge.base_url, body, peak)
                except Exception as error:  # one arm's failure is a row of the table; the others still run
                    traceback.print_exc()
                    result = {"status": "failed", "reason": f"{type(error).__name__}: {str(error)[:200]}"}
                gc.collect()  # the arm's trainer, model and optimizer (they hold reference cycles)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            report["results"][arm.name] = {**asdict(arm), **result}
            report["meta"]["wall_s"] = time.perf_counter() - began
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
