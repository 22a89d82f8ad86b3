"""`trl-ext quickstart`: the pipelines in miniature, offline, on the CPU (see `trl_ext.quickstart.stepwise`)."""

from .stepwise import (
    ADAPTER_DIR,
    METHODS,
    SFT_MODEL_DIR,
    EvalResult,
    QuickstartError,
    QuickstartResult,
    QuickstartSettings,
    ScriptedSpanJudge,
    evaluate_policy,
    held_out_eval_set,
    last_number_reward,
    prepare_output_dir,
    run_quickstart,
    toy_rl_config_kwargs,
    toy_scaffold_config,
    write_run_info,
)

__all__ = [
    "ADAPTER_DIR",
    "METHODS",
    "SFT_MODEL_DIR",
    "EvalResult",
    "QuickstartError",
    "QuickstartResult",
    "QuickstartSettings",
    "ScriptedSpanJudge",
    "evaluate_policy",
    "held_out_eval_set",
    "last_number_reward",
    "prepare_output_dir",
    "run_quickstart",
    "toy_rl_config_kwargs",
    "toy_scaffold_config",
    "write_run_info",
]
