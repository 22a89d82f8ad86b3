"""A real `vllm serve` for the `vllm` test group, the tiny model it serves, and the group's marks.

`start_vllm_server` runs the `vllm` command of the current interpreter's environment (``.venv-vllm`` in CI) in its own
process group on a free 127.0.0.1 port, writes its log to a file, waits for ``/health`` and returns a `VLLMServer`;
`VLLMServer.stop` kills the whole process group (the API server and its engine-core child). When the server does not
come up, the error names the cause and ends with the tail of its log. `save_chat_model` saves the tiny test model
with TRL's qwen2_5 chat template, which TRL's asynchronous rollout worker needs (its response schema).
`VLLMServer.clear_lora_adapters` gives a server back in the state a new trainer expects, so that one server can serve
one trainer after another (`tests/conftest.py`'s `vllm_server` fixture). `VLLM_TEST_MARKS` is every vLLM test
module's ``pytestmark``.

The flags are those TRL's `AsyncGRPOTrainer` needs with LoRA sync over HTTP on vLLM's CPU build: runtime LoRA
loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), ``/pause`` and ``/server_info`` (``VLLM_SERVER_DEV_MODE``),
``--enable-lora`` with room for ``max_staleness + 2`` adapters (``--max-loras``), float32 weights (so the server's
log-probs can be compared with the trainer's tightly) and a fixed 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``: no
start-up check of the machine's free memory, as in ``tests/test_vllm.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest

VLLM_TEST_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup_vllm_cpu.sh)"
    ),
]
KV_CACHE_GIB = "1"  # plenty for the tiny model (256 bytes of KV cache per token)
LOG_TAIL_CHARS = 4000


def save_chat_model(directory: str | os.PathLike[str], seed: int = 0, **config_overrides: Any) -> Path:
    """Save the tiny vLLM-compatible model (`trl_ext.testing`) with TRL's qwen2_5 chat template; returns the directory.

    TRL's asynchronous rollout worker recognises a chat template by its text (`trl.chat_template_utils`) to parse
    responses; the tiny tokenizer's own ChatML template is not one it knows. `config_overrides` go to the model's
    config (`build_tiny_model_and_tokenizer`), e.g. ``tie_word_embeddings=False`` for an LM head of its own.
    """
    from trl_ext.testing import build_tiny_model_and_tokenizer, save_tiny_model

    model, tokenizer = build_tiny_model_and_tokenizer(seed, vllm=True, **config_overrides)
    tokenizer.chat_template = (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return save_tiny_model(model, tokenizer, directory)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process could still take it before the server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of a log file ('' when it does not exist)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


@dataclass
class VLLMServer:
    """A running `vllm serve`: its base URL, the name it serves the base model under, its log and its process."""

    url: str
    model: str
    log_path: Path
    process: subprocess.Popen

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict, timeout: float = 120.0) -> str:
        """POST `body` as JSON to `path`; returns the reply's text (some vLLM endpoints answer in plain text)."""
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError as error:  # vLLM's reply names the problem: keep it in the error
            raise RuntimeError(
                f"POST {path} failed with {error.code}: {error.read().decode(errors='replace')}"
            ) from error

    def post_json(self, path: str, body: dict, timeout: float = 120.0) -> Any:
        return json.loads(self.post(path, body, timeout))

    def served_models(self) -> list[str]:
        """The names ``/v1/models`` lists: the base model and every LoRA adapter loaded now."""
        return [entry["id"] for entry in self.get_json("/v1/models")["data"]]

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded now: every name ``/v1/models`` lists but the base model's."""
        return [name for name in self.served_models() if name != self.model]

    def is_paused(self) -> bool:
        """Whether generation is paused (``/pause``, which TRL's weight sync calls; dev mode's ``/is_paused``)."""
        return self.get_json("/is_paused")["is_paused"]

    def clear_lora_adapters(self) -> None:
        """Unload every LoRA adapter and resume generation, then check that both took.

        A trainer publishes its adapters as ``trl-policy-v1``, ``trl-policy-v2``, ... in every run, and vLLM refuses
        to load a name it holds: one server serves a second trainer only once the first one's adapters are gone. A
        run that ended during a weight sync can leave the server paused. Raises `RuntimeError` naming what is left.
        """
        for name in self.lora_adapters():
            self.post("/v1/unload_lora_adapter", {"lora_name": name})
        if self.is_paused():
            self.post("/resume", {})
        left, paused = self.lora_adapters(), self.is_paused()
        if left or paused:
            raise RuntimeError(
                f"The vLLM server at {self.url} still holds the LoRA adapters {left} (paused: {paused}) after "
                f"unloading them all and resuming it; its log: {self.log_path}"
            )

    def prompt_logprobs(self, model: str, token_ids: list[int]) -> list[float]:
        """Log-probability of each token of `token_ids` after the ones before it, under `model` (base or adapter).

        Returns ``len(token_ids) - 1`` floats: the first token has no context. vLLM's completions endpoint scores the
        prompt with ``prompt_logprobs=0`` (the prompt's own token at each position, nothing more) and generates one
        token, which is ignored. The log-probs are vLLM's raw ones (log-softmax of the logits, no temperature).
        """
        reply = self.post_json(
            "/v1/completions",
            {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
        )
        positions = reply["choices"][0]["prompt_logprobs"]
        if len(positions) != len(token_ids) or positions[0] is not None:
            raise RuntimeError(f"vLLM returned {len(positions)} prompt log-probs for {len(token_ids)} tokens: {reply}")
        return [entry[str(token)]["logprob"] for token, entry in zip(token_ids[1:], positions[1:], strict=True)]

    def stop(self) -> None:
        """Kill the server's process group (its engine-core child too) and wait for it."""
        if self.process.poll() is None:
            stop_process_group(self.process)


def stop_process_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group `process` leads, then SIGKILL it if it has not exited after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # the whole group has exited already
            return
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # children the leader left behind (the engine core) get the same end
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def vllm_command() -> Path:
    """The `vllm` command installed beside the current interpreter; an error names the fix when it is missing."""
    command = Path(sys.executable).parent / "vllm"
    if not command.exists():
        raise FileNotFoundError(
            f"No `vllm` command beside {sys.executable}: run this test with the vLLM environment's interpreter "
            "(`.venv-vllm/bin/python -m pytest -m vllm`, made by scripts/setup_vllm_cpu.sh)."
        )
    return command


def start_vllm_server(
    model_dir: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    *,
    max_loras: int = 4,
    max_lora_rank: int = 16,
    max_model_len: int = 512,
    timeout_s: float = 240.0,
) -> VLLMServer:
    """Start `vllm serve` on `model_dir` and wait until ``/health`` answers; the caller stops it (`VLLMServer.stop`).

    The base model is served under its directory's path (``--served-model-name``), the name TRL's trainers request
    (the model config's ``name_or_path``). Raises `RuntimeError` with the log's tail when the server exits during
    start-up or is not healthy after `timeout_s` seconds (then it is killed first).
    """
    model = str(model_dir)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        str(vllm_command()),
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-loras",
        str(max_loras),
        "--enforce-eager",
    ]
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /server_info
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log_path.parent
        )
    server = VLLMServer(url=f"http://127.0.0.1:{port}", model=model, log_path=log_path, process=process)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            stop_process_group(process)
            raise RuntimeError(
                f"`vllm serve` exited with code {process.returncode} during start-up (command: {' '.join(command)}). "
                f"The end of its log ({log_path}):\n{log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            stop_process_group(process)
            raise RuntimeError(
                f"`vllm serve` did not answer /health within {timeout_s:.0f} s (command: {' '.join(command)}); "
                f"raise the timeout on a slow machine. The end of its log ({log_path}):\n{log_tail(log_path)}"
            )
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------------------------
# What the async method tests against the shared server have in common
# ----------------------------------------------------------------------------------------------------------------
def served_run_settings(server: VLLMServer, max_steps: int, max_staleness: int) -> dict[str, Any]:
    """Config fields of a short asynchronous LoRA run against ``server``: IPO, 4 samples a micro-batch, a bounded
    queue, the CPU, a log line per step, no checkpoints."""
    return dict(
        loss_type="ipo",
        max_steps=max_steps,
        max_staleness=max_staleness,
        per_device_train_batch_size=4,
        token_budget=0,
        queue_maxsize=16,
        learning_rate=1e-2,
        vllm_server_base_url=server.url,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )


def count_prompts() -> Any:
    """The 8 prompts the async method tests train on."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"count to {i}" for i in range(8)]})


def tiny_lora() -> Any:
    """The adapter the async method tests train (rank 8 on the attention's q and v)."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def trained_on_synced_adapters(trainer: Any, server: VLLMServer, max_steps: int) -> list[dict[str, Any]]:
    """Assert ``trainer`` ran ``max_steps`` steps whose worker asked the server for synced adapters (v1 is the sync
    before step 1) and that the server holds the last one; returns the steps' log entries."""
    generator = trainer.rollout_worker.generator
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == max_steps and len(history) == max_steps
    assert generator.lora_name == "trl-policy" and max(generator.versions_used) >= 1
    assert f"trl-policy-v{trainer.model_version}" in server.served_models()
    return history


def worker_metric(history: list[dict[str, Any]], name: str) -> list[float]:
    """The values of a rollout worker's metric ``name`` over the logged steps: a worker pushes its metrics once a
    run, and a run need not end within every step (the staleness gate may hold the next one), so a step's log can
    lack them. Asserts that some step logged it."""
    values = [entry[name] for entry in history if name in entry]
    assert values, f"no logged step has the worker metric {name!r}"
    return values
