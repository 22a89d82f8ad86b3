"""`trl-ext quickstart`: the pipelines in miniature, offline, on the CPU, in a few minutes.

Demo code kept apart from the library: it uses ``trl_ext`` as a user would. ``run_quickstart(method=...)`` runs

- ``"stepwise-rlm"`` (the default, `trl_ext.quickstart.stepwise`): the whole stepwise-RLM pipeline on the built-in
  toy task (`trl_ext.quickstart.toy_task`: a context too long to read in one turn, where handing its parts to child
  RLMs pays): teacher traces from a scripted teacher, cold-start SFT of a tiny model, `StepwiseRLMTrainer` with the
  IPO loss, and the held-out reward, delegation and children's answers before and after RL;
- ``"judge-credit"`` (`trl_ext.quickstart.judge_credit`): `JudgeCreditTrainer` on a digit-copy task whose
  outcome reward is sparse and whose scripted judge marks the wrong digit, against the same RL without judge credit;
- ``"rlmt"`` (`trl_ext.quickstart.rlmt`): `RLMTTrainer` in a few steps, showing the trainer, monitors and outputs
  end to end.

The modules: `settings` (the knobs and the trainer configs they become), `runner` (the entry point and the output
directory), `evaluation` (held-out evaluation), `training` (what every trainer run shares), `report` (the result and
``trl_ext_run.json``), `toy_task`, `copy_task` (the judge-credit miniature's task and judge), and `scripted_server`
(a scripted OpenAI-compatible chat server on 127.0.0.1 that plays the teacher and the judge here, and serves tests
and benchmarks).

Nothing here prints: progress goes through ``log`` (the CLI passes ``print``) and tqdm bars (``progress=True``).
Importing the package loads only the standard library; the methods it runs are `trl_ext.methods.QUICKSTART_METHODS`.
"""

from .copy_task import ScriptedSpanJudge, last_number_reward
from .evaluation import EvalResult, evaluate_policy, held_out_eval_set
from .report import QuickstartResult, quickstart_run_info
from .runner import QuickstartError, prepare_output_dir, run_quickstart
from .settings import QuickstartSettings, toy_rl_config_kwargs, toy_scaffold_config
from .stepwise import SFT_MODEL_DIR
from .training import ADAPTER_DIR

__all__ = [
    "ADAPTER_DIR",
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
    "quickstart_run_info",
    "run_quickstart",
    "toy_rl_config_kwargs",
    "toy_scaffold_config",
]
