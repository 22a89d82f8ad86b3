"""The pure functions of one RLM turn: parsing, formatting, prompt rebuilding, configuration."""

from __future__ import annotations

import pytest

from trl_ext.rlm import ReplResult, RLMScaffoldConfig
from trl_ext.rlm import prompts as P
from trl_ext.rlm.scaffold import (
    FinalAnswer,
    build_system_prompt,
    build_turn_messages,
    describe_context,
    find_code_block,
    find_final_answer,
    format_observation,
    format_repl_output,
    truncate_output,
)


# -------------------------------------------------------------------------------------------- code blocks
def test_the_last_repl_block_is_the_one_that_runs():
    action = "Plan.\n```repl\nx = 1\n```\nThen:\n```python\nnot this\n```\n```repl\ny = x + 1\nprint(y)\n```\nDone."
    assert find_code_block(action) == "y = x + 1\nprint(y)"


def test_code_block_edge_cases():
    assert find_code_block("no code here") is None
    assert find_code_block("```repl\nx = 1") is None  # cut by the token limit: not run
    assert find_code_block("```python\nx = 1\n```") is None  # only ```repl blocks run
    assert (
        find_code_block("  ```repl\n  for i in range(2):\n      print(i)\n  ```") == "for i in range(2):\n    print(i)"
    )
    assert find_code_block("```repl  \n\n```") == ""
    assert find_code_block("```repl\ns = '```'\n```") == "s = '```'"  # a fence must start its line to close


# ------------------------------------------------------------------------------------------ final answers
@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("Done.\nFINAL(42)", FinalAnswer("FINAL", "42")),
        ("FINAL(f(x) = (a + b))\ntrailing", FinalAnswer("FINAL", "f(x) = (a + b)")),
        ("FINAL(line one\nline two)", FinalAnswer("FINAL", "line one\nline two")),
        ("  FINAL_VAR(answer)  ", FinalAnswer("FINAL_VAR", "answer")),
        ("FINAL_VAR('answer')", FinalAnswer("FINAL_VAR", "answer")),
        ('FINAL_VAR("answer")\nFINAL(later)', FinalAnswer("FINAL_VAR", "answer")),
        ("FINAL(first)\nFINAL_VAR(later)", FinalAnswer("FINAL", "first")),
        ("The answer is FINAL(42)", None),  # not on a line of its own
        ("```repl\nFINAL(42)\n```", None),  # inside code
        ("```repl\nx = 1\n```\nFINAL(after code)", FinalAnswer("FINAL", "after code")),
        ("```\nFINAL(in an unterminated fence)", None),
        ("FINAL(never closed", None),
        ("nothing", None),
    ],
)
def test_find_final_answer(action, expected):
    assert find_final_answer(action) == expected


# ------------------------------------------------------------------------------------------- formatting
def test_truncate_output():
    assert truncate_output("abcdef", 6) == "abcdef"
    assert truncate_output("abcdef", 4) == "abcd\n... [2 more characters truncated]"


def test_format_repl_output_keeps_room_for_the_error():
    assert format_repl_output(ReplResult(stdout=""), 100) == "(no output)"
    assert format_repl_output(ReplResult(stdout="out\n", error="Boom\n"), 100) == "out\nBoom"
    long = format_repl_output(ReplResult(stdout="x" * 50, error="E" * 10), 20)
    assert long == "x" * 10 + "\n... [40 more characters truncated]\n" + "E" * 10


def test_format_observation_variants():
    config = RLMScaffoldConfig()
    assert format_observation(config, ReplResult(stdout="3\n")) == "REPL output:\n3"
    assert format_observation(config, None) == P.NO_CODE_PROMPT
    assert (
        format_observation(config, None, ("ans", "NameError: no"))
        == "FINAL_VAR(ans) did not give an answer:\nNameError: no"
    )
    both = format_observation(config, ReplResult(stdout="1\n"), ("ans", "E"))
    assert both == "REPL output:\n1\n\nFINAL_VAR(ans) did not give an answer:\nE"


def test_describe_context():
    assert describe_context("abc") == "a str of 3 characters"
    assert describe_context(["ab", "cde", 7]) == "a list of 3 items (6 characters in total)"
    assert describe_context({"k": "vv"}) == "a dict with 1 keys (3 characters in total)"
    assert describe_context(12345) == "a int (5 characters as text)"


# ----------------------------------------------------------------------------------------------- prompts
def test_system_prompt_notes_the_recursion_limit():
    config = RLMScaffoldConfig(max_depth=1, max_children=3)
    top = build_system_prompt(config, "abcd", depth=0)
    leaf = build_system_prompt(config, "abcd", depth=1)
    assert "`context`: a str of 4 characters." in top and "(at most 3 per call)" in top
    assert P.LEAF_RECURSION_NOTE not in top and P.LEAF_RECURSION_NOTE in leaf


def test_turn_prompt_is_rebuilt_with_a_fresh_user_message():
    config = RLMScaffoldConfig(max_turns=3)
    first = build_turn_messages(config, "SYS", [], "Count the x.", 0)
    assert first == [
        {"role": "system", "content": "SYS"},
        {
            "role": "user",
            "content": P.FIRST_USER_PROMPT.format(task="Count the x.", turn=1, max_turns=3, turns_left=3),
        },
    ]
    assert "do not give a final answer yet" in first[-1]["content"]  # the iteration-0 safeguard
    history = [("```repl\nprint(1)\n```", "REPL output:\n1"), ("thinking", P.NO_CODE_PROMPT)]
    third = build_turn_messages(config, "SYS", history, "Count the x.", 2)
    assert third == [
        {"role": "system", "content": "SYS"},
        {"role": "assistant", "content": "```repl\nprint(1)\n```"},
        {"role": "user", "content": "REPL output:\n1"},
        {"role": "assistant", "content": "thinking"},
        {"role": "user", "content": P.NO_CODE_PROMPT},
        {"role": "user", "content": P.USER_PROMPT.format(task="Count the x.", turn=3, max_turns=3, turns_left=1)},
    ]
    assert "Turn 3 of 3 (1 left, this one included)" in third[-1]["content"]
    # the fresh message is not part of the history: the next turn's prompt does not contain turn 2's
    assert third[-1] not in build_turn_messages(config, "SYS", [*history, ("a", "b")], "Count the x.", 3)[:-1]
    with pytest.raises(ValueError, match="must follow exactly 1 earlier turns"):
        build_turn_messages(config, "SYS", [], "t", 1)


def test_templates_are_overridable():
    config = RLMScaffoldConfig(first_user_prompt="Go: {task} ({turn}/{max_turns})", repl_output_prompt="OUT {output}")
    assert build_turn_messages(config, "S", [], "t", 0)[-1]["content"] == "Go: t (1/10)"
    assert format_observation(config, ReplResult(stdout="x")) == "OUT x"


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_turns": 0}, "max_turns must be an int >= 1"),
        ({"max_depth": -1}, "max_depth must be an int >= 0"),
        ({"max_children": 2.5}, "max_children must be an int >= 1"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens must be an int >= 1"),
        ({"user_prompt": "Task {task} {unknown}"}, "user_prompt is not a valid template"),
        ({"system_prompt": "a {literal} brace"}, "literal braces must be doubled"),
    ],
)
def test_config_validation_names_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RLMScaffoldConfig(**kwargs)


def test_config_defaults_follow_the_spec():
    config = RLMScaffoldConfig()
    assert (config.max_turns, config.max_depth, config.sandbox.max_output_chars) == (10, 1, 20_000)
    assert config.sandbox.isolation == "auto" and not config.sandbox.network
    assert RLMScaffoldConfig(helpers="def f(): pass").helpers == ("def f(): pass",)


def test_scaffold_arguments_mirror_the_scaffold_settings():
    """`ScaffoldArguments` fields take the scaffold's defaults and help; `arguments_for` names them, and
    `scaffold_config` turns them back into the same settings."""
    from dataclasses import fields

    from trl_ext.rlm.sandbox import SandboxArguments, SandboxLimits
    from trl_ext.rlm.scaffold import ScaffoldArguments

    by_name = {f.name: f for f in fields(ScaffoldArguments)}
    assert by_name["max_turns"].default == 10 and by_name["max_turns"].metadata["help"].startswith("RLM scaffold: ")
    assert by_name["rlm_user_prompt"].default is None
    assert by_name["rlm_user_prompt"].metadata["help"].endswith(" None: the built-in template.")
    timeout = {f.name: f for f in fields(SandboxArguments)}["repl_timeout_s"]
    limit = SandboxLimits.__dataclass_fields__["timeout_s"]
    assert timeout.default == limit.default and timeout.metadata["help"] == f"REPL sandbox: {limit.metadata['help']}"

    settings = {"max_turns": 3, "max_depth": 0, "system_prompt": "Be brief. {context_description}"}
    arguments = ScaffoldArguments.arguments_for(**settings)
    assert arguments == {"max_turns": 3, "max_depth": 0, "rlm_system_prompt": "Be brief. {context_description}"}
    assert ScaffoldArguments(**arguments).scaffold_config().to_dict() == RLMScaffoldConfig(**settings).to_dict()
    with pytest.raises(TypeError, match=r"\['helpers'\] are not RLMScaffoldConfig limits or templates"):
        ScaffoldArguments.arguments_for(helpers=("x = 1",))
