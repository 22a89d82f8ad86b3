"""What the async seam takes from TRL's experimental asynchronous trainer, as data, and `check_trl_async`, which
compares it with the installed TRL.

`check_trl_async` runs when the seam is imported: a TRL whose overridden methods, replaced module attributes,
private attributes or collated batch differ from these fails at once, with the fix, instead of minutes into a run.
"""

from __future__ import annotations

import ast
import inspect

import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer, packing
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample

from ..trl_seam.check import (
    assigned_attributes,
    attribute_problems,
    raise_if_problems,
    signature_problems,
    source_tree,
)

__all__ = [
    "ASYNC_ATTRIBUTES",
    "ASYNC_MODULE_ATTRIBUTES",
    "ASYNC_SEAM",
    "ROLLOUT_WORKER_ATTRIBUTES",
    "ROLLOUT_WORKER_SEAM",
    "ROLLOUT_SAMPLE_FIELDS",
    "BATCH_KEYS",
    "RolloutSample",
    "FORWARD_KEYS",
    "KERNEL_KEYWORDS",
    "LOSS_WEIGHT_INTERNALS",
    "TOKEN_CREDIT_INTERNALS",
    "check_trl_async",
]

# AsyncGRPOTrainer methods the seam (or a trl-ext trainer) overrides -> their parameter names.
ASYNC_SEAM: dict[str, tuple[str, ...]] = {
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "_save_checkpoint": ("self", "model", "trial"),  # faults.save_rollout_state for trl-ext's workers
    "_inner_training_loop": ("self", "args", "kwargs"),  # faults.restore_rollout_state
    "_sync_weight": ("self",),  # AsyncSeam: a sync that cannot reach the server names it
}
# AsyncRolloutWorker (TRL's own worker) methods the seam wraps (`faults.guard_rollout_worker`) -> parameter names,
# and the attributes it reads: ``_process`` (the spawned child, assigned in __init__ and start), ``_heartbeat_value``
# (the child's last tick, wall-clock seconds) and ``_failed_event`` (set when the child failed with an exception).
ROLLOUT_WORKER_SEAM: dict[str, tuple[str, ...]] = {
    "check_health": ("self", "stale_after_s"),
    "stop": ("self",),
}
ROLLOUT_WORKER_ATTRIBUTES: tuple[str, ...] = ("_process", "_heartbeat_value", "_failed_event")
# The fields trl-ext's rollout workers fill in `RolloutSample` (`trl_ext.trainers.async_seam.samples.to_rollout_sample`).
ROLLOUT_SAMPLE_FIELDS: tuple[str, ...] = (
    "prompt", "completion", "input_ids", "completion_mask", "old_log_probs", "advantage", "model_version", "group_id",
    "metrics",
)  # fmt: skip
# The leading parameters of AsyncGRPOTrainer.__init__ the seam passes on by position.
INIT_PARAMETERS: tuple[str, ...] = ("self", "model", "reward_funcs", "args")

# Module attributes `install_cpu_support` replaces -> their parameter names.
ASYNC_MODULE_ATTRIBUTES: dict[tuple[object, str], tuple[str, ...]] = {
    (packing, "_flash_attn"): (),  # TRL's FA3 fetch through `kernels`
    (async_grpo_trainer, "get_peak_flops_per_device"): ("accelerator", "dtype"),  # calls torch.cuda unconditionally
    # one per periodic task (weight sync, step metrics): AsyncSeam.add_callback keeps the second without a notice
    (async_grpo_trainer, "StepIntervalCallback"): ("fn", "every_n_steps"),
}

# The keywords `packing.tree_attention` passes to the kernel's ``flash_attn_varlen_func`` besides the 7 positional
# arguments: `trl_ext.attention.flash_attn_varlen_cpu` must take each.
KERNEL_KEYWORDS: tuple[str, ...] = ("softmax_scale", "causal", "window_size", "softcap")

# Attributes the seam reads or writes on the trainer: set by AsyncGRPOTrainer's methods (``self.<name> = ...``) or
# class attributes. Private ones first.
ASYNC_ATTRIBUTES: tuple[str, ...] = (
    "_metrics",  # {"train"|"eval": {name: [values]}}: what TRL reduces into each log (`_reduce_metric`)
    "_step_forward_tokens",  # one optimizer step's accounting, flushed by `_log_step_metrics`
    "_step_trained_tokens",
    "_step_seq_len_weighted",
    "_step_samples",
    "_step_forward_s",
    "_last_forward_time_s",
    "_tag_names",  # the model card: tags, method name, paper
    "_name",
    "_paper",
    "aux_loss_enabled",  # the MoE load-balancing loss of the forward
    "epsilon_low",  # the PPO-clip range: ExtAsyncGRPOTrainer's loss_type="dapo" (trl_ext.losses.ppo_clip_loss)
    "epsilon_high",
    "router_aux_loss_coef",
    "_lora_sync",  # policy.served_policy_names: whether syncs publish a LoRA adapter, and under which prefix
    "_lora_name",
    "_get_output_dir",  # faults: the checkpoint folder a save writes (transformers.Trainer's)
    "_trained_groups",  # faults: the group ids TRL's collator has trained on (where a worker's dataset resumes)
    "rollout_queue",  # what get_train_dataloader hands RolloutQueueDataset: wrapped by weights.VersionTaggedQueue
)

# Keys of a batch of TRL's collator (`DataCollatorForRollout`): the packed row (`TreeRow.pack`) and the counts.
BATCH_KEYS: frozenset[str] = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "shift_labels",
        "token_index",
        "old_log_probs",
        "advantages",
        "segment_id",
        "tree_kv_index",
        "tree_cu_seqlens_q",
        "tree_cu_seqlens_k",
        "tree_max_seqlens",
        "global_n_tokens",
        "global_n_forward_tokens",
        "mean_seq_len",
    }
)
# The batch keys TRL's compute_loss reads, which the seam's `tree_forward` and step accounting read the same way.
FORWARD_KEYS: frozenset[str] = BATCH_KEYS

# What carrying per-token loss weights (`weights`) takes from TRL: ``get_train_dataloader`` builds its collator by the
# module name ``DataCollatorForRollout`` (swapped by `loss_weight_collator`), ``RolloutQueueDataset.__iter__`` yields
# each sample's ``metrics`` dict as is (the reserved keys ride in it), and the collator's ``segment_id`` is each loss
# token's sample index in its row (checked by collating two hand-built samples).
LOSS_WEIGHT_INTERNALS: tuple[str, ...] = (
    "async_grpo_trainer.DataCollatorForRollout (named in AsyncGRPOTrainer.get_train_dataloader)",
    "RolloutQueueDataset.__iter__ yields {'metrics': sample.metrics}",
    "RolloutQueueDataset reads its queue through get() and qsize() only (weights.VersionTaggedQueue)",
    "the collated segment_id: each loss token's sample index in its row",
)


# What carrying per-token credit (`credit`) takes from TRL, besides the first two of `LOSS_WEIGHT_INTERNALS`: the
# packer emits a row's loss terms sample by sample, each sample's at its positions p >= 1 with completion_mask[p] = 1
# in order, with the sample's advantage (checked by collating two credited samples that share a prefix).
TOKEN_CREDIT_INTERNALS: tuple[str, ...] = (
    "packing.TreeRow.pack: a row's loss terms sample by sample, each at its trained positions p >= 1 in order",
    "the collated advantages: each loss term's sample advantage",
)


def check_trl_async() -> None:
    """Fail with the fix when the installed TRL's asynchronous trainer lacks what the async seam relies on."""
    problems = signature_problems(AsyncGRPOTrainer, ASYNC_SEAM)
    problems += signature_problems(AsyncRolloutWorker, ROLLOUT_WORKER_SEAM)
    problems += attribute_problems(
        AsyncRolloutWorker, ROLLOUT_WORKER_ATTRIBUTES, assigned_attributes(AsyncRolloutWorker)
    )
    sample_fields = set(inspect.signature(RolloutSample).parameters)
    problems += [f"RolloutSample has no field {name}" for name in ROLLOUT_SAMPLE_FIELDS if name not in sample_fields]
    init = tuple(inspect.signature(AsyncGRPOTrainer.__init__).parameters)[: len(INIT_PARAMETERS)]
    if init != INIT_PARAMETERS:
        problems.append(f"AsyncGRPOTrainer.__init__{init}... (expected {INIT_PARAMETERS}...)")
    for (module, name), expected in ASYNC_MODULE_ATTRIBUTES.items():
        value = getattr(module, name, None)
        if not callable(value):
            problems.append(f"{module.__name__}.{name} is missing")
        elif not getattr(value, "trl_ext_cpu_support", False):  # once replaced, ours is there: nothing to compare
            if (params := tuple(inspect.signature(value).parameters)) != expected:
                problems.append(f"{module.__name__}.{name}{params} (expected {expected})")
    keywords = _kernel_call_keywords()
    if keywords is not None and not set(keywords) <= set(KERNEL_KEYWORDS):
        problems.append(f"packing.tree_attention passes the kernel {keywords} (expected some of {KERNEL_KEYWORDS})")
    problems += attribute_problems(AsyncGRPOTrainer, ASYNC_ATTRIBUTES, assigned_attributes(AsyncGRPOTrainer))
    try:
        keys = collated_batch_keys()
    except Exception as error:  # noqa: BLE001  (any failure of TRL's collator on a valid sample is a difference)
        problems.append(f"TRL's collator fails on a one-sample batch ({type(error).__name__}: {error})")
    else:
        if keys != BATCH_KEYS:
            problems.append(
                f"TRL's collator returns the keys {sorted(keys)} (missing {sorted(BATCH_KEYS - keys)}, new "
                f"{sorted(keys - BATCH_KEYS)})"
            )
    read = _compute_loss_batch_keys()
    if read is not None and read != FORWARD_KEYS:
        problems.append(
            f"AsyncGRPOTrainer.compute_loss reads the batch keys {sorted(read)} (expected {sorted(FORWARD_KEYS)})"
        )
    problems += _loss_weight_problems()
    problems += _token_credit_problems()
    raise_if_problems("TRL 1.16's experimental AsyncGRPOTrainer internals (for its async trainer)", problems)


def collated_batch_keys() -> frozenset[str]:
    """The keys TRL's collator returns for one hand-built rollout sample (a 3-token prompt, a 2-token answer)."""
    row = packing.TreeRow()
    row.add(
        {
            "input_ids": torch.tensor([1, 2, 3, 4, 5]),
            "completion_mask": torch.tensor([0, 0, 0, 1, 1]),
            "old_log_probs": torch.tensor([0.0, 0.0, 0.0, -1.0, -1.0]),
            "advantage": 1.0,
            "group_id": 0,
            "metrics": {},
        }
    )
    return frozenset(async_grpo_trainer.DataCollatorForRollout(pad_token_id=0).torch_call([[row]]))


def _loss_weight_problems() -> list[str]:
    """What `LOSS_WEIGHT_INTERNALS` lists, checked against the installed TRL."""
    from .weights import LOSS_WEIGHTS_KEY, LossWeightCollator, weighted_sample_metrics

    problems = []
    tree = source_tree(async_grpo_trainer.AsyncGRPOTrainer.get_train_dataloader)
    if tree is not None and not any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "DataCollatorForRollout"
        for node in ast.walk(tree)
    ):
        problems.append("AsyncGRPOTrainer.get_train_dataloader no longer builds DataCollatorForRollout(...)")
    tree = source_tree(async_grpo_trainer.RolloutQueueDataset.__iter__)
    if tree is not None and not any(
        isinstance(node, ast.Dict)
        and any(
            isinstance(key, ast.Constant)
            and key.value == "metrics"
            and isinstance(value, ast.Attribute)
            and value.attr == "metrics"
            for key, value in zip(node.keys, node.values, strict=True)
        )
        for node in ast.walk(tree)
    ):
        problems.append("RolloutQueueDataset.__iter__ no longer yields each sample's metrics dict ('metrics')")
    if tree is not None:
        used = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "queue"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        }
        if not used <= {"get", "qsize"}:
            problems.append(f"RolloutQueueDataset.__iter__ uses its queue's {sorted(used)} (expected get and qsize)")
    try:
        row = packing.TreeRow()
        for index, completion in enumerate(([4, 5], [6, 7, 8])):
            row.add(
                {
                    "input_ids": torch.tensor([1, 2, 3, *completion]),
                    "completion_mask": torch.tensor([0, 0, 0] + [1] * len(completion)),
                    "old_log_probs": torch.zeros(3 + len(completion)),
                    "advantage": 1.0,
                    "group_id": 0,
                    "metrics": weighted_sample_metrics({}, token_weight=index + 1.0, root_share=0.5),
                }
            )
        batch = LossWeightCollator(pad_token_id=0).torch_call([[row]])
    except Exception as error:  # noqa: BLE001  (any failure on a valid sample is a difference)
        return [*problems, f"the loss-weight collator fails on two samples ({type(error).__name__}: {error})"]
    if batch["segment_id"][0].tolist() != [0, 0, 1, 1, 1]:
        problems.append(f"the collated segment_id is {batch['segment_id'][0].tolist()} (expected [0, 0, 1, 1, 1])")
    elif batch[LOSS_WEIGHTS_KEY][0].tolist() != [5.0, 5.0, 10.0, 10.0, 10.0]:  # weight x 5 tokens / 1 root
        problems.append(f"the collated loss_weights are {batch[LOSS_WEIGHTS_KEY][0].tolist()}")
    return problems


def _token_credit_problems() -> list[str]:
    """What `TOKEN_CREDIT_INTERNALS` lists, checked against the installed TRL: two credited samples sharing a prompt
    collate to advantages ``A + c`` term by term."""
    from .credit import TokenCreditCollator, credited_sample_metrics

    samples = (
        ([4, 5], 1.0, [0.5, -0.5]),
        ([6, 7, 8], -1.0, [0.25, 0.0, 1.0]),
    )
    try:
        row = packing.TreeRow()
        for completion, advantage, credit in samples:
            row.add(
                {
                    "input_ids": torch.tensor([1, 2, 3, *completion]),
                    "completion_mask": torch.tensor([0, 0, 0] + [1] * len(completion)),
                    "old_log_probs": torch.zeros(3 + len(completion)),
                    "advantage": advantage,
                    "group_id": 0,
                    "metrics": credited_sample_metrics({}, [0.0, 0.0, 0.0, *credit]),
                }
            )
        batch = TokenCreditCollator(pad_token_id=0).torch_call([[row]])
    except Exception as error:  # noqa: BLE001  (any failure on a valid sample is a difference)
        return [f"the token-credit collator fails on two samples ({type(error).__name__}: {error})"]
    expected = [advantage + value for _, advantage, credit in samples for value in credit]
    if batch["advantages"][0].tolist() != expected:
        return [f"the collated per-token advantages are {batch['advantages'][0].tolist()} (expected {expected})"]
    return []


def _kernel_call_keywords() -> tuple[str, ...] | None:
    """The keywords of the ``flash_attn_varlen_func(...)`` call in ``packing.tree_attention``; None without source.
    A ``**{...}`` of constant keys (TRL's optional ``softcap``) counts its keys."""
    tree = source_tree(packing.tree_attention)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "flash_attn_varlen_func"
        ):
            names = []
            for keyword in node.keywords:
                if keyword.arg is not None:
                    names.append(keyword.arg)
                else:
                    dicts = [item for item in ast.walk(keyword.value) if isinstance(item, ast.Dict)]
                    names += [key.value for item in dicts for key in item.keys if isinstance(key, ast.Constant)]
            return tuple(names)
    return ()


def _compute_loss_batch_keys() -> frozenset[str] | None:
    """The collator's keys named in AsyncGRPOTrainer.compute_loss's source; None when it is unavailable."""
    tree = source_tree(AsyncGRPOTrainer.compute_loss)
    if tree is None:
        return None
    return frozenset(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in BATCH_KEYS
    )


check_trl_async()
