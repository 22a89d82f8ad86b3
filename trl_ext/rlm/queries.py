"""Answering the query calls of a node's code (``llm_query*``/``rlm_query*``; docs/rlm_scaffold.md).

A call is checked before anything is tokenized or generated: its number of prompts (``max_llm_queries`` per plain
call, ``max_children`` per recursive one), the length of each query text (``max_query_prompt_chars``), then the
cell's query budget (`CellQueryUse`, `query_budget_refusal`: prompts, characters, generated tokens and wall time per
REPL cell; `tree_budget_refusal`: prompts and characters of a root's whole tree, every node and cell), then each plain
prompt's token count; a refused call raises `QueryRefused` into the model's code. An
accepted call starts a child node per ``rlm_query`` prompt (within ``max_depth`` and ``max_total_children``; the
others are degraded to plain completions) and sends its plain completions to the run's `WaveScheduler`.

`QueryAnswering` is the part of `trl_ext.rlm.engine.RLMEngine` that does this (the engine inherits it); the budget's
state and check are pure and live here too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .repl_protocol import QueryRefused, QueryRequest
from .scaffold import RLMScaffoldConfig, describe_context
from .scheduler import Join, WaveScheduler
from .stats import EngineStats
from .tree import LLMCall, RolloutNode


class QueryRun(Protocol):
    """What answering a query call needs of the engine's run (`trl_ext.rlm.engine`'s run state has it)."""

    scheduler: WaveScheduler
    stats: EngineStats
    trees: list[list[RolloutNode]]  # nodes of each root, in creation order
    tree_of: dict[int, int]  # id(node) -> tree index
    path_of: dict[int, tuple[tuple[int, int, int], ...]]  # id(node) -> where it sits in its tree

    def next_request_index(self, node: RolloutNode, turn_index: int) -> int: ...

    def tree_query_use(self, node: RolloutNode) -> CellQueryUse: ...

    def request_key(self, node: RolloutNode, turn_index: int, request_index: int = -1, offset: int = 0) -> tuple: ...

    def new_node(self, tree: int, **fields: Any) -> RolloutNode: ...

    def spawn(self, coroutine: Any) -> Any: ...


@dataclass
class CellQueryUse:
    """What the query calls of one REPL cell have used so far (the engine adds to it as it answers each call).

    Attributes:
        prompts: prompts accepted, every prompt of a batched call, children and plain completions alike.
        prompt_chars: characters of its query texts that passed the length checks (counted before tokenizing,
            even when the call is then refused for its token count).
        generated_tokens: tokens generated for its plain completions (children's own turns are not counted).
        time_s: wall time spent answering its calls, refused ones included (tokenizing, generating, waiting for
            children), measured by the trainer.
    """

    prompts: int = 0
    prompt_chars: int = 0
    generated_tokens: int = 0
    time_s: float = 0.0


CELL_ADVICE = "use what you have, or go on in the next cell (the budget is per cell)"
# scope -> (who may send, the prompts limit's name, the characters limit's name, the advice)
_SCOPES = {
    "cell": ("this cell", "max_cell_queries", "max_cell_query_chars", CELL_ADVICE),
    "tree": (
        "this rollout (the root and all its sub-agents)",
        "max_tree_queries",
        "max_tree_query_chars",
        "this rollout's query budget is spent: answer with what you have",
    ),
}


def query_budget_refusal(
    config: RLMScaffoldConfig, used: CellQueryUse, function: str, texts: Sequence[str]
) -> str | None:
    """Why a cell that has used `used` may not make a call of `function` whose query texts (one per prompt: a
    child's task or a plain completion's user message) are `texts`, or None when it may.

    The budget is `config`'s ``max_cell_queries`` (prompts), ``max_cell_query_chars`` (characters),
    ``max_cell_query_tokens`` (generated tokens) and ``max_cell_query_time_s`` (wall time). The tokens and time of a
    call are known only once it is answered, so the call that crosses those two limits completes and the next one is
    refused. Returns what the model's code reads in its ``RuntimeError``.
    """
    refusal = _count_refusal(used, function, texts, config.max_cell_queries, config.max_cell_query_chars, scope="cell")
    if refusal is not None:
        return refusal
    advice = CELL_ADVICE
    if used.generated_tokens >= config.max_cell_query_tokens:
        return (
            f"this cell's queries have generated {used.generated_tokens:,} tokens, their budget "
            f"(max_cell_query_tokens={config.max_cell_query_tokens:,}); {advice}"
        )
    if used.time_s >= config.max_cell_query_time_s:
        return (
            f"this cell's queries have taken {used.time_s:.1f} s, their budget "
            f"(max_cell_query_time_s={config.max_cell_query_time_s:g}); {advice}"
        )
    return None


def tree_budget_refusal(
    config: RLMScaffoldConfig, used: CellQueryUse, function: str, texts: Sequence[str]
) -> str | None:
    """Why a call of `function` with query texts `texts` may not be made in a tree whose query calls (every node's,
    every cell's) have used `used`, or None when it may: ``max_tree_queries`` prompts and ``max_tree_query_chars``
    characters per root rollout. The per-cell budget alone lets a tree send cells × nodes times as much (one root
    with 4 children sent 1,276 prompts at max_cell_queries=256). Returns what the model's code reads."""
    return _count_refusal(used, function, texts, config.max_tree_queries, config.max_tree_query_chars, scope="tree")


def _count_refusal(
    used: CellQueryUse, function: str, texts: Sequence[str], max_prompts: int, max_chars: int, *, scope: str
) -> str | None:
    """The refusal of a call whose `texts` would take `used` past ``max_prompts`` prompts or ``max_chars``
    characters in ``scope`` (`_SCOPES`), or None."""
    who, prompts_name, chars_name, advice = _SCOPES[scope]
    if used.prompts + len(texts) > max_prompts:
        return (
            f"{function} asked for {len(texts)} prompt(s), but {who} may send only {max_prompts - used.prompts} more "
            f"({prompts_name}={max_prompts}); {advice}"
        )
    chars = sum(len(text) for text in texts)
    if used.prompt_chars + chars > max_chars:
        return (
            f"{function} sends {chars:,} characters, but {who} may send only {max_chars - used.prompt_chars:,} more "
            f"({chars_name}={max_chars:,}); {advice}"
        )
    return None


class QueryAnswering:
    """Answers the query calls of a node's code; `trl_ext.rlm.engine.RLMEngine` inherits it.

    It uses the engine's ``config``, ``tokenizer`` (decodes plain completions), ``_render`` (chat messages -> prompt
    ids) and ``_run_node`` (the scaffold loop, which a child node runs).
    """

    config: RLMScaffoldConfig
    tokenizer: Any
    _render: Callable[[list[dict[str, str]]], list[int]]
    _run_node: Callable[..., Coroutine[Any, Any, None]]

    async def _serve_query(
        self, run: QueryRun, node: RolloutNode, turn_index: int, used: CellQueryUse, request: QueryRequest
    ) -> list[str]:
        """Answer one ``llm_query*``/``rlm_query*`` call of `node`'s code (the REPL waits meanwhile), within the
        cell's query budget: `used` is what the cell's earlier calls used, and grows by what this one uses."""
        started = time.monotonic()
        try:
            return await self._answer_query(run, node, turn_index, used, request)
        finally:
            used.time_s += time.monotonic() - started

    async def _answer_query(
        self, run: QueryRun, node: RolloutNode, turn_index: int, used: CellQueryUse, request: QueryRequest
    ) -> list[str]:
        config, stats = self.config, run.stats
        turn = node.turns[turn_index]
        request_index = run.next_request_index(node, turn_index)
        prompts = list(request.prompts)
        if not request.recursive and len(prompts) > config.max_llm_queries:
            stats.refused_queries += 1
            raise QueryRefused(
                f"{request.function} got {len(prompts)} prompts, more than max_llm_queries={config.max_llm_queries} "
                "per call; split them over several calls"
            )
        if request.recursive and len(prompts) > config.max_children:
            stats.refused_queries += 1
            raise QueryRefused(
                f"{request.function} got {len(prompts)} prompts, but one call may start at most "
                f"max_children={config.max_children} sub-agents; split them over several calls or use llm_query_batched"
            )
        num_children = 0
        if request.recursive and node.depth < config.max_depth:
            tree_nodes = run.trees[run.tree_of[id(node)]]
            num_children = max(0, min(len(prompts), config.max_total_children - (len(tree_nodes) - 1)))
        llm_prompts = [
            self._plain_prompt(prompt, request.contexts[index] if request.contexts is not None else None)
            for index, prompt in enumerate(prompts)
        ][num_children:]
        # Every length check comes before tokenizing, whose cost grows with the text.
        texts = [*prompts[:num_children], *llm_prompts]
        for text in texts:
            if len(text) > config.max_query_prompt_chars:
                stats.refused_queries += 1
                raise QueryRefused(
                    f"a query prompt of {len(text):,} characters is longer than max_query_prompt_chars="
                    f"{config.max_query_prompt_chars:,}; shorten it, or pass the text in parts (it starts {text[:80]!r})"
                )
        tree_used = run.tree_query_use(node)
        refusal = query_budget_refusal(config, used, request.function, texts) or tree_budget_refusal(
            config, tree_used, request.function, texts
        )
        if refusal is not None:
            stats.refused_queries += 1
            stats.over_budget_queries += 1
            raise QueryRefused(refusal)
        chars = sum(len(text) for text in texts)
        used.prompt_chars += chars  # counted even when refused for its tokens below
        tree_used.prompt_chars += chars
        llm_prompt_ids = [self._render([{"role": "user", "content": prompt}]) for prompt in llm_prompts]
        if config.max_prompt_tokens is not None:
            for prompt, ids in zip(llm_prompts, llm_prompt_ids):
                if len(ids) > config.max_prompt_tokens:
                    stats.refused_queries += 1
                    raise QueryRefused(
                        f"a prompt of {len(ids)} tokens is longer than max_prompt_tokens={config.max_prompt_tokens}; "
                        f"shorten it (it starts {prompt[:80]!r})"
                    )

        if request.recursive:
            stats.degraded_rlm_queries += len(prompts) - num_children
        used.prompts += len(prompts)
        tree_used.prompts += len(prompts)
        join = Join(run.scheduler, len(prompts))
        for index in range(num_children):
            context = request.contexts[index] if request.contexts is not None else None
            self._spawn_child(run, node, turn_index, request_index, prompts[index], context, join, index)
        for offset, ids in enumerate(llm_prompt_ids):
            key = run.request_key(node, turn_index, request_index, num_children + offset)
            run.scheduler.submit(ids, join, num_children + offset, key)
        stats.llm_queries += len(llm_prompts)
        results = await run.scheduler.wait(join)

        answers = list(results[:num_children])
        for prompt, ids, completion in zip(llm_prompts, llm_prompt_ids, results[num_children:]):
            used.generated_tokens += len(completion.token_ids)
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            turn.llm_calls.append(LLMCall(prompt, ids, completion.token_ids, completion.logprobs, text, request_index))
            answers.append(text)
        return answers

    def _plain_prompt(self, prompt: str, context: Any) -> str:
        """The user message of a plain completion: ``llm_query``'s prompt, or a degraded ``rlm_query`` with context."""
        if context is None:
            return self.config.llm_query_prompt.format(prompt=prompt)
        text = context if isinstance(context, str) else json.dumps(context, ensure_ascii=False)
        return self.config.degraded_rlm_query_prompt.format(prompt=prompt, context=text)

    def _spawn_child(
        self,
        run: QueryRun,
        parent: RolloutNode,
        turn_index: int,
        request_index: int,
        prompt: str,
        context: Any,
        join: Join,
        index: int,
    ) -> None:
        context = prompt if context is None else context
        child = run.new_node(
            run.tree_of[id(parent)],
            parent=parent.id,
            depth=parent.depth + 1,
            task=prompt,
            context_description=describe_context(context),
            spawned_at=(turn_index, request_index),
        )
        run.path_of[id(child)] = run.path_of[id(parent)] + ((turn_index, request_index, index),)
        parent.children.append(child.id)
        parent.turns[turn_index].children.append(child.id)
        run.stats.children += 1

        def deliver(done: RolloutNode) -> None:
            answer = done.final_answer
            join.set(
                index,
                answer
                if answer is not None
                else self.config.child_no_answer.format(end_reason=done.end_reason or "error"),
            )

        run.scheduler.acquire()
        run.spawn(self._run_node(run, child, context, on_done=deliver))
