"""The `trl-ext` command line: ``quickstart``, ``train``, ``tiny-model``, ``push`` and ``plot``.

Heavy imports (TRL, transformers) happen inside the subcommands, so ``trl-ext --help`` and argument errors are
instant. Under Accelerate: ``accelerate launch -m trl_ext.cli train CONFIG.yaml`` (or ``accelerate launch $(which
trl-ext) train CONFIG.yaml``).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from trl_ext import __version__
from trl_ext.methods import METHODS, QUICKSTART_METHODS  # standard library imports only: the CLI starts fast


def _int_at_least(minimum: int):
    """An argparse ``type``: a whole number >= ``minimum``, or a one-line error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_seed = _int_at_least(0)


def _add_command(
    sub: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The subcommand ``name``, which ``run`` carries out; ``run``'s docstring is its help: the first line in
    ``trl-ext --help``, the paragraph after it in ``trl-ext NAME --help``."""
    summary, _, description = inspect.cleandoc(run.__doc__ or "").partition("\n\n")
    parser = sub.add_parser(name, help=summary, description=description)
    parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-ext",
        description="Stepwise RLM training, judge credit, the IPO loss and monitors on top of Hugging Face TRL.",
    )
    parser.add_argument("--version", action="version", version=f"trl-ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    quickstart = _add_command(sub, "quickstart", _quickstart)
    quickstart.add_argument(
        "--output-dir", default="trl-ext-quickstart", help="where everything is written (default: %(default)s)"
    )
    quickstart.add_argument(
        "--method",
        choices=QUICKSTART_METHODS,
        default=QUICKSTART_METHODS[0],
        help="stepwise-rlm (default: the full pipeline), judge-credit or rlmt (miniature runs)",
    )
    quickstart.add_argument("--fast", action="store_true", help="a scaled-down run for CI (well under a minute)")
    quickstart.add_argument(
        "--steps", type=_positive_int, default=None, help="RL optimizer steps (default: 28; --fast: 4)"
    )
    quickstart.add_argument("--seed", type=_seed, default=0, help="seeds data, model, SFT, RL and evaluation")
    quickstart.add_argument("--no-progress", action="store_true", help="no progress bars")
    quickstart.add_argument("--verbose", action="store_true", help="show the libraries' warnings and logs")

    train = _add_command(sub, "train", _train)
    trainers = ", ".join(method.recipe_name for method in METHODS.values())
    train.add_argument("config", metavar="CONFIG.yaml", help=f"the recipe (see recipes/; trainer: {trainers})")
    overrides = train.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="--key value pairs that override the recipe (optional)"
    )
    overrides.required = False  # argparse counts a REMAINDER positional as required: "CONFIG.yaml, overrides"

    tiny = _add_command(sub, "tiny-model", _tiny_model)
    tiny.add_argument("directory", metavar="DIR", help="the folder to write (created; a tiny model there is replaced)")
    kind = tiny.add_mutually_exclusive_group()
    kind.add_argument(
        "--reward-model",
        action="store_true",
        help="a sequence-classification reward model (one label), e.g. for reward_model_name_or_path or reward_models",
    )
    kind.add_argument("--vllm", action="store_true", help="a model vLLM's CPU build loads (one 32-wide head)")
    tiny.add_argument("--seed", type=_seed, default=0, help="seeds the weights (default: %(default)s)")

    push = _add_command(sub, "push", _push)
    push.add_argument("output_dir", metavar="OUTPUT_DIR", help="the output directory of trl-ext quickstart or train")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub repository, user/name or org/name")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    push.add_argument("--commit-message", default=None, help="commit message")
    push.add_argument(
        "--license",
        default=None,
        help="license id for the card's metadata, e.g. apache-2.0 (usually the base model's; default: none written)",
    )
    push.add_argument("--dry-run", action="store_true", help="print the files and the model card, upload nothing")

    plot = _add_command(sub, "plot", _plot)
    plot.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's output_dir (or a checkpoint folder)")
    plot.add_argument("--out", metavar="FILE", default=None, help="PNG to write (default: OUTPUT_DIR/monitors.png)")
    return parser


# ----------------------------------------------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------------------------------------------
def _plot(args: argparse.Namespace) -> int:
    """one PNG of a run's health (reward, clip rate, entropy, KL, monitor alerts) from its trainer_state.json

    Read OUTPUT_DIR/trainer_state.json (or the newest checkpoint-*/trainer_state.json) and draw reward, clip rate /
    IPO masked ratio with the healthy band, entropy, KL, judge share and monitor alerts."""
    from trl_ext.callbacks.plotting import plot_run

    try:
        path = plot_run(args.output_dir, out=args.out)
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"trl-ext plot: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# quickstart
# ----------------------------------------------------------------------------------------------------------------
def _quiet_libraries() -> None:
    """Keep the quickstart's output to its own lines, progress bars and the monitors' alerts."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # dataset.map bars; the training bars stay
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("transformers", "trl", "peft", "accelerate", "datasets", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _quickstart(args: argparse.Namespace) -> int:
    """the whole method in miniature: offline, CPU, a tiny model, a few minutes

    Cold-start SFT on scripted teacher traces of a built-in toy task, then StepwiseRLMTrainer RL (IPO loss, LoRA,
    default monitors), then the held-out reward before and after RL. Offline, on the CPU. --method judge-credit /
    rlmt run those trainers in miniature instead."""
    from trl_ext.quickstart import QuickstartError, prepare_output_dir

    try:  # fail on an unusable output directory before the slow imports
        prepare_output_dir(args.output_dir)
    except QuickstartError as error:
        print(f"trl-ext quickstart: error: {error}", file=sys.stderr)
        return 2
    if not args.verbose:
        _quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from dataclasses import replace

    from trl_ext.quickstart import QuickstartSettings, run_quickstart

    settings = QuickstartSettings.fast(args.seed) if args.fast else QuickstartSettings.default(args.seed)
    if args.steps is not None:
        settings = replace(settings, rl_steps=args.steps)
    mode = " (--fast)" if args.fast else ""
    print(
        f"trl-ext quickstart: method {args.method}{mode}, seed {args.seed}, output in {args.output_dir}/", flush=True
    )
    started = time.perf_counter()
    try:
        result = run_quickstart(
            args.output_dir,
            method=args.method,
            fast=args.fast,
            settings=settings,
            progress=not args.no_progress,
            log=lambda line: print(line, flush=True),
        )
    except QuickstartError as error:
        print(f"trl-ext quickstart: error: {error}", file=sys.stderr)
        return 2
    print(format_quickstart_report(result, time.perf_counter() - started))
    return 0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _child_share(evaluation: Any, strategy: str) -> float | None:
    """The share of an evaluation's children that answered by ``strategy`` (None when it started no child)."""
    return None if evaluation.child_answer_rate is None else evaluation.child_strategies.get(strategy, 0.0)


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_quickstart_report(result: Any, wall_time_s: float) -> str:
    """The final table of ``trl-ext quickstart``."""
    out = result.output_dir
    lines = ["", f"trl-ext quickstart: {result.method}, seed {result.seed}, {wall_time_s:.0f} s", ""]
    if result.before is not None and result.after is not None:
        before, after = result.before, result.after
        rows = [
            ("held-out reward (share of parts right)", _num(before.reward), _num(after.reward)),
            ("final answer given", _pct(before.final_answer_rate), _pct(after.final_answer_rate)),
            (
                "root delegates to children",
                _pct(before.strategies.get("delegate", 0.0)),
                _pct(after.strategies.get("delegate", 0.0)),
            ),
            (
                "root reads the values itself",
                _pct(before.strategies.get("read", 0.0)),
                _pct(after.strategies.get("read", 0.0)),
            ),
            ("children per root", f"{before.children_mean:.2f}", f"{after.children_mean:.2f}"),
            ("children that answer", _pct(before.child_answer_rate), _pct(after.child_answer_rate)),
            ("children that answer right", _pct(before.child_correct_rate), _pct(after.child_correct_rate)),
            (
                "children using the lookup program",
                _pct(_child_share(before, "lookup")),
                _pct(_child_share(after, "lookup")),
            ),
            (
                "children copying the value by hand",
                _pct(_child_share(before, "copy")),
                _pct(_child_share(after, "copy")),
            ),
        ]
        width = max(len(r[0]) for r in rows)
        lines.append(f"  {'':<{width}}   {'SFT only':>9}   {'after RL':>9}")
        for label, left, right in rows:
            lines.append(f"  {label:<{width}}   {left:>9} → {right:>9}")
        samples = int(result.extra.get("eval_samples") or 1)
        lines.append(
            f"  ({before.rollouts} rollouts each: {before.rollouts // samples} held-out tasks x {samples} samples, "
            "tasks seen in neither SFT nor RL)"
        )
        lines.append("")
    heldout = result.extra.get("heldout")
    if heldout:  # the judge-credit miniature: greedy held-out figures, with judge credit and outcome-only
        rows = [("with judge credit", heldout)]
        if result.extra.get("heldout_outcome_only"):
            rows.append(("outcome-only (λ = 0)", result.extra["heldout_outcome_only"]))
        lines.append(f"  {'held-out (greedy)':<22}   {'exact match':>19}   {'per-digit accuracy':>19}")
        for label, values in rows:
            exact = f"{values['exact_match_before']:.3f} → {values['exact_match_after']:.3f}"
            digits = f"{values['digit_acc_before']:.3f} → {values['digit_acc_after']:.3f}"
            lines.append(f"  {label:<22}   {exact:>19}   {digits:>19}")
        lines.append("  (SFT only → after RL, on prompts seen in neither SFT nor RL)")
        lines.append("")
    rewards = list(result.train_rewards)
    if len(rewards) > 12:  # one value per generation batch; keep the line short
        rewards = [rewards[round(i * (len(rewards) - 1) / 11)] for i in range(12)]
    lines.append(
        f"  RL steps: {result.train_steps}; training reward per generation batch: "
        + (" ".join(f"{r:.2f}" for r in rewards) or "n/a")
    )
    if result.trust_region_metric is not None:
        from trl_ext.losses import trust_region_label

        label = trust_region_label(result.trust_region_metric)
        lines.append(f"  {label}: mean {_pct(result.trust_region_mean)}, max {_pct(result.trust_region_max)}")
    for key, label in (
        ("judge_share_mean", "judge share of the advantage"),
        ("judge_failure_ratio_mean", "judge failures"),
    ):
        if result.extra.get(key) is not None:
            lines.append(f"  {label}: {_pct(result.extra[key])}")
    if result.extra.get("malformed_ratio_mean") is not None:
        lines.append(
            f"  malformed completions (no <think> ... </think>): {_pct(result.extra['malformed_ratio_mean'])}"
        )
    fired = {rule: count for rule, count in result.alerts.items() if count}
    if fired:
        lines.append("  monitor alerts: " + ", ".join(f"{rule} ×{count}" for rule, count in fired.items()))
        lines.append("    (what each means and what to do: docs/troubleshooting.md)")
    else:
        lines.append("  monitor alerts: none")
    lines.append("")
    lines.append(f"  LoRA adapter      {result.adapter_dir}/")
    if result.plot_file is not None:
        lines.append(f"  metrics plot      {result.plot_file}")
    if (out / "rlm_trees").is_dir():
        lines.append(f"  rollout trees     {out / 'rlm_trees'}/ (training), {out / 'eval'}/ (held-out evaluation)")
    if (out / "sft_model").is_dir():
        lines.append(f"  SFT base model    {out / 'sft_model'}/")
    if (out / "judge_audit.jsonl").is_file():
        lines.append(f"  judge audit log   {out / 'judge_audit.jsonl'}")
    lines.append(f"  run summary       {out / 'trl_ext_run.json'}")
    lines.append(f"  push the adapter: trl-ext push {out} <user>/<repo>")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------------------------
def _train(args: argparse.Namespace) -> int:
    """train from a TRL-style YAML recipe (`trainer:` picks the method)

    Train from a YAML recipe with TRL's conventions (trl.TrlParser): `trainer:` picks the config and trainer classes,
    the other keys are fields of the config, trl.ModelConfig, the script arguments and trl.DatasetMixtureConfig.
    Extra --key value pairs override the file. Runs under `accelerate launch -m trl_ext.cli train CONFIG.yaml`."""
    from trl_ext.hub import HubUploadError
    from trl_ext.recipe_training import train_from_recipe
    from trl_ext.recipes import RecipeError, parse_recipe

    try:
        recipe = parse_recipe(args.config, args.overrides)
        trainer = train_from_recipe(recipe)
    except (RecipeError, ImportError) as error:  # ImportError: a missing optional dependency, with its install line
        print(f"trl-ext train: error: {error}", file=sys.stderr)
        return 2
    except HubUploadError as error:  # training finished and the outputs are saved; only the push failed
        output_dir = recipe.training_args.output_dir
        print(
            f"trl-ext train: error: training finished and the outputs are saved in {output_dir}, but {error}. "
            f"Push them later with `trl-ext push {output_dir} <user>/<repo>`.",
            file=sys.stderr,
        )
        return 1
    if trainer.accelerator.is_main_process:
        print(
            f"trl-ext train: done; adapter/model, trainer state and trl_ext_run.json in {recipe.training_args.output_dir}"
        )
    return 0


# ----------------------------------------------------------------------------------------------------------------
# tiny-model
# ----------------------------------------------------------------------------------------------------------------
def _tiny_model(args: argparse.Namespace) -> int:
    """write a tiny offline model and tokenizer to DIR, for --model_name_or_path DIR in dry runs

    Write a tiny randomly initialised Qwen2 model (~30k parameters) and its tokenizer with a ChatML chat template to
    DIR, built offline (trl_ext.testing). Use it to try a recipe without the Hub or a GPU: `trl-ext tiny-model tiny
    && trl-ext train RECIPE.yaml --model_name_or_path tiny ...` (docs/recipes.md). It learns nothing useful: it
    checks that a setup runs."""
    from pathlib import Path

    directory = Path(args.directory)
    if directory.exists() and not directory.is_dir():
        print(f"trl-ext tiny-model: error: {directory} exists and is not a directory; pass a folder.", file=sys.stderr)
        return 2
    if directory.is_dir() and any(directory.iterdir()) and not (directory / "config.json").is_file():
        print(
            f"trl-ext tiny-model: error: {directory} is not empty and holds no model (no config.json); pass a new or "
            "empty folder.",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    from trl_ext.testing import build_tiny_model_and_tokenizer, build_tiny_reward_model, save_tiny_model

    hf_logging.disable_progress_bar()  # "Writing model shards": one file, a few kB

    if args.reward_model:
        model, tokenizer = build_tiny_reward_model(args.seed)
        what = "reward model (Qwen2ForSequenceClassification, one label)"
    else:
        model, tokenizer = build_tiny_model_and_tokenizer(args.seed, vllm=args.vllm)
        what = "causal LM (Qwen2ForCausalLM" + (", vLLM-compatible)" if args.vllm else ")")
    try:
        save_tiny_model(model, tokenizer, directory)
    except OSError as error:
        print(f"trl-ext tiny-model: error: cannot write {directory} ({error}).", file=sys.stderr)
        return 1
    parameters = sum(p.numel() for p in model.parameters())
    print(f"trl-ext tiny-model: a tiny {what}, {parameters:,} parameters, and its tokenizer in {directory}/")
    key = "reward_model_name_or_path" if args.reward_model else "model_name_or_path"
    print(f"  use it offline: trl-ext train RECIPE.yaml --{key} {directory} ...  (docs/recipes.md)")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# push
# ----------------------------------------------------------------------------------------------------------------
def _push(args: argparse.Namespace) -> int:
    """push a run's LoRA adapter (adapter files only) with a generated model card to the Hub

    Upload the LoRA adapter of OUTPUT_DIR (OUTPUT_DIR/adapter or OUTPUT_DIR) with its tokenizer files,
    trl_ext_run.json, monitors.png and a generated README.md model card, in one commit. Never uploads merged or full
    weights. Uses HF_TOKEN / `hf auth login` and HF_ENDPOINT."""
    from trl_ext.hub import HubUploadError, PushError, build_model_card, collect_adapter_files, push_adapter

    try:
        if args.dry_run:
            files = collect_adapter_files(args.output_dir)
            print("files:", ", ".join(sorted([*files.files, "README.md"])))
            print(build_model_card(args.output_dir, args.repo_id, files, license=args.license))
            return 0
        options = {name: getattr(args, name) for name in ("private", "revision", "commit_message", "license")}
        info = push_adapter(args.output_dir, args.repo_id, **options)
    except HubUploadError as error:  # offline, unreachable, refused token, ...: one line saying which
        print(f"trl-ext push: error: {error}", file=sys.stderr)
        return 1
    except (PushError, ValueError) as error:
        print(f"trl-ext push: error: {error}", file=sys.stderr)
        return 2
    print(f"trl-ext push: {getattr(info, 'commit_url', None) or args.repo_id}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
