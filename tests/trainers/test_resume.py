"""Resuming after ``kill -9`` (`trl_ext.checkpoints`, `TRLSeam._save_checkpoint`): bit-exact, incomplete checkpoints
skipped and named, a full disk named.

The killed runs are subprocesses of tests/scripts/interrupted_run.py that SIGKILL themselves (inside a generation,
before an optimizer step, while a checkpoint is written), started together; the uninterrupted references and the
resumed runs train in this process (one thread, as the subprocesses).
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from trl_ext.checkpoints import (
    checkpoint_problem,
    checkpoint_step,
    name_disk_full,
    required_checkpoint_files,
    resolve_resume_checkpoint,
)
from trl_ext.trainers.trl_seam import generation_buffer_file

from ..scripts import interrupted_run
from ..scripts.interrupted_run import MAX_STEPS, build_trainer, run

SCRIPT = Path(interrupted_run.__file__)
KILL_STEP = 3  # checkpoints 1 and 2 are complete when the run dies
KILLED = {  # scenario -> (trainer, --kill-at, num_iterations)
    "generation": ("grpo", f"generation:{KILL_STEP}", 1),
    "optimizer": ("grpo", f"optimizer:{KILL_STEP}", 1),
    "saving": ("grpo", f"saving:{KILL_STEP}", 1),
    "stepwise": ("stepwise", f"generation:{KILL_STEP}", 1),
    # two passes over each generation batch: checkpoint-1 falls inside the batch of steps 1-2, which it must hold
    "iterations": ("grpo", "optimizer:2", 2),
}
REFERENCES = {"grpo": ("grpo", 1), "stepwise": ("stepwise", 1), "iterations": ("grpo", 2)}
LOGGER = "trl_ext.checkpoints"


# ---------------------------------------------------------------------------------------------------------------
# Runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The killed subprocesses (all at once) and, meanwhile, the uninterrupted reference runs in this process."""
    root = tmp_path_factory.mktemp("resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    processes = {}
    for name, (trainer, kill_at, iterations) in KILLED.items():
        command = [sys.executable, str(SCRIPT), str(root / name), "--trainer", trainer, "--kill-at", kill_at]
        command += ["--num-iterations", str(iterations)]
        processes[name] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        references = {
            name: run(root / f"reference-{name}", trainer, num_iterations=iterations)
            for name, (trainer, iterations) in REFERENCES.items()
        }
        killed = {}
        for name, process in processes.items():
            output, _ = process.communicate(timeout=300)
            killed[name] = (root / name, process.returncode, output.decode(errors="replace")[-3000:])
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return references, killed


def step_logs(log_history: list[dict]) -> list[dict]:
    """The per-step logs without wall-clock times (`step_time`) and without the end-of-training summary."""
    return [
        {key: value for key, value in logs.items() if key != "step_time"} for logs in log_history if "loss" in logs
    ]


def assert_same_run(resumed, reference) -> None:
    reference_params = reference.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, reference_params[name]), f"{name} differs from the uninterrupted run"
    assert len(step_logs(reference.state.log_history)) == MAX_STEPS
    assert step_logs(resumed.state.log_history) == step_logs(reference.state.log_history)


def killed_run(runs, name: str) -> Path:
    output_dir, returncode, output = runs[1][name]
    assert returncode == -signal.SIGKILL, f"the run was to kill itself; exit {returncode}:\n{output}"
    assert not (output_dir / "final_params.pt").exists()
    return output_dir


# ---------------------------------------------------------------------------------------------------------------
# Kill -9, resume, compare


@pytest.mark.slow
@pytest.mark.parametrize("point", ["generation", "optimizer", "saving"])
def test_resume_after_kill_is_bit_exact(runs, point, caplog):
    """ExtGRPOTrainer, num_iterations=1: killed at step 3 and resumed, it ends with the uninterrupted run's weights
    and logs, bit for bit. Killed while saving checkpoint-3, the resume skips it with a warning, from checkpoint-2."""
    output_dir = killed_run(runs, point)
    if point == "saving":
        assert "trainer_state.json is missing" in checkpoint_problem(output_dir / f"checkpoint-{KILL_STEP}")
    else:
        assert not (output_dir / f"checkpoint-{KILL_STEP}").exists()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        resumed = run(output_dir, "grpo", resume=True)
    skipped = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    if point == "saving":
        assert len(skipped) == 1 and f"checkpoint-{KILL_STEP} on resume: trainer_state.json is missing" in skipped[0]
    else:
        assert not skipped
    assert resumed.start_step == KILL_STEP - 1
    assert_same_run(resumed, runs[0]["grpo"])
    assert checkpoint_problem(output_dir / f"checkpoint-{KILL_STEP}") is None  # written again, complete


@pytest.mark.slow
def test_resume_inside_a_generation_batch_continues_on_that_batch(runs):
    """num_iterations=2: checkpoint-1 is saved between the two passes over the first generation batch. TRL keeps
    that batch in memory only; the checkpoint holds it, and the resumed run trains its second pass on it (bit-exact
    with the uninterrupted run) instead of generating a new batch."""
    output_dir = killed_run(runs, "iterations")
    assert (output_dir / "checkpoint-1" / generation_buffer_file(0)).is_file()
    assert not (output_dir / "checkpoint-2" / generation_buffer_file(0)).exists()  # at a batch boundary: none
    resumed = run(output_dir, "grpo", resume=True, num_iterations=2)
    assert resumed.start_step == 1
    assert_same_run(resumed, runs[0]["iterations"])


@pytest.mark.slow
def test_stepwise_resume_after_kill_is_bit_exact_with_the_same_tree_records(runs):
    """StepwiseRLMTrainer (child_sampling="one": the trainer draws which child trains) killed inside the generation
    of step 3: the resumed run ends with the uninterrupted run's weights and logs, and its rollout-tree files hold
    exactly the uninterrupted run's records (the killed step's trees are not kept twice)."""
    output_dir = killed_run(runs, "stepwise")
    resumed = run(output_dir, "stepwise", resume=True)
    reference = runs[0]["stepwise"]
    assert resumed.start_step == KILL_STEP - 1
    assert_same_run(resumed, reference)
    trees = Path(reference.args.output_dir) / "rlm_trees"
    expected = {path.name: path.read_text(encoding="utf-8").splitlines() for path in sorted(trees.iterdir())}
    got = {path.name: path.read_text(encoding="utf-8").splitlines() for path in sorted(output_dir.glob("rlm_trees/*"))}
    assert len(expected) == MAX_STEPS and all(len(lines) == 4 for lines in expected.values())
    assert {name: len(lines) for name, lines in got.items()} == {name: len(lines) for name, lines in expected.items()}
    assert got == expected


def test_a_failed_save_leaves_no_stale_trainer_state_and_other_errors_pass_unchanged(tmp_path):
    """Saving over an existing checkpoint-N removes its old trainer_state.json first: a save that fails half-way
    leaves a folder named incomplete, not old state beside new weights. An error that is no full disk is re-raised
    as it was."""
    trainer = build_trainer(tmp_path, "grpo", None)
    trainer.create_optimizer_and_scheduler(num_training_steps=MAX_STEPS)
    trainer._save_checkpoint(trainer.model, None)
    folder = tmp_path / "checkpoint-0"
    assert checkpoint_problem(folder) is None

    def broken(output_dir):
        raise RuntimeError("the RNG state could not be pickled")

    trainer._save_rng_state = broken
    with pytest.raises(RuntimeError, match="could not be pickled"):
        trainer._save_checkpoint(trainer.model, None)
    assert "trainer_state.json is missing" in checkpoint_problem(folder)


# ---------------------------------------------------------------------------------------------------------------
# A full disk, for real: a tmpfs too small for the first checkpoint


def tmpfs_size_for(reference_dir: Path, fails_on: str) -> int:
    """A tmpfs size (bytes, whole pages) in which checkpoint-1 of the reference run fails on ``fails_on``."""
    page = 4096

    def pages(path: Path) -> int:
        return -(-path.stat().st_size // page) * page

    checkpoint = reference_dir / "checkpoint-1"
    if fails_on == "model.safetensors":
        return pages(checkpoint / fails_on) // 2 // page * page
    # every file written before the optimizer (the model card, the model, the tokenizer), then half the optimizer
    before = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")
    written = sum(pages(path) for path in checkpoint.iterdir() if path.name not in before)
    return written + pages(reference_dir / "README.md") + pages(checkpoint / "optimizer.pt") // 2 // page * page


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of the requested size at a fresh folder; unmounted afterwards, whatever happens."""
    mounted = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"tmpfs-{size}"
        folder.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    yield mount
    gc.collect()  # the failed writer's file handle lives in the exception's traceback until collected
    for folder in mounted:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)  # detached now, freed once closed


@pytest.mark.slow
@pytest.mark.parametrize(
    "fails_on, original",
    [("model.safetensors", SafetensorError), ("optimizer.pt", RuntimeError)],
    ids=["safetensors", "torch-zip-writer"],
)
def test_disk_full_while_saving_says_disk_full(runs, small_tmpfs, fails_on, original):
    """safetensors says "I/O error: No space left on device" in a SafetensorError, torch's zip writer only
    "[enforce fail at inline_container.cc:...] unexpected pos ..." in a RuntimeError: both reach the user as an
    OSError(ENOSPC) that says "disk full", with the fix, raised from the original."""
    output_dir = small_tmpfs(tmpfs_size_for(Path(runs[0]["grpo"].args.output_dir), fails_on))
    with pytest.raises(OSError) as caught:
        run(output_dir, "grpo", max_steps=1)
    error = caught.value
    assert error.errno == errno.ENOSPC
    assert f"disk full while saving {output_dir / 'checkpoint-1'}" in str(error)
    assert "save_total_limit" in str(error) and "save_only_model=True" in str(error)
    assert isinstance(error.__cause__, original)
    assert checkpoint_problem(output_dir / "checkpoint-1") is not None  # skipped by a resume
    with pytest.raises(ValueError, match="No complete checkpoint.*checkpoint-1: trainer_state.json is missing"):
        resolve_resume_checkpoint(True, output_dir)


# ---------------------------------------------------------------------------------------------------------------
# trl_ext.checkpoints on hand-made folders


def make_checkpoint(output_dir: Path, step: int, *, state: str | None = None, weights=("model.safetensors",)) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in weights:
        (folder / name).write_bytes(b"weights")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}) if state is None else state)
    return folder


def test_checkpoint_problem_names_what_is_missing_or_broken(tmp_path):
    assert checkpoint_problem(make_checkpoint(tmp_path, 4)) is None
    assert checkpoint_step(tmp_path / "checkpoint-4") == 4
    assert checkpoint_problem(make_checkpoint(tmp_path, 5, weights=["adapter_model.safetensors"])) is None

    truncated = make_checkpoint(tmp_path, 6, state='{"global_step": 6, "log_hist')
    assert "trainer_state.json is not valid JSON" in checkpoint_problem(truncated)
    (truncated / "trainer_state.json").unlink()
    assert "trainer_state.json is missing" in checkpoint_problem(truncated)

    no_weights = make_checkpoint(tmp_path, 7, weights=["optimizer.pt"])
    assert "model weights are missing" in checkpoint_problem(no_weights)
    assert "model.safetensors" in checkpoint_problem(no_weights)

    other_step = make_checkpoint(tmp_path, 8, state=json.dumps({"global_step": 6}))
    assert "global_step 6, not 8" in checkpoint_problem(other_step)

    sharded = make_checkpoint(tmp_path, 9, weights=["model-00001-of-00002.safetensors"])
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in checkpoint_problem(sharded)

    # TRL writes the adaptive-entropy state after trainer_state.json
    assert required_checkpoint_files(build_args(use_adaptive_entropy=True)) == ("entropy_ctrl_state.json",)
    assert required_checkpoint_files(build_args()) == ()
    entropy = make_checkpoint(tmp_path, 10)
    assert "entropy_ctrl_state.json is missing" in checkpoint_problem(entropy, ["entropy_ctrl_state.json"])
    (entropy / "entropy_ctrl_state.json").write_text('{"entropy_co')
    assert "entropy_ctrl_state.json is not valid JSON" in checkpoint_problem(entropy, ["entropy_ctrl_state.json"])


def build_args(**overrides):
    from trl_ext.trainers import ExtGRPOConfig

    from ..utils import cpu_config_kwargs

    return ExtGRPOConfig(**cpu_config_kwargs("unused", **overrides))


def test_resolve_true_skips_incomplete_checkpoints_with_a_warning(tmp_path, caplog):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 12, state="{")
    make_checkpoint(tmp_path, 11, weights=())
    (tmp_path / "checkpoint-13").write_text("not a folder")  # ignored, as by transformers
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_resume_checkpoint(True, tmp_path) == str(tmp_path / "checkpoint-10")
    warnings = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(warnings) == 2
    assert f"{tmp_path / 'checkpoint-12'} on resume: trainer_state.json is not valid JSON" in warnings[0]
    assert f"{tmp_path / 'checkpoint-11'} on resume: the model weights are missing" in warnings[1]


def test_resolve_passes_no_resume_and_complete_paths_through(tmp_path):
    assert resolve_resume_checkpoint(None, tmp_path) is None
    assert resolve_resume_checkpoint(False, tmp_path) is None
    folder = make_checkpoint(tmp_path, 3)
    assert resolve_resume_checkpoint(str(folder), "elsewhere") == str(folder)


def test_resolve_true_without_checkpoints_fails_as_transformers(tmp_path):
    with pytest.raises(ValueError) as caught:
        resolve_resume_checkpoint(True, tmp_path)
    assert str(caught.value) == f"No valid checkpoint found in output directory ({tmp_path})"  # Trainer.train's
    with pytest.raises(FileNotFoundError):  # as get_last_checkpoint
        resolve_resume_checkpoint(True, tmp_path / "missing")


def test_resolve_true_with_only_incomplete_checkpoints_names_them_and_the_fix(tmp_path):
    make_checkpoint(tmp_path, 1, weights=())
    make_checkpoint(tmp_path, 2, state="")
    with pytest.raises(ValueError) as caught:
        resolve_resume_checkpoint(True, tmp_path)
    message = str(caught.value)
    assert f"No complete checkpoint in output directory ({tmp_path})" in message
    assert "checkpoint-2: trainer_state.json is not valid JSON" in message
    assert "checkpoint-1: the model weights are missing" in message
    assert "train from the start" in message


def test_resolve_an_incomplete_path_names_it_and_the_complete_ones(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    broken = make_checkpoint(tmp_path, 3, state='{"glo')
    with pytest.raises(ValueError) as caught:
        resolve_resume_checkpoint(str(broken), tmp_path)
    message = str(caught.value)
    assert f"Cannot resume from {broken}: trainer_state.json is not valid JSON" in message
    assert f"resume from an earlier complete checkpoint: {tmp_path / 'checkpoint-2'}, {tmp_path / 'checkpoint-1'}" in (
        message
    )
    with pytest.raises(ValueError) as caught:  # a path that does not exist: said so, with what is there
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-9"), tmp_path)
    message = str(caught.value)
    assert f"Cannot resume from {tmp_path / 'checkpoint-9'}: it does not exist." in message
    assert "incomplete" in message.split("Checkpoints found: ", 1)[1]  # checkpoint-3, named with its problem
    assert (
        f"{tmp_path / 'checkpoint-2'}, {tmp_path / 'checkpoint-1'}" in message and "The checkpoint is" not in message
    )
    with pytest.raises(ValueError, match="it does not exist. There is no checkpoint-N folder in"):
        resolve_resume_checkpoint(str(tmp_path / "elsewhere" / "checkpoint-1"), tmp_path / "empty-run")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="it is a file, not a checkpoint folder"):
        resolve_resume_checkpoint(str(tmp_path / "a-file"), tmp_path)


def test_name_disk_full(tmp_path):
    def named(error):
        return name_disk_full(error, tmp_path / "checkpoint-5")

    for error in (
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ):
        result = named(error)
        assert isinstance(result, OSError) and result.errno == errno.ENOSPC
        assert result.strerror.startswith(f"disk full while saving {tmp_path / 'checkpoint-5'}: ")
        assert "bytes free on /" in result.strerror and "skipped on resume" in result.strerror
    try:  # the ENOSPC is the cause of what reached the trainer
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from inner
    except RuntimeError as outer:
        assert named(outer) is not None
    # not a full disk: this filesystem has room, and these errors say nothing of space
    assert named(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")) is None
    assert named(OSError(errno.EACCES, "Permission denied")) is None
    assert named(ValueError("bad value")) is None
    assert named(KeyboardInterrupt()) is None
    assert named(named(OSError(errno.ENOSPC, "No space left on device"))) is None  # not named twice
