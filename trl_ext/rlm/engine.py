"""The batched asynchronous rollout engine: many RLM trees sampled from one policy at once (docs/rlm_scaffold.md).

```python
from trl_ext.rlm import RLMEngine, RLMScaffoldConfig, RLMTask, TransformersGenerator

engine = RLMEngine(TransformersGenerator(model, tokenizer), tokenizer, RLMScaffoldConfig(max_depth=1))
trees = engine.run([RLMTask(prompt="How many 'x' are there?", context=text)] * 8)
for tree in trees:
    tree.final_answer, tree.turn_samples(), tree.weights()   # see trl_ext.rlm.tree
engine.stats                                                 # EngineStats of the last run
```

How it runs. Every node (root or child) is an asyncio task running `RLMEngine._run_node`, the scaffold loop:
rebuild the prompt, ask for one action, run its code in the node's REPL, check for a final answer, repeat.
Asking for an action, an ``llm_query`` completion or a child's action all go through one `WaveScheduler`
(`trl_ext.rlm.scheduler`), which sends **every pending request of every live node to the generator in one batched
call** as soon as no node is *busy* (or the batch reaches ``max_batch_size``, or the oldest request has waited
``max_batch_wait_s``). A node is busy while it does something that may lead to a request: rendering a prompt,
running a REPL cell, starting. It is idle while it waits for a generation or for its children. So the number of
generator calls follows the depth of the dependency chain (the waves),
not the number of rollouts: 64 roots whose children all start in the same wave share one call per wave.

REPL cells of a wave run in parallel: each node has its own interpreter process and the engine waits on all
their pipes at once from the event loop; starting and closing REPLs runs on a thread pool, overlapping
generation. The generator runs on its own thread, one call at a time.

Failures are contained and recorded, never raised: a REPL that times out, crashes or cannot start, code that
raises, an action without code or answer — each ends up in the tree (`Turn.repl_result`, `Turn.observation`,
`RolloutNode.end_reason == "error"` with `RolloutNode.error`) and in `EngineStats`. Only a failing *generator*
(a systemic fault, e.g. out of GPU memory) aborts the run: every REPL is closed and `GeneratorError` raised.

Query calls of the model's code (``llm_query``, ``rlm_query`` and their batched forms) are answered by
`trl_ext.rlm.queries.QueryAnswering`, which the engine inherits: children are nodes of the same run, plain
completions go through the same scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .generators import Generator
from .queries import CellQueryUse, QueryAnswering
from .repl import PythonREPL
from .sandbox import SandboxBackend, select_backend
from .sandbox.backend import quote_sandbox_text
from .scaffold import (
    RLMScaffoldConfig,
    build_system_prompt,
    build_turn_messages,
    describe_context,
    find_code_block,
    find_final_answer,
    format_observation,
)
from .scheduler import GeneratorError, WaveScheduler
from .stats import EngineStats
from .tree import RolloutNode, RolloutTree, Turn, preorder

logger = logging.getLogger(__name__)

__all__ = ["EngineStats", "RLMEngine", "RLMTask"]


@dataclass(frozen=True)
class RLMTask:
    """One root rollout to run.

    Attributes:
        prompt: the task (question/instruction), restated to the model every turn.
        context: the REPL's ``context`` variable (str, list or dict); None means the prompt itself.
    """

    prompt: str
    context: Any = None


@dataclass
class _Run:
    """State of one `RLMEngine.arun`: the scheduler, the nodes of every tree, the live tasks."""

    scheduler: WaveScheduler
    pool: ThreadPoolExecutor
    stats: EngineStats
    trees: list[list[RolloutNode]] = field(default_factory=list)  # nodes of each root, in creation order
    tree_of: dict[int, int] = field(default_factory=dict)  # id(node) -> tree index
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    closing: set[asyncio.Task[None]] = field(default_factory=set)  # REPLs being closed in the background
    query_calls: dict[tuple[int, int], int] = field(default_factory=dict)  # (id(node), turn) -> calls so far
    # id(node) -> where it sits in its tree, whatever the timing: () for a root, the parent's path plus
    # (turn, query call, prompt index) of the call that started it for a child
    path_of: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    # tree index -> what the query calls of the whole tree (every node, every cell) have used so far
    tree_queries: dict[int, CellQueryUse] = field(default_factory=dict)

    def tree_query_use(self, node: RolloutNode) -> CellQueryUse:
        """What the query calls of ``node``'s whole tree have used so far (`trl_ext.rlm.queries.tree_budget_refusal`)."""
        return self.tree_queries.setdefault(self.tree_of[id(node)], CellQueryUse())

    def request_key(self, node: RolloutNode, turn_index: int, request_index: int = -1, offset: int = 0) -> tuple:
        """A generation request's place in the rollouts, independent of timing: the tree, the node's path, the turn,
        and for a plain completion its query call and prompt (a turn's own action first)."""
        return (self.tree_of[id(node)], self.path_of[id(node)], turn_index, request_index, offset)

    def next_request_index(self, node: RolloutNode, turn_index: int) -> int:
        """Index of a node turn's next query call (calls of one index were generated together)."""
        key = (id(node), turn_index)
        self.query_calls[key] = self.query_calls.get(key, 0) + 1
        return self.query_calls[key] - 1

    def new_node(self, tree: int, **fields: Any) -> RolloutNode:
        nodes = self.trees[tree]
        node = RolloutNode(id=len(nodes), **fields)
        nodes.append(node)
        self.tree_of[id(node)] = tree
        self.path_of[id(node)] = ()
        self.stats.nodes += 1
        return node

    def spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


# ------------------------------------------------------------------------------------------------- engine
class RLMEngine(QueryAnswering):
    """Runs RLM rollout trees for many tasks concurrently, batching all generations (see the module docstring).

    Args:
        generator: the policy (`trl_ext.rlm.generators`).
        tokenizer: renders chat messages to prompt ids (``apply_chat_template``) and decodes actions.
        config: limits, sandbox settings, batching and prompt templates.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``).
        max_repl_workers: threads that start and close REPL processes.
        sandbox_backend: where every REPL's interpreter runs (a `trl_ext.rlm.sandbox.SandboxBackend`; docs/security.md
            says how to write one). Default: the local backend ``config.sandbox.isolation`` resolves to on this
            host, chosen once here (``isolation="strict"`` without namespaces fails now, ``"auto"`` warns once).
    """

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        config: RLMScaffoldConfig | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_repl_workers: int = 8,
        sandbox_backend: SandboxBackend | None = None,
    ) -> None:
        if not callable(getattr(generator, "generate", None)):
            raise TypeError(f"generator must have a generate(prompts) method, got {type(generator).__name__}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("The tokenizer needs a chat template (tokenizer.chat_template) to render turn prompts")
        self.generator = generator
        self.tokenizer = tokenizer
        self.config = config if config is not None else RLMScaffoldConfig()
        if sandbox_backend is not None and not isinstance(sandbox_backend, SandboxBackend):
            raise TypeError(f"sandbox_backend must be a SandboxBackend, got {type(sandbox_backend).__name__}")
        self.sandbox_backend = sandbox_backend if sandbox_backend is not None else select_backend(self.config.sandbox)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_repl_workers = max_repl_workers
        self.stats = EngineStats()

    # ----------------------------------------------------------------------------------------- entry points
    def run(self, tasks: Sequence[RLMTask | str]) -> list[RolloutTree]:
        """Run one tree per task and return them in task order (blocking; see `arun`)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(tasks))
        with ThreadPoolExecutor(max_workers=1) as pool:  # inside a running loop (e.g. a notebook)
            return pool.submit(asyncio.run, self.arun(tasks)).result()

    async def arun(self, tasks: Sequence[RLMTask | str]) -> list[RolloutTree]:
        """Run one tree per task concurrently; returns the trees in task order. Raises `GeneratorError` only."""
        tasks = [RLMTask(task) if isinstance(task, str) else task for task in tasks]
        for task in tasks:
            if not isinstance(task, RLMTask) or not isinstance(task.prompt, str):
                raise TypeError(f"tasks must be RLMTask objects or prompt strings, got {task!r:.100}")
        started = time.perf_counter()
        self.stats = stats = EngineStats()
        run = _Run(
            scheduler=WaveScheduler(self.generator, self.config.max_batch_size, self.config.max_batch_wait_s, stats),
            pool=ThreadPoolExecutor(max_workers=self.max_repl_workers, thread_name_prefix="rlm-repl"),
            stats=stats,
        )
        roots = []
        for index, task in enumerate(tasks):
            run.trees.append([])
            context = task.prompt if task.context is None else task.context
            node = run.new_node(
                index, parent=None, depth=0, task=task.prompt, context_description=describe_context(context)
            )
            run.scheduler.acquire()
            roots.append(run.spawn(self._run_node(run, node, context, on_done=None)))
        everything = asyncio.gather(*roots)
        try:
            await asyncio.wait({everything, run.scheduler.failure}, return_when=asyncio.FIRST_COMPLETED)
            if run.scheduler.failure.done():
                raise run.scheduler.failure.exception()  # type: ignore[misc]
            await everything
        except BaseException:
            for task in list(run.tasks):
                task.cancel()
            await asyncio.gather(everything, *run.tasks, return_exceptions=True)  # retrieve every outcome
            raise
        finally:
            while run.closing:  # every REPL is closed before the run returns or raises
                await asyncio.gather(*run.closing, return_exceptions=True)
            run.scheduler.shutdown()
            run.pool.shutdown(wait=True)
            stats.wall_time_s = time.perf_counter() - started
        return [preorder(nodes) for nodes in run.trees]

    # -------------------------------------------------------------------------------------- the RLM loop
    async def _run_node(
        self, run: _Run, node: RolloutNode, context: Any, on_done: Callable[[RolloutNode], None] | None
    ) -> None:
        """The scaffold loop of one node. Holds a busy token from start to end (taken by whoever spawned it)."""
        config, loop = self.config, asyncio.get_running_loop()
        repl_future = loop.run_in_executor(run.pool, partial(self._new_repl, context))  # boots during generation
        system_prompt = build_system_prompt(config, context, node.depth)
        history: list[tuple[str, str]] = []
        try:
            for turn_index in range(config.max_turns):
                messages = build_turn_messages(config, system_prompt, history, node.task, turn_index)
                prompt_ids = self._render(messages)
                if config.max_prompt_tokens is not None and len(prompt_ids) > config.max_prompt_tokens:
                    node.end_reason = "prompt_too_long"
                    break

                [completion] = await run.scheduler.generate([prompt_ids], [run.request_key(node, turn_index)])
                action = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                turn = Turn(
                    prompt_ids, completion.token_ids, completion.logprobs, action, code=find_code_block(action)
                )
                node.turns.append(turn)
                run.stats.turns += 1

                if turn.code is not None:
                    repl = await repl_future
                    serve = partial(self._serve_query, run, node, turn_index, CellQueryUse())
                    turn.repl_result = await repl.aexecute(turn.code, on_query=serve)
                    self._count_cell(run.stats, turn)

                answer, final_var_error = await self._final_answer(turn, repl_future)
                if answer is not None:
                    node.final_answer, node.end_reason = answer, "final_answer"
                    break

                if turn.code is None and final_var_error is None:
                    run.stats.malformed_actions += 1
                turn.observation = format_observation(config, turn.repl_result, final_var_error)
                history.append((action, turn.observation))
            else:
                node.end_reason = "max_turns"
        except (GeneratorError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - a broken node is recorded, the other rollouts go on
            node.end_reason, node.error = "error", f"{type(exc).__name__}: {exc}"
            logger.warning(  # the error may carry a REPL's text: quoted, so it cannot pass for a log record
                "RLM node (depth %d, task %.60r) ended with an error:\n%s",
                node.depth,
                node.task,
                quote_sandbox_text(node.error),
            )
        finally:
            # Closed in the background: a parent waiting for this node's answer need not wait for the cleanup.
            closing = loop.create_task(self._close_repl(run, repl_future))
            run.closing.add(closing)
            closing.add_done_callback(run.closing.discard)
            self._count_end(run.stats, node)
            if on_done is not None:
                on_done(node)  # wakes the parent (taking its token) before this node's token is released
            run.scheduler.release()

    def _new_repl(self, context: Any) -> PythonREPL:
        config = self.config
        return PythonREPL(
            context,
            limits=config.sandbox,
            helpers=config.helpers,
            helper_objects=config.helper_objects,
            backend=self.sandbox_backend,
        )

    async def _close_repl(self, run: _Run, repl_future: asyncio.Future[PythonREPL]) -> None:
        try:
            repl = await repl_future
        except Exception:  # noqa: BLE001 - it never started; the error was recorded where it was awaited
            return
        await asyncio.get_running_loop().run_in_executor(run.pool, repl.close)

    async def _final_answer(
        self, turn: Turn, repl_future: asyncio.Future[PythonREPL]
    ) -> tuple[str | None, tuple[str, str] | None]:
        """The turn's answer: ``FINAL_VAR`` called by its code, else its first ``FINAL``/``FINAL_VAR`` line.

        Returns ``(answer, None)``, ``(None, None)`` when there is none, or ``(None, (name, error))`` when a
        ``FINAL_VAR(name)`` line named no variable (the model is told so in the next prompt).
        """
        if turn.repl_result is not None and turn.repl_result.final_answer is not None:
            return turn.repl_result.final_answer, None
        final = find_final_answer(turn.action)
        if final is None:
            return None, None
        if final.kind == "FINAL":
            return final.value, None
        result = await (await repl_future).aexecute(f"FINAL_VAR({final.value!r})")
        if result.final_answer is not None:
            return result.final_answer, None
        return None, (final.value, result.error or "FINAL_VAR gave no answer")

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------------------- counting
    @staticmethod
    def _count_cell(stats: EngineStats, turn: Turn) -> None:
        result = turn.repl_result
        assert result is not None
        stats.repl_cells += 1
        stats.repl_timeouts += result.timed_out
        stats.repl_restarts += result.restarted
        stats.repl_crashes += result.crashed
        stats.truncated_answers += result.answer_truncated
        stats.repl_errors += result.error is not None and not (result.timed_out or result.crashed)

    @staticmethod
    def _count_end(stats: EngineStats, node: RolloutNode) -> None:
        if node.end_reason == "final_answer":
            stats.final_answers += 1
        elif node.end_reason == "max_turns":
            stats.max_turns += 1
        elif node.end_reason == "prompt_too_long":
            stats.prompt_too_long += 1
        elif node.end_reason == "error":
            stats.node_errors += 1
