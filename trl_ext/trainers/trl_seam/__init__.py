"""The seam between trl-ext and TRL: every override of TRL internals (`trl.GRPOTrainer`'s private methods, and the
weight sync of TRL's vLLM backend) lives here.

TRL 1.16 has no public hooks for what trl-ext needs, so `TRLSeam` overrides nine of its private methods, once each,
and turns each (but ``_save_checkpoint``) into a trl-ext hook with a documented contract, one hook per moment.
trl-ext's trainers override the hooks, never TRL's private methods, and reach TRL's private state only through the
seam's services (`log_metric`, `global_sums`, `tokenizer`, ...: see `grpo`); the per-batch state the hooks share
lives in one `BatchScope` object, not in trainer fields. This package is the only place in trl-ext that names
anything private in TRL (`tests/trainers/test_trl_seam.py` scans the code for it). A tenth override replaces the
colocated weight sync of TRL's `VLLMGeneration`, which the trainer holds (`LayerwiseReloadVLLMGeneration`,
installed by `TRLSeam.__init__`).

| TRL private method | what the override changes, and why | trl-ext hook |
|---|---|---|
| ``_generate_and_score_completions`` | opens a `BatchScope` for the batch; hands TRL's scored batch to the hook, which may replace advantages by per-token ones and change the rows (stepwise turns) | `on_batch_start`, `process_scored_batch`, `on_batch_end` |
| ``_tokenize_prompts`` | caps the length of the tokenized prompts before anything is generated (TRL 1.16 has no prompt cap) | `limit_prompt_ids` |
| ``_generate`` | reads TRL's 8-tuple by name (`GeneratedBatch`) so a trainer can start work on the raw rollouts before TRL scores them (the span judge) | `on_generated` |
| ``_generate_single_turn`` | post-processes the sampled ids of every generation call (RLMT cuts at stop strings) | `postprocess_samples` |
| ``_calculate_rewards`` | lets a trainer change the rewards per function (RLM roots without an answer get 0; the judge reuses its verifier call) and keeps them in the scope | `compute_rewards` |
| ``_compute_loss`` | routes the loss through the registry of `trl_ext.losses` (``loss_type="ipo"`` and per-token weights) | `compute_policy_loss` |
| ``_get_per_token_logps_and_entropies`` | every log-prob pass (policy, old policy, reference, entropies) goes through one hook, where shared-prefix packing computes the same ``(B, T)`` tensors; TRL's old/reference passes over rows the hook will replace (``BatchScope.replaces_rows``) are skipped | `per_token_logps_and_entropies` |
| ``_prepare_inputs`` | after TRL shuffles and splits a new generation batch into micro-batches, lets a trainer re-split it (packing keeps rows that share a prefix in one micro-batch) | `arrange_micro_batches` |
| ``_save_checkpoint`` (transformers.Trainer's; TRL's override adds the model card) | saves the buffered generation batch when the checkpoint falls inside one (TRL does not; `restore_generation_buffer` puts it back on resume); removes a stale ``trainer_state.json`` from the ``checkpoint-N`` folder it is about to overwrite (that file, written last, marks a finished save); a save that fails on a full disk raises ``OSError(ENOSPC)`` saying "disk full", from the original error (torch's zip writer raises a RuntimeError without errno, "unexpected pos ..." or "PytorchStreamWriter failed writing file ...", safetensors a SafetensorError), see `trl_ext.checkpoints` | none |
| ``VLLMGeneration.sync_weights`` (TRL's vLLM backend; the trainer's ``vllm_generation`` becomes a `LayerwiseReloadVLLMGeneration`) | colocate mode: the weights go through vLLM's layerwise reload, which re-runs each layer's weight processing (TRL's per-tensor ``load_weights`` fails on vLLM-CPU, whose oneDNN, AMX or zentorch kernels prepack the linear weights and drop their loaders); a tied LM head is re-processed too. Server mode is TRL's (vLLM's weight-transfer engine, the same reload) | none |

A failed save leaves its partial ``checkpoint-N`` folder in place: `trl_ext.checkpoints.resolve_resume_checkpoint`
skips it on resume, and removing it is not safe (other ranks may still write into it; after a resume from an earlier
checkpoint it may hold the only copy of some of step N's files).

Modules: `grpo` (`TRLSeam`, `BatchScope`, `GeneratedBatch`, resuming's generation buffer), `vllm` (the weight
sync), `check` (what the seam takes from TRL, as data, and `check_trl`). `check_trl` runs at import: it checks that
the installed TRL has the private methods (with their signatures), the private attributes and `_generate`'s 8-tuple
the seam relies on, those of `VLLMGeneration` included, and fails with the fix (install ``trl>=1.16,<1.17``)
otherwise.
"""

from .check import FORWARD_KEYS, SEAM, SEAM_ATTRIBUTES, SEAM_CALLS, VLLM_GENERATION_SEAM, check_trl
from .grpo import BatchScope, GeneratedBatch, TRLSeam, generation_buffer_file
from .vllm import LayerwiseReloadVLLMGeneration, tied_modules, use_layerwise_reload

__all__ = [
    "FORWARD_KEYS",
    "SEAM",
    "SEAM_ATTRIBUTES",
    "SEAM_CALLS",
    "VLLM_GENERATION_SEAM",
    "BatchScope",
    "GeneratedBatch",
    "LayerwiseReloadVLLMGeneration",
    "TRLSeam",
    "check_trl",
    "generation_buffer_file",
    "tied_modules",
    "use_layerwise_reload",
]
