"""Recursive Language Model (RLM) rollouts (docs/rlm_scaffold.md, docs/stepwise_rlm.md): sandboxed REPL, scaffold, batched engine, trees.

Modules, in the order data flows through them:

- `repl`: `PythonREPL`, one sandboxed persistent interpreter per rollout (security boundary), with
  `repl_protocol` (its messages and framing) and `repl_resources` (its folder, uid and interpreter); the package
  `sandbox` holds the operating-system side, one concern a module: `SandboxLimits`, host probes, private uids,
  control groups, the `SandboxBackend` interface and the local backend, the code that runs inside (the threat
  model is docs/security.md).
- `prompts`, `scaffold`: the templates and the pure functions of one turn (`RLMScaffoldConfig`, parsing of
  ```` ```repl ```` blocks and ``FINAL``/``FINAL_VAR`` lines, prompt rebuilding, output truncation).
- `generators`: the `Generator` protocol (prompt ids in, completion ids + sampling log-probs out) and its
  transformers / colocated vLLM / vLLM server / scripted implementations.
- `engine`, `scheduler`: `RLMEngine`, which runs many trees concurrently, on `WaveScheduler`, which batches every
  pending generation of every live rollout into one generator call per wave.
- `queries`: the answering of the code's ``llm_query``/``rlm_query`` calls (children, plain completions), within the
  per-call limits and the cell's query budget (`CellQueryUse`, `query_budget_refusal`); `RLMEngine` inherits it.
- `tree`: `RolloutTree` (nodes, turns with exact prompt ids, action ids and log-probs), `subtree_weights`.

For a trainer: ``trees = RLMEngine(generator, tokenizer, config).run(tasks)``, then per tree
``tree.final_answer`` (reward input), ``tree.turn_samples()`` (one sample per turn of every node, with the node's
1/k weight) and ``tree.weights()`` / `subtree_weights`.
"""

from ..advantages import subtree_weights
from .engine import RLMEngine, RLMTask
from .generators import (
    CanonicalOrderGenerator,
    Completion,
    Generator,
    SamplingSettings,
    ScriptedGenerator,
    TransformersGenerator,
    VLLMColocateGenerator,
    VLLMServerGenerator,
)
from .repl import PythonREPL
from .repl_protocol import QueryRefused, QueryRequest, ReplResult
from .sandbox import SandboxError, SandboxLimits
from .scaffold import RLMScaffoldConfig
from .scheduler import GeneratorError, critical_path_generations
from .stats import EngineStats
from .tree import LLMCall, RolloutNode, RolloutTree, Turn, TurnSample, canonical_rollout_order

__all__ = [
    "CanonicalOrderGenerator",
    "Completion",
    "EngineStats",
    "Generator",
    "GeneratorError",
    "LLMCall",
    "PythonREPL",
    "QueryRefused",
    "QueryRequest",
    "ReplResult",
    "RLMEngine",
    "RLMScaffoldConfig",
    "RLMTask",
    "RolloutNode",
    "RolloutTree",
    "SandboxError",
    "SamplingSettings",
    "SandboxLimits",
    "ScriptedGenerator",
    "TransformersGenerator",
    "Turn",
    "TurnSample",
    "VLLMColocateGenerator",
    "VLLMServerGenerator",
    "canonical_rollout_order",
    "critical_path_generations",
    "subtree_weights",
]
