"""`trl_ext.judge.math_expr`: the grammar ``check_equivalent`` reads the judge's math with (issue 30, class 2).

The text comes from a judge that has read the policy's rollout: every test below is either a hand-computed
equivalence or an attack that must be refused. The attacks through `JudgeTools` run the real checker sandbox.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import sympy
from sympy.core.function import AppliedUndef

from trl_ext.judge import JudgeTools, build_marked_trace
from trl_ext.judge.math_expr import (
    CONSTANTS,
    MAX_CHARS,
    MAX_DEPTH,
    SYMPY_FUNCTIONS,
    MathSyntaxError,
    to_sympy,
)
from trl_ext.judge.math_grammar import parse_math
from trl_ext.testing import build_tiny_tokenizer

# The payload that ran os.getuid() in the checker before the grammar: LaTeX spacing (\,) was stripped after the
# character filter, so "_\,_" became "__" and ".\,name" an attribute; worth 1 + 1 = 2 if it runs, it made
# check_equivalent(<it>, "2") answer "equivalent".
GETUID_PAYLOAD = (
    r"1 + simplify.\,_\,_globals_\,_.\,get(sstr(_\,_builtins_\,_)).\,get(sstr(_\,_import_\,_))"
    r".\,_\,_call_\,_(sstr(o)+sstr(s)).\,getuid()^0"
)

INJECTIONS = [
    GETUID_PAYLOAD,
    r"_\,_import_\,_(os)",
    r"x.\,func",
    r"S.\,true",
    r"x.\left\right_\!_class_\;_",
    "__import__('os').system('id')",
    "__import__",
    "Symbol('x').__class__",
    "Symbol(x).__class__",
    "x.func",
    "(lambda: 0)()",
    "lambda x: x",
    "x[0]",
    "(x)[0]",
    "getattr(x, y)",
    "[].__class__.__base__",
    "x; import os",
    "1\nimport os",
    "x # comment",
    "1\r\nimport os",
    "1\u2028import os",
    "f'{x}'",
    "x @ y",
    "1, 2",
    "a_1",
    r"\_\_import\_\_",
    r"\alpha",
    "\\",
    "x!",
    "\u212a",  # the Kelvin sign: lower() makes it an ASCII "k"
    "ｘ",  # a full-width x
    "٣",  # an Arabic-Indic digit: int() reads it, the grammar does not
]

HUGE = [
    "9^9^9^9",
    "2^(10^100)",
    "10^10^10",
    "x^(10^9)",
    "e^{10^{9}}",
    r"\exp(10^{6})",
    r"\exp(1000 \ln 2)",
    "(2^{1000})^{1000}",
    "(" * (MAX_DEPTH + 1) + "x" + ")" * (MAX_DEPTH + 1),
    "-" * (MAX_DEPTH + 1) + "1",
    "x^" * (MAX_DEPTH + 1) + "x",
    "1" * 101,
    "1e1001",
    "x+" * MAX_CHARS + "x",
]

EQUIVALENT = [
    ("1 + 1", "2"),
    ("2/4", "1/2"),
    (r"\frac{10}{2}", "5"),
    (r"\frac12", "0.5"),
    (r"\dfrac{3}{4}", "0.75"),
    ("0.1 + 0.2", "0.3"),
    ("2.5e-3", "1/400"),
    ("(x+1)^2", "x^2 + 2x + 1"),
    ("(x+1)**2", "(x+1)(x+1)"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\sqrt[3]{27}", "3"),
    (r"\sin^2 x + \cos^2 x", "1"),
    (r"\log_2 8", "3"),
    ("log_{10}(1000)", "3"),
    (r"e^{\ln 2}", "2"),
    ("2^3^2", "512"),
    ("2^{2^3}", "256"),
    ("|-3|", "3"),
    (r"\left| -3 \right|", "3"),
    (r"3 \times 4 \div 6", "2"),
    ("3 × 4 ÷ 6", "2"),
    ("2ab", "2*a*b"),
    (r"\pi r^2", r"r^2 \cdot \pi"),
    (r"\left(\frac{x}{2}\right)^2", "x^2/4"),
    (r"$\boxed{42}$", "42"),
    (r"\mathrm{7}", "7"),
    ("x = 2", "x - 2"),
    ("-x^2", "-(x^2)"),
    ("2*-3", "-6"),
    ("sin x^2", "sin(x^2)"),
    (r"\frac{x^2 - 1}{x - 1}", "x + 1"),
    ("−1", "-1"),
]

NOT_EQUIVALENT = [
    ("1", "2"),
    ("x^2", "2x"),
    ("(-x)^2", "-x^2"),
    ("0.333", "1/3"),
    (r"\frac{1}{2}x", r"\frac{1}{2x}"),
]


def difference(a: str, b: str):
    return sympy.simplify(to_sympy(parse_math(a)) - to_sympy(parse_math(b)))


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_hand_computed_equivalences(a, b):
    assert difference(a, b) == 0


@pytest.mark.parametrize(("a", "b"), NOT_EQUIVALENT)
def test_hand_computed_differences(a, b):
    assert difference(a, b) != 0


def test_the_tree_is_what_the_docstring_says():
    assert parse_math(r"2x + \frac{1}{y}") == (
        "add",
        (
            ("mul", (("number", 2, 1), ("symbol", "x"))),
            ("mul", (("number", 1, 1), ("pow", ("symbol", "y"), ("number", -1, 1)))),
        ),
    )
    assert parse_math(r"\log_2 \pi") == ("log", ("constant", "pi"), ("number", 2, 1))
    assert parse_math("0.25") == ("number", 1, 4)  # decimals are exact


@pytest.mark.parametrize("text", INJECTIONS)
def test_injection_payloads_are_refused(text):
    with pytest.raises(MathSyntaxError):
        parse_math(text)


@pytest.mark.parametrize("text", HUGE)
def test_inputs_over_the_limits_are_refused_before_sympy_sees_them(text):
    with pytest.raises(MathSyntaxError, match="beyond|bits|deeper|characters|digits"):
        parse_math(text)


def test_words_are_products_of_one_letter_symbols_never_names():
    # what a word of Python becomes: letters multiplied, nothing looked up or called
    for text in ("1 if x else 0", "exec(chr(49))", "Symbol(x)", "import"):
        expression = to_sympy(parse_math(text))
        assert all(len(symbol.name) == 1 for symbol in expression.free_symbols)
        assert not expression.atoms(sympy.Function) - {sympy.exp(2)}  # e*e in "exec" is Euler's number squared


def test_errors_say_what_and_where():
    with pytest.raises(MathSyntaxError, match=r"the character '\.' at position 1"):
        parse_math("x.func")
    with pytest.raises(MathSyntaxError, match=r"LaTeX command \\alpha at position 2 is not supported"):
        parse_math(r"2 \alpha")
    with pytest.raises(MathSyntaxError, match="two numbers in a row"):
        parse_math("1 000")


def test_a_tree_not_made_by_the_parser_is_not_built():
    for tree in (("function", "__import__", ("symbol", "x")), ("symbol", "os"), ("number", "1", 1), ("eval", "1")):
        with pytest.raises(MathSyntaxError, match="not a node"):
            to_sympy(tree)


# ----------------------------------------------------------------------------------------------------------- fuzz
# Fragments rich in what attacks are made of (dunders, dots, quotes, brackets, LaTeX spacing and commands, names of
# Python and sympy, look-alike Unicode), mixed with enough math that a good share of the strings parse.
_FRAGMENTS = list("_.'\"`()[]{}\\,;:@#!$%&|?<>~=+-*/^ \n\t0123456789xyzeEKISo") + [
    "__",
    "**",
    r"\,",
    r"\!",
    r"\;",
    r"\ ",
    r"\left",
    r"\right",
    r"\frac",
    r"\sqrt",
    r"\cdot",
    r"\pi",
    r"\log",
    r"\boxed",
    r"\text",
    r"\_",
    "_\\,_",
    ".\\,",
    "lambda",
    "import",
    "os",
    "getattr",
    "Symbol",
    "class",
    "func",
    "sin",
    "exp",
    "ln",
    "sqrt",
    "abs",
    "log_",
    "99",
    "1e9",
    "π",
    "−",
    "×",
    "\u212a",
    "٣",
    "ｘ",
]
_ALLOWED_FUNCTIONS = {getattr(sympy, name) for name in SYMPY_FUNCTIONS} | {sympy.log}
# What sympy itself may make of an allowed function when it evaluates (Abs(exp(x)) is exp(re(x))): not from the text.
_SYMPY_REWRITES = {sympy.re, sympy.im, sympy.sign, sympy.arg}
_NUMBERS = (sympy.Number, sympy.NumberSymbol, sympy.core.numbers.ImaginaryUnit, sympy.core.numbers.ComplexInfinity)


def _check_tree(node) -> None:
    """Every node of a parsed tree is one of the documented shapes, with names from the allow-lists only."""
    kind = node[0]
    if kind == "number":
        assert type(node[1]) is int and type(node[2]) is int and node[2] > 0
    elif kind == "symbol":
        assert len(node[1]) == 1 and node[1].isascii() and node[1].isalpha()
    elif kind == "constant":
        assert node[1] in set(CONSTANTS.values())
    elif kind in ("add", "mul"):
        assert isinstance(node[1], tuple) and len(node[1]) >= 2
        for child in node[1]:
            _check_tree(child)
    elif kind in ("pow", "log"):
        _check_tree(node[1])
        _check_tree(node[2])
    else:
        assert kind == "function" and node[1] in SYMPY_FUNCTIONS
        _check_tree(node[2])


def _check_expression(expression) -> None:
    """Only numbers, single-letter symbols and allowed functions reached sympy: no undefined function (a name made
    into a function), no attribute, no subscript (Indexed), nothing that is not a sympy expression."""
    assert isinstance(expression, sympy.Expr)
    for node in sympy.preorder_traversal(expression):
        assert isinstance(node, sympy.Basic), type(node)
        assert not isinstance(node, (AppliedUndef, sympy.Indexed, sympy.IndexedBase)), node
        if isinstance(node, sympy.Symbol):
            assert len(node.name) == 1 and node.name.isascii() and node.name.isalpha(), node.name
        elif isinstance(node, sympy.Function):
            assert type(node) in _ALLOWED_FUNCTIONS | _SYMPY_REWRITES, type(node)
        elif not node.args:
            assert isinstance(node, _NUMBERS), type(node)
        else:
            assert isinstance(node, (sympy.Add, sympy.Mul, sympy.Pow)), type(node)


def test_fuzz_nothing_outside_the_allow_lists_reaches_sympy():
    rng = random.Random(30)
    built = 0
    for _ in range(5000):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 14)))
        try:
            tree = parse_math(text)  # any exception but MathSyntaxError fails the test
        except MathSyntaxError:
            continue
        _check_tree(tree)
        _check_expression(to_sympy(tree))
        built += 1
    assert built >= 200  # the fuzz reaches the builder, not only the tokenizer


# ------------------------------------------------------------------------------------- attacks through the tool
def test_2_check_equivalent_refuses_the_issues_bypasses_in_the_real_sandbox():
    tokenizer = build_tiny_tokenizer()
    trace = build_marked_trace(tokenizer, tokenizer("2 + 2 = 5")["input_ids"], every=8)
    tools = JudgeTools(trace, python_timeout=5)

    async def attack():
        try:
            refused = [
                await tools.call("check_equivalent", {"a": a, "b": "2"})
                for a in (GETUID_PAYLOAD, r"_\,_import_\,_(os)", r"x.\,func", "9^9^9^9")
            ]
            checked = [
                await tools.call("check_equivalent", {"a": a, "b": b})
                for a, b in ((r"\frac{10}{2}", "5"), ("1", "2"), ("exec(chr(49))", "1"))
            ]
            return refused, checked
        finally:
            await tools.aclose()

    refused, checked = asyncio.run(attack())
    for answer in refused:
        assert answer.startswith("error: a is not a math expression"), answer
    assert checked[0] == "equivalent"
    assert checked[1] == "not equivalent: a - b simplifies to -1"
    assert checked[2].startswith("not equivalent") and "49" in checked[2]  # a product of symbols, nothing called
