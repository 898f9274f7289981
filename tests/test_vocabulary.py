"""The closed vocabularies (statuses, stages, decisions, phases, outcomes, limits) are
``Literal`` types in one module, and only the pure core compares their values (DESIGN rule
3, issue #21). Everywhere else a rule about them is a named predicate or set of
``boundloop.policy.kinds`` (``TERMINAL_STATUSES``, ``is_resumable(status)``...), so a
value added to a vocabulary, or a rule changed, is changed in one place.

What counts as comparing a vocabulary value, found with ``ast`` in every module of the
package outside ``EXEMPT``:

* a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``, ``is not``) with a string
  constant on one side, or a tuple/list/set of string constants, or a module-level name
  bound to one (``RESUMABLE = ("needs_review", ...)``; ``frozenset((...))`` too);
* a ``match`` whose subject is such a field, with a ``case "final":`` (or ``case "a" |
  "b":``); and a class pattern naming the field, ``case RunFinished(status="final"):``;

when the other side *names* one of the vocabulary fields (its last identifier: ``status``,
``x.status``, ``x["status"]``, ``x.get("status")``, ``getattr(x, "status")``; the name is
the field or ends with ``_<field>``, like ``run_status``) and the constant is a value of
*that field's* vocabulary (``FIELDS``). The field decides the vocabulary because many of
the values are ordinary words: ``kind == "final"`` (a stream event's kind) or a provider's
``response.status == "failed"`` are not ours and are not flagged, while
``status == "final"`` and ``record.stage == "awaiting"`` are. What the rule does not see (a
value reached through a dict, ``{"final": ...}[status]``, or a field under another name)
is left to review.
"""

from __future__ import annotations

import ast
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

try:  # the pure core moves from policy/ to core/ (issue #21)
    from boundloop.core import kinds  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    from boundloop.core import kinds

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "boundloop"

#: Where comparing the vocabularies is the job: the pure core (issue #21). The run's
#: interpreter (``loop.py``) and the actors are held to the rule like everything else.
EXEMPT = ("boundloop/core/",)
#: Single functions let off, each with why: (path, function name) -> reason.
EXEMPT_FUNCTIONS: dict[tuple[str, str], str] = {}


def _members(tp: object) -> frozenset[str]:
    """The strings a ``Literal`` (or a union of them) admits."""
    if typing.get_origin(tp) is typing.Literal:
        return frozenset(a for a in typing.get_args(tp) if isinstance(a, str))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return frozenset().union(*(_members(a) for a in typing.get_args(tp)))
    raise TypeError(f"not a Literal: {tp!r}")


#: A field's name -> the values of its vocabulary.
FIELDS: dict[str, frozenset[str]] = {
    "status": _members(kinds.RunStatus) | _members(kinds.RecordStatus)
    | _members(kinds.SucceededStatus),
    "stage": _members(kinds.CallStage),
    "phase": _members(kinds.Phase),
    "decision": _members(kinds.Decision),
    "outcome": _members(kinds.Resolution),
    "limit": _members(kinds.Limit),  # exhausted_limit too
}


def _field(node: ast.expr) -> str | None:
    """The vocabulary field ``node`` names, if any."""
    name: str | None = None
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = node.slice.value if isinstance(node.slice.value, str) else None
    elif isinstance(node, ast.Call) and node.args:
        func = node.func
        key = node.args[1] if isinstance(func, ast.Name) and func.id == "getattr" \
            and len(node.args) > 1 else node.args[0] if isinstance(func, ast.Attribute) \
            and func.attr == "get" else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            name = key.value
    if name is None:
        return None
    for field in FIELDS:
        if name == field or name.endswith("_" + field):
            return field
    return None


def _strings(node: ast.expr, bound: dict[str, ast.expr]) -> list[str]:
    """The string constants ``node`` is: one, a literal collection of them, a
    ``frozenset``/``set``/``tuple`` of one, or a module-level name bound to any of those."""
    if isinstance(node, ast.Name) and node.id in bound:
        return _strings(bound[node.id], {})
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("frozenset", "set", "tuple") and len(node.args) == 1:
        return _strings(node.args[0], bound)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        out = [s for e in node.elts for s in _strings(e, bound)]
        return out if len(out) == len(node.elts) else []
    return []


def _pattern_strings(pattern: ast.pattern) -> list[str]:
    if isinstance(pattern, ast.MatchValue):
        return _strings(pattern.value, {})
    if isinstance(pattern, ast.MatchOr):
        return [s for p in pattern.patterns for s in _pattern_strings(p)]
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _pattern_strings(pattern.pattern)
    return []


def comparisons(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each vocabulary value ``source`` compares (see the module's docstring)."""
    tree = ast.parse(source)
    bound: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and stmt.value is not None:
            bound[stmt.target.id] = stmt.value

    def hit(field: str | None, values: list[str]) -> str | None:
        if field is None:
            return None
        ours = sorted(set(values) & FIELDS[field])
        return f"{field} vs {ours}" if ours else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a, b in zip(sides, sides[1:], strict=False):
                for named, constant in ((a, b), (b, a)):
                    what = hit(_field(named), _strings(constant, bound))
                    if what:
                        yield node.lineno, what
        elif isinstance(node, ast.Match):
            subject = _field(node.subject)
            for case in node.cases:
                what = hit(subject, _pattern_strings(case.pattern))
                if what:
                    yield case.pattern.lineno, what
        elif isinstance(node, ast.MatchClass):
            for key, pattern in zip(node.kwd_attrs, node.kwd_patterns, strict=True):
                what = hit(_field(ast.Name(key)), _pattern_strings(pattern))
                if what:
                    yield pattern.lineno, what


def _exempt_lines(path: Path, source: str) -> set[int]:
    """The lines of ``path``'s functions named in ``EXEMPT_FUNCTIONS``."""
    rel = path.relative_to(ROOT).as_posix()
    names = {name for where, name in EXEMPT_FUNCTIONS if where == rel}
    return {line for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}


def _modules() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not any(rel == e or rel.startswith(e) for e in EXEMPT):
            yield path


def test_no_module_outside_the_core_compares_a_vocabulary_value() -> None:
    found = []
    for path in _modules():
        source = path.read_text()
        exempt = _exempt_lines(path, source)
        found += [f"{path.relative_to(ROOT)}:{line}: {what}"
                  for line, what in comparisons(source) if line not in exempt]
    assert not found, ("these compare closed-vocabulary values outside the pure core; use (or "
                       "add) a named predicate or set in boundloop/policy/kinds.py:\n"
                       + "\n".join(found))


def test_the_exempt_paths_exist() -> None:
    """An exemption for a path that has gone (moved, or the rewrite landed) is a hole."""
    gone = [e for e in EXEMPT if not (ROOT / e).exists() and e != "boundloop/core/"]
    assert not gone, f"drop these from EXEMPT: {gone}"
    for (where, name), why in EXEMPT_FUNCTIONS.items():
        path = ROOT / where
        assert why and path.exists() and _exempt_lines(path, path.read_text()), \
            f"drop {where}:{name} from EXEMPT_FUNCTIONS: it is gone"


@pytest.mark.parametrize("source", [
    'if result.status == "final": pass',
    'ok = status != "awaiting_approval"',
    'x = record.stage in ("intended", "running")',
    'y = "allow" == call.decision',
    'z = r["status"] not in ("ok", "error")',
    'w = row.get("status") == "needs_review"',
    'v = getattr(r, "exhausted_limit") == "deadline"',
    'u = run_status is "rejected"',
    'OPEN = ("needs_review", "awaiting_approval")\nq = state.status in OPEN',
    'OPEN = frozenset({"intended", "dispatched"})\nq = phase in OPEN',
    'match state.outcome:\n    case "abandoned": pass',
    'match r.status:\n    case "final" | "cancelled": pass',
    'match e:\n    case RunFinished(status="final"): pass',
], ids=lambda s: s.splitlines()[-1].strip())
def test_the_rule_finds_comparisons_of_vocabulary_fields(source: str) -> None:
    assert list(comparisons(source)), source


@pytest.mark.parametrize("source", [
    'a = kind == "final"',  # a stream event's kind: not a vocabulary field
    'b = response.status == "failed"',  # not a run or call status: a provider's
    'c = word == "running"',
    'd = status in kinds.TERMINAL_STATUSES',  # the named set: what the rule asks for
    'e = status == other.status',
    'match r.status:\n    case str(): pass',
], ids=lambda s: s.splitlines()[-1].strip())
def test_the_rule_leaves_other_comparisons_alone(source: str) -> None:
    assert not list(comparisons(source)), source
