"""`StepwiseArguments`: the settings of stepwise RLM training as trainer-config fields, declared and documented once
for the synchronous (`StepwiseRLMConfig`) and the asynchronous (`AsyncStepwiseRLMConfig`) trainer
(docs/stepwise_rlm.md): the RLM scaffold (`ScaffoldArguments`), the REPL sandbox (`SandboxArguments`: ``repl_<name>``)
and which turns become samples, with what weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields, documented
from ..losses import LOSSES, get_loss
from .sandbox import SandboxArguments
from .scaffold import RLMScaffoldConfig, ScaffoldArguments

__all__ = ["CHILD_SAMPLING", "LOSS_NORMALIZATIONS", "StepwiseArguments"]

CHILD_SAMPLING = ("all", "one")
LOSS_NORMALIZATIONS = ("subtree", "token")
_SAMPLES = "Training samples (docs/stepwise_rlm.md)"


@document_fields
@dataclass
class StepwiseArguments(ScaffoldArguments, SandboxArguments):
    """The stepwise RLM settings: the scaffold, the sandbox, the training samples and where the trees go."""

    train_children: bool = documented(
        True, "Train the child nodes' turns too (False: root turns only).", section=_SAMPLES
    )
    child_sampling: str = documented(
        "all",
        "'all' children with 1/k weights, or 'one' uniformly drawn child per parent (weight 1, unbiased, cheaper, "
        "noisier).",
        section=_SAMPLES,
    )
    rlm_loss_normalization: str = documented(
        "subtree",
        "'subtree' = the 1/k_g loss of docs/stepwise_rlm.md exactly (needs a loss normalised by the batch's token "
        "count, e.g. dapo or ipo); 'token' = every turn an ordinary row under the loss type's own normalisation "
        "(for dapo/ipo: the plain token mean).",
        section=_SAMPLES,
    )
    context_column: str = documented("context", "Dataset column holding each task's REPL `context`.", section="Data")
    save_rollout_trees: bool = documented(
        True,
        "Write every rollout tree as JSON lines under output_dir/rlm_trees/ (docs/stepwise_rlm.md names the files; "
        "the synchronous trainer's completions table links to them).",
        section="Data",
    )

    def check_stepwise_arguments(self) -> None:
        """Check these fields (each error names the field and the fix); the scaffold limits with the scaffold's own
        messages."""
        if self.child_sampling not in CHILD_SAMPLING:
            raise ValueError(f"child_sampling={self.child_sampling!r}: set 'all' (1/k weights) or 'one'.")
        if self.rlm_loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"rlm_loss_normalization={self.rlm_loss_normalization!r}: set 'subtree' or 'token'.")
        if self.rlm_loss_normalization == "subtree" and get_loss(self.loss_type).normalization != "tokens":
            raise ValueError(
                f"rlm_loss_normalization='subtree' needs a loss normalised by the batch's token count, not "
                f"loss_type={self.loss_type!r}: set loss_type to one of "
                f"{[name for name, spec in LOSSES.items() if spec.normalization == 'tokens']}, or "
                "rlm_loss_normalization='token'."
            )
        self.scaffold_config()

    def scaffold_config(self) -> RLMScaffoldConfig:
        """The `RLMScaffoldConfig` of these settings, with the ``repl_<name>`` sandbox limits."""
        return ScaffoldArguments.scaffold_config(self, self.sandbox_limits())
