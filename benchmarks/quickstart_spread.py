"""Quickstart spread: the held-out improvement, wall time and peak memory of `trl-ext quickstart` over seeds, torch
thread counts and CPU kernels.

One seed's exact numbers do not carry from one machine to the next: another CPU runs other vectorised kernels, rounds
float sums differently, the sampled rollouts diverge and the run ends elsewhere. Two knobs reproduce that here:

- ``ATEN_CPU_CAPABILITY`` (``--kernels``): torch's vectorised CPU kernels (``native``: what torch picks for this
  CPU; ``default``: the portable scalar ones; ``avx2``, ``avx512`` where the CPU has them). Other kernels give
  other rounding (about 5e-7 on the tiny model's logits), exactly what another CPU does.
- ``OMP_NUM_THREADS`` (``--threads``): a different reduction order where torch splits the work. On the quickstart's
  tiny model few operations are split: 1 and 2 threads moved the training metrics in the 7th digit, flipped no
  sampled token, and ended with the same held-out outcome (the table shows it).

Each run is the quickstart with its default settings in a fresh process; the benchmark reads its
``trl_ext_run.json`` and writes every run, the ranges and the CI test's bounds checked against them into
``benchmarks/RESULTS.md``. The README's stated range and the CI test's bounds (tests/quickstart/test_quickstart.py)
come from this table.

    python benchmarks/quickstart_spread.py --jobs 2       # seeds 0-4 x kernels native, default x 1 thread; then
                                                          # seeds 0-1 at 2 threads alone (the user's wall time)
    python benchmarks/quickstart_spread.py --seeds 0 --threads 2 --kernels native --no-write   # one run, printed
    python benchmarks/quickstart_spread.py --jobs 2 --workdir DIR --render    # the table again from DIR's runs

Peak memory is sampled every 0.2 s over the whole process tree (the trainer and its REPL interpreters) as PSS
(proportional set size: a page shared by several processes is split between them, so the sum is the memory the run
really holds) and as the plain sum of RSS (which counts the interpreters' shared pages once per process, about 3x
too much here); the kernel's peak resident size of the largest single process, the trainer (``ru_maxrss``), is
reported beside them. Times of runs that
ran beside another run (``--jobs 2`` runs two 1-thread runs at once) are marked as such: only the runs alone on the
machine give the time a user sees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from _memory import tree_memory  # noqa: E402
from _results import machine, write_section  # noqa: E402

SECTION = "quickstart_spread"
NATIVE = "native"  # torch's own choice of vectorised CPU kernels for this CPU (ATEN_CPU_CAPABILITY unset)


def run_name(seed: int, threads: int, kernels: str) -> str:
    return f"seed{seed}-threads{threads}" + ("" if kernels == NATIVE else f"-{kernels}")


@dataclass
class Measured:
    """What the benchmark measures around one run (the rest is in the run's ``trl_ext_run.json``)."""

    seed: int
    threads: int
    shared_cpus: bool
    wall_s: float
    tree_peak_mb: float  # the sum of RSS over the tree
    process_peak_mb: float | None  # None: not recorded
    kernels: str = NATIVE
    tree_pss_peak_mb: float | None = None  # None: not recorded


@dataclass
class Run:
    measured: Measured
    before: dict
    after: dict

    @classmethod
    def load(cls, workdir: Path, seed: int, threads: int, kernels: str) -> Run:
        name = run_name(seed, threads, kernels)
        saved = json.loads((workdir / f"{name}.json").read_text())
        measured = Measured(**{key: saved[key] for key in Measured.__dataclass_fields__ if key in saved})
        info = json.loads((workdir / name / "trl_ext_run.json").read_text())
        result = info["extra"]["result"]  # trl_ext.run_info.RunInfo: the quickstart's result is in `extra`
        return cls(measured, result["before"], result["after"])

    @property
    def gain(self) -> float:
        return self.after["reward"] - self.before["reward"]

    def share(self, which: str, strategy: str) -> float:
        return getattr(self, which)["strategies"].get(strategy, 0.0)

    @property
    def children_gain(self) -> float:
        """Children per root, after RL minus before."""
        return self.after["children_mean"] - self.before["children_mean"]

    @property
    def child_correct_gain(self) -> float:
        """The share of children answering their part right, after RL minus before."""
        return (self.after["child_correct_rate"] or 0.0) - (self.before["child_correct_rate"] or 0.0)


def run_one(seed: int, threads: int, kernels: str, workdir: Path, shared_cpus: bool) -> Run:
    """One quickstart in a fresh process with ``threads`` torch threads and ``kernels`` (an ``ATEN_CPU_CAPABILITY``
    value, or `NATIVE`); its numbers from ``trl_ext_run.json``."""
    name = run_name(seed, threads, kernels)
    output = workdir / name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernels != NATIVE:
        env["ATEN_CPU_CAPABILITY"] = kernels
        # torch's compile cache is not keyed on ATEN_CPU_CAPABILITY: a kernel compiled under AVX2 and read back on
        # AVX-512 gave FlexAttention log-probs 4 nats off (tests/test_packing.py). Each kernel family its own cache.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"trl-ext-inductor-{kernels}")
    command = [sys.executable, "-m", "trl_ext.cli", "quickstart", "--no-progress", "--seed", str(seed)]
    command += ["--output-dir", str(output)]
    log = (workdir / f"{name}.log").open("w")
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak = peak_pss = 0
    watched = psutil.Process(child.pid)
    while True:  # os.wait4, not Popen.poll: it also returns the child's resource usage
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            break
        rss, pss = tree_memory(watched)
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.2)
    wall = time.perf_counter() - started
    log.close()
    if child.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {child.returncode}); see {log.name}")
    measured = Measured(
        seed, threads, shared_cpus, wall, peak / 2**20, usage.ru_maxrss / 1024, kernels, peak_pss / 2**20
    )  # ru_maxrss: kB
    (workdir / f"{name}.json").write_text(json.dumps(asdict(measured)))
    return Run.load(workdir, seed, threads, kernels)


def spread_lines(runs: list[Run], command: str) -> str:
    """The RESULTS.md section: every run, the ranges, and the CI test's bounds checked against them. A run with the
    same seed and kernels as another and the same held-out outcome (another thread count that flipped no sampled
    token) is listed but counted once."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "quickstart"))
    from test_quickstart import CI_CHILD_CORRECT_BOUND, CI_CHILDREN_GAIN_BOUND, CI_GAIN_BOUND

    runs = sorted(
        runs, key=lambda r: (r.measured.kernels != NATIVE, r.measured.kernels, r.measured.seed, r.measured.threads)
    )
    distinct: dict[tuple, Run] = {}
    for run in runs:
        outcome = [(part["reward"], sorted(part["strategies"].items())) for part in (run.before, run.after)]
        key = (run.measured.seed, run.measured.kernels, json.dumps(outcome))
        distinct.setdefault(key, run)
    counted = list(distinct.values())
    gains = [run.gain for run in counted]
    children = [run.children_gain for run in counted]
    correct = [run.child_correct_gain for run in counted]
    alone = [run.measured for run in runs if not run.measured.shared_cpus]
    timed, timed_label = (alone, "alone on the machine") if alone else ([r.measured for r in runs], "(none ran alone)")
    pss = [run.measured.tree_pss_peak_mb / 1024 for run in runs if run.measured.tree_pss_peak_mb is not None]
    lines = [
        "## Quickstart spread: held-out improvement over seeds, CPU kernels and thread counts",
        "",
        f"`{command}` ({machine(threads=False)}, {os.cpu_count()} CPUs). Each run is `trl-ext quickstart --seed S` "
        "(the default settings) in a fresh process with `ATEN_CPU_CAPABILITY` = kernels (native: torch's choice for "
        "this CPU; default: the portable scalar kernels, which round differently, as another CPU does) and "
        "`OMP_NUM_THREADS` = threads. Held-out figures on 96 rollouts (48 tasks never seen in SFT or RL x 2 "
        "samples): the reward (share of parts right), the share of roots that delegate, children per root, and the "
        "share of children that answer their part right. Memory: peak PSS of the process tree (trainer and REPL "
        "interpreters, shared pages counted once), the peak sum of RSS over the tree, and the trainer's peak RSS.",
        "",
        "| seed | kernels | threads | SFT only → after RL | gain | root delegates | children per root | "
        "children right | wall time | PSS (tree) | RSS sum (tree) | trainer RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        m = run.measured
        shared = " (2 runs at once)" if m.shared_cpus else " (alone)"
        repeat = "" if run in counted else " (same outcome as 1 thread)"
        lines.append(
            f"| {m.seed} | {m.kernels} | {m.threads}{repeat} | {run.before['reward']:.3f} → {run.after['reward']:.3f} "
            f"| **{run.gain:+.3f}** | {run.share('before', 'delegate'):.0%} → {run.share('after', 'delegate'):.0%} | "
            f"{run.before['children_mean']:.2f} → {run.after['children_mean']:.2f} | "
            f"{run.before['child_correct_rate'] or 0:.0%} → {run.after['child_correct_rate'] or 0:.0%} | "
            f"{m.wall_s / 60:.1f} min{shared} | {_gigabytes(m.tree_pss_peak_mb)} | {m.tree_peak_mb / 1024:.2f} GB | "
            f"{_gigabytes(m.process_peak_mb)} |"
        )
    lines += [
        "",
        f"**Gain over the {len(counted)} distinct runs: {min(gains):+.2f} to {max(gains):+.2f}** (mean "
        f"{statistics.fmean(gains):+.3f}, standard deviation {statistics.pstdev(gains):.3f}); children per root "
        f"{min(children):+.2f} to {max(children):+.2f}; children answering right {100 * min(correct):+.0f} to "
        f"{100 * max(correct):+.0f} percentage points. Wall time {timed_label}: "
        f"{min(m.wall_s for m in timed) / 60:.1f} to {max(m.wall_s for m in timed) / 60:.1f} min; peak memory of the "
        + (f"process tree (PSS): {min(pss):.2f} to {max(pss):.2f} GB." if pss else "process tree: not recorded."),
        "",
        "The CI test (`tests/quickstart/test_quickstart.py::test_default_quickstart_learns`, seed 0) asserts a gain ≥ "
        f"{CI_GAIN_BOUND:+.2f} ({_verdict(min(gains), CI_GAIN_BOUND)}), children per root up by ≥ "
        f"{CI_CHILDREN_GAIN_BOUND:.2f} ({_verdict(min(children), CI_CHILDREN_GAIN_BOUND)}) and children answering "
        f"right up by ≥ {100 * CI_CHILD_CORRECT_BOUND:.0f} points ({_verdict(min(correct), CI_CHILD_CORRECT_BOUND)}).",
    ]
    return "\n".join(lines)


def _gigabytes(megabytes: float | None) -> str:
    return "not recorded" if megabytes is None else f"{megabytes / 1024:.2f} GB"


def _verdict(worst: float, bound: float) -> str:
    if worst < bound:
        return f"NOT met by every run: worst {worst:+.3f}"
    if bound > 0:
        return f"the worst run is {worst / bound:.1f}x the bound"
    return f"the worst run is {worst - bound:.2f} above it"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--kernels", nargs="+", default=[NATIVE, "default"], help="ATEN_CPU_CAPABILITY values")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch threads of every run")
    parser.add_argument(
        "--alone-seeds",
        type=int,
        nargs="*",
        default=[0, 1],
        help="also run these with 2 threads and native kernels, "
        "alone on the machine: the wall time a user sees, and whether the thread count changes the run",
    )
    parser.add_argument("--jobs", type=int, default=1, help="1-thread runs at once")
    parser.add_argument("--workdir", default=None, help="keep the runs' output directories here")
    parser.add_argument("--render", action="store_true", help="no new runs: rebuild the table from --workdir")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if args.render and not args.workdir:
        parser.error("--render needs the --workdir of an earlier run")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart-spread-"))
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = [(seed, threads, kernels) for kernels in args.kernels for threads in args.threads for seed in args.seeds]
    jobs += [(seed, 2, NATIVE) for seed in args.alone_seeds if (seed, 2, NATIVE) not in jobs]
    if args.render:
        runs = [Run.load(workdir, *job) for job in jobs]
    else:
        runs = measure(jobs, workdir, args.jobs)
    command = (
        f"python benchmarks/quickstart_spread.py --seeds {' '.join(map(str, args.seeds))} --kernels "
        f"{' '.join(args.kernels)} --threads {' '.join(map(str, args.threads))} --alone-seeds "
        f"{' '.join(map(str, args.alone_seeds))} --jobs {args.jobs}"
    )
    body = spread_lines(runs, command)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


def measure(jobs: list[tuple[int, int, str]], workdir: Path, max_jobs: int) -> list[Run]:
    """Run every (seed, threads, kernels) job. Runs with one torch thread share the CPUs fairly (``max_jobs`` at
    once); runs with more threads get the cores they ask for (``max_jobs // threads`` at once), so their wall times
    are what a user sees."""
    runs: list[Run] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(queue: list[tuple[int, int, str]], shared_cpus: bool) -> None:
        while True:
            with lock:
                if not queue:
                    return
                seed, threads, kernels = queue.pop(0)
            try:
                run = run_one(seed, threads, kernels, workdir, shared_cpus)
            except RuntimeError as error:
                with lock:
                    errors.append(str(error))
                continue
            with lock:
                runs.append(run)
                print(
                    f"{run_name(seed, threads, kernels)}: gain {run.gain:+.3f}, {run.measured.wall_s:.0f} s",
                    flush=True,
                )

    for threads in sorted({job[1] for job in jobs}):
        queue = [job for job in jobs if job[1] == threads]
        at_once = max(1, max_jobs // threads)
        workers = [threading.Thread(target=worker, args=(queue, at_once > 1)) for _ in range(at_once)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return runs


if __name__ == "__main__":
    main()
