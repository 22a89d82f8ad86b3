"""`EngineStats`: the counters of one RLM engine run (`trl_ext.rlm.metrics` makes the trainers' metrics of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters of one `RLMEngine.run`.

    Attributes:
        generator_calls: batched calls made to the generator; `batch_sizes` has the size of each.
        sequences: completions generated (actions and ``llm_query`` completions).
        nodes, turns: rollout nodes (roots and children) and their turns.
        children: child nodes started; degraded_rlm_queries: ``rlm_query`` prompts answered by a plain completion
            (depth or budget limit); refused_queries: query calls refused (too many prompts, a prompt too long,
            the cell's query budget spent); over_budget_queries: those of them refused for the cell's budget
            (``max_cell_queries``, ``max_cell_query_chars``, ``max_cell_query_tokens``, ``max_cell_query_time_s``)
            or the tree's (``max_tree_queries``, ``max_tree_query_chars``).
        llm_queries: plain completions requested by code (degraded ``rlm_query`` prompts included).
        repl_cells: cells run; repl_errors: cells that raised; repl_timeouts: cells killed at the time limit;
            repl_crashes: cells whose interpreter died; repl_restarts: cells run in a restarted interpreter;
            truncated_answers: final answers longer than the sandbox's ``max_answer_chars``, cut to it.
        malformed_actions: actions with neither a ```repl block nor a usable FINAL line.
        final_answers, max_turns, prompt_too_long, node_errors: how the nodes ended.
        wall_time_s: the whole run; generator_time_s: time inside generator calls.
    """

    generator_calls: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    sequences: int = 0
    nodes: int = 0
    turns: int = 0
    children: int = 0
    degraded_rlm_queries: int = 0
    refused_queries: int = 0
    over_budget_queries: int = 0
    llm_queries: int = 0
    repl_cells: int = 0
    repl_errors: int = 0
    repl_timeouts: int = 0
    repl_crashes: int = 0
    repl_restarts: int = 0
    truncated_answers: int = 0
    malformed_actions: int = 0
    final_answers: int = 0
    max_turns: int = 0
    prompt_too_long: int = 0
    node_errors: int = 0
    wall_time_s: float = 0.0
    generator_time_s: float = 0.0
