"""`JudgeCreditConfig`: `ExtGRPOConfig` plus the span judge's settings (`trl_ext.judge.arguments.JudgeCreditArguments`:
endpoint, λ, labels, tools, the sandbox of its Python tools; docs/judge_credit.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import document_fields, documented
from ..judge.arguments import JudgeCreditArguments
from .ext_grpo_config import ExtGRPOConfig


@document_fields
@dataclass
class JudgeCreditConfig(JudgeCreditArguments, ExtGRPOConfig):
    r"""
    Configuration for [`JudgeCreditTrainer`]: every field of [`ExtGRPOConfig`], plus the span judge's settings of
    `trl_ext.judge.arguments.JudgeCreditArguments` (shared with `AsyncJudgeCreditConfig`).

    Defaults follow the reference run of docs/judge_credit.md: `loss_type="ipo"` and `scale_rewards="none"` (Dr. GRPO,
    `A = r − mean(group)`). The ``repl_<name>`` fields (every `trl_ext.rlm.SandboxLimits` field) set the sandboxes of
    the judge's ``run_python`` and ``check_equivalent``; ``repl_timeout_s`` is the wall-clock limit of each call
    (docs/security.md). `judge_endpoint` gives the judge endpoint's fields as one `EndpointSettings`.
    """

    judge_on_eval: bool = documented(
        False, "Also judge evaluation rollouts (costs judge calls; off by default).", section="Judge behaviour"
    )

    def __post_init__(self):
        super().__post_init__()
        self.check_judge_arguments()
