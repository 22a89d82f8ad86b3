"""Shared pieces of the tests: a toy prompt dataset, a reward with spread, CPU-safe configs, process checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datasets import Dataset

PROMPTS = ["What is 2 + 3?", "Say hello.", "Count to five.", "Name a colour.", "What is 7 * 6?", "Say yes or no."]


def toy_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def digit_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of characters that are digits: varies between samples, so group advantages are non-zero."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def cpu_config_kwargs(output_dir: str, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


def saved_tiny_model(directory: Path, seed: int = 0) -> str:
    """Save the tiny model and tokenizer of ``seed`` (`trl_ext.testing`) into ``directory``; its path as a string,
    as a trainer takes a model name."""
    from trl_ext.testing import build_tiny_model_and_tokenizer

    model, tokenizer = build_tiny_model_and_tokenizer(seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def process_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return "\nState:\tZ" not in handle.read()
    except FileNotFoundError:
        return False


def run_processes(script: str, out_dir: Path, nproc: int = 2, timeout: int = 300) -> None:
    """Run ``tests/scripts/<script> OUT_DIR`` under ``torchrun --nproc_per_node nproc``; fail with its output."""
    path = Path(__file__).parent / "scripts" / script
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    with socket.socket() as probe:  # a free rendezvous port: never a port an earlier run's processes still hold
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
    ]
    result = subprocess.run(
        [*launcher, str(path), str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def end_distributed_script() -> None:
    """End a script run under ``torchrun`` once its results are written: wait for every rank, then leave without
    running destructors (``os._exit(0)``).

    Left to interpreter exit, the DDP reducer that a trainer holds is freed in the main thread, which holds the GIL
    while its gloo process group joins its worker thread; that thread may still be freeing a finished collective's
    tensors, which needs the GIL: a deadlock (one rank hung until a test's timeout; py-spy showed
    ``~ProcessGroupGloo`` joining a thread waiting in ``gil_scoped_acquire``). Tearing gloo down at exit can also
    abort the process (SIGABRT)."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def generator_rollout_func(generator: Any, prompt_ids: Callable[[Any], list[int]]) -> Callable:
    """TRL's ``rollout_func`` sampling from a `trl_ext.rlm.Generator`: each prompt rendered by ``prompt_ids`` (pass
    the asynchronous worker's rendering, so both trainers see the very same tokens), the generator's completions and
    log-probs as they are."""

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list]:
        ids = [prompt_ids(prompt) for prompt in prompts]
        completions = generator.generate(ids)
        return {
            "prompt_ids": ids,
            "completion_ids": [list(c.token_ids) for c in completions],
            "logprobs": [list(c.logprobs) for c in completions],
        }

    return rollout
