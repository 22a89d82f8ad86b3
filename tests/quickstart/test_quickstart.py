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
    EXPLORE_ACTION,
    SHORTCUT_ACTION,
    ToyTeacher,
    classify_strategy,
    exact_match_reward,
    make_toy_dataset,
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
        pairs, key_line = row["context"].split("\n")
        values = dict(pair.split("=") for pair in pairs.split())
        assert 3 <= len(values) <= 5 and key_line.startswith("key: ")
        assert values[key_line[-1]] == row["answer"] and len(row["answer"]) == 2
    with pytest.raises(ValueError, match="min_pairs"):
        make_toy_dataset(1, min_pairs=0)


def test_exact_match_reward():
    assert exact_match_reward(["13", " '13' ", "14", "", [{"role": "assistant", "content": "13"}]], ["13"] * 5) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]


def test_programs_compute_the_right_values_in_the_real_repl():
    """The lookup program is always right; the shortcut only when the asked key comes first."""
    dataset = make_toy_dataset(12, seed=1)
    for row in dataset:
        repl = PythonREPL(row["context"])
        try:
            assert repl.execute(code_of(COMPUTE_ACTION) + "\nprint(answer)").stdout.strip() == row["answer"]
            shortcut = repl.execute(code_of(SHORTCUT_ACTION) + "\nprint(answer)").stdout.strip()
            asked_first = row["context"].startswith(row["context"][-1] + "=")
            assert (shortcut == row["answer"]) == asked_first or row["context"].split()[0][2:] == row["answer"]
        finally:
            repl.close()


def _request(*contents: str) -> dict:
    roles = ["system"] + ["assistant", "user"] * ((len(contents) - 2) // 2) + ["user"]
    return {"messages": [{"role": role, "content": text} for role, text in zip(roles, contents)]}


def test_teacher_explores_then_answers_by_strategy():
    teacher = ToyTeacher(compute_fraction=0.4, shortcut_fraction=0.3, seed=0)
    assert teacher(_request("system", "Turn 1 of 3. task")) == EXPLORE_ACTION
    observations = [f"REPL output:\nb=4{i} d=5{i} c=6{i}\nkey: d" for i in range(200)]
    answers = [teacher(_request("system", EXPLORE_ACTION, obs, "Turn 2 of 3. task")) for obs in observations]
    counts = {action: answers.count(action) for action in (COMPUTE_ACTION, SHORTCUT_ACTION)}
    reads = [a for a in answers if a.startswith("FINAL(")]
    assert all(a == f"FINAL(5{i})" for i, a in enumerate(answers) if a.startswith("FINAL("))
    assert 0.3 < counts[COMPUTE_ACTION] / 200 < 0.5 and 0.2 < counts[SHORTCUT_ACTION] / 200 < 0.4
    assert len(reads) + sum(counts.values()) == 200
    # a seeded function of what the teacher sees: the same request gets the same action, whatever the order
    shuffled = random.Random(1).sample(range(200), 200)
    assert all(teacher(_request("system", EXPLORE_ACTION, observations[i], "t")) == answers[i] for i in shuffled)
    with pytest.raises(ValueError, match="sum to at most 1"):
        ToyTeacher(0.8, 0.5)


def test_teacher_traces_through_the_real_scaffold():
    """Played by a ScriptedGenerator through RLMEngine: two turns, correct answers for compute and read traces."""
    from trl_ext.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    teacher = ToyTeacher(compute_fraction=0.5, shortcut_fraction=0.0, seed=0)

    def respond(prompt_text: str) -> str:
        blocks = prompt_text.split("<|im_start|>")[1:]
        messages = [
            {"role": b.split("\n", 1)[0], "content": b.split("\n", 1)[1].rsplit("<|im_end|>", 1)[0]}
            for b in blocks
            if "\n" in b and b.split("\n", 1)[0] in ("system", "user", "assistant")
        ]
        return teacher({"messages": messages})

    dataset = make_toy_dataset(8, seed=2)
    engine = RLMEngine(ScriptedGenerator(respond, tokenizer), tokenizer, toy_scaffold_config(QuickstartSettings()))
    trees = engine.run([RLMTask(row["prompt"], row["context"]) for row in dataset])
    assert exact_match_reward([t.final_answer for t in trees], dataset["answer"]) == [1.0] * 8
    assert all(len(tree.root.turns) == 2 for tree in trees)
    kinds = {classify_strategy(tree) for tree in trees}
    assert kinds == {"lookup", "copy"}


def test_classify_strategy():
    class Turn:
        def __init__(self, action):
            self.action = action

    class Node:
        def __init__(self, *actions):
            self.turns = [Turn(a) for a in actions]

    class Tree:
        def __init__(self, answer, *actions):
            self.final_answer = answer
            self.nodes = [Node(*actions)]

    assert classify_strategy(Tree("13", EXPLORE_ACTION, COMPUTE_ACTION)) == "lookup"
    assert classify_strategy(Tree("13", EXPLORE_ACTION, SHORTCUT_ACTION)) == "shortcut"
    assert classify_strategy(Tree("13", EXPLORE_ACTION, "FINAL(13)")) == "copy"
    assert classify_strategy(Tree(None, EXPLORE_ACTION)) == "no_answer"


# ----------------------------------------------------------------------------------------------------------------
# Pipeline pieces
# ----------------------------------------------------------------------------------------------------------------
def test_held_out_eval_set_is_disjoint_from_the_training_data():
    train = make_toy_dataset(2000, seed=0)
    held_out = held_out_eval_set(48, 0, exclude=train["context"])
    assert len(held_out) == 48 and not set(held_out["context"]) & set(train["context"])


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
    with pytest.raises(ValueError, match="rl_micro_batches=3 must divide the 64 rollouts"):
        QuickstartSettings(rl_micro_batches=3).validate()
    with pytest.raises(ValueError, match="method"):
        run_quickstart(method="ppo")


def test_rl_stage_uses_the_evaluation_scaffold(tmp_path):
    """The RL stage's scaffold fields describe the very scaffold the evaluation runs."""
    from dataclasses import fields

    from trl_ext.rlm.scaffold import ScaffoldArguments

    settings = QuickstartSettings(max_turns=3)
    names = {f.name for f in fields(ScaffoldArguments)}
    kwargs = toy_rl_config_kwargs(settings, tmp_path, progress=False)
    scaffold = ScaffoldArguments(**{k: v for k, v in kwargs.items() if k in names}).scaffold_config()
    assert scaffold.to_dict() == toy_scaffold_config(settings).to_dict() and scaffold.max_turns == 3


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
    assert result.reward_first is not None and result.masked_ratio_mean is not None
    if method == "judge-credit":
        assert result.extra["judge_requests"] > 0 and result.extra["judge_failure_ratio_mean"] == 0.0
        assert (tmp_path / "judge_audit.jsonl").is_file()
        assert result.extra["judge_share_mean"] > 0.0  # the scripted judge's spans reached the advantages
    else:
        assert result.extra["malformed_ratio_mean"] is not None


# The bounds the default run must meet on any machine of the CI kind, from benchmarks/quickstart_spread.py (seeds 0-4,
# each with torch's native CPU kernels and with the scalar ones, which round differently as another CPU does; the
# table is in benchmarks/RESULTS.md). The robust sign of learning is that RL drives out copying values by hand (the
# strategy that is mostly wrong): every measured run's copied share fell by at least twice CI_COPY_DROP_BOUND. The
# held-out gain itself ranged from about 0 to +0.47, so the gain bound only says that RL did not make the policy
# worse beyond the evaluation's noise (about 0.05 on 192 rollouts); the README states the measured range.
CI_COPY_DROP_BOUND = 0.05
CI_GAIN_BOUND = -0.10


@pytest.mark.slow
def test_default_quickstart_learns(tmp_path):
    """The README's claim, checked on the default settings (several minutes on 2 cores) with bounds that hold whatever
    the machine's rounding: RL drives out copying values by hand, and does not make the held-out reward worse beyond
    the evaluation's noise."""
    result = run_quickstart(tmp_path, seed=0, progress=False, log=lambda line: None)
    before, after = result.before, result.after
    assert before is not None and after is not None and before.rollouts == after.rollouts == 192
    assert result.train_steps == 40
    assert after.reward - before.reward >= CI_GAIN_BOUND, (before.reward, after.reward)
    copied_before, copied_after = before.strategies.get("copy", 0.0), after.strategies.get("copy", 0.0)
    assert copied_before - copied_after >= CI_COPY_DROP_BOUND, (before.strategies, after.strategies)
