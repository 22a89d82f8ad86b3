"""Quickstart spread: the held-out improvement, wall time and peak memory of `trl-ext quickstart` over seeds and
torch thread counts.

One seed's exact numbers do not carry from one machine to the next: another CPU rounds the float sums differently,
the sampled rollouts diverge, and the run ends elsewhere. A different torch thread count changes the reduction
order in the same way, so runs at 1 and 2 threads stand in for "another machine". This benchmark runs the
quickstart once per (seed, threads) in a fresh process (``OMP_NUM_THREADS``), reads each run's
``trl_ext_run.json``, and writes every run, the range, the mean and the minimum into ``benchmarks/RESULTS.md``.
The README's stated range and the CI test's bound (tests/test_quickstart.py) come from this table.

    python benchmarks/quickstart_spread.py                      # seeds 0-4 x threads 1, 2: 10 runs, about an hour
    python benchmarks/quickstart_spread.py --jobs 2             # two 1-thread runs at a time; 2-thread runs alone
    python benchmarks/quickstart_spread.py --seeds 0 --threads 2 --no-write   # one run, printed only
    python benchmarks/quickstart_spread.py --jobs 2 --workdir DIR --render    # the table again from DIR's runs

Peak memory is sampled every 0.2 s over the whole process tree (the trainer and its REPL interpreters), and the
kernel's peak resident size of the largest single process (``ru_maxrss``) is reported beside it. Times of runs that
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
from _results import machine, write_section  # noqa: E402

SECTION = "quickstart_spread"


@dataclass
class Measured:
    """What the benchmark measures around one run (the rest is in the run's ``trl_ext_run.json``)."""

    seed: int
    threads: int
    shared_cpus: bool
    wall_s: float
    tree_peak_mb: float
    process_peak_mb: float


@dataclass
class Run:
    measured: Measured
    before: dict
    after: dict

    @classmethod
    def load(cls, workdir: Path, seed: int, threads: int) -> Run:
        saved = json.loads((workdir / f"seed{seed}-threads{threads}.json").read_text())
        measured = Measured(**{name: saved[name] for name in Measured.__dataclass_fields__})
        info = json.loads((workdir / f"seed{seed}-threads{threads}" / "trl_ext_run.json").read_text())
        return cls(measured, info["result"]["before"], info["result"]["after"])

    @property
    def gain(self) -> float:
        return self.after["reward"] - self.before["reward"]

    def share(self, which: str, strategy: str) -> float:
        return getattr(self, which)["strategies"].get(strategy, 0.0)

    @property
    def copy_drop(self) -> float:
        return self.share("before", "copy") - self.share("after", "copy")


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_one(seed: int, threads: int, workdir: Path, shared_cpus: bool) -> Run:
    """One quickstart in a fresh process with ``threads`` torch threads; its numbers from ``trl_ext_run.json``."""
    output = workdir / f"seed{seed}-threads{threads}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trl_ext.cli", "quickstart", "--no-progress", "--seed", str(seed)]
    command += ["--output-dir", str(output)]
    log = (workdir / f"seed{seed}-threads{threads}.log").open("w")
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    peak = 0
    watched = psutil.Process(child.pid)
    while True:  # os.wait4, not Popen.poll: it also returns the child's resource usage
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            break
        peak = max(peak, _tree_rss(watched))
        time.sleep(0.2)
    wall = time.perf_counter() - started
    log.close()
    if child.returncode != 0:
        raise RuntimeError(f"seed {seed}, {threads} threads failed (exit {child.returncode}); see {log.name}")
    measured = Measured(seed, threads, shared_cpus, wall, peak / 2**20, usage.ru_maxrss / 1024)  # ru_maxrss: kB
    (workdir / f"seed{seed}-threads{threads}.json").write_text(json.dumps(asdict(measured)))
    return Run.load(workdir, seed, threads)


def spread_lines(runs: list[Run], command: str) -> str:
    """The RESULTS.md section: every run, the ranges, and the CI test's bounds checked against them."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_quickstart import CI_COPY_DROP_BOUND, CI_GAIN_BOUND

    gains = [run.gain for run in runs]
    drops = [run.copy_drop for run in runs]
    alone = [run.measured for run in runs if not run.measured.shared_cpus] or [run.measured for run in runs]
    peaks = [run.measured.tree_peak_mb / 1024 for run in runs]
    lines = [
        "## Quickstart spread: held-out improvement over seeds and thread counts",
        "",
        f"`{command}` ({machine(threads=False)}, {os.cpu_count()} CPUs). Each run is `trl-ext quickstart --seed S` (the default "
        "settings) in a fresh process with `OMP_NUM_THREADS` = threads; a different thread count changes the float "
        "reduction order the way another CPU does, so these runs stand in for other machines of this kind. "
        "Rewards on the 192 held-out rollouts; strategy shares of the same rollouts.",
        "",
        "| seed | threads | SFT only | after RL | gain | lookup program | copied by hand | wall time | "
        "peak RSS (tree) | largest process |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r.measured.threads, r.measured.seed)):
        m = run.measured
        shared = " (2 runs at once)" if m.shared_cpus else ""
        lines.append(
            f"| {m.seed} | {m.threads} | {run.before['reward']:.3f} | {run.after['reward']:.3f} | "
            f"**{run.gain:+.3f}** | {run.share('before', 'lookup'):.0%} → {run.share('after', 'lookup'):.0%} | "
            f"{run.share('before', 'copy'):.0%} → {run.share('after', 'copy'):.0%} | {m.wall_s / 60:.1f} min{shared} | "
            f"{m.tree_peak_mb / 1024:.2f} GB | {m.process_peak_mb / 1024:.2f} GB |"
        )
    lines += [
        "",
        f"**Gain over {len(runs)} runs: {min(gains):+.2f} to {max(gains):+.2f}** (mean {statistics.fmean(gains):+.3f}, "
        f"standard deviation {statistics.pstdev(gains):.3f}); the share of hand-copied answers drops by "
        f"{min(drops):.0%} to {max(drops):.0%}. Wall time of the runs alone on the machine: "
        f"{min(m.wall_s for m in alone) / 60:.1f} to {max(m.wall_s for m in alone) / 60:.1f} min; peak resident "
        f"memory of the process tree (trainer and REPL interpreters, sampled every 0.2 s): {min(peaks):.1f} to "
        f"{max(peaks):.1f} GB.",
        "",
        "The CI test (`tests/test_quickstart.py::test_default_quickstart_learns`, seed 0) asserts gain ≥ "
        f"{CI_GAIN_BOUND:+.2f} ({_verdict(min(gains), CI_GAIN_BOUND)}) and a drop of the copied share ≥ "
        f"{CI_COPY_DROP_BOUND:.0%} ({_verdict(min(drops), CI_COPY_DROP_BOUND)}).",
    ]
    return "\n".join(lines)


def _verdict(worst: float, bound: float) -> str:
    if worst < bound:
        return f"NOT met by every run: worst {worst:+.3f}"
    return f"the worst run is {worst / bound:.1f}x the bound" if bound > 0 else "every run meets it"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="1-thread runs at once (2-thread runs: jobs // 2)")
    parser.add_argument("--workdir", default=None, help="keep the runs' output directories here")
    parser.add_argument("--render", action="store_true", help="no new runs: rebuild the table from --workdir")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    if args.render and not args.workdir:
        parser.error("--render needs the --workdir of an earlier run")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart-spread-"))
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = [(seed, threads) for threads in args.threads for seed in args.seeds]
    if args.render:
        runs = [Run.load(workdir, seed, threads) for seed, threads in jobs]
    else:
        runs = measure(jobs, workdir, args.jobs)
    command = f"python benchmarks/quickstart_spread.py --seeds {' '.join(map(str, args.seeds))} --threads "
    command += f"{' '.join(map(str, args.threads))} --jobs {args.jobs}"
    body = spread_lines(runs, command)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


def measure(jobs: list[tuple[int, int]], workdir: Path, max_jobs: int) -> list[Run]:
    """Run every (seed, threads) job. Runs with one torch thread share the CPUs fairly (``max_jobs`` at once); runs
    with more threads get the cores they ask for (``max_jobs // threads`` at once), so their wall times are what a
    user sees."""
    runs: list[Run] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(queue: list[tuple[int, int]], shared_cpus: bool) -> None:
        while True:
            with lock:
                if not queue:
                    return
                seed, threads = queue.pop(0)
            try:
                run = run_one(seed, threads, workdir, shared_cpus)
            except RuntimeError as error:
                with lock:
                    errors.append(str(error))
                continue
            with lock:
                runs.append(run)
                print(f"seed {seed}, {threads} threads: gain {run.gain:+.3f}, {run.measured.wall_s:.0f} s", flush=True)

    for threads in sorted({threads for _, threads in jobs}):
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
