"""The quickstart's built-in toy task, where delegating to child RLMs pays: look a key up in each of several parts.

An example is a context (the REPL variable ``context``), a list of 2–3 *parts*, each a small lookup::

    ["c=41 a=73 f=13\\nkey: f", "b=90 e=25 a=61 d=38\\nkey: d"]

the task `TOY_TASK` (restated every turn) and the answer ``"13,38"``: the value asked on each part's last line, in
order. The reward is the share of parts answered right (`parts_reward`).

The context is **too long to read in one turn**: the REPL shows at most `TOY_OUTPUT_CHARS` characters of a cell's
output, so ``print(context)`` at the root shows the first part and no more. A part fits: a child RLM given one part
can print it whole. The winning strategy is the RLM's: hand every part to a child with ``rlm_query_batched`` and
join their answers (`DELEGATE_ACTION`); each child — the same policy, at depth 1 — answers `PART_TASK` on its part,
best with the lookup program (`COMPUTE_ACTION`).

A scripted **teacher** (`ToyTeacher`, served by `trl_ext.quickstart.scripted_server.ScriptedChatServer` on
127.0.0.1) plays the policy, root and children, in the real scaffold to produce the cold-start traces. Every node
first prints its context (`EXPLORE_ACTION`), then answers:

- a **root** *delegates* (probability ``delegate_fraction``) or *reads*: copies the values of the parts it could
  see, ``FINAL(13)`` — right on the first part only, so it scores 1/2 or 1/3;
- a **child** *computes* (``compute_fraction``: the lookup program, then ``FINAL_VAR(answer)``), takes the
  *shortcut* (``shortcut_fraction``: the first pair's value, right only when the asked key comes first) or *reads*
  (copies the value out of the printed part: ``FINAL(13)``).

The reward filter keeps every trace that scored, so the SFT set holds reading roots and wrong shortcuts, as a small
holdout of an imperfect teacher would. A tiny policy trained on it writes the scaffold's format and delegates about
as often as the teacher did, but its children mostly copy by hand and often miss: the program text is the same
whatever the part, while a copied value must be found and reproduced digit by digit. RL on the root's reward teaches
both levels at once — roots to delegate, children to let the REPL do the lookup — with every child's turns trained
under the root's advantage (weight 1/k_g): the RLM lesson in miniature.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ANSWER_COLUMN",
    "COMPUTE_ACTION",
    "DELEGATE_ACTION",
    "EXPLORE_ACTION",
    "PART_TASK",
    "SHORTCUT_ACTION",
    "TOY_FIRST_USER_PROMPT",
    "TOY_OUTPUT_CHARS",
    "TOY_SYSTEM_PROMPT",
    "TOY_TASK",
    "TOY_USER_PROMPT",
    "ToyTeacher",
    "classify_child",
    "classify_root",
    "exact_match_reward",
    "expected_parts",
    "make_toy_dataset",
    "parts_reward",
]

ANSWER_COLUMN = "answer"
KEYS = "abcdefgh"

# The root's task, restated every turn; and the task a delegating root gives each child (short: the policy writes it).
TOY_TASK = "Values asked on each part's last line, comma-separated."
PART_TASK = "lookup"

# Characters of a cell's output shown to the model: one part whole, not the whole context (see the module docstring).
TOY_OUTPUT_CHARS = 40

# Short templates (the scaffold's defaults are ~1,000 tokens for the tiny byte-level tokenizer). Placeholders: see
# trl_ext.rlm.prompts.
TOY_SYSTEM_PROMPT = (
    "Python REPL; `context` is {context_description}. Code goes in a ```repl block; "
    "rlm_query_batched(tasks, contexts) runs sub-agents. End with FINAL(answer) or FINAL_VAR(name)."
)
TOY_FIRST_USER_PROMPT = "Turn {turn} of {max_turns}. {task}"
TOY_USER_PROMPT = "Turn {turn} of {max_turns}. {task}"

_KEY_RE = re.compile(r"^key: ([a-z])$", re.MULTILINE)
_PAIR_RE = re.compile(r"\b([a-z])=(\d+)\b")
# A part as the root sees it in print(context): the repr of one list item, whole (a truncated one does not match).
_SHOWN_PART_RE = re.compile(r"'((?:[a-z]=\d+ ?)+)\\nkey: ([a-z])'")

# The teacher's actions. Every node's turn 1 explores; turn 2 answers by one strategy.
EXPLORE_ACTION = "```repl\nprint(context)\n```"
DELEGATE_ACTION = (
    f"```repl\na = ','.join(rlm_query_batched(['{PART_TASK}'] * len(context), context))\n```\nFINAL_VAR(a)"
)
COMPUTE_ACTION = "```repl\nkey = context[-1]\nanswer = context.split(key + '=')[1][:2]\n```\nFINAL_VAR(answer)"
SHORTCUT_ACTION = "```repl\nanswer = context.split()[0].split('=')[1]\n```\nFINAL_VAR(answer)"
ROOT_STRATEGIES = ("delegate", "read")
CHILD_STRATEGIES = ("compute", "shortcut", "read")


def make_toy_dataset(
    num_examples: int,
    seed: int = 0,
    *,
    min_parts: int = 2,
    max_parts: int = 3,
    min_pairs: int = 3,
    max_pairs: int = 4,
    parts_counts: Sequence[int] | None = None,
) -> Any:
    """``num_examples`` seeded toy examples as a `datasets.Dataset` with ``prompt``, ``context`` and ``answer``.

    Every example has ``min_parts``..``max_parts`` parts — or, with ``parts_counts``, a count drawn uniformly from
    that list (e.g. ``(1, 2, 5, 6)``: deliberately uneven rollout trees, benchmarks/uneven_trees.py); a part draws
    ``min_pairs``..``max_pairs`` distinct keys from ``a``..``h`` in random order, a two-digit value for each, and
    asks for one of them::

        context = ["c=41 a=73 f=13\\nkey: f", "b=90 e=25 a=61 d=38\\nkey: d"], answer = "13,38"

    Same arguments: same dataset on any machine. The defaults keep every part within `TOY_OUTPUT_CHARS`.
    """
    from datasets import Dataset

    if not 1 <= min_pairs <= max_pairs <= len(KEYS):
        raise ValueError(f"Need 1 <= min_pairs <= max_pairs <= {len(KEYS)}, got {min_pairs} and {max_pairs}.")
    if not 1 <= min_parts <= max_parts:
        raise ValueError(f"Need 1 <= min_parts <= max_parts, got {min_parts} and {max_parts}.")
    if parts_counts is not None:
        parts_counts = list(parts_counts)
        if not parts_counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in parts_counts):
            raise ValueError(f"parts_counts must be a non-empty list of ints >= 1, got {parts_counts!r}.")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "context": [], ANSWER_COLUMN: []}
    for _ in range(num_examples):
        parts, values = [], []
        count = rng.randint(min_parts, max_parts) if parts_counts is None else rng.choice(parts_counts)
        for _ in range(count):
            keys = rng.sample(KEYS, rng.randint(min_pairs, max_pairs))
            pair_values = [str(rng.randint(10, 99)) for _ in keys]
            asked = rng.randrange(len(keys))
            parts.append(" ".join(f"{k}={v}" for k, v in zip(keys, pair_values)) + f"\nkey: {keys[asked]}")
            values.append(pair_values[asked])
        rows["prompt"].append(TOY_TASK)
        rows["context"].append(parts)
        rows[ANSWER_COLUMN].append(",".join(values))
    return Dataset.from_dict(rows)


def expected_parts(answer: str) -> list[str]:
    """The per-part values of an ``answer`` column entry (``"13,38"`` -> ``["13", "38"]``)."""
    return answer.split(",")


def parts_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """The share of parts answered right: the final answer split on commas (surrounding whitespace and quotes ignored
    per value), compared position by position with the ``answer`` column, divided by the larger of the two counts
    (so listing extra values does not pay)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else _message_text(completion)
        given = [value.strip().strip("'\"").strip() for value in text.strip().strip("[]").split(",")]
        wanted = expected_parts(str(expected))
        right = sum(g == w for g, w in zip(given, wanted))
        rewards.append(right / max(len(given), len(wanted)))
    return rewards


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
    """The scripted teacher: a `ScriptedChatServer` script that plays the policy — roots and children — on the toy
    task.

    It reads the request's chat messages exactly as the scaffold built them (system prompt, earlier actions and REPL
    outputs, the fresh user message, which names the node's task) and writes the next action: first it prints the
    context (every node), then it answers by a strategy drawn per node (see the module docstring):

    - a root delegates (probability ``delegate_fraction``) or reads the values of the parts it saw;
    - a child computes (``compute_fraction``), takes the shortcut (``shortcut_fraction``) or reads its part's value.

    The draw is a seeded function of what the teacher sees (the node's first REPL output), so the traces do not
    depend on the order in which requests arrive.
    """

    def __init__(
        self,
        delegate_fraction: float = 0.5,
        compute_fraction: float = 0.25,
        shortcut_fraction: float = 0.25,
        seed: int = 0,
    ):
        if not 0.0 <= delegate_fraction <= 1.0:
            raise ValueError(f"delegate_fraction={delegate_fraction!r} must be in [0, 1].")
        if not (0.0 <= compute_fraction and 0.0 <= shortcut_fraction and compute_fraction + shortcut_fraction <= 1.0):
            raise ValueError(
                f"compute_fraction={compute_fraction!r} and shortcut_fraction={shortcut_fraction!r} must be >= 0 "
                "and sum to at most 1."
            )
        self.delegate_fraction = delegate_fraction
        self.compute_fraction = compute_fraction
        self.shortcut_fraction = shortcut_fraction
        self.seed = seed

    def strategy(self, observation: str, child: bool) -> str:
        """The strategy of the node whose first REPL output is ``observation``."""
        draw = random.Random(f"{self.seed}|{int(child)}|{observation}").random()
        if not child:
            return "delegate" if draw < self.delegate_fraction else "read"
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
        child = TOY_TASK not in _content(messages[-1])
        observation = history[1]
        strategy = self.strategy(observation, child)
        if strategy == "delegate":
            return DELEGATE_ACTION
        if strategy == "compute":
            return COMPUTE_ACTION
        if strategy == "shortcut":
            return SHORTCUT_ACTION
        if child:
            key = _KEY_RE.search(observation)
            return f"FINAL({dict(_PAIR_RE.findall(observation)).get(key.group(1) if key else '', 'unknown')})"
        seen = [
            dict(_PAIR_RE.findall(pairs)).get(key, "unknown") for pairs, key in _SHOWN_PART_RE.findall(observation)
        ]
        return f"FINAL({','.join(seen) or 'unknown'})"


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _actions(node: Any) -> list[str]:
    return [turn.action for turn in node.turns]


def classify_root(tree: Any) -> str:
    """How a rollout tree's root answered: ``"delegate"`` (it called ``rlm_query_batched`` or ``rlm_query``),
    ``"read"`` (a final answer without delegating) or ``"no_answer"``."""
    if tree.final_answer is None:
        return "no_answer"
    return "delegate" if any("rlm_query" in action for action in _actions(tree.root)) else "read"


def classify_child(node: Any) -> str:
    """How a child answered its part: ``"lookup"`` (the lookup program), ``"shortcut"``, ``"copy"`` (a
    ``FINAL(value)`` without either program) or ``"no_answer"``."""
    if node.final_answer is None:
        return "no_answer"
    actions = _actions(node)
    if any("split(key" in action for action in actions):
        return "lookup"
    if any("[0].split" in action for action in actions):
        return "shortcut"
    return "copy"
