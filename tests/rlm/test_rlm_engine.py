"""The rollout engine driven by scripted policies: exact trees, prompts, answers, batching and failures."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import psutil
import pytest

from trl_ext.rlm import (
    Completion,
    GeneratorError,
    RLMEngine,
    RLMScaffoldConfig,
    RLMTask,
    SandboxLimits,
    ScriptedGenerator,
    critical_path_generations,
)
from trl_ext.rlm import prompts as P
from trl_ext.rlm.scaffold import build_system_prompt
from trl_ext.testing import build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()
_TASK_AND_TURN = re.compile(r"Task: (.*?)\n\nTurn (\d+) of", re.DOTALL)


def scripted(
    table: Mapping[str, Sequence[str]], llm: Callable[[str], str] = lambda prompt: f"LLM<{prompt}>"
) -> ScriptedGenerator:
    """A policy that plays `table[task][turn]`; prompts without a task (llm_query) get `llm(prompt)`."""

    def respond(prompt: str) -> str:
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        match = _TASK_AND_TURN.search(last_user)
        if match is None:
            return llm(last_user)
        return table[match.group(1)][int(match.group(2)) - 1]

    return ScriptedGenerator(respond, TOKENIZER)


def render(messages: list[dict[str, str]]) -> str:
    return TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def expected_prompt(
    config: RLMScaffoldConfig, context: str, depth: int, task: str, history: list[tuple[str, str]]
) -> str:
    turn = len(history)
    messages = [{"role": "system", "content": build_system_prompt(config, context, depth)}]
    for action, observation in history:
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
    template = config.first_user_prompt if turn == 0 else config.user_prompt
    fresh = template.format(task=task, turn=turn + 1, max_turns=config.max_turns, turns_left=config.max_turns - turn)
    return render([*messages, {"role": "user", "content": fresh}])


def _repl_processes() -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True) if child.status() != psutil.STATUS_ZOMBIE]


# ------------------------------------------------------------------------------------------ depth-2 trees
ROOT = [
    "Plan.\n```repl\nanswers = rlm_query_batched(['sub A', 'sub B'], context_list=[context[:4], context[4:]])\nprint(answers)\n```",
    "```repl\nresult = ' & '.join(answers)\n```",
    "FINAL_VAR(result)",
]
SUB_A = ["```repl\ninner = rlm_query_batched(['leaf A1'])\nprint(inner)\n```", "FINAL(A done)"]
SUB_B = [
    "```repl\n1/0\n```",  # a REPL error
    "I am thinking.",  # neither code nor answer
    "```repl\nb = context.upper()\n```",
    "FINAL_VAR(missing)",  # no such variable; the last turn: max_turns
]
LEAF_A1 = [
    "```repl\nv = rlm_query('deep question')\nw = llm_query('plain question')\n```",  # at max depth: both plain
    "```repl\nFINAL_VAR('v')\n```",  # the answer set from code
]
TABLE = {"root task": ROOT, "sub A": SUB_A, "sub B": SUB_B, "leaf A1": LEAF_A1}
NO_ANSWER = P.CHILD_NO_ANSWER.format(end_reason="max_turns")


@pytest.fixture(scope="module")
def depth_two_run():
    config = RLMScaffoldConfig(max_turns=4, max_depth=2, max_children=3, sandbox=SandboxLimits(timeout_s=5))
    generator = scripted(TABLE)
    engine = RLMEngine(generator, TOKENIZER, config)
    trees = engine.run([RLMTask("root task", "abcdefgh"), RLMTask("root task", "abcdefgh")])
    return config, generator, engine, trees


def test_depth_two_tree_structure_and_answers(depth_two_run):
    _, _, _, trees = depth_two_run
    for tree in trees:
        assert [node.task for node in tree.nodes] == ["root task", "sub A", "leaf A1", "sub B"]
        assert tree.parents() == [None, 0, 1, 0]
        assert [node.depth for node in tree.nodes] == [0, 1, 2, 1]
        assert tree.weights() == [1.0, 0.5, 0.5, 0.5]
        assert [node.end_reason for node in tree.nodes] == [
            "final_answer",
            "final_answer",
            "final_answer",
            "max_turns",
        ]
        assert [node.final_answer for node in tree.nodes] == [
            f"A done & {NO_ANSWER}",
            "A done",
            "LLM<deep question>",
            None,
        ]
        assert tree.final_answer == f"A done & {NO_ANSWER}"
        assert [len(node.turns) for node in tree.nodes] == [3, 2, 2, 4]
        assert [node.spawned_at for node in tree.nodes] == [None, (0, 0), (0, 0), (0, 0)]
        assert tree.nodes[0].turns[0].children == [1, 3] and tree.nodes[1].turns[0].children == [2]
        assert [node.context_description for node in tree.nodes] == [
            "a str of 8 characters",
            "a str of 4 characters",
            "a str of 7 characters",
            "a str of 4 characters",
        ]


def test_depth_two_turn_records(depth_two_run):
    _, _, _, trees = depth_two_run
    root, sub_a, leaf, sub_b = trees[0].nodes
    assert [turn.action for turn in root.turns] == ROOT
    assert (
        root.turns[0].code
        == "answers = rlm_query_batched(['sub A', 'sub B'], context_list=[context[:4], context[4:]])\nprint(answers)"
    )
    assert root.turns[0].observation == f"REPL output:\n['A done', '{NO_ANSWER}']"
    assert root.turns[2].code is None and root.turns[2].observation is None  # the last turn answered
    # the grandchild at max depth: its rlm_query became a plain completion, recorded with its ids
    assert [(call.request, call.prompt, call.completion) for call in leaf.turns[0].llm_calls] == [
        (0, "deep question", "LLM<deep question>"),
        (1, "plain question", "LLM<plain question>"),
    ]
    call = leaf.turns[0].llm_calls[0]
    assert TOKENIZER.decode(call.prompt_ids, skip_special_tokens=False) == render(
        [{"role": "user", "content": "deep question"}]
    )
    assert call.completion_ids == TOKENIZER("LLM<deep question>")["input_ids"] + [TOKENIZER.eos_token_id]
    assert leaf.turns[1].repl_result.final_answer == "LLM<deep question>"
    # the child that never answered: a REPL error, a codeless turn, a silent cell, a FINAL_VAR of nothing
    assert sub_b.turns[0].repl_result.error.endswith("ZeroDivisionError: division by zero\n")
    assert sub_b.turns[0].observation == (
        "REPL output:\nTraceback (most recent call last):\n"
        '  File "<repl-1>", line 1, in <module>\n    1/0\n     ~^~\nZeroDivisionError: division by zero'
    )
    assert sub_b.turns[1].repl_result is None and sub_b.turns[1].observation == P.NO_CODE_PROMPT
    assert sub_b.turns[2].observation == "REPL output:\n(no output)"
    assert sub_b.turns[3].observation.startswith("FINAL_VAR(missing) did not give an answer:\nTraceback")
    assert "NameError: FINAL_VAR('missing'): no variable named 'missing'" in sub_b.turns[3].observation
    for node in trees[0].nodes:
        for turn in node.turns:
            assert turn.action_ids[-1] == TOKENIZER.eos_token_id and turn.logprobs == [0.0] * len(turn.action_ids)


def test_depth_two_prompts_are_rebuilt_exactly(depth_two_run):
    config, generator, _, trees = depth_two_run
    root, sub_a, leaf, sub_b = trees[0].nodes
    observations = {
        "root task": [root.turns[0].observation, "REPL output:\n(no output)"],
        "sub B": [node_turn.observation for node_turn in sub_b.turns],
    }
    cases = [(root, "abcdefgh", ROOT), (sub_a, "abcd", SUB_A), (leaf, "leaf A1", LEAF_A1), (sub_b, "efgh", SUB_B)]
    for node, context, actions in cases:
        for index, turn in enumerate(node.turns):
            history = [(actions[i], node.turns[i].observation) for i in range(index)]
            if node.task in observations:
                assert [obs for _, obs in history] == observations[node.task][:index]
            prompt = expected_prompt(config, context, node.depth, node.task, history)
            assert TOKENIZER.decode(turn.prompt_ids, skip_special_tokens=False) == prompt
            assert turn.prompt_ids == TOKENIZER(prompt, add_special_tokens=False)["input_ids"]
            assert prompt in generator.prompts  # these very ids were what the generator got
    assert "do not give a final answer yet" in TOKENIZER.decode(root.turns[0].prompt_ids)  # iteration-0 safeguard
    assert P.LEAF_RECURSION_NOTE.strip() in TOKENIZER.decode(leaf.turns[0].prompt_ids)


def test_depth_two_batching_is_one_call_per_wave(depth_two_run):
    _, generator, engine, trees = depth_two_run
    # waves: root t0 | A t0, B t0 | A1 t0, B t1 | A1 query 0, B t2 | A1 query 1, B t3 | A1 t1 | A t1 | root t1 | root t2
    assert generator.batch_sizes == [2, 4, 4, 4, 4, 2, 2, 2, 2]
    assert critical_path_generations(trees[0]) == engine.stats.generator_calls == 9
    stats = engine.stats
    assert (stats.nodes, stats.turns, stats.children, stats.sequences) == (8, 22, 6, 26)
    assert (stats.llm_queries, stats.degraded_rlm_queries, stats.repl_cells) == (4, 2, 14)
    assert (stats.repl_errors, stats.malformed_actions, stats.final_answers, stats.max_turns) == (2, 2, 6, 2)
    assert stats.node_errors == stats.repl_timeouts == stats.refused_queries == 0


# ------------------------------------------------------------------------------------------ limits, failures
def run_one(table, llm=lambda prompt: f"LLM<{prompt}>", timeout_s=5, max_answer_chars=100_000, **config_kwargs):
    limits = SandboxLimits(timeout_s=timeout_s, max_answer_chars=max_answer_chars)
    config = RLMScaffoldConfig(sandbox=limits, **config_kwargs)
    engine = RLMEngine(scripted(table, llm), TOKENIZER, config)
    [tree] = engine.run([RLMTask("t", "ctx")])
    return tree, engine.stats


def test_timeout_then_restart_notice():
    table = {"t": ["```repl\nx = 5\nwhile True:\n    pass\n```", "```repl\nprint(x)\n```", "FINAL(gave up)"]}
    tree, stats = run_one(table, timeout_s=0.5)
    first, second, _ = tree.root.turns
    assert first.repl_result.timed_out
    assert first.observation.startswith("REPL output:\nTimeoutError: the cell did not finish within 0.5 s.")
    notice = "[The REPL was restarted because the previous cell exceeded the 0.5 s time limit."
    assert second.observation.startswith(f"REPL output:\n{notice}")
    assert "NameError: name 'x' is not defined" in second.observation
    assert tree.final_answer == "gave up"
    assert (stats.repl_timeouts, stats.repl_restarts, stats.repl_errors) == (1, 1, 1)


def test_max_turn_exhaustion():
    tree, stats = run_one({"t": ["hmm", "```repl\nprint('x')\n```", "still thinking"]}, max_turns=3)
    assert tree.root.end_reason == "max_turns" and tree.final_answer is None
    assert [turn.observation for turn in tree.root.turns] == [P.NO_CODE_PROMPT, "REPL output:\nx", P.NO_CODE_PROMPT]
    assert stats.malformed_actions == 2 and stats.max_turns == 1


def test_crash_is_recorded_and_the_rollout_goes_on():
    tree, stats = run_one({"t": ["```repl\nimport os\nos._exit(7)\n```", "```repl\nprint('again')\n```", "FINAL(ok)"]})
    assert tree.root.turns[0].repl_result.crashed
    assert "The REPL process exited with status 7" in tree.root.turns[0].observation
    assert tree.root.turns[1].observation.endswith("loaded again.]\nagain")
    assert tree.final_answer == "ok" and stats.repl_crashes == 1 and stats.repl_restarts == 1


def test_an_answer_over_the_cap_is_cut_and_counted():
    table = {"t": ["```repl\nanswer = 'z' * 5000\nFINAL_VAR('answer')\n```"]}
    tree, stats = run_one(table, max_answer_chars=100)
    assert tree.final_answer == "z" * 100 and tree.root.turns[0].repl_result.answer_truncated
    assert stats.truncated_answers == 1


def test_too_many_children_in_one_call_is_refused():
    table = {"t": ["```repl\nrlm_query_batched(['a', 'b', 'c'])\n```", "FINAL(no)"]}
    tree, stats = run_one(table, max_children=2)
    assert tree.root.turns[0].observation.endswith(
        "RuntimeError: rlm_query_batched failed: rlm_query_batched got 3 prompts, but one call may start at most "
        "max_children=2 sub-agents; split them over several calls or use llm_query_batched"
    )
    assert len(tree.nodes) == 1 and stats.refused_queries == 1


def test_child_budget_and_depth_zero_degrade_to_llm_query():
    table = {
        "t": ["```repl\nr = rlm_query_batched(['a', 'b'])\nprint(r)\n```", "FINAL(done)"],
        "a": ["FINAL(child a)"],
    }
    tree, stats = run_one(table, max_total_children=1)
    assert [node.task for node in tree.nodes] == ["t", "a"]
    assert tree.root.turns[0].observation == "REPL output:\n['child a', 'LLM<b>']"
    assert stats.children == 1 and stats.degraded_rlm_queries == 1
    tree, stats = run_one(table, max_depth=0)
    assert len(tree.nodes) == 1 and tree.root.turns[0].observation == "REPL output:\n['LLM<a>', 'LLM<b>']"
    assert stats.degraded_rlm_queries == 2


def test_prompt_too_long_ends_the_node_and_refuses_long_queries():
    tree, stats = run_one({"t": ["FINAL(x)"]}, max_prompt_tokens=10)
    assert tree.root.end_reason == "prompt_too_long" and tree.root.turns == [] and stats.prompt_too_long == 1
    table = {"t": ["```repl\nllm_query('qz' * 1000)\n```", "FINAL(x)"]}
    short = {"system_prompt": "S", "first_user_prompt": "Task: {task}\n\nTurn {turn} of {max_turns}"}
    tree, stats = run_one(table, max_prompt_tokens=400, user_prompt=short["first_user_prompt"], **short)
    assert len(tree.root.turns[1].prompt_ids) <= 400
    assert "RuntimeError: llm_query failed: a prompt of " in tree.root.turns[0].observation
    assert "tokens is longer than max_prompt_tokens=400; shorten it (it starts 'qzqz" in tree.root.turns[0].observation
    assert stats.refused_queries == 1 and tree.final_answer == "x"


def test_final_var_from_an_earlier_turn():
    tree, _ = run_one({"t": ["```repl\nanswer = sum(range(5))\n```", "FINAL_VAR(answer)"]})
    assert tree.final_answer == "10" and len(tree.root.turns) == 2


def test_max_batch_size_caps_every_call():
    generator = scripted({f"t{i}": ["FINAL(done)"] for i in range(5)})
    engine = RLMEngine(generator, TOKENIZER, RLMScaffoldConfig(max_batch_size=2))
    trees = engine.run([f"t{i}" for i in range(5)])
    assert [tree.final_answer for tree in trees] == ["done"] * 5
    assert generator.batch_sizes == [2, 2, 1]


def test_a_repl_that_cannot_start_is_a_node_error_not_an_exception():
    generator = scripted({"t": ["```repl\nprint(1)\n```"]})
    engine = RLMEngine(generator, TOKENIZER, RLMScaffoldConfig(helpers=("raise ValueError('broken helper')",)))
    [tree] = engine.run(["t"])
    assert tree.root.end_reason == "error" and "ValueError: broken helper" in tree.root.error
    assert engine.stats.node_errors == 1


class _FailingGenerator:
    def __init__(self, fail_on_call: int) -> None:
        self.inner = scripted(
            {
                "t": ["```repl\nr = rlm_query_batched(['c1', 'c2'])\n```", "FINAL(x)"],
                "c1": ["```repl\nimport time\n```"] * 3,
                "c2": ["```repl\nx = 1\n```"] * 3,
            }
        )
        self.calls = 0
        self.fail_on_call = fail_on_call

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self.inner.generate(prompts)


def test_generator_failure_aborts_the_run_and_closes_every_repl():
    before = {process.pid for process in _repl_processes()}
    engine = RLMEngine(_FailingGenerator(fail_on_call=3), TOKENIZER, RLMScaffoldConfig(max_turns=3))
    with pytest.raises(GeneratorError, match="CUDA out of memory"):
        engine.run(["t", "t"])
    leftover = [process for process in _repl_processes() if process.pid not in before]
    assert leftover == []


def test_generator_returning_the_wrong_count_is_an_error():
    class Short:
        def generate(self, prompts):
            return []

    with pytest.raises(GeneratorError, match="returned 0 completions for 1 prompts"):
        RLMEngine(Short(), TOKENIZER).run(["t"])


def test_generator_raising_stop_iteration_fails_instead_of_hanging():
    # StopIteration cannot cross an asyncio Future: unguarded, the run would wait forever.
    class Exhausted:
        def generate(self, prompts):
            return [next(iter([]))]

    with pytest.raises(GeneratorError, match="StopIteration"):
        RLMEngine(Exhausted(), TOKENIZER).run(["t"])


def test_engine_input_validation():
    with pytest.raises(TypeError, match="generate"):
        RLMEngine(object(), TOKENIZER)
    with pytest.raises(TypeError, match="RLMTask objects or prompt strings"):
        RLMEngine(scripted({}), TOKENIZER).run([42])
    assert RLMEngine(scripted({}), TOKENIZER).run([]) == []


def test_degraded_rlm_query_inlines_its_context():
    table = {"t": ["```repl\nr = rlm_query('sum it', context=[1, 2])\nprint(r)\n```", "FINAL(done)"]}
    tree, stats = run_one(table, max_depth=0)
    [call] = tree.root.turns[0].llm_calls
    assert call.prompt == "sum it\n\nContext:\n[1, 2]"
    assert tree.root.turns[0].observation == "REPL output:\nLLM<sum it\n\nContext:\n[1, 2]>"
    assert stats.degraded_rlm_queries == 1 and len(tree.nodes) == 1


def test_max_batch_wait_stops_a_slow_cell_from_holding_back_the_others():
    table = {
        "slow": ["```repl\nimport time\ntime.sleep(1.0)\n```", "FINAL(s)"],
        "fast": ["```repl\nx = 1\n```", "```repl\ny = 2\n```", "FINAL(f)"],
    }
    waves = scripted(table)
    RLMEngine(waves, TOKENIZER, RLMScaffoldConfig(sandbox=SandboxLimits(timeout_s=5))).run(["slow", "fast"])
    assert waves.batch_sizes == [2, 2, 1]  # one call per wave: "fast" waited for "slow"
    eager = scripted(table)
    RLMEngine(eager, TOKENIZER, RLMScaffoldConfig(sandbox=SandboxLimits(timeout_s=5), max_batch_wait_s=0.1)).run(
        ["slow", "fast"]
    )
    assert eager.batch_sizes == [2, 1, 1, 1]  # "fast" went on alone while "slow" slept


class RowDraws:
    """A generator whose completion depends on the row it lands in, as batched sampling does (row i gets the i-th
    random draw): a child answers with its row number; everything else follows `respond`."""

    def __init__(self, respond: Callable[[str], str]):
        self.respond = respond

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        completions = []
        for row, prompt in enumerate(prompts):
            text = TOKENIZER.decode(list(prompt), skip_special_tokens=False)
            action = f"FINAL(row{row})" if "Task: part" in text else self.respond(text)
            ids = list(TOKENIZER(action, add_special_tokens=False)["input_ids"]) + [TOKENIZER.eos_token_id]
            completions.append(Completion(ids, [0.0] * len(ids)))
        return completions


def test_identical_prompts_of_different_nodes_get_the_same_draws_whatever_the_timing():
    """Children given different contexts of one length have identical prompts (their context is in the REPL, not the
    prompt), so only their place in the rollouts tells them apart. Roots whose REPL cells take a random time start
    their children in a different order each run; each child must still get the same row of every batch."""
    root_action = (
        "```repl\nimport random, time\ntime.sleep(random.random() / 20)\n"
        "answer = ','.join(rlm_query_batched(['part'] * 3, [context + str(i) for i in range(3)]))\n```\nFINAL_VAR(answer)"
    )

    def respond(text: str) -> str:
        return root_action

    config = RLMScaffoldConfig(max_turns=1, max_depth=1)
    tasks = [RLMTask("root task", context=str(10 + i)) for i in range(6)]
    runs = [
        [tree.final_answer for tree in RLMEngine(RowDraws(respond), TOKENIZER, config).run(tasks)] for _ in range(4)
    ]
    assert all(len(set(answer.split(","))) == 3 for answer in runs[0])  # 18 children, one call, 18 distinct rows
    assert runs[1] == runs[0] and runs[2] == runs[0] and runs[3] == runs[0]
    assert runs[0][0] == "row0,row1,row2"  # in the order of the rollouts: tree 0's children come first
