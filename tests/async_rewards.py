"""Reward functions for TRL's asynchronous GRPO trainer in tests.

Its rollout worker scores completions in a spawned child process, which unpickles the reward functions by their
module path: they must be module-level functions of an importable module (not closures, lambdas or test-local
functions).
"""

from __future__ import annotations


def completion_text(completion) -> str:
    """The text of one completion: the last message's content (conversational) or the string itself (standard)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def vowel_share_reward(completions, **kwargs) -> list[float]:
    """Share of the completion's characters that are vowels (0 for an empty one).

    The tiny random policy's completions differ in it, so every group has a reward spread and the policy gets a
    gradient at every step.
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(sum(char in "aeiouAEIOU" for char in text) / max(len(text), 1))
    return rewards
