"""Tools the span judge may call while reading a rollout (docs/judge_credit.md): view a token range, search the
trace, run sandboxed Python, check two math expressions for equivalence with sympy.

Every tool answers with a string and never raises: a bad call (unknown tool, malformed arguments, a crash, a
timeout) comes back to the judge as ``"error: ..."`` so it can correct itself within its round budget.

`run_python` and `check_equivalent` run in the RLM scaffold's sandbox, `trl_ext.rlm.PythonREPL` (`ReplSandbox`, with
the same `SandboxLimits`): one persistent interpreter per judge conversation for ``run_python`` (variables survive
between the judge's calls), and another one for ``check_equivalent``, which ``run_python`` code cannot reach (its own
private uid, PID and mount namespaces): code run by the judge cannot patch what decides equivalence. The judge has
read text the policy wrote, so none of it runs in the trainer's process. ``check_equivalent`` never evaluates its
input: `trl_ext.judge.math_expr` reads it with an allow-list grammar (numbers, single-letter symbols, + - * / ^, a
fixed set of functions, LaTeX read by the tokenizer itself), refuses anything else and anything over its size
limits, and builds the sympy expression from the parse; the simplification runs in a child process of the checker's
sandbox forked for that one check and killed at the time limit: nothing a check does outlives it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from . import math_expr
from .markers import MarkedTrace
from .math_expr import MathSyntaxError
from .math_grammar import parse_math

logger = logging.getLogger(__name__)

_MATH_EXPR_SOURCE = inspect.getsource(math_expr)  # sent to the checker's sandbox, which cannot import trl_ext

TOOL_NAMES = ("view_tokens", "search_trace", "run_python", "check_equivalent")

_TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "view_tokens": {
        "description": "Show completion tokens [start, end) (end exclusive) with a ⟦i⟧ marker before every token, "
        "to find exact span boundaries. At most 256 tokens per call.",
        "parameters": {
            "type": "object",
            "properties": {
                "start": {"type": "integer", "description": "first token index"},
                "end": {"type": "integer", "description": "one past the last token index"},
            },
            "required": ["start", "end"],
        },
    },
    "search_trace": {
        "description": "Find a literal text (case-insensitive) in the trace. Returns up to 20 hits, each with the "
        "index of the token where it starts and the surrounding text.",
        "parameters": {
            "type": "object",
            "properties": {"pattern": {"type": "string", "description": "text to look for"}},
            "required": ["pattern"],
        },
    },
    "run_python": {
        "description": "Run Python 3 code in a sandbox (no network, no files kept, a few seconds of CPU) and return "
        "what it prints. sympy is available. Use it to recompute a step of the trace.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a Python program; print the results"}},
            "required": ["code"],
        },
    },
    "check_equivalent": {
        "description": "Check with sympy whether two math expressions are equal. Math only: numbers, "
        "single-letter symbols (e is Euler's number), + - * / ^ =, brackets, |x|, sin cos tan cot sec csc arcsin "
        "arccos arctan sinh cosh tanh exp ln log sqrt abs, and simple LaTeX (\\frac, \\sqrt, \\cdot, \\times, "
        "\\pi, \\log_b). Answers 'equivalent', 'not equivalent' or why it could not decide.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "required": ["a", "b"],
        },
    },
}


def tool_schemas(names: Sequence[str] = TOOL_NAMES) -> list[dict[str, Any]]:
    """OpenAI ``tools`` definitions for the named judge tools."""
    unknown = [name for name in names if name not in _TOOL_SCHEMAS]
    if unknown:
        raise ValueError(f"Unknown judge tool(s) {unknown}; choose from {list(TOOL_NAMES)}.")
    return [{"type": "function", "function": {"name": name, **_TOOL_SCHEMAS[name]}} for name in names]


class PythonSandbox(Protocol):
    """Runs Python programs for one judge conversation and returns their output as text; must not raise."""

    async def run(self, code: str, timeout: float) -> str: ...

    async def aclose(self) -> None: ...


class ReplSandbox:
    """`PythonSandbox` on `trl_ext.rlm.PythonREPL`, started on the first call and kept for the conversation.

    Args:
        limits: the sandbox's limits and isolation (`trl_ext.rlm.SandboxLimits`; default: its defaults with
            ``max_output_chars=4000``, the output returned to the judge). The wall-clock limit per run is the
            ``timeout`` of each `run` call.
        **repl_kwargs: other `PythonREPL` arguments (``helpers``, ``env``, ``backend`` (a
            `trl_ext.rlm.sandbox.SandboxBackend`), or `SandboxLimits` fields).
    """

    def __init__(self, limits: Any = None, **repl_kwargs: Any):
        if limits is None:
            from ..rlm import SandboxLimits

            limits = SandboxLimits(max_output_chars=4000)
        self.limits = limits
        self.repl_kwargs = repl_kwargs
        self._repl: Any = None
        self._lock: asyncio.Lock | None = None

    async def run(self, code: str, timeout: float) -> str:
        if self._lock is None:
            self._lock = asyncio.Lock()  # one cell at a time: tool calls of a round may arrive together
        async with self._lock:
            return await self._run(code, timeout)

    async def _run(self, code: str, timeout: float) -> str:
        try:
            if self._repl is None:
                from ..rlm import PythonREPL

                kwargs = {**self.repl_kwargs, "timeout_s": timeout}
                self._repl = await asyncio.to_thread(PythonREPL, limits=self.limits, **kwargs)
            result = await self._repl.aexecute(code)
        except Exception as error:  # the sandbox failing must not take the judge down
            logger.warning("Judge sandbox failed: %r", error)
            return f"error: the sandbox failed ({type(error).__name__}: {error})"
        text = result.stdout
        if result.error:
            text += ("\n" if text and not text.endswith("\n") else "") + result.error
        return text.strip() or "(no output)"

    async def aclose(self) -> None:
        if self._repl is not None:
            repl, self._repl = self._repl, None
            await asyncio.to_thread(repl.close)


# Runs inside the checker's own sandbox, on two expression trees that `math_grammar.parse_math` made of the judge's text
# (the text itself never enters the sandbox): `math_expr.to_sympy` (the module's source, sent with each check) builds
# the sympy expressions and sympy simplifies their difference, in a child forked for this one check, so whatever the
# check does dies with the child and a slow one is killed at the time limit. The sandbox's interpreter makes itself
# non-dumpable first: a forked child cannot write its memory through /proc.
_CHECK_EQUIVALENT = r"""
def __trl_ext_check_equivalent(math_expr_source, trees, timeout):
    import os, select, signal, time
    import sympy
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    except Exception:
        pass
    math_expr = {{"__name__": "trl_ext_math_expr"}}
    exec(math_expr_source, math_expr)

    def verdict():
        x, y = (math_expr["to_sympy"](tree) for tree in trees)
        difference = sympy.simplify(x - y)
        return "equivalent" if difference == 0 else f"not equivalent: a - b simplifies to {{difference}}"

    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            text = verdict()
        except BaseException as error:
            text = f"could not decide: {{type(error).__name__}}"
        os.write(write, text.encode("utf-8", "replace")[:4000])
        os._exit(0)
    os.close(write)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(child, signal.SIGKILL)
            chunks = [b"could not decide within the time limit"]
            break
        chunk = os.read(read, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    print(b"".join(chunks).decode("utf-8", "replace") or "could not decide (the check crashed)")

__trl_ext_check_equivalent(*{payload})
del __trl_ext_check_equivalent
"""


class JudgeTools:
    """The judge's tools bound to one trace.

    Args:
        trace: the rollout being judged.
        enabled: names of the tools offered (subset of `TOOL_NAMES`).
        python: sandbox for ``run_python`` of this conversation (default: a `ReplSandbox`, started on first use).
        checker: sandbox for ``check_equivalent``, apart from `python` so that ``run_python`` code cannot reach it
            (default: another `ReplSandbox`). `aclose` the tools when the conversation ends.
        python_timeout: wall-clock seconds per sandboxed run.
        max_view_tokens: largest ``end - start`` ``view_tokens`` shows.
        max_search_hits: hits ``search_trace`` returns.
    """

    def __init__(
        self,
        trace: MarkedTrace,
        *,
        enabled: Sequence[str] = TOOL_NAMES,
        python: PythonSandbox | None = None,
        checker: PythonSandbox | None = None,
        python_timeout: float = 10.0,
        max_view_tokens: int = 256,
        max_search_hits: int = 20,
    ):
        tool_schemas(enabled)  # validates the names
        self.trace = trace
        self.enabled = tuple(enabled)
        self.python = python if python is not None else ReplSandbox()
        self.checker = checker if checker is not None else ReplSandbox()
        if self.checker is self.python:
            raise ValueError("checker must be another sandbox than python: run_python code could patch the checks")
        self.python_timeout = python_timeout
        self.max_view_tokens = max_view_tokens
        self.max_search_hits = max_search_hits
        self.calls: list[dict[str, Any]] = []  # (name, arguments, output) of every call, for the audit log

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return tool_schemas(self.enabled)

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Run tool ``name`` with JSON ``arguments``; returns its output or ``"error: ..."``."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser's stack
            output = f"error: arguments of {name} are not a JSON object ({error})"
        else:
            output = await self._dispatch(name, args)
        self.calls.append({"name": name, "arguments": arguments, "output": output[:500]})
        return output

    async def _dispatch(self, name: str, args: dict[str, Any]) -> str:
        if name not in self.enabled:
            return f"error: unknown tool {name!r}; available: {list(self.enabled)}"
        try:
            if name == "view_tokens":
                return self.view_tokens(args["start"], args["end"])
            if name == "search_trace":
                return self.search_trace(args["pattern"])
            if name == "run_python":
                return await self.python.run(str(args["code"]), self.python_timeout)
            if name == "check_equivalent":
                return await self.check_equivalent(str(args["a"]), str(args["b"]))
        except KeyError as error:
            return f"error: {name} needs the argument {error}"
        except (TypeError, ValueError) as error:
            return f"error: {error}"
        except Exception as error:  # a tool must never take the judge down
            logger.warning("Judge tool %s crashed: %r", name, error)
            return f"error: {name} failed ({type(error).__name__}: {error})"
        return f"error: unknown tool {name!r}"

    def view_tokens(self, start: Any, end: Any) -> str:
        n = self.trace.num_tokens
        if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool) or isinstance(end, bool):
            raise TypeError(f"start and end must be integers, got {start!r} and {end!r}")
        if not 0 <= start < end <= n:
            raise ValueError(f"need 0 <= start < end <= {n} (the trace has {n} tokens), got [{start}, {end})")
        if end - start > self.max_view_tokens:
            raise ValueError(f"at most {self.max_view_tokens} tokens per call, got {end - start}; narrow the range")
        return self.trace.render(start, end)

    def search_trace(self, pattern: Any) -> str:
        if not isinstance(pattern, str) or not pattern.strip():
            raise ValueError("pattern must be a non-empty string")
        text, needle = self.trace.text.lower(), pattern.lower()
        hits, position = [], text.find(needle)
        while position >= 0 and len(hits) < self.max_search_hits:
            token = self.trace.token_at_char(position)
            context = self.trace.text[max(0, position - 40) : position + len(pattern) + 40].replace("\n", "\\n")
            hits.append(f"token {token}: ...{context}...")
            position = text.find(needle, position + 1)
        if not hits:
            return f"no match for {pattern!r}"
        more = " (more hits not shown)" if position >= 0 else ""
        return "\n".join(hits) + more

    async def aclose(self) -> None:
        """Close the sandboxes (those that were started)."""
        await asyncio.gather(self.python.aclose(), self.checker.aclose())

    async def check_equivalent(self, a: str, b: str) -> str:
        """Whether ``a`` and ``b`` are equal by sympy; each is read by `math_grammar.parse_math` (its grammar and
        limits; refused input raises `ValueError` with the reason) and only the parsed trees reach the sandbox."""
        trees = []
        for name, text in (("a", a), ("b", b)):
            try:
                trees.append(parse_math(text))
            except MathSyntaxError as error:
                raise ValueError(
                    f"{name} is not a math expression: {error}. check_equivalent reads math only; use run_python "
                    "for anything else."
                ) from None
        code = _CHECK_EQUIVALENT.format(payload=repr([_MATH_EXPR_SOURCE, trees, self.python_timeout]))
        return (await self.checker.run(code, self.python_timeout + 5)).strip()
