"""Math expressions of model text, read by a grammar that knows only math (the judge's ``check_equivalent``).

The text comes from a model that has read the policy's rollout, so it is hostile: nothing of it is ever evaluated.
`trl_ext.judge.math_grammar.parse_math` reads it with an allow-list grammar (the tokenizer of
`trl_ext.judge.math_tokens` and a recursive-descent parser, with the size checks of `trl_ext.judge.math_limits`)
into an expression tree of plain tuples, and `to_sympy` (here) builds the sympy expression from that tree with
sympy's constructors. There is no ``eval``, ``sympify``, ``parse_expr`` or ``parse_latex`` of model text anywhere: an
attribute, a subscript, a string, a comma, a LaTeX command or a character outside the lists below is a
`MathSyntaxError`, and a word is never a name looked up, only a product of one-letter symbols.

What the grammar accepts (LaTeX is read by the tokenizer itself, so nothing is stripped after a check):

- numbers: ``12``, ``0.5``, ``.5``, ``2.5e-3`` (exact rationals: ``0.1 + 0.2`` equals ``0.3``), at most
  `MAX_NUMBER_DIGITS` digits;
- symbols: one ASCII letter each; a longer run of letters that is not a name below is a product of its letters
  (``2ab`` is ``2*a*b``); ``e`` is Euler's number, ``pi``/``\\pi``/``π`` is π, ``oo``/``\\infty``/``∞`` is ∞;
- operators: ``+ - * / ^`` (``**``, ``×``, ``·``, ``÷``, ``−``, ``\\cdot``, ``\\times``, ``\\div``), ``=`` once (an
  equation ``l = r`` is read as ``l - r``), implicit products (``2x``, ``2(x+1)``, ``(a)(b)``; not ``x[0]``),
  parentheses, brackets and braces, ``|x|``; spaces and tabs (a newline is refused: one expression, one line);
- functions (`FUNCTIONS`), with or without a backslash, applied to a bracketed argument or to the next factor
  (``\\sin x^2`` is ``sin(x^2)``), with an optional power (``\\sin^2 x``); ``\\log_b x`` and ``log_{b}(x)``;
- LaTeX: ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``, ``\\frac12``), ``\\sqrt{x}``, ``\\sqrt[n]{x}``, the contents of
  ``\\boxed{}``, ``\\text{}``, ``\\mathrm{}``, ``\\mathbf{}``; ``$``, ``\\left``, ``\\right``, ``\\displaystyle`` and
  the spacing commands (``\\,``, ``\\;``, ``\\!``, ``\\:``, ``\\ ``, ``\\quad``, ``\\qquad``) are skipped.

Inputs are bounded before sympy sees them: at most `MAX_CHARS` characters and `MAX_DEPTH` levels of nesting; an
exponent that is a constant must be at most `MAX_EXPONENT` in absolute value (``9^9^9^9`` is refused), and so must
the argument of ``exp``; a constant (numbers, π, e and what operators make of them) may not need more than
`MAX_CONSTANT_BITS` bits. What is still slow for sympy (a long simplification) is bounded by the caller's time limit.

This module holds what every part shares: the limits, the names of functions and constants, `MathSyntaxError`,
and the tree (what `parse_math` returns and `to_sympy` reads), one tuple per node:

    ("number", p, q)            the rational p/q (ints, q > 0)
    ("symbol", letter)          one ASCII letter
    ("constant", name)          "pi", "E" or "oo"
    ("add", (term, ...))        a sum of two or more terms
    ("mul", (factor, ...))      a product of two or more factors
    ("pow", base, exponent)
    ("function", name, arg)     name is one of `SYMPY_FUNCTIONS`
    ("log", arg, base)          the logarithm of arg to the given base

This module imports only the standard library at import time (sympy is imported by `to_sympy`) and no module of
trl-ext, so its source can be sent as it is into the sandbox that runs the checks (`trl_ext.judge.tools`).
"""

from __future__ import annotations

MAX_CHARS = 1000  # longest input
MAX_DEPTH = 40  # deepest nesting of brackets, functions, signs and exponents
MAX_NUMBER_DIGITS = 100  # longest number literal (digits before and after the point, and of its exponent)
MAX_EXPONENT = 1000  # largest constant exponent, in absolute value (also the argument of exp)
MAX_CONSTANT_BITS = 10_000  # largest constant sympy may have to compute, in bits

# Function names the grammar knows (with or without a backslash) -> the sympy function each builds.
FUNCTIONS = {
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "cot": "cot",
    "sec": "sec",
    "csc": "csc",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "asin": "asin",
    "acos": "acos",
    "atan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "exp": "exp",
    "ln": "log",
    "log": "log",
    "sqrt": "sqrt",
    "abs": "Abs",
}
# The sympy functions a tree may name: the only attributes of sympy that `to_sympy` reads for a function node.
SYMPY_FUNCTIONS = frozenset(FUNCTIONS.values()) - {"sqrt"}  # sqrt is built as a power of 1/2
CONSTANTS = {"pi": "pi", "e": "E", "oo": "oo", "infty": "oo"}  # names (and LaTeX commands) of constants


class MathSyntaxError(ValueError):
    """The text is not a math expression of the grammar (or is over one of its limits); says what and where."""


def to_sympy(tree: tuple):
    """The sympy expression of a tree from `parse_math`, built with sympy's constructors (never from text).

    The only names of sympy it reads are ``Rational``, ``Symbol``, ``Add``, ``Mul``, ``Pow``, ``log``, the constants
    ``pi``, ``E``, ``oo`` and the functions of `SYMPY_FUNCTIONS`. A node of another shape raises `MathSyntaxError`.
    """
    import sympy

    kind = tree[0]
    if kind == "number" and type(tree[1]) is int and type(tree[2]) is int and tree[2] > 0:
        return sympy.Rational(tree[1], tree[2])
    if kind == "symbol" and isinstance(tree[1], str) and len(tree[1]) == 1 and tree[1].isascii() and tree[1].isalpha():
        return sympy.Symbol(tree[1])
    if kind == "constant" and tree[1] in ("pi", "E", "oo"):
        return {"pi": sympy.pi, "E": sympy.E, "oo": sympy.oo}[tree[1]]
    if kind == "add":
        return sympy.Add(*(to_sympy(child) for child in tree[1]))
    if kind == "mul":
        return sympy.Mul(*(to_sympy(child) for child in tree[1]))
    if kind == "pow":
        return sympy.Pow(to_sympy(tree[1]), to_sympy(tree[2]))
    if kind == "function" and tree[1] in SYMPY_FUNCTIONS:
        return getattr(sympy, tree[1])(to_sympy(tree[2]))
    if kind == "log":
        return sympy.log(to_sympy(tree[1]), to_sympy(tree[2]))
    raise MathSyntaxError(f"not a node of a parsed expression: {str(tree)[:100]}")
