"""`StepwiseRLMTrainer`: the loss and gradient equal the J of docs/stepwise_rlm.md on scripted depth-2 trees; row accounting."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_ext.testing import RLM_SCRIPT_TURNS, VariantGenerator, build_tiny_model_and_tokenizer, yes_reward
from trl_ext.trainers.stepwise_rlm import StepwiseRLMConfig, StepwiseRLMTrainer

from ..utils import cpu_config_kwargs, run_processes
from .parity import grads


def make_trainer(tmp_path, prompts=("root task",), model_config=None, **overrides):
    """A trainer of the tiny model on RLM_SCRIPT's trees; ``model_config``: Qwen2Config fields, ``overrides``: config."""
    model, tokenizer = build_tiny_model_and_tokenizer(0, initializer_range=0.2, **(model_config or {}))
    settings = dict(max_depth=2, max_turns=4, loss_type="dapo", beta=0.0, max_steps=1, save_rollout_trees=True)
    settings.update(overrides)
    config = StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), **settings))
    dataset = Dataset.from_dict({"prompt": list(prompts) * 4, "context": ["abcdefgh"] * (4 * len(prompts))})
    return StepwiseRLMTrainer(
        model,
        yes_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=VariantGenerator(tokenizer),
    )


def generation_inputs(prompt: str = "root task", count: int = 4) -> list[dict]:
    return [{"prompt": prompt, "context": "abcdefgh"} for _ in range(count)]


# ----------------------------------------------------------------------------------------------------------------
# J = mean_g L_subtree(root_g), evaluated directly
# ----------------------------------------------------------------------------------------------------------------
def turn_logps(model, turn) -> torch.Tensor:
    ids = torch.tensor([turn.prompt_ids + turn.action_ids])
    logits = model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(turn.action_ids).unsqueeze(-1)).squeeze(-1)


def node_loss(model, node, advantage: float, old_logps: dict, eps_low: float, eps_high: float) -> torch.Tensor:
    """L_node(v): token mean over all of v's action tokens of the PPO-clip loss -min(ρA, clip(ρ)A)."""
    token_losses = []
    for index, turn in enumerate(node.turns):
        ratio = torch.exp(turn_logps(model, turn) - old_logps[(node.id, index)])
        clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
        token_losses.append(-torch.min(ratio * advantage, clipped * advantage))
    return torch.cat(token_losses).mean()


def subtree_loss(model, tree, node_id: int, advantage: float, old_logps: dict, eps: tuple) -> torch.Tensor:
    """L_subtree(v) = L_node(v) + (1/k_v) Σ_c L_subtree(c)  (docs/stepwise_rlm.md)."""
    node = tree.nodes[node_id]
    loss = node_loss(model, node, advantage, old_logps, *eps)
    if node.children:
        children = [subtree_loss(model, tree, child, advantage, old_logps, eps) for child in node.children]
        loss = loss + torch.stack(children).sum() / len(node.children)
    return loss


@pytest.fixture(scope="module")
def subtree_run(tmp_path_factory):
    # num_iterations=2: the batch is reused after an update, so TRL keeps old log-probs and ratios move off 1
    trainer = make_trainer(tmp_path_factory.mktemp("subtree"), num_iterations=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss below is one full step
    batch = trainer._generate_and_score_completions(generation_inputs())
    return trainer, batch


def test_trees_are_the_scripted_depth_two_trees(subtree_run):
    trainer, batch = subtree_run
    assert len(trainer.last_rollout_trees) == 4
    for tree in trainer.last_rollout_trees:
        assert [node.task for node in tree.nodes] == ["root task", "sub A", "leaf A1", "leaf A2", "sub B", "sub C"]
        assert tree.weights() == pytest.approx([1, 1 / 3, 1 / 6, 1 / 6, 1 / 3, 1 / 3])
    assert sorted(tree.final_answer for tree in trainer.last_rollout_trees) == ["no", "no", "yes", "yes"]
    assert batch["rewards"].tolist().count(1.0) == 4 * RLM_SCRIPT_TURNS["root task"] // 2


def test_loss_and_gradient_equal_direct_subtree_objective(subtree_run):
    trainer, batch = subtree_run
    model = trainer.model
    trees = trainer.last_rollout_trees
    with torch.no_grad():  # the sampling-time policy's log-probs, then an "update" that moves every ratio
        old_logps = [
            {(node.id, i): turn_logps(model, turn) for node in tree.nodes for i, turn in enumerate(node.turns)}
            for tree in trees
        ]
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))

    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    trainer_grads = grads(model)
    clip_rate = trainer._metrics["train"]["clip_ratio/region_mean"][-1]

    advantages = dict(zip(batch["rlm_root"].tolist(), batch["advantages"].tolist()))
    assert set(advantages) == {0, 1, 2, 3} and len(set(advantages.values())) == 2
    eps = (trainer.epsilon_low, trainer.epsilon_high)
    model.zero_grad()
    objective = torch.stack(
        [subtree_loss(model, tree, 0, advantages[g], old_logps[g], eps) for g, tree in enumerate(trees)]
    ).mean()
    objective.backward()
    direct_grads = grads(model)

    assert 0.0 < clip_rate < 1.0, "the perturbation should clip some tokens and not others"
    assert abs(objective.item()) > 1e-3
    assert loss.item() == pytest.approx(objective.item(), rel=1e-4)
    assert trainer_grads.keys() == direct_grads.keys() and trainer_grads
    for name in trainer_grads:  # float32 sums in another order (padded batch vs one sequence): ~1e-5 relative
        error = (trainer_grads[name] - direct_grads[name]).norm() / direct_grads[name].norm()
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"


def test_ipo_kl_tau_term_carries_the_node_weight(tmp_path):
    """Under "subtree" the node weight W(v)/n_v multiplies the node's whole IPO loss, τ(log ρ)² included:
    J = mean_g L_subtree(root_g) with L_node(v) = mean_{t in v} (−A·min(ρ_t, C) + τ·(log ρ_t)²)."""
    tau, cap = 0.5, 8.0
    trainer = make_trainer(
        tmp_path, loss_type="ipo", ipo_kl_tau=tau, ipo_threshold=1.0, ipo_ratio_cap=cap, num_iterations=2
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions(generation_inputs())
    model, trees = trainer.model, trainer.last_rollout_trees
    with torch.no_grad():
        # IPO's p_old is the sampler's own log-probs (here the scripted generator's), as with vLLM.
        old_logps = [
            {(node.id, i): torch.tensor(turn.logprobs) for node in tree.nodes for i, turn in enumerate(node.turns)}
            for tree in trees
        ]
        loss = trainer.compute_loss(model, batch).item()
        advantages = dict(zip(batch["rlm_root"].tolist(), batch["advantages"].tolist()))

        def subtree(tree, node_id, advantage, old):
            node = tree.nodes[node_id]
            tokens = []
            for index, turn in enumerate(node.turns):
                log_ratio = turn_logps(model, turn) - old[(node.id, index)]
                tokens.append(-advantage * log_ratio.exp().clamp(max=cap) + tau * log_ratio.pow(2))
            value = torch.cat(tokens).mean()
            if node.children:
                value = value + sum(subtree(tree, c, advantage, old) for c in node.children) / len(node.children)
            return value

        objective = torch.stack([subtree(tree, 0, advantages[g], old_logps[g]) for g, tree in enumerate(trees)])
        objective = objective.mean().item()
        penalty_only = torch.stack([subtree(tree, 0, 0.0, old_logps[g]) for g, tree in enumerate(trees)]).mean()
    assert penalty_only.item() > 1e-2, "the τ term should carry a visible share of the loss"
    assert loss == pytest.approx(objective, rel=1e-4)


def test_rows_are_every_turn_of_every_node_with_exact_prompts(subtree_run):
    trainer, batch = subtree_run
    real = ~batch["is_padding_row"]
    assert int(real.sum()) == 4 * RLM_SCRIPT_TURNS["root task"]
    tokenizer = trainer.processing_class
    samples = [s for tree in trainer.last_rollout_trees for s in tree.turn_samples()]
    for row, sample in enumerate(samples):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        action = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        assert prompt == sample.prompt_ids and action == sample.action_ids
    assert tokenizer.decode(samples[1].prompt_ids).count("REPL output") >= 1  # turn 2 sees turn 1's output


def test_child_sampling_one_trains_one_child_per_parent(tmp_path):
    trainer = make_trainer(tmp_path, child_sampling="one")
    trainer.model.train()
    batch = trainer._generate_and_score_completions(generation_inputs())
    real = ~batch["is_padding_row"]
    for root in range(4):
        rows = real & (batch["rlm_root"] == root)
        nodes = set(batch["rlm_node"][rows].tolist())
        tree = trainer.last_rollout_trees[root]
        trained = sorted(nodes)
        assert trained[0] == 0
        for node in trained:  # every trained node with children has exactly one trained child
            kids = [c for c in tree.nodes[node].children if c in nodes]
            assert len(kids) == (1 if tree.nodes[node].children else 0)
        assert int(rows.sum()) == sum(len(tree.nodes[n].turns) for n in nodes)
    # with one child per parent every trained node weighs 1
    counts = batch["completion_mask"].sum(-1).float()
    node_tokens = {}
    for i in torch.nonzero(real).flatten().tolist():
        key = (int(batch["rlm_root"][i]), int(batch["rlm_node"][i]))
        node_tokens[key] = node_tokens.get(key, 0) + counts[i]
    weights = batch["loss_weights"].sum(-1)
    scale = batch["completion_mask"][real].sum() / 4
    for i in torch.nonzero(real).flatten().tolist():
        key = (int(batch["rlm_root"][i]), int(batch["rlm_node"][i]))
        assert weights[i].item() == pytest.approx((counts[i] / node_tokens[key] * scale).item(), rel=1e-5)


def test_train_children_false_keeps_root_turns_only(tmp_path):
    trainer = make_trainer(tmp_path, train_children=False)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(generation_inputs())
    real = ~batch["is_padding_row"]
    assert int(real.sum()) == 4 * 2
    assert batch["rlm_depth"][real].tolist() == [0] * 8


class RowRecordingTrainer(StepwiseRLMTrainer):
    def process_scored_batch(self, batch, inputs):
        batch = super().process_scored_batch(batch, inputs)
        batch["row_id"] = torch.arange(len(batch["prompt_ids"]))
        self.expected_rows = len(batch["prompt_ids"])
        return batch

    def _compute_loss(self, model, inputs):
        self.seen.extend(inputs["row_id"][~inputs["is_padding_row"]].tolist())
        return super()._compute_loss(model, inputs)


@pytest.mark.parametrize("steps_per_generation", [1, 3, 5])
def test_no_row_dropped_for_any_steps_per_generation(tmp_path, steps_per_generation):
    model, tokenizer = build_tiny_model_and_tokenizer(0)
    config = StepwiseRLMConfig(
        **cpu_config_kwargs(
            str(tmp_path),
            max_depth=2,
            max_turns=4,
            beta=0.0,
            per_device_train_batch_size=4,
            steps_per_generation=steps_per_generation,
            max_steps=steps_per_generation,
        )
    )
    n = 4 * steps_per_generation
    dataset = Dataset.from_dict({"prompt": ["root task", "small task"] * n, "context": ["abcdefgh"] * (2 * n)})
    trainer = RowRecordingTrainer(
        model,
        yes_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        generator=VariantGenerator(tokenizer),
    )
    trainer.seen = []
    trainer.train()
    assert sorted(trainer.seen) == list(range(trainer.expected_rows))
    history = trainer.state.log_history[0]
    for key in (
        "rlm/turns_mean",
        "rlm/children_mean",
        "rlm/depth_max",
        "rlm/rows_per_root",
        "rlm/final_answer_rate",
        "repl/error_rate",
        "repl/timeout_rate",
        "rlm/padding_rows",
    ):
        assert key in history, key
    assert history["rlm/final_answer_rate"] == 1.0 and history["rlm/depth_max"] == 2.0


def test_roots_without_an_answer_get_zero_reward(tmp_path):
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = make_trainer(tmp_path, max_turns=1)  # every node is cut after turn 1: no answers at all
    trainer.reward_funcs = [always_one]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(generation_inputs())
    assert all(tree.final_answer is None for tree in trainer.last_rollout_trees)
    assert batch["rewards"].abs().sum() == 0


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="rlm_loss_normalization='subtree' needs"):
        StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), loss_type="grpo"))
    StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), loss_type="grpo", rlm_loss_normalization="token"))
    with pytest.raises(ValueError, match="child_sampling"):
        StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), child_sampling="some"))
    with pytest.raises(ValueError, match="max_turns"):
        StepwiseRLMConfig(**cpu_config_kwargs(str(tmp_path), max_turns=0))


@pytest.mark.slow
def test_two_processes_with_unequal_rows_match_one_process(tmp_path):
    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"nproc{nproc}"
        run_processes("stepwise_ddp.py", out, nproc=nproc)
        losses[nproc] = [float(x) for x in (out / "losses.txt").read_text().split()]
    rows = (tmp_path / "nproc2" / "rows.txt").read_text().split()
    assert len(set(rows)) == 2, f"the ranks should hold different row counts, got {rows}"
    assert len(losses[1]) == 2
    assert losses[2] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
