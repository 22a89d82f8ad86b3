"""Write one benchmark's table into benchmarks/RESULTS.md, between its own markers, keeping the others."""

from __future__ import annotations

import platform
import re
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = (
    "# Benchmark results\n\nEach section is written by the benchmark named in it; rerun it to refresh the numbers.\n"
)


def machine(threads: bool = True) -> str:
    """The machine line of a section; ``threads=False`` for benchmarks whose runs set their own thread counts."""
    count = f"{torch.get_num_threads()} torch threads, " if threads else ""
    return f"{platform.machine()}, {count}torch {torch.__version__}, {date.today()}"


def write_section(name: str, body: str) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def quiet_run(threads: int) -> None:
    """A benchmark process's set-up: offline, ``threads`` torch threads, no tokenizer worker threads, no progress bars
    or info logs of transformers and datasets."""
    import os

    import datasets
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
