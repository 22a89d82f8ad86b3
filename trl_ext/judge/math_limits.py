"""The size checks of a parsed math expression: what sympy would compute eagerly is refused before it sees it.

`constant_bounds` bounds every constant subtree of a tree from `trl_ext.judge.math_grammar.parse_math` (which calls
it): a constant exponent (or ``exp`` argument) beyond `MAX_EXPONENT` in absolute value, or a constant that may need
more than `MAX_CONSTANT_BITS` bits, is a `MathSyntaxError` (the limits are in `trl_ext.judge.math_expr`).
"""

from __future__ import annotations

import math
from fractions import Fraction

from .math_expr import MAX_CONSTANT_BITS, MAX_EXPONENT, MathSyntaxError


class _Constant:
    """What `constant_bounds` knows of a constant subtree: an upper bound on log2 of its absolute value, an upper
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


def constant_bounds(node: tuple) -> _Constant | None:
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
        parts = [constant_bounds(child) for child in node[1]]  # every child is checked, constant or not
        if any(part is None for part in parts):
            return None
        return _combine(kind, parts)  # type: ignore[arg-type]
    if kind == "pow":
        return _power_bounds(constant_bounds(node[1]), constant_bounds(node[2]))
    if kind == "function":
        argument = constant_bounds(node[2])
        if argument is None:
            return None
        if node[1] == "exp":
            _check_exponent(argument, "the argument of exp")
            return _Constant(argument.magnitude() * math.log2(math.e), argument.bits + argument.magnitude() * 2)
        if node[1] == "log" and argument.exact is not None:  # |ln p/q| <= ln 2 * bits + π (π: a negative p/q)
            return _Constant(math.log2(math.log(2) * argument.bits + math.pi), argument.bits + 1)
        return _Constant(_FUNCTION_LOG2_BOUNDS.get(node[1], math.inf), argument.bits + 1)
    if kind == "log":
        argument, base = constant_bounds(node[1]), constant_bounds(node[2])
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
