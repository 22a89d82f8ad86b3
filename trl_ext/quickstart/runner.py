"""The quickstart's entry point: `run_quickstart` checks the settings and the output directory
(`prepare_output_dir`, `QuickstartError`), runs the chosen method's pipeline and writes ``trl_ext_run.json``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from trl_ext.methods import QUICKSTART_METHODS
from trl_ext.run_info import write_run_info

from .judge_credit import run_judge_credit
from .report import QuickstartResult, quickstart_run_info
from .rlmt import run_rlmt
from .settings import QuickstartSettings
from .stepwise import run_stepwise

logger = logging.getLogger(__name__)

# method (one per `QUICKSTART_METHODS` entry) -> its pipeline: (output dir, settings, fast, progress, log) -> result
_PIPELINES: dict[str, Callable[[Path, QuickstartSettings, bool, bool, Callable[[str], None]], QuickstartResult]] = {
    "stepwise-rlm": run_stepwise,
    "judge-credit": run_judge_credit,
    "rlmt": run_rlmt,
}


class QuickstartError(RuntimeError):
    """A quickstart run cannot start or finish (e.g. the output directory is not writable)."""


def run_quickstart(
    output_dir: str | os.PathLike[str] = "trl-ext-quickstart",
    *,
    method: str = "stepwise-rlm",
    fast: bool = False,
    seed: int = 0,
    settings: QuickstartSettings | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> QuickstartResult:
    """Run the quickstart (see the `trl_ext.quickstart` package docstring) and return its numbers.

    Args:
        output_dir: created if needed; must be writable. Files already there with the same names are replaced.
        method: ``"stepwise-rlm"`` (the full pipeline), ``"judge-credit"`` or ``"rlmt"`` (miniature runs).
        fast: the scaled-down `QuickstartSettings.fast` (CI); ignored when ``settings`` is given.
        seed: seeds data, teacher, model, SFT, RL and evaluation; ignored when ``settings`` is given.
        settings: every knob explicitly.
        progress: show tqdm progress bars.
        log: receives one line per stage (default: the module logger at INFO).
    """
    if method not in QUICKSTART_METHODS:
        raise ValueError(f"method={method!r}: choose one of {', '.join(QUICKSTART_METHODS)}.")
    if settings is None:
        settings = QuickstartSettings.fast(seed) if fast else QuickstartSettings.default(seed)
    settings.validate()
    output = prepare_output_dir(output_dir)
    say = log if log is not None else logger.info
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    with _library_progress_bars(progress):
        result = _PIPELINES[method](output, settings, fast, progress, say)
    result.wall_time_s = time.perf_counter() - started
    write_run_info(output, quickstart_run_info(result, settings))  # atomic: a failed write leaves no torn file
    return result


@contextlib.contextmanager
def _library_progress_bars(enabled: bool) -> Iterator[None]:
    """Without ``progress``, also silence the bars transformers and datasets draw themselves (saving shards, mapping
    datasets); restored afterwards."""
    if enabled:
        yield
        return
    import datasets
    from transformers.utils import logging as hf_logging

    transformers_on = hf_logging.is_progress_bar_enabled()
    datasets_on = datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if datasets_on:
            datasets.enable_progress_bars()


def prepare_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Create ``output_dir`` if needed and check that files can be written in it; raise `QuickstartError` if not."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise QuickstartError(f"--output-dir {path} exists and is not a directory; pass a directory path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".trl-ext-write-test"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as error:
        raise QuickstartError(
            f"--output-dir {path} is not writable ({error.strerror or error}); pass a directory you can write to, "
            "e.g. --output-dir ./trl-ext-quickstart."
        ) from None
    return path
