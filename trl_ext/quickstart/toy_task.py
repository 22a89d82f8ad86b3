"""The quickstart's built-in toy task: look one key up in a few ``key=value`` pairs, inside the RLM scaffold.

An example is a context (the REPL variable ``context``)::

    c=41 a=73 f=13 b=90
    key: f

the task ``"Give the value of the key named on the last line of the context."`` (restated every turn) and the
answer ``"13"``. The reward is exact match of the final answer (`exact_match_reward`).

A scripted **teacher** (`ToyTeacher`, served by `trl_ext.quickstart.scripted_server.ScriptedChatServer` on
127.0.0.1) plays the policy in the real scaffold to produce the cold-start traces. It first prints the context, then
answers with one of three strategies, drawn per example:

- *compute* — let the REPL find the value and return the variable (`COMPUTE_ACTION`)::

      ```repl
      key = context[-1]
      answer = context.split(key + '=')[1][:2]
      ```
      FINAL_VAR(answer)

- *shortcut* — the first pair's value (`SHORTCUT_ACTION`): right only when the asked key comes first; the reward
  filter keeps exactly those traces, so the shortcut slips into the SFT set by luck, as it would with a small
  holdout;
- *read* — copy the value out of the printed context: ``FINAL(13)``.

The teacher is right every time it answers by *compute* or *read*. A tiny policy is not: the *compute* program is the
same text whatever the example, while *read* needs the right two digits found and copied out of the REPL output. So
after cold-start SFT the policy writes the scaffold's format (a ```repl block, then ``FINAL``/``FINAL_VAR``) but
mostly copies by hand and is usually wrong; exact-match RL learns to let the REPL do the work — the RLM lesson in
miniature — and the held-out reward before and after RL measures that.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ANSWER_COLUMN",
    "COMPUTE_ACTION",
    "EXPLORE_ACTION",
    "SHORTCUT_ACTION",
    "TOY_TASK",
    "TOY_FIRST_USER_PROMPT",
    "TOY_SYSTEM_PROMPT",
    "TOY_USER_PROMPT",
    "ToyTeacher",
    "classify_strategy",
    "exact_match_reward",
    "make_toy_dataset",
]

ANSWER_COLUMN = "answer"
KEYS = "abcdefgh"

# The RLM task, restated every turn; the question itself is the context's last line.
TOY_TASK = "Give the value of the key named on the last line of the context."

# Short templates (the scaffold's defaults are ~1,000 tokens for the tiny byte-level tokenizer). Placeholders: see
# trl_ext.rlm.prompts.
TOY_SYSTEM_PROMPT = (
    "Answer with Python in a REPL. `context` is {context_description}. Run code in a ```repl block. "
    "End with FINAL(answer) or FINAL_VAR(name) on its own line."
)
TOY_FIRST_USER_PROMPT = "Turn {turn} of {max_turns}. {task}"
TOY_USER_PROMPT = "Turn {turn} of {max_turns}. {task}"

_KEY_LINE = "key: "
_KEY_RE = re.compile(r"^key: ([a-z])$", re.MULTILINE)
_PAIR_RE = re.compile(r"\b([a-z])=(\d+)\b")

# The teacher's actions. Turn 1 always explores; turn 2 uses one of three strategies.
EXPLORE_ACTION = "```repl\nprint(context)\n```"
COMPUTE_ACTION = "```repl\nkey = context[-1]\nanswer = context.split(key + '=')[1][:2]\n```\nFINAL_VAR(answer)"
SHORTCUT_ACTION = "```repl\nanswer = context.split()[0].split('=')[1]\n```\nFINAL_VAR(answer)"
STRATEGIES = ("compute", "shortcut", "read")


def make_toy_dataset(num_examples: int, seed: int = 0, *, min_pairs: int = 3, max_pairs: int = 5) -> Any:
    """``num_examples`` seeded toy examples as a `datasets.Dataset` with ``prompt``, ``context`` and ``answer``.

    Every example draws ``min_pairs``..``max_pairs`` distinct keys from ``a``..``h`` in random order, a two-digit
    value for each, and asks for one of them: ``context = "c=41 a=73 f=13 b=90\\nkey: f"``, ``answer = "13"``.
    Same ``(num_examples, seed)``: same dataset on any machine.
    """
    from datasets import Dataset

    if not 1 <= min_pairs <= max_pairs <= len(KEYS):
        raise ValueError(f"Need 1 <= min_pairs <= max_pairs <= {len(KEYS)}, got {min_pairs} and {max_pairs}.")
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "context": [], ANSWER_COLUMN: []}
    for _ in range(num_examples):
        keys = rng.sample(KEYS, rng.randint(min_pairs, max_pairs))
        values = [str(rng.randint(10, 99)) for _ in keys]
        asked = rng.randrange(len(keys))
        rows["prompt"].append(TOY_TASK)
        rows["context"].append(" ".join(f"{k}={v}" for k, v in zip(keys, values)) + f"\n{_KEY_LINE}{keys[asked]}")
        rows[ANSWER_COLUMN].append(values[asked])
    return Dataset.from_dict(rows)


def exact_match_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the final answer equals the ``answer`` column (surrounding whitespace and quotes ignored), else 0."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else _message_text(completion)
        rewards.append(1.0 if text.strip().strip("'\"").strip() == str(expected).strip() else 0.0)
    return rewards


def _message_text(completion: Any) -> str:
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


class ToyTeacher:
    """The scripted teacher: a `ScriptedChatServer` script that plays the policy on the toy task.

    It reads the request's chat messages exactly as the scaffold built them (system prompt, earlier actions and
    REPL outputs, the fresh user message) and writes the next action: first it prints the context (every trace),
    then it answers with one of three strategies, drawn per example:

    - ``"compute"`` (probability ``compute_fraction``): the lookup program, then ``FINAL_VAR(answer)``;
    - ``"shortcut"`` (probability ``shortcut_fraction``): the first pair's value, then ``FINAL_VAR(answer)``:
      right only when the asked key comes first (the reward filter keeps exactly those traces);
    - ``"read"`` (the rest): the value copied from the printed context, ``FINAL(13)``.

    The draw is a seeded function of what the teacher sees (its first REPL output), so the traces do not depend on
    the order in which requests arrive.
    """

    def __init__(self, compute_fraction: float = 0.25, shortcut_fraction: float = 0.25, seed: int = 0):
        if not (0.0 <= compute_fraction and 0.0 <= shortcut_fraction and compute_fraction + shortcut_fraction <= 1.0):
            raise ValueError(
                f"compute_fraction={compute_fraction!r} and shortcut_fraction={shortcut_fraction!r} must be >= 0 "
                "and sum to at most 1."
            )
        self.compute_fraction = compute_fraction
        self.shortcut_fraction = shortcut_fraction
        self.seed = seed

    def strategy(self, observation: str) -> str:
        """The strategy of the example whose first REPL output is ``observation``."""
        draw = random.Random(f"{self.seed}|{observation}").random()
        if draw < self.compute_fraction:
            return "compute"
        if draw < self.compute_fraction + self.shortcut_fraction:
            return "shortcut"
        return "read"

    def __call__(self, request: dict[str, Any]) -> str:
        messages = request.get("messages", [])
        history = [_content(m) for m in messages[1:-1]]  # action, observation, action, observation, ...
        if len(history) < 2:
            return EXPLORE_ACTION
        observation = history[1]
        strategy = self.strategy(observation)
        if strategy == "compute":
            return COMPUTE_ACTION
        if strategy == "shortcut":
            return SHORTCUT_ACTION
        key = _KEY_RE.search(observation)
        value = dict(_PAIR_RE.findall(observation)).get(key.group(1) if key else "", "unknown")
        return f"FINAL({value})"


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def classify_strategy(tree: Any) -> str:
    """How a rollout tree of the toy task answered: ``"lookup"`` (the compute program), ``"shortcut"``,
    ``"copy"`` (a ``FINAL(value)`` without either program) or ``"no_answer"``."""
    actions = [turn.action for node in tree.nodes for turn in node.turns]
    if tree.final_answer is None:
        return "no_answer"
    if any("split(key" in action for action in actions):
        return "lookup"
    if any("[0].split" in action for action in actions):
        return "shortcut"
    return "copy"
