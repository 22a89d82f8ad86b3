"""`AsyncStepwiseRLMTrainer` on the CPU without vLLM: its `RolloutWorker` (of `StepwiseRLM`) runs the RLM engine
on the scripted depth-2 trees of the synchronous tests (`tests/trainers/test_stepwise_rlm.py`), the weight sync is a
no-op. The loss of a micro-batch of whole trees equals the direct ``mean_g L_subtree(root_g)`` of
docs/stepwise_rlm.md."""

from __future__ import annotations

import json
import math
import queue
import time

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.async_grpo.packing import TreeRow

from trl_ext.advantages import group_advantages
from trl_ext.rlm import RLMScaffoldConfig, ScriptedGenerator
from trl_ext.rlm.method import StepwiseRLM
from trl_ext.rlm.tree_files import TREES_FOLDER
from trl_ext.testing import RLM_SCRIPT_TURNS, VariantGenerator, build_tiny_model_and_tokenizer, yes_reward
from trl_ext.trainers import ExtAsyncGRPOConfig
from trl_ext.trainers.async_rlm import (
    AsyncStepwiseRLMConfig,
    AsyncStepwiseRLMTrainer,
)
from trl_ext.trainers.async_seam import LossWeightCollator, to_rollout_sample
from trl_ext.trainers.async_worker import RolloutWorker
from trl_ext.trainers.stepwise_rlm_config import StepwiseRLMConfig

from .test_ext_async_grpo import NoWeightSync
from .test_stepwise_rlm import turn_logps

DATASET = Dataset.from_dict({"prompt": ["root task"] * 4, "context": ["abcdefgh"] * 4})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_rlm")
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_trainer(model_dir, output_dir, generator=None, reward_funcs=yes_reward, **overrides):
    settings = dict(
        output_dir=str(output_dir), max_depth=2, max_turns=4, num_generations=4, max_inflight_tasks=4,
        per_device_train_batch_size=14, token_budget=0, max_staleness=100, max_steps=1, max_completion_length=64, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, gradient_checkpointing=False,
    )  # fmt: skip
    settings.update(overrides)
    if generator is None:  # given at construction: a trainer without one would sample from (and probe) vllm serve
        generator = VariantGenerator(AutoTokenizer.from_pretrained(str(model_dir)))
    return AsyncStepwiseRLMTrainer(
        str(model_dir),
        reward_funcs,
        args=AsyncStepwiseRLMConfig(**settings),
        train_dataset=DATASET,
        generator=generator,
        weight_transfer=NoWeightSync(),
    )


def collate(samples) -> dict[str, torch.Tensor]:
    """One micro-batch of all ``samples`` on one row, as TRL's planner and the loss-weight collator build it."""
    row = TreeRow()
    for sample in samples:
        row.add({
            "input_ids": torch.as_tensor(sample.input_ids), "completion_mask": torch.as_tensor(sample.completion_mask),
            "old_log_probs": torch.as_tensor(sample.old_log_probs), "advantage": sample.advantage,
            "group_id": sample.group_id, "metrics": sample.metrics,
        })  # fmt: skip
    return LossWeightCollator(pad_token_id=0).torch_call([[row]])


# ----------------------------------------------------------------------------------------------------------------
# The loss of whole trees = mean_g L_subtree(root_g), evaluated node by node
# ----------------------------------------------------------------------------------------------------------------
def node_loss(model, node, advantage, old, loss_type, eps, tau, cap):
    """L_node(v): token mean over v's action tokens of PPO-clip (dapo) or IPO (all kept: threshold 1)."""
    losses = []
    for index, turn in enumerate(node.turns):
        log_ratio = turn_logps(model, turn) - old[(node.id, index)]
        ratio = log_ratio.exp()
        if loss_type == "dapo":
            losses.append(-torch.min(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage))
        else:
            losses.append(-advantage * ratio.clamp(max=cap) + tau * log_ratio.pow(2))
    return torch.cat(losses).mean()


def subtree_loss(model, tree, node_id, advantage, old, *settings):
    """L_subtree(v) = L_node(v) + (1/k_v) Σ_c L_subtree(c)."""
    node = tree.nodes[node_id]
    loss = node_loss(model, node, advantage, old, *settings)
    if node.children:
        children = [subtree_loss(model, tree, child, advantage, old, *settings) for child in node.children]
        loss = loss + torch.stack(children).sum() / len(node.children)
    return loss


@pytest.mark.parametrize("loss_type", ["dapo", "ipo"])
def test_loss_of_whole_trees_equals_direct_subtree_objective(model_dir, tmp_path, loss_type):
    tau, cap = 0.5, 8.0
    trainer = make_trainer(model_dir, tmp_path, loss_type=loss_type, ipo_kl_tau=tau, ipo_threshold=1.0)
    worker = trainer.rollout_worker
    samples = worker.rollout([DATASET[0]])  # one group: 4 trees of 6 nodes
    trees = worker.method.last_trees
    assert len(trees) == 4 and len(samples) == 4 * RLM_SCRIPT_TURNS["root task"]
    assert sorted(tree.final_answer for tree in trees) == ["no", "no", "yes", "yes"]

    # The sampler's log-probs are p_old; perturb the policy so that ratios move off 1 (and PPO clips some tokens).
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in trainer.model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, collate(samples))

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    reference.load_state_dict(trainer.model.state_dict())
    advantages = group_advantages([1.0 if tree.final_answer == "yes" else 0.0 for tree in trees])
    assert {round(a, 4) for a in advantages} == {round(s.advantage, 4) for s in samples} and len(set(advantages)) == 2
    with torch.no_grad():
        objective = torch.stack(
            [
                subtree_loss(
                    reference,
                    tree,
                    0,
                    advantage,
                    {(n.id, i): torch.tensor(t.logprobs) for n in tree.nodes for i, t in enumerate(n.turns)},
                    loss_type,
                    trainer.epsilon_low,
                    tau,
                    cap,
                )  # fmt: skip
                for tree, advantage in zip(trees, advantages, strict=True)
            ]
        ).mean()
    assert abs(objective.item()) > 1e-3
    assert loss.item() == pytest.approx(objective.item(), rel=1e-4)
    if loss_type == "dapo":
        assert 0.0 < trainer._metrics[trainer.mode]["clip_ratio/region_mean"][-1] < 1.0


def test_token_normalisation_trains_turns_as_ordinary_samples(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, rlm_loss_normalization="token")
    samples = trainer.rollout_worker.rollout([DATASET[0]])
    assert not any("trl_ext/token_weight" in sample.metrics for sample in samples)
    batch = collate(samples)
    assert "loss_weights" not in batch
    trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 1
    assert math.isfinite(trainer.compute_loss(trainer.model, batch).item())


# ----------------------------------------------------------------------------------------------------------------
# Samples and advantages (pure)
# ----------------------------------------------------------------------------------------------------------------
def tree_samples(tree, turns, **fields):
    samples = StepwiseRLM.training_samples(tree, turns, advantage=0.5, group_id=7, **fields)
    return [to_rollout_sample(sample, 3, weighted=True) for sample in samples]


def test_tree_samples_are_every_turn_with_its_weight(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path)
    trainer.rollout_worker.rollout([DATASET[0]])
    tree = trainer.rollout_worker.method.last_trees[0]
    samples = tree_samples(tree, tree.turn_samples(), metrics={"reward": 1.0})
    turns = [(node, turn) for node in tree.nodes for turn in node.turns]
    assert len(samples) == len(turns) == RLM_SCRIPT_TURNS["root task"]
    weights = tree.weights()
    for sample, (node, turn) in zip(samples, turns, strict=True):
        assert sample.input_ids.tolist() == turn.prompt_ids + turn.action_ids
        assert sample.completion_mask.tolist() == [0] * len(turn.prompt_ids) + [1] * len(turn.action_ids)
        assert sample.old_log_probs[len(turn.prompt_ids) :].tolist() == pytest.approx(turn.logprobs)
        assert (sample.advantage, sample.model_version, sample.group_id) == (0.5, 3, 7)
        node_tokens = sum(len(t.action_ids) for t in node.turns)
        assert sample.metrics["trl_ext/token_weight"] == pytest.approx(weights[node.id] / node_tokens)
    assert sum(s.metrics["trl_ext/root_share"] for s in samples) == pytest.approx(1.0)
    roots_only = tree_samples(tree, tree.turn_samples(train_children=False))
    assert len(roots_only) == len(tree.root.turns)


# ----------------------------------------------------------------------------------------------------------------
# Rewards and rollout-tree files
# ----------------------------------------------------------------------------------------------------------------
def length_of_yes(completions, **kwargs):
    """3 for the answer "yes"; no reward (None) for any other."""
    return [len(text) if text.strip() == "yes" else None for text in completions]


def test_reward_weights_weigh_each_function_in_the_sum(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, reward_funcs=[yes_reward, length_of_yes], reward_weights=[2.0, -0.5])
    worker = trainer.rollout_worker
    samples = worker.rollout([DATASET[0]])
    answers = [tree.final_answer for tree in worker.method.last_trees]
    assert sorted(answers) == ["no", "no", "yes", "yes"]
    # "yes": 2·1 − 0.5·3 = 0.5; "no": 2·0, its None from length_of_yes skipped = 0.0
    expected = [0.5 if answer == "yes" else 0.0 for answer in answers]
    firsts = samples[:: RLM_SCRIPT_TURNS["root task"]]  # each tree's first sample: the samples run tree by tree
    assert [sample.metrics["reward"] for sample in firsts] == pytest.approx(expected)
    assert [sample.advantage for sample in firsts] == pytest.approx(group_advantages(expected))
    # the per-function metrics stay unweighted (NaN where a function gave no reward), as TRL logs them
    assert [sample.metrics["rewards/yes_reward"] for sample in firsts] == [float(a == "yes") for a in answers]
    lengths = [sample.metrics["rewards/length_of_yes"] for sample in firsts]
    assert [value for value in lengths if not math.isnan(value)] == [3.0, 3.0]


async def answered_and_logged(completions, rlm_has_answer, log_metric, **kwargs):
    log_metric("custom/answered", float(sum(rlm_has_answer)))
    return [1.0 if text == "yes" else 0.0 for text in completions]


def test_reward_functions_are_called_as_grpo_trainer_calls_them(model_dir, tmp_path):
    """An ``async def`` reward function is awaited and gets ``log_metric`` and ``rlm_has_answer``, as the
    synchronous trainer (TRL's reward call) gives them."""
    trainer = make_trainer(model_dir, tmp_path, reward_funcs=[answered_and_logged])
    worker = trainer.rollout_worker
    samples = worker.rollout([DATASET[0]])
    answers = [tree.final_answer for tree in worker.method.last_trees]
    firsts = samples[:: RLM_SCRIPT_TURNS["root task"]]
    assert [sample.metrics["reward"] for sample in firsts] == [float(answer == "yes") for answer in answers]
    logged = [worker.metrics_queue.get_nowait() for _ in range(worker.metrics_queue.qsize())]
    assert {"custom/answered": float(sum(answer is not None for answer in answers))} in logged


def test_reward_weights_of_the_wrong_length_are_refused_at_construction(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, 2.0\] has 2 weight\(s\) for 1 reward function"):
        make_trainer(model_dir, tmp_path, reward_weights=[1.0, 2.0])


def test_each_run_writes_its_trees_and_a_resumed_run_never_reuses_a_file(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path)
    worker = trainer.rollout_worker
    folder = tmp_path / TREES_FOLDER
    worker.update_model_version(3)
    worker.rollout([DATASET[0]])
    first_trees = worker.method.last_trees
    worker.rollout([DATASET[1]])
    first = folder / "train-v000003-run000000.jsonl"
    assert sorted(path.name for path in folder.iterdir()) == [first.name, "train-v000003-run000001.jsonl"]
    records = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    tokenizer = trainer.processing_class
    assert records == [json.loads(json.dumps(tree.to_dict(tokenizer), default=str)) for tree in first_trees]
    assert sorted(record["final_answer"] for record in records) == ["no", "no", "yes", "yes"]
    assert "Task: root task" in records[0]["nodes"][0]["turns"][0]["prompt_text"]
    assert len(records[0]["nodes"]) == 6  # the root and its five descendants

    # A resumed run: a new worker on the same folder, its version counter restored to the checkpoint's (3 again).
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    resumed = RolloutWorker(
        dataset=DATASET, reward_funcs=[yes_reward], tokenizer=tokenizer,
        generator=VariantGenerator(tokenizer),
        method=StepwiseRLM(RLMScaffoldConfig(max_depth=2, max_turns=4), tokenizer, trees_dir=folder), num_generations=4,
    )  # fmt: skip
    resumed.update_model_version(3)
    resumed.rollout([DATASET[0]])
    after = {path.name: path.read_bytes() for path in folder.iterdir()}
    assert {name: after[name] for name in before} == before  # the earlier runs' files untouched
    assert sorted(set(after) - set(before)) == ["train-v000003-run000002.jsonl"]
    assert len(after["train-v000003-run000002.jsonl"].splitlines()) == 4


def test_no_tree_files_without_save_rollout_trees(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, save_rollout_trees=False)
    trainer.rollout_worker.rollout([DATASET[0]])
    assert not (tmp_path / TREES_FOLDER).exists()


# ----------------------------------------------------------------------------------------------------------------
# The worker thread: training, faults
# ----------------------------------------------------------------------------------------------------------------
def test_trains_two_steps_on_the_worker_thread(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, loss_type="ipo", ipo_threshold=1.0, queue_maxsize=64)
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(history) == 2 and all(math.isfinite(entry["loss"]) for entry in history)
    logged = {key for entry in history for key in entry}
    assert {"rlm/turns_mean", "rlm/children_mean", "rlm/final_answer_rate", "reward", "ipo/masked_ratio"} <= logged
    assert not any(key.startswith("trl_ext/") for key in logged)  # the weights are not logged as metrics
    assert any(not torch.equal(before[name], param) for name, param in trainer.model.named_parameters())
    assert trainer.rollout_worker._stop.is_set()


class FlakyGenerator(ScriptedGenerator):
    """Fails its first ``failures`` calls, then plays VariantGenerator's script."""

    def __init__(self, tokenizer, failures: int):
        self.script_player = VariantGenerator(tokenizer)
        super().__init__(self.script_player._respond, tokenizer)
        self.failures = failures

    def generate(self, prompts):
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("the policy server went away")
        return super().generate(prompts)


def make_worker(model_dir, generator_failures: int):
    _, tokenizer = build_tiny_model_and_tokenizer(0)
    return RolloutWorker(
        dataset=DATASET, reward_funcs=[yes_reward], tokenizer=tokenizer,
        generator=FlakyGenerator(tokenizer, generator_failures),
        method=StepwiseRLM(RLMScaffoldConfig(max_depth=2, max_turns=4), tokenizer), num_generations=2,
        max_consecutive_errors=2,
    )  # fmt: skip


def drain_metric(worker, name) -> float:
    total = 0.0
    while True:
        try:
            total += worker.metrics_queue.get_nowait().get(name, 0.0)
        except queue.Empty:
            return total


def test_a_failed_run_is_counted_and_rollouts_go_on(model_dir):
    worker = make_worker(model_dir, generator_failures=1)
    worker.start()
    try:
        sample = worker.rollout_buffer.get(timeout=120)
        worker.check_health(stale_after_s=300)
    finally:
        worker.stop()
    assert sample.metrics["reward"] in (0.0, 1.0)
    assert worker.errors == 1 and drain_metric(worker, "rlm/worker_errors_total") == 1.0


def test_worker_that_keeps_failing_stops_and_check_health_names_the_cause(model_dir):
    worker = make_worker(model_dir, generator_failures=100)
    worker.start()
    deadline = time.monotonic() + 120
    while worker._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(RuntimeError, match="RLM rollout worker stopped.*2 RLM rollout runs failed") as raised:
        worker.check_health(stale_after_s=300)
    cause = raised.value.__cause__
    assert "the policy server went away" in str(cause.__cause__) or "the policy server went away" in str(cause)
    assert worker.errors == 2 and worker.rollout_buffer.empty()
    worker.stop()


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def test_config_shares_the_stepwise_names_and_meanings(tmp_path):
    config = AsyncStepwiseRLMConfig(output_dir=str(tmp_path), max_turns=3, repl_timeout_s=5.0)
    sync = StepwiseRLMConfig(output_dir=str(tmp_path))
    names = ("train_children", "child_sampling", "rlm_loss_normalization", "context_column", "scale_rewards")
    for name in (*names, "reward_weights", "save_rollout_trees"):
        assert getattr(config, name) == getattr(sync, name)
    assert config.scaffold_config().max_turns == 3 and config.scaffold_config().sandbox.timeout_s == 5.0
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        AsyncStepwiseRLMConfig(output_dir=str(tmp_path), scale_rewards="batch")
    with pytest.raises(ValueError, match="child_sampling"):
        AsyncStepwiseRLMConfig(output_dir=str(tmp_path), child_sampling="some")


def test_refuses_another_config_tools_and_a_dataset_without_prompts(model_dir, tmp_path):
    with pytest.raises(TypeError, match=r"Pass args=trl_ext.trainers.AsyncStepwiseRLMConfig\(...\)"):
        AsyncStepwiseRLMTrainer(
            str(model_dir), yes_reward, args=ExtAsyncGRPOConfig(output_dir=str(tmp_path)), train_dataset=DATASET
        )
    args = AsyncStepwiseRLMConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="tools are the RLM's REPL: do not pass environment_factory"):
        AsyncStepwiseRLMTrainer(str(model_dir), yes_reward, args=args, train_dataset=DATASET, environment_factory=dict)
    with pytest.raises(ValueError, match="needs a train_dataset with a 'prompt' column"):
        AsyncStepwiseRLMTrainer(
            str(model_dir), yes_reward, args=args, train_dataset=Dataset.from_dict({"task": ["a"]})
        )
    with pytest.raises(TypeError, match="pass callables"):
        AsyncStepwiseRLMTrainer(str(model_dir), "a/reward-model", args=args, train_dataset=DATASET)
