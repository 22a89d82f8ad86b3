"""The quickstart: the toy task, its scripted teacher, the pieces of the pipeline, and `--fast` runs end to end."""

from __future__ import annotations

import json
import random

import pytest

from trl_ext.quickstart import (
    EvalResult,
    QuickstartError,
    QuickstartSettings,
    evaluate_policy,
    held_out_eval_set,
    prepare_output_dir,
    run_quickstart,
    toy_rl_config_kwargs,
    toy_scaffold_config,
)
from trl_ext.quickstart.toy_task import (
    COMPUTE_ACTION,
    DELEGATE_ACTION,
    EXPLORE_ACTION,
    PART_TASK,
    SHORTCUT_ACTION,
    TOY_OUTPUT_CHARS,
    TOY_TASK,
    ToyTeacher,
    classify_child,
    classify_root,
    exact_match_reward,
    make_toy_dataset,
    parts_reward,
)
from trl_ext.rlm import PythonREPL, RLMEngine, RLMTask, ScriptedGenerator


def code_of(action: str) -> str:
    return action.split("```repl\n", 1)[1].split("\n```", 1)[0]


# ----------------------------------------------------------------------------------------------------------------
# The toy task
# ----------------------------------------------------------------------------------------------------------------
def test_toy_dataset_is_seeded_and_well_formed():
    first, again, other = make_toy_dataset(50, seed=3), make_toy_dataset(50, seed=3), make_toy_dataset(50, seed=4)
    assert first["context"] == again["context"] and first["context"] != other["context"]
    for row in first:
        assert 2 <= len(row["context"]) <= 3 and row["prompt"] == TOY_TASK
        answers = row["answer"].split(",")
        assert len(answers) == len(row["context"])
        for part, answer in zip(row["context"], answers):
            pairs, key_line = part.split("\n")
            values = dict(pair.split("=") for pair in pairs.split())
            assert 3 <= len(values) <= 4 and key_line.startswith("key: ")
            assert values[key_line[-1]] == answer and len(answer) == 2
            assert len(part) <= TOY_OUTPUT_CHARS  # a child can print its part whole
        assert len(str(row["context"])) > TOY_OUTPUT_CHARS  # the root cannot print the whole context
    with pytest.raises(ValueError, match="min_pairs"):
        make_toy_dataset(1, min_pairs=0)
    with pytest.raises(ValueError, match="min_parts"):
        make_toy_dataset(1, min_parts=3, max_parts=2)


def test_rewards():
    assert exact_match_reward(["13", " '13' ", "14", "", [{"role": "assistant", "content": "13"}]], ["13"] * 5) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    answers = ["13,38"] * 7
    completions = [
        "13,38",
        " 13 , '38' ",
        "13",
        "38,13",
        "13,38,13,38",
        "",
        [{"role": "assistant", "content": "13,38"}],
    ]
    assert parts_reward(completions, answers) == [1.0, 1.0, 0.5, 0.0, 0.5, 0.0, 1.0]  # extra values do not pay


def test_programs_compute_the_right_values_in_the_real_repl():
    """The lookup program is always right on a part; the shortcut only when the asked key comes first."""
    for row in make_toy_dataset(6, seed=1):
        for part, answer in zip(row["context"], row["answer"].split(",")):
            repl = PythonREPL(part)
            try:
                assert repl.execute(code_of(COMPUTE_ACTION) + "\nprint(answer)").stdout.strip() == answer
                shortcut = repl.execute(code_of(SHORTCUT_ACTION) + "\nprint(answer)").stdout.strip()
                asked_first = part.startswith(part[-1] + "=")
                assert (shortcut == answer) == asked_first or part.split()[0][2:] == answer
            finally:
                repl.close()


def _request(*contents: str) -> dict:
    roles = ["system"] + ["assistant", "user"] * ((len(contents) - 2) // 2) + ["user"]
    return {"messages": [{"role": role, "content": text} for role, text in zip(roles, contents)]}


def test_teacher_children_explore_then_answer_by_strategy():
    teacher = ToyTeacher(compute_fraction=0.4, shortcut_fraction=0.3, seed=0)
    assert teacher(_request("system", f"Turn 1 of 3. {PART_TASK}")) == EXPLORE_ACTION
    observations = [f"REPL output:\nb=4{i} d=5{i} c=6{i}\nkey: d" for i in range(200)]
    answers = [teacher(_request("system", EXPLORE_ACTION, obs, f"Turn 2 of 3. {PART_TASK}")) for obs in observations]
    counts = {action: answers.count(action) for action in (COMPUTE_ACTION, SHORTCUT_ACTION)}
    reads = [a for a in answers if a.startswith("FINAL(")]
    assert all(a == f"FINAL(5{i})" for i, a in enumerate(answers) if a.startswith("FINAL("))
    assert 0.3 < counts[COMPUTE_ACTION] / 200 < 0.5 and 0.2 < counts[SHORTCUT_ACTION] / 200 < 0.4
    assert len(reads) + sum(counts.values()) == 200
    # a seeded function of what the teacher sees: the same request gets the same action, whatever the order
    shuffled = random.Random(1).sample(range(200), 200)
    assert all(teacher(_request("system", EXPLORE_ACTION, observations[i], PART_TASK)) == answers[i] for i in shuffled)
    with pytest.raises(ValueError, match="sum to at most 1"):
        ToyTeacher(compute_fraction=0.8, shortcut_fraction=0.5)
    with pytest.raises(ValueError, match="delegate_fraction"):
        ToyTeacher(delegate_fraction=1.5)


def test_teacher_roots_delegate_or_read_what_they_saw():
    teacher = ToyTeacher(delegate_fraction=0.5, seed=0)
    truncated = "['b=41 d=52 c=63\\nkey: d', 'a=12 e=\n... [30 more characters truncated]"
    observations = [truncated.replace("b=41", f"b={10 + i}") for i in range(100)]
    answers = [teacher(_request("system", EXPLORE_ACTION, obs, f"Turn 2 of 2. {TOY_TASK}")) for obs in observations]
    assert set(answers) == {DELEGATE_ACTION, "FINAL(52)"}  # only the part shown whole is read
    assert 0.35 < answers.count(DELEGATE_ACTION) / 100 < 0.65


def teacher_engine(teacher: ToyTeacher, settings: QuickstartSettings | None = None):
    """`RLMEngine` in the toy scaffold of ``settings`` (default: the quickstart's), every node played by ``teacher``
    through a `ScriptedGenerator` and real REPLs."""
    from trl_ext.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()

    def respond(prompt_text: str) -> str:
        blocks = prompt_text.split("<|im_start|>")[1:]  # the last one is the generation prompt, not a message
        messages = [
            {"role": b.split("\n", 1)[0], "content": b.split("\n", 1)[1].rsplit("<|im_end|>", 1)[0]}
            for b in blocks
            if "<|im_end|>" in b
        ]
        return teacher({"messages": messages})

    return RLMEngine(
        ScriptedGenerator(respond, tokenizer), tokenizer, toy_scaffold_config(settings or QuickstartSettings())
    )


def test_delegating_teacher_solves_every_task_through_real_children():
    """Played by a ScriptedGenerator through RLMEngine and real REPLs: a root that delegates starts one child per
    part, the children (computing or reading) answer their parts, and the joined answers are exactly right."""
    dataset = make_toy_dataset(8, seed=2)
    engine = teacher_engine(ToyTeacher(delegate_fraction=1.0, compute_fraction=0.5, shortcut_fraction=0.0, seed=0))
    trees = engine.run([RLMTask(row["prompt"], row["context"]) for row in dataset])
    assert parts_reward([t.final_answer for t in trees], dataset["answer"]) == [1.0] * 8
    assert [len(tree.root.children) for tree in trees] == [len(row["context"]) for row in dataset]
    assert all(classify_root(tree) == "delegate" and len(tree.root.turns) == 2 for tree in trees)
    children = [tree.nodes[i] for tree in trees for i in tree.root.children]
    assert all(child.depth == 1 and child.task == PART_TASK and len(child.turns) == 2 for child in children)
    assert {classify_child(child) for child in children} == {"lookup", "copy"}


def test_reading_teacher_scores_only_the_part_it_saw():
    """A root that reads sees only the first part of print(context) (the output is cut to TOY_OUTPUT_CHARS)."""
    dataset = make_toy_dataset(8, seed=2)
    trees = teacher_engine(ToyTeacher(delegate_fraction=0.0, seed=0)).run(
        [RLMTask(row["prompt"], row["context"]) for row in dataset]
    )
    assert all(classify_root(tree) == "read" and not tree.root.children for tree in trees)
    expected = [1 / len(row["context"]) for row in dataset]
    assert parts_reward([t.final_answer for t in trees], dataset["answer"]) == expected


def test_classify_root_and_child():
    class Turn:
        def __init__(self, action):
            self.action = action

    class Node:
        def __init__(self, answer, *actions):
            self.final_answer = answer
            self.turns = [Turn(a) for a in actions]

    class Tree:
        def __init__(self, answer, *actions):
            self.final_answer = answer
            self.root = Node(answer, *actions)

    assert classify_root(Tree("13,38", EXPLORE_ACTION, DELEGATE_ACTION)) == "delegate"
    assert classify_root(Tree("13", EXPLORE_ACTION, "FINAL(13)")) == "read"
    assert classify_root(Tree(None, EXPLORE_ACTION)) == "no_answer"
    assert classify_child(Node("13", EXPLORE_ACTION, COMPUTE_ACTION)) == "lookup"
    assert classify_child(Node("13", EXPLORE_ACTION, SHORTCUT_ACTION)) == "shortcut"
    assert classify_child(Node("13", EXPLORE_ACTION, "FINAL(13)")) == "copy"
    assert classify_child(Node(None, EXPLORE_ACTION)) == "no_answer"


# ----------------------------------------------------------------------------------------------------------------
# Pipeline pieces
# ----------------------------------------------------------------------------------------------------------------
def test_held_out_eval_set_is_disjoint_from_the_training_data():
    train = make_toy_dataset(2000, seed=0)
    held_out = held_out_eval_set(48, 0, exclude=train["context"])
    assert len(held_out) == 48 and not {tuple(c) for c in held_out["context"]} & {tuple(c) for c in train["context"]}


def test_prepare_output_dir_errors(tmp_path):
    assert prepare_output_dir(tmp_path / "new" / "dir").is_dir()
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(QuickstartError, match="not a directory"):
        prepare_output_dir(file)
    with pytest.raises(QuickstartError, match="not writable"):
        prepare_output_dir(file / "below-a-file")


def test_settings_validation():
    QuickstartSettings.default().validate()
    QuickstartSettings.fast().validate()
    with pytest.raises(ValueError, match="rl_steps"):
        QuickstartSettings(rl_steps=0).validate()
    with pytest.raises(ValueError, match="num_generations"):
        QuickstartSettings(num_generations=1).validate()
    with pytest.raises(ValueError, match="rl_micro_batches=3 must divide the 32 rollouts"):
        QuickstartSettings(rl_micro_batches=3).validate()
    with pytest.raises(ValueError, match="method"):
        run_quickstart(method="ppo")


def test_rl_stage_uses_the_evaluation_scaffold(tmp_path):
    """The RL stage's scaffold fields describe the very scaffold the evaluation runs."""
    from trl_ext.trainers import StepwiseRLMConfig

    settings = QuickstartSettings(max_turns=3)
    scaffold = StepwiseRLMConfig(**toy_rl_config_kwargs(settings, tmp_path, progress=False)).scaffold_config()
    assert scaffold.to_dict() == toy_scaffold_config(settings).to_dict() and scaffold.max_turns == 3
    assert scaffold.max_depth == 1 and scaffold.sandbox.max_output_chars == TOY_OUTPUT_CHARS


def test_evaluate_policy_on_an_untrained_model(tmp_path):
    from trl_ext.testing import build_tiny_model_and_tokenizer

    model, tokenizer = build_tiny_model_and_tokenizer(0)
    settings = QuickstartSettings(num_eval_examples=3, eval_samples=2, max_completion_length=8, max_turns=2)
    eval_set = make_toy_dataset(3, seed=5)
    result = evaluate_policy(model, tokenizer, eval_set, settings, tmp_path / "trees.jsonl")
    assert isinstance(result, EvalResult) and result.rollouts == 6
    assert result.reward == 0.0 and result.strategies == {"no_answer": 1.0}
    records = [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()]
    assert len(records) == 6 and records[0]["answer"] == eval_set[0]["answer"] and "tree" in records[0]


# ----------------------------------------------------------------------------------------------------------------
# End to end (--fast; the default run is what the README's numbers come from). The stepwise pipeline's --fast
# run is tested through the command line in test_cli.py.
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", ["judge-credit", "rlmt"])
def test_fast_variants_run_and_report(method, tmp_path):
    result = run_quickstart(tmp_path, method=method, fast=True, progress=False, log=lambda line: None)
    assert result.method == method and result.train_steps == 2
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "trl_ext_run.json").is_file() and (tmp_path / "monitors.png").is_file()
    assert result.reward_first is not None and result.trust_region_mean is not None
    assert {rule: n for rule, n in result.alerts.items() if n} == {}, result.alert_log  # healthy: no alert
    if method == "judge-credit":
        assert result.extra["judge_requests"] > 0 and result.extra["judge_failure_ratio_mean"] == 0.0
        assert (tmp_path / "judge_audit.jsonl").is_file()
        assert result.extra["judge_share_mean"] > 0.0  # the scripted judge's spans reached the advantages
    else:
        assert result.extra["malformed_ratio_mean"] is not None


# The bounds the default run must meet on any machine of the CI kind. Measured (benchmarks/RESULTS.md,
# benchmarks/quickstart_ablations.py, the default arm): seeds 0-2 on three families of CPU kernels (this machine's
# AVX-512, AVX2 and the portable scalar ones, which round differently as other CPUs do), one torch thread: held-out
# gain +0.128 to +0.483, children per root +0.39 to +1.02, children answering right +6 to +42 points. Each bound is
# half the smallest change measured, so a machine that lands elsewhere in that range still passes; the README states
# the ranges.
CI_GAIN_BOUND = 0.06  # held-out reward, after RL minus SFT only
CI_CHILDREN_GAIN_BOUND = 0.19  # children per root, after RL minus SFT only
CI_CHILD_CORRECT_BOUND = 0.03  # share of children answering their part right, after RL minus SFT only


@pytest.mark.slow
def test_default_quickstart_learns(tmp_path):
    """The README's claim, checked on the default settings (a few minutes on 2 cores) with bounds that hold whatever
    the machine's rounding: children are started and trained, roots delegate more, children answer their parts right
    more often, and the held-out reward rises."""
    result = run_quickstart(tmp_path, seed=0, progress=False, log=lambda line: None)
    before, after = result.before, result.after
    assert before is not None and after is not None and before.rollouts == after.rollouts == 96
    assert result.train_steps == QuickstartSettings.default().rl_steps
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    trained_children = [h["rlm/children_mean"] for h in history if "rlm/children_mean" in h]
    assert trained_children and min(trained_children) > 0.5  # children were spawned and trained at every step
    assert any("rlm/child_answer_rate" in h for h in history)
    assert after.reward - before.reward >= CI_GAIN_BOUND, (before.reward, after.reward)
    assert after.children_mean - before.children_mean >= CI_CHILDREN_GAIN_BOUND, (before, after)
    assert after.child_correct_rate - before.child_correct_rate >= CI_CHILD_CORRECT_BOUND, (before, after)
    # the run the README calls healthy raises no monitor alert on any kernels measured (issue 40: at a constant
    # learning rate its last passes over a batch threw the policy off on AVX2 kernels, and kl_spike fired)
    assert {rule: n for rule, n in result.alerts.items() if n} == {}, result.alert_log
