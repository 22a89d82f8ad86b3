"""Math expressions of model text, read by a grammar that knows only math (the judge's ``check_equivalent``).

The text comes from a model that has read the policy's rollout, so it is hostile: nothing of it is ever evaluated.
`parse_math` reads it with an allow-list grammar (a tokenizer and a recursive-descent parser) into an expression
tree of plain tuples, and `to_sympy` builds the sympy expression from that tree with sympy's constructors. There is
no ``eval``, ``sympify``, ``parse_expr`` or ``parse_latex`` of model text anywhere: an attribute, a subscript, a
string, a comma, a LaTeX command or a character outside the lists below is a `MathSyntaxError`, and a word is never a
name looked up, only a product of one-letter symbols.

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

The tree (what `parse_math` returns and `to_sympy` reads), one tuple per node:

    ("number", p, q)            the rational p/q (ints, q > 0)
    ("symbol", letter)          one ASCII letter
    ("constant", name)          "pi", "E" or "oo"
    ("add", (term, ...))        a sum of two or more terms
    ("mul", (factor, ...))      a product of two or more factors
    ("pow", base, exponent)
    ("function", name, arg)     name is one of `SYMPY_FUNCTIONS`
    ("log", arg, base)          the logarithm of arg to the given base

This module imports only the standard library at import time (sympy is imported by `to_sympy`), so its source can
be sent as it is into the sandbox that runs the checks.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

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

_OPERATOR_COMMANDS = {"cdot": "*", "times": "*", "div": "/"}
_FRACTION_COMMANDS = {"frac", "dfrac", "tfrac"}
_WRAPPER_COMMANDS = {"boxed", "text", "mathrm", "mathbf", "textbf", "mathit", "textrm"}  # \x{...} reads as (...)
_SKIPPED_COMMANDS = {"left", "right", "displaystyle", "quad", "qquad"}
_SKIPPED_SYMBOL_COMMANDS = {",", ";", ":", "!", " "}  # \, \; \: \! and a backslash-space
_UNICODE = {"π": ("constant", "pi"), "∞": ("constant", "oo"), "×": ("op", "*"), "·": ("op", "*"), "⋅": ("op", "*")}
_UNICODE |= {"÷": ("op", "/"), "−": ("op", "-")}
_PLAIN_OPERATORS = set("+-*/^=()[]{}|_")
_OPENERS = {"(": ")", "[": "]", "{": "}"}

_DIGITS = "0123456789"
_NUMBER_RE = re.compile(r"(\d+)(?:\.(\d*))?(?:[eE]([+-]?\d+))?|\.(\d+)(?:[eE]([+-]?\d+))?", re.ASCII)
_LETTERS_RE = re.compile(r"[A-Za-z]+")
_COMMAND_RE = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)

_NEGATIVE_ONE = ("number", -1, 1)
_HALF = ("number", 1, 2)


class MathSyntaxError(ValueError):
    """The text is not a math expression of the grammar (or is over one of its limits); says what and where."""


# ------------------------------------------------------------------------------------------------------ tokenizer
def tokenize(text: str) -> list[tuple[str, object, int]]:
    """The tokens of ``text``, each ``(kind, value, position)``; raises `MathSyntaxError` on anything else.

    Kinds: ``"number"`` (value: ``(exact Fraction, digits)``, the digits of a plain integer, else ``""``:
    ``\\frac12`` takes one digit per argument), ``"name"`` (a run of ASCII letters), ``"constant"`` (``"pi"``,
    ``"E"``, ``"oo"``), ``"op"`` (one of ``+ - * / ^ = ( ) [ ] { } | _``), ``"frac"``, ``"sqrt"``, ``"wrap"``
    (``\\boxed`` and the like), ``"function"`` (a LaTeX function command; value: its name without the backslash).
    LaTeX spacing, ``\\left``/``\\right`` and ``$`` produce no token, so nothing is removed after the grammar has
    read the text.
    """
    if len(text) > MAX_CHARS:
        raise MathSyntaxError(f"the expression has {len(text)} characters, more than {MAX_CHARS}; shorten it")
    tokens: list[tuple[str, object, int]] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in " \t$":  # one expression, on one line: a newline (or other white space) is refused
            i += 1
        elif char in _DIGITS or (char == "." and i + 1 < len(text) and text[i + 1] in _DIGITS):
            match = _NUMBER_RE.match(text, i)
            assert match is not None  # a digit, or a point before a digit, always starts a number
            tokens.append(("number", _number_value(match), i))
            i = match.end()
        elif char.isascii() and char.isalpha():
            match = _LETTERS_RE.match(text, i)
            assert match is not None
            word = match.group()
            tokens.append(("constant", CONSTANTS[word], i) if word in CONSTANTS else ("name", word, i))
            i = match.end()
        elif char == "\\":
            match = _COMMAND_RE.match(text, i)
            if match is None:
                raise MathSyntaxError(f"a lone backslash at position {i} ends the expression")
            tokens.extend(_command_tokens(match.group(1), i))
            i = match.end()
        elif char == "*" and text[i + 1 : i + 2] == "*":
            tokens.append(("op", "^", i))
            i += 2
        elif char in _PLAIN_OPERATORS:
            tokens.append(("op", char, i))
            i += 1
        elif char in _UNICODE:
            kind, value = _UNICODE[char]
            tokens.append((kind, value, i))
            i += 1
        else:
            raise MathSyntaxError(
                f"the character {char!r} at position {i} is outside the grammar (numbers, single-letter symbols, "
                "+ - * / ^ =, brackets, |x|, the functions " + ", ".join(sorted(FUNCTIONS)) + ")"
            )
    return tokens


def _number_value(match: re.Match[str]) -> tuple[Fraction, str]:
    """The exact value of a number literal, and its digits when it is a plain integer (else ``""``)."""
    whole, decimals = match.group(1) or "", match.group(2) or match.group(4) or ""
    exponent = match.group(3) or match.group(5)
    if len(whole) + len(decimals) + len(exponent or "") > MAX_NUMBER_DIGITS:
        raise MathSyntaxError(f"the number {match.group()[:20]}... has more than {MAX_NUMBER_DIGITS} digits")
    value = Fraction(int(whole or "0") * 10 ** len(decimals) + int(decimals or "0"), 10 ** len(decimals))
    if exponent is not None:
        if abs(int(exponent)) > MAX_EXPONENT:
            raise MathSyntaxError(f"the number {match.group()} has an exponent beyond ±{MAX_EXPONENT}")
        value *= Fraction(10) ** int(exponent)
    plain_integer = match.group(2) is None and match.group(4) is None and exponent is None  # no point, no exponent
    return value, whole if plain_integer else ""


def _command_tokens(command: str, position: int) -> list[tuple[str, object, int]]:
    """The tokens of one LaTeX command (``command`` without its backslash): none for spacing and the like."""
    if command in _SKIPPED_COMMANDS or command in _SKIPPED_SYMBOL_COMMANDS:
        return []
    if command in ("{", "}"):  # \{ \} group like braces
        return [("op", command, position)]
    if command == "|":
        return [("op", "|", position)]
    if command in _OPERATOR_COMMANDS:
        return [("op", _OPERATOR_COMMANDS[command], position)]
    if command in CONSTANTS:
        return [("constant", CONSTANTS[command], position)]
    if command in _FRACTION_COMMANDS:
        return [("frac", command, position)]
    if command == "sqrt":
        return [("sqrt", command, position)]
    if command in _WRAPPER_COMMANDS:
        return [("wrap", command, position)]
    if command in FUNCTIONS:
        return [("function", command, position)]
    raise MathSyntaxError(
        f"the LaTeX command \\{command} at position {position} is not supported; use \\frac, \\sqrt, \\cdot, "
        "\\times, \\div, \\pi, \\infty or a function (" + ", ".join(sorted(FUNCTIONS)) + ")"
    )


# --------------------------------------------------------------------------------------------------------- parser
class _Parser:
    """Recursive descent over `tokenize`'s tokens; one instance per expression.

    Grammar (lowest precedence first; ``factor`` starts a term's implicit product)::

        equation := sum ["=" sum]
        sum      := term {("+"|"-") term}
        term     := signed {("*"|"/") signed | factor}
        signed   := ("+"|"-") signed | power
        power    := atom ["^" signed]                   (right-associative: 2^3^2 is 2^9)
        atom     := number | letters | constant | "(" sum ")" | "[" sum "]" | "{" sum "}" | "|" sum "|"
                  | function | \\frac group group | \\sqrt ["[" sum "]"] group | \\boxed{sum}
        function := name ["^" signed] (bracketed sum | power)      log: ["_" group] before its argument
        group    := "{" sum "}" | one digit | one letter
    """

    def __init__(self, text: str):
        self.tokens = tokenize(text)
        self.position = 0
        self.depth = 0
        self.open_bars = 0  # inside |...|, a "|" closes: it cannot start an implicit factor

    # -- token access
    def peek(self) -> tuple[str, object, int] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def at(self, kind: str, value: object = None) -> bool:
        token = self.peek()
        return token is not None and token[0] == kind and (value is None or token[1] == value)

    def take(self) -> tuple[str, object, int]:
        token = self.peek()
        if token is None:
            raise MathSyntaxError("the expression ends too early (an operand or a closing bracket is missing)")
        self.position += 1
        return token

    def expect(self, value: str) -> None:
        token = self.take()
        if token[:2] != ("op", value):
            raise MathSyntaxError(f"expected {value!r} at position {token[2]}, found {_describe(token)}")

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MathSyntaxError(f"the expression nests deeper than {MAX_DEPTH} levels; simplify it first")

    # -- grammar
    def parse(self) -> tuple:
        left = self.sum()
        if self.at("op", "="):
            self.take()
            right = self.sum()
            left = ("add", (left, _negate(right)))
        token = self.peek()
        if token is not None:
            raise MathSyntaxError(f"unexpected {_describe(token)}; one expression (or one equation) is expected")
        return left

    def sum(self) -> tuple:
        terms = [self.term()]
        while self.at("op", "+") or self.at("op", "-"):
            sign = self.take()[1]
            term = self.term()
            terms.append(term if sign == "+" else _negate(term))
        return terms[0] if len(terms) == 1 else ("add", tuple(terms))

    def term(self) -> tuple:
        factors = [self.signed()]
        while True:
            if self.at("op", "*") or self.at("op", "/"):
                operator = self.take()[1]
                factor = self.signed()
                factors.append(factor if operator == "*" else ("pow", factor, _NEGATIVE_ONE))
            elif self.starts_factor():
                factors.append(self.power())
            else:
                break
        return factors[0] if len(factors) == 1 else ("mul", tuple(factors))

    def starts_factor(self) -> bool:
        """Whether the next token begins an implicit product's next factor (``2x``, ``x(y)``, ``2\\pi``)."""
        token = self.peek()
        if token is None:
            return False
        kind, value, _ = token
        if kind == "number":
            previous = self.tokens[self.position - 1]
            if previous[0] == "number":
                raise MathSyntaxError(f"two numbers in a row at position {token[2]}; put an operator between them")
            return True
        if kind == "op":
            return value in ("(", "{") or (value == "|" and self.open_bars == 0)  # x[0] is not a product
        return kind in ("name", "constant", "frac", "sqrt", "wrap", "function")

    def signed(self) -> tuple:
        if self.at("op", "+") or self.at("op", "-"):
            sign = self.take()[1]
            self.nested()
            operand = self.signed()
            self.depth -= 1
            return operand if sign == "+" else _negate(operand)
        return self.power()

    def power(self) -> tuple:
        base = self.atom()
        if not self.at("op", "^"):
            return base
        self.take()
        self.nested()
        exponent = self.signed()
        self.depth -= 1
        return ("pow", base, exponent)

    def atom(self) -> tuple:
        token = self.take()
        kind, value, _ = token
        self.nested()
        try:
            if kind == "number":
                number, _ = value  # type: ignore[misc]
                return ("number", number.numerator, number.denominator)
            if kind == "constant":
                return ("constant", value)
            if kind == "name":
                return self.letters(str(value))
            if kind == "function":
                return self.function(str(value))
            if kind == "frac":
                numerator = self.group()
                denominator = self.group()
                return ("mul", (numerator, ("pow", denominator, _NEGATIVE_ONE)))
            if kind == "sqrt":
                return self.square_root()
            if kind == "wrap":
                self.expect("{")
                inner = self.sum()
                self.expect("}")
                return inner
            if kind == "op" and value in _OPENERS:
                inner = self.sum()
                self.expect(_OPENERS[str(value)])
                return inner
            if kind == "op" and value == "|":
                self.open_bars += 1
                inner = self.sum()
                self.expect("|")
                self.open_bars -= 1
                return ("function", "Abs", inner)
            raise MathSyntaxError(f"unexpected {_describe(token)}; an operand is expected there")
        finally:
            self.depth -= 1

    def letters(self, word: str) -> tuple:
        """A function name, or one symbol per letter (``ab`` is ``a*b``; ``e`` is Euler's number)."""
        if word in FUNCTIONS:
            return self.function(word)
        factors = [("constant", "E") if letter == "e" else ("symbol", letter) for letter in word]
        return factors[0] if len(factors) == 1 else ("mul", tuple(factors))

    def function(self, name: str) -> tuple:
        """The application of function ``name``, whose name token was just read."""
        base = None
        if name == "log" and self.at("op", "_"):
            self.take()
            base = self.group()
        power = None
        if self.at("op", "^"):  # \sin^2 x is sin(x)^2
            self.take()
            power = self.signed()
        if self.at("op") and self.peek()[1] in _OPENERS:  # type: ignore[index]
            opener = str(self.take()[1])
            argument = self.sum()
            self.expect(_OPENERS[opener])
        else:
            argument = self.power()
        if name == "sqrt":
            applied: tuple = ("pow", argument, _HALF)
        elif base is not None:
            applied = ("log", argument, base)
        else:
            applied = ("function", FUNCTIONS[name], argument)
        return applied if power is None else ("pow", applied, power)

    def square_root(self) -> tuple:
        """``\\sqrt{x}`` or ``\\sqrt[n]{x}``, its command just read: x to the power 1/2 or 1/n."""
        index = None
        if self.at("op", "["):
            self.take()
            index = self.sum()
            self.expect("]")
        radicand = self.group()
        exponent = _HALF if index is None else ("pow", index, _NEGATIVE_ONE)
        return ("pow", radicand, exponent)

    def group(self) -> tuple:
        """A LaTeX argument: ``{sum}``, or a single digit or letter (``\\frac12``, ``\\sqrt2``, ``\\frac ab``)."""
        token = self.peek()
        if token is not None and token[:2] == ("op", "{"):
            self.take()
            inner = self.sum()
            self.expect("}")
            return inner
        if token is not None and token[0] == "number" and len(token[1][1]) > 1:  # type: ignore[index]
            digits = token[1][1]  # type: ignore[index]
            rest = (Fraction(int(digits[1:])), digits[1:])
            self.tokens[self.position] = ("number", rest, token[2] + 1)  # \frac12: the first digit is an argument
            return ("number", int(digits[0]), 1)
        if token is not None and token[0] == "name" and len(str(token[1])) > 1 and str(token[1]) not in FUNCTIONS:
            word = str(token[1])
            self.tokens[self.position] = ("name", word[1:], token[2] + 1)
            return ("constant", "E") if word[0] == "e" else ("symbol", word[0])
        return self.atom()


def _negate(node: tuple) -> tuple:
    return ("mul", (_NEGATIVE_ONE, node))


def _describe(token: tuple[str, object, int]) -> str:
    kind, value, position = token
    shown = str(value[0]) if kind == "number" else value  # type: ignore[index]
    return f"{kind} {shown!r} at position {position}"


# --------------------------------------------------------------------------------------------------- size checks
class _Constant:
    """What `_constant_bounds` knows of a constant subtree: an upper bound on log2 of its absolute value, an upper
    bound on the bits sympy needs to hold it, and its exact value when it is a rational small enough to compute."""

    __slots__ = ("log2_abs", "bits", "exact")

    def __init__(self, log2_abs: float, bits: float, exact: Fraction | None = None):
        self.log2_abs, self.bits, self.exact = log2_abs, bits, exact
        if bits > MAX_CONSTANT_BITS:
            raise MathSyntaxError(
                f"a constant of the expression would need more than {MAX_CONSTANT_BITS} bits; use smaller numbers"
            )

    def magnitude(self) -> float:
        """An upper bound on the absolute value (``math.inf`` when unbounded)."""
        if self.exact is not None:
            return float(abs(self.exact)) if abs(self.exact) < 2**1000 else math.inf
        return 2.0**self.log2_abs if self.log2_abs < 1000 else math.inf


def _log2(value: Fraction) -> float:
    return -math.inf if value == 0 else math.log2(abs(value.numerator)) - math.log2(value.denominator)


def _exact_constant(value: Fraction) -> _Constant:
    return _Constant(_log2(value), max(value.numerator.bit_length(), value.denominator.bit_length(), 1), value)


# log2 of a bound on |f(x)| for a real constant x, for the functions with one; the others are unbounded
_FUNCTION_LOG2_BOUNDS = {"sin": 0.0, "cos": 0.0, "tanh": 0.0, "atan": 1.0}


def _constant_bounds(node: tuple) -> _Constant | None:
    """The bounds of a constant subtree, or None when it has a symbol (or ∞) in it; refuses what is too large.

    Raises `MathSyntaxError` when a constant exponent (or ``exp`` argument) may exceed `MAX_EXPONENT` in absolute
    value, or a constant may need more than `MAX_CONSTANT_BITS` bits: sympy would compute such numbers eagerly.
    """
    kind = node[0]
    if kind == "number":
        return _exact_constant(Fraction(node[1], node[2]))
    if kind == "constant":
        return None if node[1] == "oo" else _Constant(2.0, 2.0)
    if kind == "symbol":
        return None
    if kind in ("add", "mul"):
        parts = [_constant_bounds(child) for child in node[1]]  # every child is checked, constant or not
        if any(part is None for part in parts):
            return None
        return _combine(kind, parts)  # type: ignore[arg-type]
    if kind == "pow":
        return _power_bounds(_constant_bounds(node[1]), _constant_bounds(node[2]))
    if kind == "function":
        argument = _constant_bounds(node[2])
        if argument is None:
            return None
        if node[1] == "exp":
            _check_exponent(argument, "the argument of exp")
            return _Constant(argument.magnitude() * math.log2(math.e), argument.bits + argument.magnitude() * 2)
        if node[1] == "log" and argument.exact is not None:  # |ln p/q| <= ln 2 * bits + π (π: a negative p/q)
            return _Constant(math.log2(math.log(2) * argument.bits + math.pi), argument.bits + 1)
        return _Constant(_FUNCTION_LOG2_BOUNDS.get(node[1], math.inf), argument.bits + 1)
    if kind == "log":
        argument, base = _constant_bounds(node[1]), _constant_bounds(node[2])
        if argument is None or base is None:
            return None
        return _Constant(math.inf, argument.bits + base.bits + 1)
    raise MathSyntaxError(f"unknown node {kind!r}")  # never from `parse_math`: a tree built by hand


def _combine(kind: str, parts: list[_Constant]) -> _Constant:
    """Bounds of a sum or product of constants (exact when all parts are)."""
    bits = sum(part.bits for part in parts) + len(parts)
    if kind == "add":
        log2_abs = max(part.log2_abs for part in parts) + math.log2(len(parts))
    else:
        log2_abs = -math.inf if any(part.log2_abs == -math.inf for part in parts) else sum(p.log2_abs for p in parts)
    exact = None
    if all(part.exact is not None for part in parts) and bits <= MAX_CONSTANT_BITS:
        exact = Fraction(0) if kind == "add" else Fraction(1)
        for part in parts:
            exact = exact + part.exact if kind == "add" else exact * part.exact  # type: ignore[operator]
    return _Constant(log2_abs, bits, exact)


def _check_exponent(exponent: _Constant, what: str) -> float:
    """The bound on ``|exponent|``; refuses one beyond `MAX_EXPONENT`."""
    magnitude = exponent.magnitude()
    if magnitude > MAX_EXPONENT:
        raise MathSyntaxError(f"{what} may be beyond ±{MAX_EXPONENT}; sympy would compute it: use a smaller one")
    return magnitude


def _power_bounds(base: _Constant | None, exponent: _Constant | None) -> _Constant | None:
    """Bounds of ``base ^ exponent``: a constant exponent is at most `MAX_EXPONENT` whatever the base."""
    if exponent is None:
        return None
    magnitude = _check_exponent(exponent, "an exponent")
    if base is None:
        return None
    bits = base.bits * max(1.0, magnitude)
    exact = None
    if base.exact is not None and exponent.exact is not None and exponent.exact.denominator == 1:
        if bits <= MAX_CONSTANT_BITS and (base.exact != 0 or exponent.exact >= 0):
            exact = base.exact ** int(exponent.exact)
    if exact is not None:
        return _Constant(_log2(exact), bits, exact)
    if base.exact is not None and base.exact != 0:
        log2_abs = abs(_log2(base.exact)) * magnitude  # |b|^e or (1/|b|)^|e|, whichever the sign of e gives
    else:
        log2_abs = math.inf
    return _Constant(log2_abs, bits)


# ------------------------------------------------------------------------------------------------------- public
def parse_math(text: str) -> tuple:
    """The expression tree of ``text`` (the node shapes are in this module's docstring).

    Raises `MathSyntaxError`, naming the problem and where it is, for anything outside the grammar or its limits.
    """
    tree = _Parser(text).parse()
    _constant_bounds(tree)
    return tree


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
