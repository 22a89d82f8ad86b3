"""The engine's wave scheduling: every pending generation request of every live rollout goes to the generator in one
batched call as soon as no rollout is busy (or the batch is full, or the oldest request has waited long enough).

`WaveScheduler` owns the batching and the generator's thread; `Join` is what a rollout waits on (a turn's action,
the completions of one ``llm_query_batched`` call, the answers of its children). How busy tokens make "no rollout
is busy" mean "every request of this wave is in": `WaveScheduler`'s docstring. `critical_path_generations` is the
fewest calls any scheduler could make for a tree, which a scheduler's efficiency is measured against.
`trl_ext.rlm.engine` runs the rollouts on top of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .generators import Completion, Generator
from .stats import EngineStats
from .tree import RolloutNode, RolloutTree

__all__ = ["GeneratorError", "Join", "WaveScheduler", "critical_path_generations"]


class GeneratorError(RuntimeError):
    """The generator raised or returned something unusable; the run is aborted."""


class Join:
    """Completes when all of its `size` parts are set; hands the waiter a busy token as it wakes it."""

    def __init__(self, scheduler: WaveScheduler, size: int) -> None:
        self.scheduler = scheduler
        self.results: list[Any] = [None] * size
        self.remaining = size
        self.future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if size == 0:
            self._wake(None)

    def _wake(self, error: BaseException | None) -> None:
        if self.future.done():
            return
        self.scheduler.busy += 1  # taken for the waiter *before* anyone can see the scheduler idle
        if error is None:
            self.future.set_result(self.results)
        else:
            self.future.set_exception(error)

    def set(self, index: int, value: Any) -> None:
        self.results[index] = value
        self.remaining -= 1
        if self.remaining == 0:
            self._wake(None)

    def fail(self, error: BaseException) -> None:
        self._wake(error)


class WaveScheduler:
    """Batches generation requests: one generator call whenever no node is busy, or when a batch is full.

    Busy tokens: a node holds one from its start to its end, except while it waits (`wait`); whoever completes
    what it waits for gives it a token back before it can run (`Join._wake`). So ``busy == 0`` means every
    live node waits for a generation or for children that all wait for generations: the pending requests are
    all the requests this wave will get.
    """

    def __init__(
        self, generator: Generator, max_batch_size: int | None, max_batch_wait_s: float | None, stats: EngineStats
    ) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.max_batch_wait_s = max_batch_wait_s
        self.stats = stats
        self.busy = 0
        self.pending: list[tuple[list[int], Join, int, tuple]] = []
        self._oldest_pending = 0.0  # loop time at which the oldest pending request arrived
        self._timer: asyncio.TimerHandle | None = None
        self.in_flight = False
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlm-generator")
        self._calls: set[asyncio.Task[None]] = set()

    def shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._executor.shutdown(wait=False)

    def acquire(self, count: int = 1) -> None:
        self.busy += count

    def release(self) -> None:
        self.busy -= 1
        self._maybe_flush()

    def submit(self, prompt_ids: list[int], join: Join, index: int, key: tuple) -> None:
        """Queue one generation whose completion becomes part `index` of `join`. ``key`` is the request's place in
        the rollouts, independent of timing (the engine's ``request_key``): each batch goes to the generator in key
        order."""
        if self.failure.done():
            raise self.failure.exception()  # type: ignore[misc]
        if not self.pending:
            self._start_waiting()
        self.pending.append((prompt_ids, join, index, key))
        self._maybe_flush()

    def _start_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        self._oldest_pending = loop.time()
        if self.max_batch_wait_s is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(self.max_batch_wait_s, self._maybe_flush)

    async def wait(self, join: Join) -> list[Any]:
        """Give up the caller's busy token until `join` completes (it comes back with the results)."""
        self.release()
        return await join.future

    async def generate(self, prompts: Sequence[list[int]], keys: Sequence[tuple]) -> list[Completion]:
        join = Join(self, len(prompts))
        for index, (prompt_ids, key) in enumerate(zip(prompts, keys, strict=True)):
            self.submit(prompt_ids, join, index, key)
        return await self.wait(join)

    def _maybe_flush(self) -> None:
        if self.in_flight or not self.pending or self.failure.done():
            return
        full = self.max_batch_size is not None and len(self.pending) >= self.max_batch_size
        overdue = (
            self.max_batch_wait_s is not None
            and asyncio.get_running_loop().time() - self._oldest_pending >= self.max_batch_wait_s
        )
        if self.busy > 0 and not full and not overdue:
            return
        size = self.max_batch_size or len(self.pending)
        # Requests arrive in the order the REPL cells finished, which varies from run to run; the generator gets
        # them in the order of their place in the rollouts instead, so that the same seed gives the same samples.
        self.pending.sort(key=lambda request: request[3])
        batch, self.pending = self.pending[:size], self.pending[size:]
        if self.pending:  # the rest of an oversized wave: it has waited already, so it goes next
            self._start_waiting()
        self.in_flight = True
        task = asyncio.get_running_loop().create_task(self._call(batch))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[tuple[list[int], Join, int, tuple]]) -> None:
        started = time.perf_counter()
        try:
            prompts = [prompt_ids for prompt_ids, _, _, _ in batch]
            completions = await asyncio.get_running_loop().run_in_executor(
                self._executor, call_generator, self.generator, prompts
            )
            if not isinstance(completions, list) or len(completions) != len(batch):
                raise GeneratorError(f"the generator returned {len(completions)} completions for {len(batch)} prompts")
            for completion in completions:
                if not isinstance(completion, Completion):
                    raise GeneratorError(
                        f"the generator must return Completion objects, got {type(completion).__name__}"
                    )
        except Exception as exc:  # noqa: BLE001 - every waiter of the batch gets it, then the run aborts
            error = exc if isinstance(exc, GeneratorError) else GeneratorError(f"the generator failed: {exc!r}")
            error.__cause__ = exc if error is not exc else None
            if not self.failure.done():
                self.failure.set_exception(error)
                self.failure.exception()  # mark retrieved: `arun` re-raises it
            for _, join, _, _ in batch:
                join.fail(error)
            return
        finally:
            self.stats.generator_calls += 1
            self.stats.batch_sizes.append(len(batch))
            self.stats.generator_time_s += time.perf_counter() - started
            self.in_flight = False
        self.stats.sequences += len(batch)
        for (_, join, index, _), completion in zip(batch, completions):
            join.set(index, completion)
        self._maybe_flush()


def call_generator(generator: Generator, prompts: list[list[int]]) -> list[Completion]:
    try:
        return generator.generate(prompts)
    except StopIteration as exc:  # cannot be set on a Future: asyncio would wait forever instead of failing
        raise GeneratorError(f"the generator raised StopIteration ({exc!r})") from exc


# ----------------------------------------------------------------------------------------------- analysis
def critical_path_generations(tree: RolloutTree) -> int:
    """The fewest sequential generator calls that can produce `tree`: its longest chain of dependent generations.

    A turn's action depends on the previous turn's code having finished, which depends on every completion and
    child that code waited for, in the order of its query calls. With every independent request of every tree
    batched together, a run needs ``max(critical_path_generations(tree) for tree in trees)`` calls; a
    scheduler's efficiency is that over the calls it made.
    """
    nodes = tree.nodes

    def last_level(node: RolloutNode, first_level: int) -> int:
        """Level (0-based call index) of the node's last generation, given the level of its first action."""
        level = first_level
        for turn_index, turn in enumerate(node.turns):
            if turn_index:
                level += 1  # this turn's action comes after the previous turn's code finished
            requests = sorted(
                {call.request for call in turn.llm_calls} | {nodes[c].spawned_at[1] for c in turn.children}
            )  # type: ignore[index]
            for request in requests:
                end = level
                if any(call.request == request for call in turn.llm_calls):
                    end = max(end, level + 1)
                for child in turn.children:
                    if nodes[child].spawned_at[1] == request:  # type: ignore[index]
                        end = max(end, last_level(nodes[child], level + 1))
                level = end
        return level

    if not tree.root.turns:
        return 0
    return last_level(tree.root, 0) + 1
