"""Every float comparison in tests/ goes through tests/testkit/tolerance.py, whose tolerances say why
they have their size; a bare literal tolerance anywhere else fails here, with its file and line.

Read from the source with ``ast`` (nothing is imported). Flagged outside the helper:
  - ``torch.testing.assert_close``, ``torch.allclose`` / ``isclose``, ``np.allclose`` / ``isclose``,
    ``np.testing.assert_allclose`` / ``assert_almost_equal``, ``math.isclose``, with or without
    tolerances: use a named kind (``KERNEL_FP32.assert_close(got, want)``); exact comparisons are
    ``==`` / ``torch.equal``;
  - ``pytest.approx(x, abs=...)`` / ``rel=...`` (``pytest.approx(x)`` alone, for arithmetic that is
    exact but for float64 rounding, stays): use ``KIND.approx(x)``, or ``estimate(x, abs=..., why=...)``
    for a quantity that is estimated (a rate on a sampled trace, a fit);
  - any ``rtol=`` / ``atol=`` keyword given a number;
  - ``abs(a - b) < 1e-6``, ``x.abs().max() < 1e-5``, ``max_rel_diff(...) < 1e-4``: a difference
    bounded from above by a number below 1;
  - ``Tolerance(...)`` built in a test (the kinds live in the helper), and ``estimate(...)`` without a
    ``why``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "testkit" / "tolerance.py"
MODULES = {"torch", "np", "numpy", "math", "torch.testing", "np.testing", "numpy.testing"}
CLOSE = {"assert_close", "allclose", "isclose", "assert_allclose", "assert_almost_equal", "assert_array_almost_equal"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _number(node: ast.AST) -> float | None:
    """The value of a numeric literal expression (``1e-5``, ``-1e-5``, ``2 * 1e-4``), else None."""
    if isinstance(node, ast.Constant):
        v = node.value
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _number(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.Pow, ast.Add, ast.Sub)):
        a, b = _number(node.left), _number(node.right)
        if a is None or b is None:
            return None
        try:
            if isinstance(node.op, ast.Pow):
                return float(a**b)
            if isinstance(node.op, ast.Div):
                return a / b if b else None
            return {ast.Mult: a * b, ast.Add: a + b, ast.Sub: a - b}[type(node.op)]
        except (OverflowError, TypeError):  # 2**4096, or a complex power: not a tolerance
            return None
    return None


def _is_difference(node: ast.AST) -> bool:
    """Does the expression measure a difference: abs(...), .abs(), a subtraction, a *diff* call?"""
    for n in ast.walk(node):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
            return True
        if isinstance(n, ast.Call):
            func = _dotted(n.func)
            if func == "abs" or func.endswith(".abs") or "diff" in func.rsplit(".", 1)[-1]:
                return True
    return False


def violations(source: str, name: str = "<src>") -> list[str]:
    """Bare float comparisons in ``source`` (see the module docstring), as 'name:line: what'."""
    tree = ast.parse(source)
    def imported_from(*modules: str) -> set[str]:
        return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in modules
                for a in n.names}

    from_modules = imported_from("torch.testing", "numpy.testing", "numpy", "math", "torch")
    helper_tolerance = "Tolerance" in imported_from("testkit.tolerance")  # not the library's own Tolerance types
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            base, _, attr = func.rpartition(".")
            if (attr in CLOSE and base in MODULES) or (not base and attr in CLOSE and attr in from_modules):
                flag(node, f"{func}(): compare through a named tolerance (testkit.tolerance)")
            if func in ("pytest.approx", "approx") and (len(node.args) > 1 or any(k.arg in ("abs", "rel")
                                                                                 for k in node.keywords)):
                flag(node, f"{func}() with a tolerance: use KIND.approx() or estimate(..., why=...)")
            for k in node.keywords:
                if k.arg in ("rtol", "atol") and _number(k.value) is not None:
                    flag(node, f"{k.arg}={ast.unparse(k.value)}: a literal tolerance")
            if func == "Tolerance" and helper_tolerance:
                flag(node, "Tolerance(...) in a test: add the kind to testkit/tolerance.py")
            if func.rsplit(".", 1)[-1] == "estimate":
                why = next((k.value for k in node.keywords if k.arg == "why"), None)
                if why is None or (isinstance(why, ast.Constant) and len(str(why.value).strip()) < 10):
                    flag(node, "estimate() without a why")
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            # a closeness check bounds a difference from above: diff < tol, or tol > diff
            op, left, right = node.ops[0], node.left, node.comparators[0]
            upper = (right, left) if isinstance(op, (ast.Lt, ast.LtE)) else \
                (left, right) if isinstance(op, (ast.Gt, ast.GtE)) else None
            if upper is not None and (value := _number(upper[0])) is not None and 0 < abs(value) < 1 \
                    and _is_difference(upper[1]):
                flag(node, f"a difference bounded by {value:g}: use a named tolerance")
    return found


def test_no_bare_float_tolerance_in_tests() -> None:
    found = [v for path in sorted(TESTS.rglob("*.py")) if path != HELPER
             for v in violations(path.read_text(encoding="utf-8"), str(path.relative_to(TESTS.parent)))]
    assert found == [], "bare float comparisons (see tests/testkit/tolerance.py):\n" + "\n".join(found)


def test_the_checker_finds_each_form_and_passes_the_helper_forms() -> None:
    bad = """
import torch, pytest
import numpy as np
from torch.testing import assert_close
from testkit.tolerance import Tolerance
torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(a, b)
assert torch.allclose(a, b)
np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)
assert_close(a, b)
assert x == pytest.approx(y, abs=1e-5)
assert x == pytest.approx(y, 1e-3)
f(a, b, rtol=2e-3)
assert abs(p.sum().item() - 1) < 1e-6
assert q.sum(-1).sub(1).abs().max() < 1e-5
assert max_rel_diff(a, b, n) < 1e-4
assert 1e-4 > abs(a - b)
T = Tolerance("mine", "because", atol=1e-3)
assert x == estimate(5.0, rel=0.1, why="")
"""
    lines = sorted({int(v.split(":")[1]) for v in violations(bad)})
    assert lines == list(range(6, 20)), violations(bad)
    good = """
import torch, pytest
from testkit.tolerance import KERNEL_FP32, LOGPROB_ACROSS_BATCHES, estimate
KERNEL_FP32.assert_close(a, b)
KERNEL_FP32.times(200).assert_close(a, b)
assert x == LOGPROB_ACROSS_BATCHES.approx(y)
assert x == pytest.approx(0.036)
assert torch.equal(a, b) and tokens == want
assert (wait > 1e-9).mean() == estimate(0.6, abs=0.02, why="P(wait) of 200k requests")
assert 5 < ppl < 30 and len(a) < 40 and abs(n - m) < 3 and hi - lo > 0.25
row = compare(real, sim, Tolerance(rel=0.1))  # a library type of the same name
"""
    assert violations(good) == []
