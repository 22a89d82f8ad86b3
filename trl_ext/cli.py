"""The `trl-ext` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trl_ext import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-ext",
        description="Stepwise RLM training, judge credit, the IPO loss and monitors on top of Hugging Face TRL.",
    )
    parser.add_argument("--version", action="version", version=f"trl-ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    quickstart = sub.add_parser("quickstart", help="a few IPO GRPO steps on the built-in tiny model (offline, CPU)")
    quickstart.add_argument("--output-dir", default="trl-ext-quickstart", help="where the LoRA adapter is saved")
    quickstart.add_argument("--steps", type=int, default=24, help="optimizer steps (default 24)")
    quickstart.add_argument("--seed", type=int, default=0)
    quickstart.set_defaults(func=_quickstart)

    plot = sub.add_parser(
        "plot",
        help="one PNG of a run's health (reward, clip rate, entropy, KL, monitor alerts) from its trainer_state.json",
        description="Read OUTPUT_DIR/trainer_state.json (or the newest checkpoint-*/trainer_state.json) and draw "
        "reward, clip rate / IPO masked ratio with the healthy band, entropy, KL, judge share and monitor alerts.",
    )
    plot.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's output_dir (or a checkpoint folder)")
    plot.add_argument("--out", metavar="FILE", default=None, help="PNG to write (default: OUTPUT_DIR/monitors.png)")
    plot.set_defaults(func=_plot)
    return parser


def _plot(args: argparse.Namespace) -> int:
    from trl_ext.callbacks.plotting import plot_run

    try:
        path = plot_run(args.output_dir, out=args.out)
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"trl-ext plot: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise SystemExit(f"trl-ext quickstart: --steps must be >= 1, got {args.steps}.")
    from trl_ext.quickstart import run_quickstart

    result = run_quickstart(args.output_dir, steps=args.steps, seed=args.seed)
    print(
        f"\ntrl-ext quickstart: {result.steps} IPO GRPO steps on the tiny model (LoRA, CPU).\n"
        f"  reward (distinct characters / 16): {result.reward_first:.3f} at step 1 -> "
        f"{result.reward_last:.3f} at the last step\n"
        f"  IPO trust region: up to {100 * result.masked_ratio_max:.1f}% of tokens masked in a step\n"
        f"  LoRA adapter saved to {result.adapter_dir}"
    )
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
