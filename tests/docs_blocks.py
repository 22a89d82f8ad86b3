"""Extract the code blocks of README.md and docs/*.md and run them (the engine of tests/test_docs.py).

The rule a doc author needs is in the docstring of tests/test_docs.py and in docs/index.md ("Docs are tested").
This module is also the runner: ``python -m tests.docs_blocks RESULTS_DIR PAGE...`` imports the heavy libraries once,
builds the tiny models, then runs each page in a forked child process of its own (a fresh process per page, without
paying the ~6 s of imports each time) and writes ``RESULTS_DIR/<page>.json`` and ``RESULTS_DIR/<page>.log``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(f"docs/{path.name}" for path in (REPO / "docs").glob("*.md")))

PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")
RUNNABLE = PYTHON + SHELL  # every other info string (none, text, json, yaml, ...) is shown, never run

SKIP_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\b(?P<rest>.*?)-->\s*$")
SKIP_REASON = re.compile(r"^\s*\((?P<reason>.*\S.*)\)\s*$")
# A shell block that installs packages is never run: it is skipped with this reason even when unmarked.
INSTALLS = re.compile(r"(^|[\s;&|])(pip|pip3|python3? -m pip) install\b", re.MULTILINE)
INSTALL_REASON = "installs packages (automatic: a shell block with `pip install` is never run)"

# Substitutions (Python blocks only).
HUB_ID = re.compile(r"""(?P<quote>["'])(?P<id>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9])(?P=quote)""")
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".png", ".py", ".md", ".txt", ".csv", ".parquet")
ENDPOINT = re.compile(
    r"""(?P<quote>["'])(?P<url>https?://(?:127\.0\.0\.1|localhost|api\.openai\.com)(?::\d+)?/v1)(?P=quote)"""
)
MAX_NEW_TOKENS = re.compile(r"\bmax_new_tokens=(?P<value>\d+)")
CAPS = {"max_steps": 2, "max_steps_unset": 1, "max_completion_length": 16, "max_new_tokens": 16, "max_turns": 2}
PAGE_TIMEOUT_S = 240


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    skip: str | None = None  # the reason, when the block is not run
    marked: bool = False  # a skip marker precedes the fence (with or without a reason)

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_blocks(text: str, page: str) -> list[Block]:
    """Fenced code blocks (``` or ~~~, CommonMark rules), each with the skip marker of the line above it, if any.

    A marker is ``<!-- docs-test: skip (reason) -->`` on the last non-blank line before the fence. A marker with no
    reason gives a block with ``marked=True`` and ``skip=None``, which `check_blocks` reports.
    """
    lines = text.split("\n")
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = re.match(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$", lines[index])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            body.append(lines[end][indent:] if lines[end][:indent].strip() == "" else lines[end].lstrip())
            end += 1
        previous = index - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        marker = SKIP_MARKER.match(lines[previous]) if previous >= 0 else None
        lang = (opening["info"].split() or [""])[0].lower()
        block = Block(page, index + 1, lang, "\n".join(body) + "\n")
        if marker is not None:
            block.marked = True
            reason = SKIP_REASON.match(marker["rest"])
            block.skip = reason["reason"].strip() if reason else None
        elif lang in SHELL and INSTALLS.search(block.source):
            block.skip = INSTALL_REASON
        blocks.append(block)
        index = end + 1
    return blocks


def page_blocks(page: str) -> list[Block]:
    return parse_blocks((REPO / page).read_text(encoding="utf-8"), page)


def check_blocks(blocks: Iterable[Block]) -> list[str]:
    """The problems that make the docs test fail before anything runs: a skip marker without a reason, or on a block
    that is never run anyway."""
    problems = []
    for block in blocks:
        if block.marked and block.skip is None:
            problems.append(f"{block.where}: skip marker without a reason: write <!-- docs-test: skip (why) -->")
        if block.marked and not block.runnable:
            problems.append(f"{block.where}: skip marker on a ```{block.lang} block, which is never run: remove it")
    return problems


def substitute(source: str, hub: dict[str, str], endpoint: str) -> str:
    """The textual substitutions of a Python block: Hub ids, judge/teacher endpoints, generation lengths."""

    def hub_id(match: re.Match) -> str:
        name = match["id"]
        if name.lower().endswith(FILE_SUFFIXES) or (REPO / name.split("/")[0]).exists():
            return match[0]  # a file of the repository (recipes/...), not a Hub id
        path = hub["reward"] if "reward" in name.lower() else hub["policy"]
        return f"{match['quote']}{path}{match['quote']}"

    source = HUB_ID.sub(hub_id, source)
    source = ENDPOINT.sub(lambda match: f"{match['quote']}{endpoint}{match['quote']}", source)
    cap = CAPS["max_new_tokens"]
    return MAX_NEW_TOKENS.sub(lambda match: f"max_new_tokens={min(int(match['value']), cap)}", source)


# ------------------------------------------------------------------------------------------------ the runner
def _cap_training_arguments() -> None:
    """Every `TrainingArguments` (every trainer config) runs at most 2 steps (1 when unset), completions of <= 16
    tokens: the only change to what a block asks for beyond the names and Hub ids."""
    from transformers import TrainingArguments

    original = TrainingArguments.__post_init__

    def __post_init__(self):  # noqa: N807 - the dataclass hook
        self.max_steps = (
            CAPS["max_steps_unset"] if self.max_steps in (-1, None) else min(self.max_steps, CAPS["max_steps"])
        )
        for name in ("max_completion_length", "max_turns"):  # max_turns: the RLM trainers' configs
            if getattr(self, name, None) is not None:
                setattr(self, name, min(getattr(self, name), CAPS[name]))
        original(self)

    TrainingArguments.__post_init__ = __post_init__


def scripted_endpoint_reply(request: dict) -> str:
    """What every judge/teacher endpoint of the docs answers: a judge-credit verdict with no spans, which also
    parses as a rubric verdict (a teacher gets it as a plain text action)."""
    return json.dumps({"spans": [], "explanation": "scripted", "precision": 7, "recall": 6})


def _preamble(hub: dict[str, str]) -> dict:
    """The names a docs block may use without defining them (see tests/test_docs.py)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    set_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hub["policy"])  # _name_or_path set: TRL finds its tokenizer
    tokenizer = AutoTokenizer.from_pretrained(hub["policy"])
    context = "Notes. The cat sat on the mat. The dog slept."
    dataset = Dataset.from_dict(
        {
            "prompt": ["Quote the sentence about the cat.", "What is 2 + 3?"],
            "context": [context, "2 + 3 = 5"],
            "answer": ["The cat sat on the mat.", "5"],
            "solution": ["The cat sat on the mat.", "5"],
            "evidence": ['["The cat sat on the mat."]', '["2 + 3 = 5"]'],
        }
    )

    def my_reward(completions, **kwargs):
        return [len(set(str(completion))) / 10 for completion in completions]

    return {
        "__name__": "__main__",
        "model": model,
        "policy": model,
        "tokenizer": tokenizer,
        "dataset": dataset,
        "sft_split": dataset,
        "prompts": list(dataset["prompt"]),
        "long_document": context * 20,
        "my_reward": my_reward,
        "lora_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }


def _run_page(page: str, hub: dict[str, str], workdir: Path) -> dict:
    import subprocess

    from trl_ext.quickstart.scripted_server import ScriptedChatServer

    blocks = [block for block in page_blocks(page) if block.runnable]
    result = {"page": page, "ran": [], "skipped": [], "failed": None, "error": None}
    os.chdir(workdir)
    (workdir / "recipes").symlink_to(REPO / "recipes")
    with ScriptedChatServer(scripted_endpoint_reply, model="docs-test") as server:
        namespace = _preamble(hub)
        for block in blocks:
            if block.skip is not None:
                result["skipped"].append([block.line, block.skip])
                continue
            print(f"\n===== docs-test: {block.where} ({block.lang})", flush=True)
            try:
                if block.lang in PYTHON:
                    source = substitute(block.source, hub, server.base_url)
                    # padded so that tracebacks give the line of the Markdown file
                    exec(compile("\n" * block.line + source, str(REPO / page), "exec"), namespace)
                else:
                    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
                    subprocess.run(["bash", "-euo", "pipefail", "-c", block.source], check=True, env=env, timeout=120)
            except BaseException:  # noqa: B036 - SystemExit of a CLI included: the block failed
                result["failed"] = block.line
                result["error"] = traceback.format_exc()
                print(result["error"], flush=True)
                break
            result["ran"].append(block.line)
    return result


def page_key(page: str) -> str:
    return page.replace("/", "__")


def main(argv: list[str]) -> int:
    results_dir, pages = Path(argv[0]), argv[1:]
    results_dir.mkdir(parents=True, exist_ok=True)
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "TOKENIZERS_PARALLELISM": "false",
        "OPENAI_API_KEY": "docs-test",  # read by the blocks that name api_key_env="OPENAI_API_KEY"
        "PYTHONHASHSEED": "0",
    }.items():
        os.environ[name] = value
    # Imported once here; every page's child process inherits them.
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch
    import trl  # noqa: F401

    from trl_ext import testing
    from trl_ext.trainers import JudgeCreditTrainer, RLMTTrainer, StepwiseRLMTrainer  # noqa: F401

    # One thread, set before any torch op: the forked pages then never inherit a running OpenMP pool, and runs are
    # deterministic.
    torch.set_num_threads(1)
    _cap_training_arguments()
    hub_dir = results_dir / "hub"
    policy, tokenizer = testing.build_tiny_model_and_tokenizer(seed=0)
    reward, reward_tokenizer = testing.build_tiny_reward_model(seed=0)
    hub = {
        "policy": str(testing.save_tiny_model(policy, tokenizer, hub_dir / "policy")),
        "reward": str(testing.save_tiny_model(reward, reward_tokenizer, hub_dir / "reward")),
    }
    for page in pages:
        key = page_key(page)
        workdir = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=results_dir))
        log = results_dir / f"{key}.log"
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the page's own process
            code = 0
            try:
                os.setsid()
                with open(log, "w") as stream:
                    os.dup2(stream.fileno(), 1)
                    os.dup2(stream.fileno(), 2)
                result = _run_page(page, hub, workdir)
                (results_dir / f"{key}.json").write_text(json.dumps(result))
            except BaseException:  # noqa: B036
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - started > PAGE_TIMEOUT_S:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                (results_dir / f"{key}.json").write_text(
                    json.dumps({"page": page, "failed": -1, "error": f"timed out after {PAGE_TIMEOUT_S} s"})
                )
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        print(f"{page}: {elapsed:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
