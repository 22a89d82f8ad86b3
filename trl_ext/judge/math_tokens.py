"""The tokenizer of math expressions (`tokenize`): numbers, letters, operators and LaTeX, read character by character.

LaTeX is read here, not stripped before: spacing, ``\\left``/``\\right`` and ``$`` produce no token, and a LaTeX
command outside the lists below is a `MathSyntaxError`. What the grammar accepts is described in
`trl_ext.judge.math_expr`; the grammar that reads these tokens is `trl_ext.judge.math_grammar`.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .math_expr import CONSTANTS, FUNCTIONS, MAX_CHARS, MAX_EXPONENT, MAX_NUMBER_DIGITS, MathSyntaxError

_OPERATOR_COMMANDS = {"cdot": "*", "times": "*", "div": "/"}
_FRACTION_COMMANDS = {"frac", "dfrac", "tfrac"}
_WRAPPER_COMMANDS = {"boxed", "text", "mathrm", "mathbf", "textbf", "mathit", "textrm"}  # \x{...} reads as (...)
_SKIPPED_COMMANDS = {"left", "right", "displaystyle", "quad", "qquad"}
_SKIPPED_SYMBOL_COMMANDS = {",", ";", ":", "!", " "}  # \, \; \: \! and a backslash-space
_UNICODE = {"π": ("constant", "pi"), "∞": ("constant", "oo"), "×": ("op", "*"), "·": ("op", "*"), "⋅": ("op", "*")}
_UNICODE |= {"÷": ("op", "/"), "−": ("op", "-")}
_PLAIN_OPERATORS = set("+-*/^=()[]{}|_")

_DIGITS = "0123456789"
_NUMBER_RE = re.compile(r"(\d+)(?:\.(\d*))?(?:[eE]([+-]?\d+))?|\.(\d+)(?:[eE]([+-]?\d+))?", re.ASCII)
_LETTERS_RE = re.compile(r"[A-Za-z]+")
_COMMAND_RE = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)


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
