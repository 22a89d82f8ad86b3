"""The grammar of math expressions: `parse_math`, a recursive-descent parser over `trl_ext.judge.math_tokens`.

`parse_math` is what reads model math: the tokens, then the grammar below, then the size checks of
`trl_ext.judge.math_limits`; its tree's node shapes (and what the grammar accepts) are in `trl_ext.judge.math_expr`.
"""

from __future__ import annotations

from fractions import Fraction

from .math_expr import FUNCTIONS, MAX_DEPTH, MathSyntaxError
from .math_limits import constant_bounds
from .math_tokens import tokenize

_NEGATIVE_ONE = ("number", -1, 1)
_HALF = ("number", 1, 2)
_OPENERS = {"(": ")", "[": "]", "{": "}"}  # an opening bracket -> the one that closes it


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


def parse_math(text: str) -> tuple:
    """The expression tree of ``text`` (the node shapes are in `trl_ext.judge.math_expr`).

    Raises `MathSyntaxError`, naming the problem and where it is, for anything outside the grammar or its limits.
    """
    tree = _Parser(text).parse()
    constant_bounds(tree)
    return tree
