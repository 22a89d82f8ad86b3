"""The seam between trl-ext and TRL's *experimental* asynchronous trainer (`trl.experimental.async_grpo`): the only
trl-ext code that names anything private of it, as `trl_seam` is for the synchronous `GRPOTrainer`.

trl-ext builds on ``AsyncGRPOTrainer`` through its extension points where they fit (``rollout_worker=``,
``weight_transfer=``, its public ``compute_loss``); what has no extension point is here, once:

| TRL internal | what the seam does, and why |
|---|---|
| ``packing._flash_attn`` (FA3 fetched from the Hub with ``kernels``) | off CUDA, replaced by `trl_ext.attention.flash_attn_varlen_cpu`: the same varlen signature in plain torch, so tree-packed training runs on the CPU (`install_cpu_support`) |
| ``async_grpo_trainer.get_peak_flops_per_device`` (calls ``torch.cuda.get_device_name`` unconditionally) | off CUDA, answers None (no MFU metric) instead of failing in ``AsyncGRPOTrainer.__init__`` |
| ``compute_loss``'s forward | `AsyncSeam.tree_forward` runs it as TRL does (padding-free row, tree kwargs, fused LM head), so a trl-ext loss gets the same log-probs |
| ``_step_*`` / ``_last_forward_time_s`` (per-step accounting) | `AsyncSeam.record_micro_batch` adds a micro-batch whose loss trl-ext computed, as TRL's ``compute_loss`` does |
| ``_metrics`` | `AsyncSeam.log_metric` |
| ``async_rollout_worker.RolloutSample`` (not exported by ``trl.experimental.async_grpo``) | the sample record every trl-ext rollout worker builds (`to_rollout_sample`); imported here once, the fields they fill checked at import (`ROLLOUT_SAMPLE_FIELDS`) |
| ``_lora_sync``, ``_lora_name`` | `served_policy_names`: the model name a rollout worker of trl-ext's requests (``trl-policy-v{N}``, or the base model) |
| ``AsyncRolloutWorker.check_health`` / ``stop``, its ``_process`` | a child process that died is named (exit code, signal) and reaped instead of reported as hung and waited for for ever (`guard_rollout_worker`) |
| ``_save_checkpoint``, ``_inner_training_loop`` (``rollout_state.json``), ``_trained_groups`` | a trl-ext worker's policy version counter is saved and restored, as TRL does for its own worker, so a resumed run does not republish adapter names a running server holds; and its dataset position (after the last run whose groups TRL trained), so a resumed run does not start the prompts over |
| ``get_train_dataloader``'s prepared loader (accelerate reads one batch ahead) | on one process, read on demand (`OnDemandLoader`): a micro-batch leaves the queue after the sync before its step, so TRL's staleness check is made under the version that trains it; `AsyncSeam.drop_stale_tokens` gives weight 0 to any token that still reaches the loss older than ``max_staleness`` (counted) |
| ``StepIntervalCallback`` (one per periodic task) | `AsyncSeam.add_callback` keeps TRL's second one without transformers' duplicate-callback notice |
| ``_tag_names``, ``_name``, ``_paper`` | set from a subclass's ``model_card`` (`trl_ext.methods.METHODS`) |
| ``async_grpo_trainer.DataCollatorForRollout`` (built in ``get_train_dataloader``), the ``metrics`` of a rollout sample | per-token loss weights: a weighted sample carries its weight in its ``metrics``; `loss_weight_collator` swaps in `LossWeightCollator` (TRL's collator plus ``loss_weights``) for the one ``get_train_dataloader`` call; `TreeForward.loss_weights` |
| ``packing.TreeRow.pack``'s order of loss terms, the collated ``advantages`` | per-token advantages ``A + c_t`` (the judge's credit): a credited sample carries ``c`` in its ``metrics``; `token_credit_collator` swaps in `TokenCreditCollator` (`LossWeightCollator` plus the credit added to ``advantages``) |

`install_cpu_support` is called by `AsyncSeam.__init__` when the model trains off CUDA (``args.device``); the
replacements dispatch on the tensors' device, so TRL's kernel and FLOPs table still serve CUDA in the same process.
Generation is TRL's: a rollout worker in a spawned child process against ``vllm serve`` (on the CPU, vLLM's CPU build;
see the ``vllm`` test group), LoRA synced over HTTP.

Modules: `check` (what the seam takes from TRL, as data, and `check_trl_async`), `cpu` (the patch; the kernel is `trl_ext.attention`),
`trainer` (`AsyncSeam`, `TreeForward`), `faults` (a dead worker process named and reaped; the policy version counter across a resume), `weights`
(per-token loss weights through TRL's batch), `credit` (per-token advantages through TRL's batch), `samples` (`to_rollout_sample`), `policy` (`served_policy_names`). `check_trl_async` runs at import: it compares the signatures of the methods
overridden and the module attributes replaced, the keywords TRL passes the attention kernel, the attributes read
(assigned by ``AsyncGRPOTrainer``'s methods, or class attributes), and the keys of TRL's collated batch (its
collator run on one hand-built sample, and the keys its ``compute_loss`` reads), and fails with the fix
(``pip install 'trl>=1.16,<1.17'``) on any difference.
"""

from .check import (
    ASYNC_ATTRIBUTES,
    ASYNC_MODULE_ATTRIBUTES,
    ASYNC_SEAM,
    BATCH_KEYS,
    FORWARD_KEYS,
    KERNEL_KEYWORDS,
    LOSS_WEIGHT_INTERNALS,
    TOKEN_CREDIT_INTERNALS,
    RolloutSample,
    check_trl_async,
    collated_batch_keys,
)
from .cpu import cpu_support_installed, install_cpu_support
from .credit import (
    TOKEN_CREDIT_KEY,
    TokenCreditCollator,
    credited_sample_metrics,
    per_token_credit,
    token_credit_collator,
)
from .policy import served_policy_names
from .samples import to_rollout_sample
from .trainer import AsyncSeam, TreeForward
from .weights import (
    LOSS_WEIGHTS_KEY,
    LossWeightCollator,
    fold_loss_weights,
    loss_weight_collator,
    per_token_loss_weights,
    weighted_sample_metrics,
)

__all__ = [
    "ASYNC_ATTRIBUTES",
    "ASYNC_MODULE_ATTRIBUTES",
    "ASYNC_SEAM",
    "BATCH_KEYS",
    "FORWARD_KEYS",
    "KERNEL_KEYWORDS",
    "LOSS_WEIGHTS_KEY",
    "LOSS_WEIGHT_INTERNALS",
    "TOKEN_CREDIT_INTERNALS",
    "TOKEN_CREDIT_KEY",
    "AsyncSeam",
    "LossWeightCollator",
    "RolloutSample",
    "TokenCreditCollator",
    "TreeForward",
    "check_trl_async",
    "collated_batch_keys",
    "credited_sample_metrics",
    "cpu_support_installed",
    "fold_loss_weights",
    "install_cpu_support",
    "loss_weight_collator",
    "per_token_credit",
    "per_token_loss_weights",
    "served_policy_names",
    "to_rollout_sample",
    "token_credit_collator",
    "weighted_sample_metrics",
]
