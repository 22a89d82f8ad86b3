"""Prompt templates of the RLM scaffold (docs/rlm_scaffold.md). Plain ``str.format`` templates: override any of them.

Pass replacements through `RLMScaffoldConfig` (``system_prompt=...``, ``first_user_prompt=...``, ...); the
placeholders each template may use are listed next to it. Literal braces must be doubled (``{{`` / ``}}``).

Every turn's prompt is rebuilt from scratch (see `trl_ext.rlm.scaffold.build_turn_messages`)::

    system: SYSTEM_PROMPT
    assistant: action of turn 0         \\
    user: REPL_OUTPUT_PROMPT / ...       |  one pair per earlier turn (the REPL history)
    ...                                 /
    user: FIRST_USER_PROMPT (turn 0) or USER_PROMPT (later turns)   <- fresh each turn, never kept in history
"""

# Placeholders: {context_description} (e.g. "a str of 12,345 characters"), {recursion_note} (RECURSION_NOTE or
# LEAF_RECURSION_NOTE), {max_children}.
SYSTEM_PROMPT = """You answer a task by writing Python code that runs in a persistent REPL. The task input is \
stored in the REPL variable `context`; it may be far too long to read at once, so inspect it with code.

The REPL gives you:
- `context`: {context_description}.
- `llm_query(prompt) -> str`: one completion from a language model (no REPL, no tools). Use it on pieces of the \
context: extraction, summaries, yes/no questions.
- `llm_query_batched(prompts) -> list[str]`: several `llm_query` calls run together; much faster than a loop.
- `rlm_query(prompt, context=None) -> str`: hands a sub-task to a sub-agent like you, with its own REPL whose \
`context` is the value you pass (the prompt itself when you pass none). It returns the sub-agent's final answer.
- `rlm_query_batched(prompts, context_list=None) -> list[str]`: several sub-agents at once (at most \
{max_children} per call).
- `SHOW_VARS()`: the variables you have created so far.
- `print()`: what you print is shown to you in the next turn (long output is truncated).
{recursion_note}
To run code, write it in a block that opens with ```repl and closes with ```. Only the last such block of your \
message runs. Variables persist from turn to turn. For example:
```repl
print(type(context), len(context))
print(context[:500])
```

When you know the answer, write it on a line of its own, outside any code block, as FINAL(your answer), or \
return a variable you created in an earlier turn with FINAL_VAR(variable_name). Work step by step: look at the \
context before answering, and act now instead of describing what you would do."""

RECURSION_NOTE = ""
LEAF_RECURSION_NOTE = (
    "Note: no further sub-agents can start at this depth; here `rlm_query` and `rlm_query_batched` run plain "
    "`llm_query` completions.\n"
)

# Placeholders: {task}, {turn} (1-based), {max_turns}, {turns_left} (this turn included).
FIRST_USER_PROMPT = """You have not looked at the REPL or the context yet: start by exploring the context; do \
not give a final answer yet.

Task: {task}

Turn {turn} of {max_turns}. Write your next action."""

USER_PROMPT = """The messages above are your earlier actions and the REPL's outputs.

Task: {task}

Turn {turn} of {max_turns} ({turns_left} left, this one included). Continue with the REPL, or give your final \
answer with FINAL(...) or FINAL_VAR(...). Write your next action."""

# Placeholders: {output} (stdout, then the error, truncated to max_output_chars).
REPL_OUTPUT_PROMPT = "REPL output:\n{output}"

# Shown when the turn had no ```repl block and no usable FINAL line. No placeholders.
NO_CODE_PROMPT = (
    "No ```repl block was found in your last message, so nothing ran. Write Python code in a ```repl block, or give "
    "your answer on a line of its own as FINAL(answer) or FINAL_VAR(variable_name)."
)

# Shown when FINAL_VAR(...) named no variable. Placeholders: {name}, {error}.
FINAL_VAR_ERROR_PROMPT = "FINAL_VAR({name}) did not give an answer:\n{error}"

# Returned to the parent's code when a child RLM ended without an answer. Placeholders: {end_reason}.
CHILD_NO_ANSWER = "[the sub-agent ended without a final answer ({end_reason})]"

# The prompt of an `llm_query` completion is this single user message. Placeholders: {prompt}.
LLM_QUERY_PROMPT = "{prompt}"

# An `rlm_query(prompt, context)` answered by a plain completion (max depth or child budget reached) gets its
# context inlined, or the completion would never see it. Placeholders: {prompt}, {context} (str, or JSON text).
DEGRADED_RLM_QUERY_PROMPT = "{prompt}\n\nContext:\n{context}"
