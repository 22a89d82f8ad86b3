"""Pure functions from scored RLM rollout trees to TRL's asynchronous training samples (docs/stepwise_rlm.md).

One prompt's ``G`` trees form one group: rewards on the roots' final answers (a root that never answered gets 0), the
group advantage as the synchronous trainer computes it (`trl_ext.advantages.group_advantages`), then one
`RolloutSample` per turn of every trained node (`tree_samples`, from `StepwiseRLM.turn_samples`): input_ids = the exact prompt ids the generator saw +
the action ids, the completion mask over the action, the sampler's log-probs as p_old, the root's advantage, and under
``rlm_loss_normalization="subtree"`` the node's per-token weight ``W(v)/n_v`` with the sample's share of its root
(`trl_ext.trainers.async_seam.weighted_sample_metrics`), which the loss turns into ``mean_g L_subtree(root_g)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...rlm import TurnSample
from ..async_seam import RolloutSample, weighted_sample_metrics
from ..async_worker import rollout_sample

__all__ = ["tree_samples"]


def tree_samples(
    turns: Sequence[TurnSample],
    *,
    advantage: float,
    model_version: int,
    group_id: int,
    metrics: Mapping[str, float],
    prompt: Any = None,
    completion: Any = None,
    weighted: bool = True,
) -> list[RolloutSample]:
    """One `RolloutSample` per trained turn of one tree.

    Args:
        turns: what the tree trains on (`RolloutTree.turn_samples`, `StepwiseRLM.turn_samples`: every turn with at
            least one action token of every trained node, with its node's ``W(v)`` and ``n_v``).
        advantage: the root's group advantage ``A_g``; every sample inherits it.
        model_version: the policy version every sample is tagged with (the trainer drops it past ``max_staleness``).
        group_id: the prompt group (TRL packs a group's samples in one row, sharing their prefixes).
        metrics: logged with each sample (``reward``, ``rewards/<name>``, ...); copied per sample.
        prompt, completion: what TRL's traces show for every sample (the task, the root's answer).
        weighted: add the loss weights of the "subtree" normalisation: the node's ``W(v)/n_v`` per token
            (``n_v``: the action tokens of all of v's trained turns) and the sample's root share
            ``W(v)/n_v · |action| / Σ_u W(u)`` (the tree's samples share 1). False: every turn an ordinary sample.

    Returns:
        The samples, nodes in pre-order, turns in order. Input ids, mask and log-probs are ``(P + C,)`` arrays with
        ``P`` the turn's prompt tokens and ``C`` its action tokens; the log-probs are 0 over the prompt.
    """
    tree_mass = sum({turn.node: turn.weight for turn in turns}.values())  # Σ_u W(u): the tree's token weights, summed
    samples = []
    for turn in turns:
        if len(turn.logprobs) != len(turn.action_ids):
            raise ValueError(
                f"node {turn.node} turn {turn.turn}: {len(turn.action_ids)} action tokens but {len(turn.logprobs)} "
                "log-probs; the generator must return one log-prob per sampled token."
            )
        if not turn.prompt_ids:
            raise ValueError(f"node {turn.node} turn {turn.turn} has no prompt ids: an action needs its prompt.")
        num_action = len(turn.action_ids)
        sample_metrics = dict(metrics)
        if weighted:
            token_weight = turn.weight / turn.node_tokens
            sample_metrics = weighted_sample_metrics(
                sample_metrics, token_weight=token_weight, root_share=token_weight * num_action / tree_mass
            )
        samples.append(
            rollout_sample(
                turn.prompt_ids,
                turn.action_ids,
                turn.logprobs,
                advantage=advantage,
                model_version=model_version,
                group_id=group_id,
                metrics=sample_metrics,
                prompt=prompt,
                completion=completion,
            )
        )
    return samples
