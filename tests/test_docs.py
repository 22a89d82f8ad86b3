"""Every runnable code block of README.md and docs/*.md runs, so the docs cannot drift from the code.

How blocks are found and run (the engine is `tests/docs_blocks.py`; the same rule, for doc authors, is in
docs/index.md, "Docs are tested"):

- **Which blocks.** Fenced blocks (```` ``` ```` or ``~~~``) whose info string is ``python``/``py`` run as Python;
  ``bash``/``sh``/``shell``/``console`` blocks run in ``bash -euo pipefail``. Blocks with any other info string (none,
  ``text``, ``json``, ``yaml``: outputs, diagrams, fragments) are shown, never run.
- **Skipping.** A runnable block that must not run gets ``<!-- docs-test: skip (reason) -->`` on the line before its
  fence (blank lines allowed between). The reason is required: a marker without one fails
  `test_every_runnable_block_is_run_or_skipped_with_a_reason`, as does a marker on a block that is never run. A
  reason starting with ``pending:`` names a trl-ext bug that keeps the block from running. A shell block that runs
  ``pip install`` is skipped without a marker (the test never installs anything).
- **Pages are notebooks.** The blocks of one page run in order, in one namespace, in a process of their own (forked
  from a runner that imported torch, transformers and TRL once), in an empty working directory holding a link to
  ``recipes/``; a page stops at its first failing block.
- **Substitutions (Python blocks), the only changes to what a page says:**

  1. Names a block uses without defining them come from a preamble: ``model`` and ``policy`` (the tiny Qwen2 policy
     of `trl_ext.testing`, loaded from disk so that TRL finds its tokenizer), ``tokenizer``, ``dataset`` and
     ``sft_split`` (2 rows: ``prompt``, ``context``, ``answer``, ``solution``, ``evidence``), ``prompts`` (its
     prompts), ``long_document`` (a string), ``my_reward`` (a reward function) and ``lora_config`` (a small
     `peft.LoraConfig`). A name defined by an earlier block of the page wins.
  2. A string literal ``"org/name"`` that is not a file of the repository (no ``.yaml``/``.json``/... suffix, first
     part not a top-level folder) is a Hub id: it becomes the path of the saved tiny reward model when the name
     contains ``reward``, of the tiny policy otherwise.
  3. A string literal ``"http(s)://127.0.0.1|localhost|api.openai.com[:port]/v1"`` (a judge or teacher endpoint)
     becomes the base URL of a `ScriptedChatServer` answering ``{"spans": [], "explanation": ..., "precision": 7,
     "recall": 6}`` (a judge-credit verdict that also parses as a rubric verdict). ``OPENAI_API_KEY`` is set.
  4. Runs are kept tiny: every ``TrainingArguments`` (so every trainer config) gets ``max_steps=1`` when unset and
     at most 2, ``max_completion_length`` and ``max_turns`` at most 16 and 2; a literal ``max_new_tokens=N`` is
     lowered to 16.

  Shell blocks are run as written (``trl-ext`` and ``python`` are this interpreter's), offline (``HF_HUB_OFFLINE``).

The page runs are slow (a few seconds of training per page; all pages together take about 2 minutes on two cores)
and marked ``slow``; the checks of the blocks themselves are fast.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .docs_blocks import (
    INSTALL_REASON,
    PAGES,
    REPO,
    check_blocks,
    page_blocks,
    page_key,
    parse_blocks,
    substitute,
)

ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]
PAGES_TO_RUN = sorted({block.page for block in ALL_BLOCKS if block.runnable and block.skip is None})


# ----------------------------------------------------------------------------------------------------------------
# The engine: fences, markers, substitutions
# ----------------------------------------------------------------------------------------------------------------
SAMPLE = """# Page

```python
x = 1
```

   ```` ```repl ```` is inline code, not a fence.

<!-- docs-test: skip (GPU only) -->

```bash
nvidia-smi
```

<!-- docs-test: skip -->
```python
y = 2
```

```bash
python -m pip install -e ".[dev]"
```

~~~text
output
~~~

<!-- docs-test: skip (shown only) -->
```
a diagram
```
"""


def test_parse_blocks_reads_fences_markers_and_reasons():
    blocks = parse_blocks(SAMPLE, "page.md")
    assert [(block.line, block.lang, block.skip) for block in blocks] == [
        (3, "python", None),
        (11, "bash", "GPU only"),
        (16, "python", None),
        (20, "bash", INSTALL_REASON),
        (24, "text", None),
        (29, "", "shown only"),
    ]
    assert blocks[0].source == "x = 1\n" and blocks[1].source == "nvidia-smi\n"
    assert [block.marked for block in blocks] == [False, True, True, False, False, True]
    problems = check_blocks(blocks)
    assert problems == [
        "page.md:16: skip marker without a reason: write <!-- docs-test: skip (why) -->",
        "page.md:29: skip marker on a ``` block, which is never run: remove it",
    ]


def test_substitute_replaces_hub_ids_endpoints_and_generation_lengths():
    hub = {"policy": "/m/policy", "reward": "/m/reward"}
    source = (
        'Trainer("Qwen/Qwen3-4B", rm="Skywork/Skywork-Reward-Llama-3.1-8B-v0.2", recipe="recipes/grpo.yaml",\n'
        "        url='http://127.0.0.1:8000/v1', other=\"https://api.openai.com/v1\", max_new_tokens=512, n=4)\n"
    )
    assert substitute(source, hub, "http://127.0.0.1:5/v1") == (
        'Trainer("/m/policy", rm="/m/reward", recipe="recipes/grpo.yaml",\n'
        "        url='http://127.0.0.1:5/v1', other=\"http://127.0.0.1:5/v1\", max_new_tokens=16, n=4)\n"
    )


def test_every_runnable_block_is_run_or_skipped_with_a_reason():
    assert check_blocks(ALL_BLOCKS) == []
    runnable = [block for block in ALL_BLOCKS if block.runnable]
    to_run = [block for block in runnable if block.skip is None]
    skipped = [block for block in runnable if block.skip is not None]
    assert len(to_run) + len(skipped) == len(runnable)
    # Drift guard: the docs have ~30 blocks that run; a parser that stops finding them must not pass silently.
    assert len(to_run) >= 25, [block.where for block in to_run]
    assert all(block.skip.strip() for block in skipped)
    print(f"\ndocs blocks: {len(to_run)} run, {len(skipped)} skipped, {len(ALL_BLOCKS) - len(runnable)} not runnable")
    for block in skipped:
        print(f"  skip {block.where}: {block.skip}")


# ----------------------------------------------------------------------------------------------------------------
# Running the pages
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def page_results(request, tmp_path_factory) -> dict[str, dict]:
    """Run the selected pages once, in one runner process (see tests/docs_blocks.py), and read their results."""
    selected = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_docs_page_runs"
    ]
    results_dir = tmp_path_factory.mktemp("docs")
    subprocess.run(
        [sys.executable, "-m", "tests.docs_blocks", str(results_dir), *dict.fromkeys(selected)],
        cwd=REPO,
        check=True,
        timeout=900,
    )
    results = {}
    for page in selected:
        path = results_dir / f"{page_key(page)}.json"
        log = results_dir / f"{page_key(page)}.log"
        result = json.loads(path.read_text()) if path.exists() else {"failed": -1, "error": "no result written"}
        result["log"] = log.read_text()[-6000:] if log.exists() else ""
        results[page] = result
    return results


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_TO_RUN)
def test_docs_page_runs(page, page_results):
    result = page_results[page]
    blocks = [block for block in page_blocks(page) if block.runnable]
    expected_run = [block.line for block in blocks if block.skip is None]
    if result.get("failed") is not None:
        pytest.fail(
            f"{page}:{result['failed']}: this block failed (the fix belongs in the page, or in trl-ext):\n"
            f"{result['error']}\n----- the page's output (tail)\n{result['log']}",
            pytrace=False,
        )
    assert result["ran"] == expected_run
    assert [line for line, _ in result["skipped"]] == [block.line for block in blocks if block.skip is not None]
