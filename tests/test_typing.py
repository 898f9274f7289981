"""boundloop is typed for its users (PEP 561): ``boundloop/py.typed`` ships in the wheel, so
``mypy --strict`` on a user's program checks it against boundloop's own annotations."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

GOOD = '''
import asyncio
from typing import Any

import boundloop as bl


@bl.tool(read_only=True)
def search(query: str) -> list[str]:
    """Search."""
    return [query]


def lookup(key: str) -> str:
    return key


def sync_model(history: list[bl.Message], ctx: bl.ModelContext) -> bl.Final:
    return bl.Final("ok")


async def async_model(history: list[bl.Message], ctx: bl.ModelContext) -> bl.CallTools:
    return bl.CallTools([bl.ToolCall("c1", "search", {"query": "x"})])


def dict_model(h: list[bl.Message], c: bl.ModelContext) -> dict[str, Any]:
    return {"kind": "final", "text": "ok"}


def main(runner: bl.Runner) -> bl.RunResult:
    models: list[bl.Model] = [sync_model, async_model, dict_model,
                              lambda history, ctx: bl.Final("ok"),
                              bl.ScriptedModel([bl.Final("ok")])]
    for model in models:
        result = runner.run(model, [search, lookup], "hi", budget=bl.Budget(max_model_steps=3))
        if result.status == "final":
            print(result.explanation)
    future = runner.submit(sync_model, tools=[search], prompt="hi")
    return future.result()


async def amain(runner: bl.Runner) -> str:
    result = await runner.arun(async_model, [search], "hi")
    return result.status
'''

BAD = '''
import boundloop as bl


def needs_int(n: int) -> int:
    return n


def wrong_return(history: list[bl.Message], ctx: bl.ModelContext) -> int:
    return 1


def main(runner: bl.Runner) -> None:
    result = runner.run(bl.ScriptedModel([bl.Final("x")]), [], "hi")
    needs_int(result.status)  # BAD: status
    runner.run(42, [], "hi")  # BAD: model
    runner.run(wrong_return, [], "hi")  # BAD: returns
    runner.run(bl.ScriptedModel([]), [42], "hi")  # BAD: tools
    if result.status == "finished":  # BAD: literal
        pass
'''


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module's checks: the second reuses what the first learnt of
    the standard library and boundloop (mypy's incremental mode) instead of reading them
    all again; each program is checked in full every time."""
    return tmp_path_factory.mktemp("mypy") / ".mypy_cache"


def _mypy(tmp_path: Path, name: str, source: str, cache: Path) -> list[str]:
    program = tmp_path / f"{name}.py"
    program.write_text(source)
    # The checkout on PYTHONPATH is found as an installed package: mypy reads its types only
    # if it carries py.typed (PEP 561), as it would from site-packages.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--strict-equality", "--no-error-summary",
         "--cache-dir", str(cache), "--hide-error-context",
         "--show-error-codes", program.name],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return [line for line in done.stdout.splitlines() if ": error:" in line]


def test_py_typed_is_in_the_package() -> None:
    assert (ROOT / "boundloop" / "py.typed").is_file()


def test_a_user_program_is_checked_against_boundloops_types(tmp_path: Path,
                                                            mypy_cache: Path) -> None:
    errors = _mypy(tmp_path, "good", GOOD, mypy_cache)
    assert errors == [], "\n".join(errors)


def test_a_user_programs_mistakes_are_found(tmp_path: Path, mypy_cache: Path) -> None:
    errors = _mypy(tmp_path, "bad", BAD, mypy_cache)
    assert not [e for e in errors if "import-untyped" in e or "import-not-found" in e], errors
    lines = BAD.splitlines()
    marked = {n: line.split("# BAD: ")[1] for n, line in enumerate(lines, 1)
              if "# BAD: " in line}
    found = {int(m.group(1)) for e in errors if (m := re.match(r"bad\.py:(\d+):", e))}
    assert found == set(marked), "\n".join(errors)
    status = next(e for e in errors if f"bad.py:{min(marked)}:" in e)
    assert "Literal['final'" in status and "expected \"int\"" in status, status


def test_the_wheel_ships_py_typed_and_the_contract(tmp_path: Path) -> None:
    wheel = pytest.importorskip("hatchling.builders.wheel",
                                reason="building the wheel needs hatchling")
    (built,) = wheel.WheelBuilder(str(ROOT)).build(directory=str(tmp_path),
                                                    versions=["standard"])
    names = set(zipfile.ZipFile(built).namelist())
    assert "boundloop/py.typed" in names
    assert "boundloop/testing/_journal_contract.py" in names
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "boundloop").rglob("*.py")}
    assert package <= names, sorted(package - names)
