"""The RLM scaffold (docs/rlm_scaffold.md): its configuration and the pure functions of one turn.

One turn of a node, as `trl_ext.rlm.engine` runs it::

    messages = build_turn_messages(config, system_prompt, history, task, turn)   # rebuilt from scratch
    action   = <one completion sampled for the rendered messages>
    code     = find_code_block(action)                 # the last ```repl block, or None
    result   = <run `code` in the node's REPL>         # may call llm_query / rlm_query
    final    = result.final_answer or find_final_answer(action)   # FINAL(...) / FINAL_VAR(...) line
    history.append((action, format_observation(...)))  # unless the node is done

Everything here is pure: no REPL, no model. The prompts are the templates of `trl_ext.rlm.prompts`, overridable
through `RLMScaffoldConfig`.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..fields import documented, mirror_field
from ..text import FinalAnswer, find_final_answer
from . import prompts
from .repl_protocol import ReplResult
from .sandbox import SandboxLimits

__all__ = [
    "FinalAnswer",
    "RLMScaffoldConfig",
    "build_system_prompt",
    "build_turn_messages",
    "describe_context",
    "find_code_block",
    "find_final_answer",
    "format_observation",
    "format_repl_output",
    "truncate_output",
]

# The template fields of the config and the placeholders each may use.
_TEMPLATE_PLACEHOLDERS = {
    "system_prompt": {"context_description": "a str", "recursion_note": "", "max_children": 4},
    "first_user_prompt": {"task": "t", "turn": 1, "max_turns": 10, "turns_left": 10},
    "user_prompt": {"task": "t", "turn": 2, "max_turns": 10, "turns_left": 9},
    "repl_output_prompt": {"output": "o"},
    "no_code_prompt": {},
    "final_var_error_prompt": {"name": "n", "error": "e"},
    "child_no_answer": {"end_reason": "max_turns"},
    "llm_query_prompt": {"prompt": "p"},
    "degraded_rlm_query_prompt": {"prompt": "p", "context": "c"},
}


@dataclass
class RLMScaffoldConfig:
    """Configuration of RLM rollouts: limits, sandbox, batching and prompt templates.

    Parameters, by topic:

    > Limits (docs/rlm_scaffold.md)

    max_turns: turns per node; a node without an answer after them ends with "max_turns" (reward 0).
    max_depth: depth of the deepest child; a node at depth >= max_depth gets plain completions from
        ``rlm_query`` (0 disables children altogether).
    max_children: prompts one ``rlm_query_batched`` call may pass; more is refused (the model sees an error).
    max_total_children: children in one root's whole tree; past it ``rlm_query`` degrades to ``llm_query``.
    max_llm_queries: prompts one ``llm_query_batched`` call may pass; more is refused.
    max_prompt_tokens: a node whose rebuilt prompt is longer ends with "prompt_too_long"; an ``llm_query``
        prompt longer is refused. None: no check (set it to the engine's context length minus the completion
        length, or a long prompt fails the whole generator call).
    max_query_prompt_chars, max_cell_queries, max_cell_query_chars, max_cell_query_tokens, max_cell_query_time_s:
        what one REPL cell's queries may cost the trainer (their help texts;
        `trl_ext.rlm.queries.query_budget_refusal`); past it the model's code gets an error it can read, and the
        rollout goes on.
    max_tree_queries, max_tree_query_chars: the same for one root rollout's whole tree, every node and cell
        (`trl_ext.rlm.queries.tree_budget_refusal`).

    > REPL sandbox (see `trl_ext.rlm.repl.PythonREPL`)

    sandbox: every limit and isolation setting of the REPLs (`SandboxLimits`: ``timeout_s``, ``memory_mb``,
        ``isolation``, ``network``...; its ``max_output_chars`` is also the REPL output shown to the model per
        turn, truncated beyond with a note).
    helpers: Python source run in every REPL at start (task helper functions).
    helper_objects: name -> picklable object copied into every REPL.

    > Engine

    max_batch_size: at most this many sequences per generator call (None: every pending request at once).
        A full batch is sent without waiting for the remaining rollouts.
    max_batch_wait_s: send the pending requests once the oldest has waited this long, even if some rollouts are
        still running code (None: wait for all of them, one call per wave). Bounds how long one slow REPL cell
        (up to ``sandbox.timeout_s``) can hold every other rollout back, at the price of more, smaller calls.

    > Prompts (templates of `trl_ext.rlm.prompts`; see there for the placeholders)

    system_prompt, first_user_prompt, user_prompt, repl_output_prompt, no_code_prompt, final_var_error_prompt,
    child_no_answer, llm_query_prompt, degraded_rlm_query_prompt, recursion_note, leaf_recursion_note.
    """

    max_turns: int = field(default=10, metadata={"help": "Turns per node before it ends without an answer."})
    max_depth: int = field(default=1, metadata={"help": "Deepest child depth; rlm_query degrades to llm_query there."})
    max_children: int = field(default=4, metadata={"help": "Children one rlm_query_batched call may start."})
    max_total_children: int = field(default=64, metadata={"help": "Children in one root's tree, all depths."})
    max_llm_queries: int = field(default=64, metadata={"help": "Prompts one llm_query_batched call may pass."})
    max_prompt_tokens: int | None = field(default=None, metadata={"help": "Longest prompt sent to the generator."})
    max_query_prompt_chars: int = documented(
        200_000,
        "Longest text in characters one query prompt may be: an llm_query prompt in its template (a degraded "
        "rlm_query's context included) or a child's task. Checked before it is tokenized; a longer one is refused.",
    )
    max_cell_queries: int = documented(
        256,
        "Query prompts one REPL cell may send, all its llm_query/rlm_query calls together (each prompt of a batched "
        "call counts); a call that would go past it is refused.",
    )
    max_cell_query_chars: int = documented(
        1_000_000,
        "Characters one REPL cell's query prompts may have together, checked before they are tokenized; a call "
        "that would go past it is refused.",
    )
    max_cell_query_tokens: int = documented(
        100_000,
        "Tokens the plain completions of one cell's queries may generate together; once they have, the cell's "
        "further queries are refused (children's own turns are not counted).",
    )
    max_cell_query_time_s: float = documented(
        600.0,
        "Wall time one cell's queries may take together (tokenizing, generating, waiting for children); once spent, "
        "the cell's further queries are refused. The cell's own run time is bounded by the sandbox's timeout_s.",
    )
    max_tree_queries: int = documented(
        1024,
        "Query prompts one root rollout may send, its root and all its sub-agents together, over all their cells "
        "(the per-cell budget alone lets a tree send cells x nodes times max_cell_queries); a call that would go past "
        "it is refused. The default is 4 cells' worth: a bound on runaway trees, not a tuned value.",
    )
    max_tree_query_chars: int = documented(
        4_000_000,
        "Characters one root rollout's query prompts may have together, its root and all its sub-agents, over all "
        "their cells; a call that would go past it is refused (4 cells' worth by default).",
    )
    sandbox: SandboxLimits = field(
        default_factory=SandboxLimits, metadata={"help": "Limits and isolation of every REPL (SandboxLimits)."}
    )
    helpers: tuple[str, ...] = field(default=(), metadata={"help": "Helper source run in every REPL."})
    helper_objects: dict[str, Any] = field(default_factory=dict, metadata={"help": "Objects copied into REPLs."})
    max_batch_size: int | None = field(default=None, metadata={"help": "Sequences per generator call."})
    max_batch_wait_s: float | None = field(
        default=None, metadata={"help": "Send pending requests after this long even if some rollouts are busy."}
    )
    system_prompt: str = field(default=prompts.SYSTEM_PROMPT, metadata={"help": "System prompt template."})
    first_user_prompt: str = field(default=prompts.FIRST_USER_PROMPT, metadata={"help": "Turn-0 user message."})
    user_prompt: str = field(default=prompts.USER_PROMPT, metadata={"help": "Later turns' user message."})
    repl_output_prompt: str = field(default=prompts.REPL_OUTPUT_PROMPT, metadata={"help": "REPL output message."})
    no_code_prompt: str = field(default=prompts.NO_CODE_PROMPT, metadata={"help": "Message after a codeless turn."})
    final_var_error_prompt: str = field(
        default=prompts.FINAL_VAR_ERROR_PROMPT, metadata={"help": "Message after a failed FINAL_VAR."}
    )
    child_no_answer: str = field(default=prompts.CHILD_NO_ANSWER, metadata={"help": "A child's non-answer."})
    llm_query_prompt: str = field(default=prompts.LLM_QUERY_PROMPT, metadata={"help": "llm_query user message."})
    degraded_rlm_query_prompt: str = field(
        default=prompts.DEGRADED_RLM_QUERY_PROMPT, metadata={"help": "A degraded rlm_query's prompt, with context."}
    )
    recursion_note: str = field(default=prompts.RECURSION_NOTE, metadata={"help": "System note above max depth."})
    leaf_recursion_note: str = field(
        default=prompts.LEAF_RECURSION_NOTE, metadata={"help": "System note at max depth."}
    )

    def __post_init__(self) -> None:
        positive = ("max_turns", "max_children", "max_total_children", "max_llm_queries", "max_query_prompt_chars")
        budgets = ("max_cell_queries", "max_cell_query_chars", "max_cell_query_tokens")
        for name in (*positive, *budgets, "max_tree_queries", "max_tree_query_chars"):
            _check_int(name, getattr(self, name), minimum=1)
        time_s = self.max_cell_query_time_s
        if isinstance(time_s, bool) or not isinstance(time_s, (int, float)) or not time_s > 0:
            raise ValueError(f"max_cell_query_time_s must be a positive number of seconds, got {time_s!r}")
        _check_int("max_depth", self.max_depth, minimum=0)
        if not isinstance(self.sandbox, SandboxLimits):
            raise TypeError(f"sandbox must be a SandboxLimits, got {type(self.sandbox).__name__}")
        for name in ("max_prompt_tokens", "max_batch_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        wait = self.max_batch_wait_s
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0):
            raise ValueError(f"max_batch_wait_s must be None or a number of seconds >= 0, got {wait!r}")
        if isinstance(self.helpers, str):
            self.helpers = (self.helpers,)
        self.helpers = tuple(self.helpers)
        if not all(isinstance(source, str) for source in self.helpers):
            raise TypeError("helpers must be Python source strings")
        for name, placeholders in _TEMPLATE_PLACEHOLDERS.items():
            template = getattr(self, name)
            if not isinstance(template, str):
                raise TypeError(f"{name} must be a str template, got {type(template).__name__}")
            try:
                template.format(**placeholders)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"{name} is not a valid template ({type(exc).__name__}: {exc}); it may use the placeholders "
                    f"{sorted(placeholders) or 'none'}, and literal braces must be doubled ({{{{ and }}}})."
                ) from None

    def to_dict(self) -> dict[str, Any]:
        return {item.name: getattr(self, item.name) for item in fields(self)}


# Trainer-config names of the scaffold's settings: the limits keep their names, templates and helpers get ``rlm_``.
_TEMPLATES = (
    "system_prompt",
    "first_user_prompt",
    "user_prompt",
    "repl_output_prompt",
    "no_code_prompt",
    "final_var_error_prompt",
    "child_no_answer",
    "llm_query_prompt",
    "degraded_rlm_query_prompt",
    "recursion_note",
    "leaf_recursion_note",
)


def _argument(name: str) -> Any:
    return mirror_field(RLMScaffoldConfig, name, "RLM scaffold")


def _template(name: str) -> Any:
    return mirror_field(RLMScaffoldConfig, name, "RLM scaffold", default=None, note="None: the built-in template.")


@dataclass
class ScaffoldArguments:
    """The `RLMScaffoldConfig` settings as trainer-config fields, so that each is one command-line flag or recipe key.

    Limits keep the scaffold's names (``max_turns``, ``max_prompt_tokens``, ``max_batch_wait_s``...); the prompt
    templates are ``rlm_<template>`` (None keeps the built-in one) and ``rlm_helpers`` is Python source run in every
    REPL. The REPL limits are `trl_ext.rlm.sandbox.SandboxArguments` (``repl_<name>``). ``helper_objects`` (Python
    objects) has no YAML form: pass a whole `RLMScaffoldConfig` to the engine for it.
    """

    max_turns: int = _argument("max_turns")
    max_depth: int = _argument("max_depth")
    max_children: int = _argument("max_children")
    max_total_children: int = _argument("max_total_children")
    max_llm_queries: int = _argument("max_llm_queries")
    max_prompt_tokens: int | None = _argument("max_prompt_tokens")
    max_query_prompt_chars: int = _argument("max_query_prompt_chars")
    max_cell_queries: int = _argument("max_cell_queries")
    max_cell_query_chars: int = _argument("max_cell_query_chars")
    max_cell_query_tokens: int = _argument("max_cell_query_tokens")
    max_cell_query_time_s: float = _argument("max_cell_query_time_s")
    max_tree_queries: int = _argument("max_tree_queries")
    max_tree_query_chars: int = _argument("max_tree_query_chars")
    max_batch_size: int | None = _argument("max_batch_size")
    max_batch_wait_s: float | None = _argument("max_batch_wait_s")
    rlm_helpers: str | None = documented(
        None, "RLM scaffold: Python source run in every REPL at start (task helpers)."
    )
    rlm_system_prompt: str | None = _template("system_prompt")
    rlm_first_user_prompt: str | None = _template("first_user_prompt")
    rlm_user_prompt: str | None = _template("user_prompt")
    rlm_repl_output_prompt: str | None = _template("repl_output_prompt")
    rlm_no_code_prompt: str | None = _template("no_code_prompt")
    rlm_final_var_error_prompt: str | None = _template("final_var_error_prompt")
    rlm_child_no_answer: str | None = _template("child_no_answer")
    rlm_llm_query_prompt: str | None = _template("llm_query_prompt")
    rlm_degraded_rlm_query_prompt: str | None = _template("degraded_rlm_query_prompt")
    rlm_recursion_note: str | None = _template("recursion_note")
    rlm_leaf_recursion_note: str | None = _template("leaf_recursion_note")

    @staticmethod
    def arguments_for(**settings: Any) -> dict[str, Any]:
        """The trainer-config keyword arguments that set these `RLMScaffoldConfig` limits and templates, e.g.
        ``arguments_for(max_turns=2, system_prompt=s)`` -> ``{"max_turns": 2, "rlm_system_prompt": s}``."""
        unknown = sorted(set(settings) - set(_LIMITS) - set(_TEMPLATES))
        if unknown:
            raise TypeError(
                f"{unknown} are not RLMScaffoldConfig limits or templates; pass the helpers as rlm_helpers and the "
                "sandbox as repl_<name> (SandboxArguments)."
            )
        return {name if name in _LIMITS else f"rlm_{name}": value for name, value in settings.items()}

    def scaffold_config(self, sandbox: SandboxLimits | None = None) -> RLMScaffoldConfig:
        """The `RLMScaffoldConfig` these fields describe, with ``sandbox`` (default: `SandboxLimits()`)."""
        limits = {name: getattr(self, name) for name in _LIMITS}
        templates = {name: getattr(self, f"rlm_{name}") for name in _TEMPLATES}
        return RLMScaffoldConfig(
            **limits,
            **{name: value for name, value in templates.items() if value is not None},
            helpers=(self.rlm_helpers,) if self.rlm_helpers else (),
            sandbox=sandbox if sandbox is not None else SandboxLimits(),
        )


_LIMITS = (
    "max_turns",
    "max_depth",
    "max_children",
    "max_total_children",
    "max_llm_queries",
    "max_prompt_tokens",
    "max_query_prompt_chars",
    "max_cell_queries",
    "max_cell_query_chars",
    "max_cell_query_tokens",
    "max_cell_query_time_s",
    "max_tree_queries",
    "max_tree_query_chars",
    "max_batch_size",
    "max_batch_wait_s",
)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


# ------------------------------------------------------------------------------------------------ parsing
_CODE_BLOCK = re.compile(r"^[ \t]*```repl[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


def find_code_block(action: str) -> str | None:
    """The code of the last ```repl block of `action` (fences on lines of their own), or None.

    An unterminated block (a completion cut by the token limit) does not count.
    """
    blocks = _CODE_BLOCK.findall(action)
    if not blocks:
        return None
    return textwrap.dedent(blocks[-1]).rstrip("\n")


# --------------------------------------------------------------------------------------------- formatting
def truncate_output(text: str, max_chars: int) -> str:
    """`text` cut to its first `max_chars` characters, with a note saying how many were dropped."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... [{len(text) - max_chars} more characters truncated]"


def format_repl_output(result: ReplResult, max_chars: int) -> str:
    """A cell's stdout followed by its error, within `max_chars` (the error keeps up to half of them)."""
    error = (result.error or "").rstrip("\n")
    error = truncate_output(error, max_chars // 2) if error else ""
    stdout = result.stdout.rstrip("\n")
    stdout = truncate_output(stdout, max(max_chars - len(error), 0)) if stdout else ""
    text = "\n".join(part for part in (stdout, error) if part)
    return text or "(no output)"


def format_observation(
    config: RLMScaffoldConfig,
    result: ReplResult | None,
    final_var_error: tuple[str, str] | None = None,
) -> str:
    """The user message that answers an action in later prompts.

    Args:
        config: gives the templates and `sandbox.max_output_chars`.
        result: the cell's result, or None when the action had no code.
        final_var_error: ``(name, error)`` when a ``FINAL_VAR(name)`` line gave no answer.
    """
    parts = []
    if result is not None:
        parts.append(
            config.repl_output_prompt.format(output=format_repl_output(result, config.sandbox.max_output_chars))
        )
    if final_var_error is not None:
        name, error = final_var_error
        parts.append(
            config.final_var_error_prompt.format(
                name=name, error=truncate_output(error, config.sandbox.max_output_chars)
            )
        )
    if not parts:
        parts.append(config.no_code_prompt.format())
    return "\n\n".join(parts)


def describe_context(context: Any) -> str:
    """A one-line description of a ``context`` value for the system prompt (type and size, not content)."""
    if isinstance(context, str):
        return f"a str of {len(context):,} characters"
    if isinstance(context, (list, tuple)):
        total = sum(len(item) if isinstance(item, str) else len(str(item)) for item in context)
        return f"a {type(context).__name__} of {len(context):,} items ({total:,} characters in total)"
    if isinstance(context, dict):
        total = sum(len(str(key)) + len(str(value)) for key, value in context.items())
        return f"a dict with {len(context):,} keys ({total:,} characters in total)"
    return f"a {type(context).__name__} ({len(str(context)):,} characters as text)"


def build_system_prompt(config: RLMScaffoldConfig, context: Any, depth: int) -> str:
    """The system prompt of a node at `depth` whose REPL holds `context`."""
    note = config.leaf_recursion_note if depth >= config.max_depth else config.recursion_note
    return config.system_prompt.format(
        context_description=describe_context(context), recursion_note=note, max_children=config.max_children
    )


def build_turn_messages(
    config: RLMScaffoldConfig,
    system_prompt: str,
    history: Sequence[tuple[str, str]],
    task: str,
    turn: int,
) -> list[dict[str, str]]:
    """The chat messages of turn `turn` (0-based), rebuilt from scratch (docs/rlm_scaffold.md).

    ``[system, (assistant action, user observation) for each earlier turn, fresh user message]``. The fresh
    message restates the task (with the iteration-0 safeguard on turn 0) and is not part of `history`, so
    successive turns' prompts do not share a prefix beyond the history.

    Args:
        history: ``(action, observation)`` of every earlier turn, in order.
        task: the node's task, restated every turn.
        turn: index of the turn being prompted; must equal ``len(history)``.
    """
    if turn != len(history):
        raise ValueError(f"turn {turn} must follow exactly {turn} earlier turns, got a history of {len(history)}")
    messages = [{"role": "system", "content": system_prompt}]
    for action, observation in history:
        messages.append({"role": "assistant", "content": action})
        messages.append({"role": "user", "content": observation})
    template = config.first_user_prompt if turn == 0 else config.user_prompt
    fresh = template.format(task=task, turn=turn + 1, max_turns=config.max_turns, turns_left=config.max_turns - turn)
    messages.append({"role": "user", "content": fresh})
    return messages
