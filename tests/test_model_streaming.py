"""What the streaming adapters share (boundloop.models._stream) and the loop's rule for a
cut turn: bl.TextStream, the output meter, the capped output maximum, and a malformed
turn whose usage is over a token limit ending the run ``limit_exceeded``.

The adapters themselves stream against the loopback fake provider in
tests/test_model_anthropic.py and tests/test_model_openai.py.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from loop_helpers import journal_of

import boundloop as bl
from boundloop.models._stream import StreamMeter, capped_max_tokens, pump


def ctx(remaining: bl.Remaining | None = None, *, step: int = 1) -> bl.ModelContext:
    return bl.ModelContext("run-1", step, True, [], remaining or bl.Remaining(5, 5), None,
                           bl.CancelToken())


# --- bl.TextStream ---------------------------------------------------------------------------

def test_a_text_stream_yields_deltas_in_order_from_any_thread() -> None:
    stream = bl.TextStream()
    stream("early ", ctx())  # buffered before anyone iterates

    async def main() -> list[bl.TextDelta]:
        def produce() -> None:
            for i in range(200):
                stream(f"{i} ", ctx(step=2))
            stream.close()
            stream("dropped", ctx())

        threading.Thread(target=produce).start()
        return [d async for d in stream]

    got = asyncio.run(main())
    assert got[0] == bl.TextDelta("early ", "run-1", 1)
    assert [d.text for d in got[1:]] == [f"{i} " for i in range(200)]
    assert {d.step for d in got[1:]} == {2} and stream.closed


def test_a_text_stream_wakes_its_reader_on_its_own_loop() -> None:
    async def main() -> list[str]:
        stream = bl.TextStream()

        async def produce() -> None:
            for word in ("a", "b", "c"):
                await asyncio.sleep(0.01)
                stream(word, ctx())
            stream.close()

        task = asyncio.create_task(produce())
        got = [d.text async for d in stream]
        await task
        return got

    assert asyncio.run(main()) == ["a", "b", "c"]


# --- the meter and the output maximum ----------------------------------------------------------

def test_the_meter_counts_four_characters_a_token_until_the_provider_counts() -> None:
    meter = StreamMeter(ctx(bl.Remaining(5, 5, output_tokens=10)), {"messages": []})
    assert meter.room() == 10 and not meter.spent()
    meter.count("x" * 40)
    assert meter.output_tokens() == 10 and not meter.spent()
    meter.count("y")
    assert meter.output_tokens() == 11 and meter.spent()
    meter.report(3)  # the provider's running count replaces the estimate so far
    assert meter.output_tokens() == 3
    meter.count("z" * 5)
    assert meter.output_tokens() == 5
    assert meter.usage(None) == bl.Usage(input_tokens=meter.input_estimate(), output_tokens=5)
    meter.reset()
    assert meter.output_tokens() == 0


def test_the_total_limit_leaves_room_for_the_input() -> None:
    request = {"messages": [{"role": "user", "content": "x" * 396}]}
    meter = StreamMeter(ctx(bl.Remaining(5, 5, total_tokens=500)), request)
    assert meter.room() == 500 - meter.input_estimate() and meter.input_estimate() > 99
    meter.input_reported = bl.Usage(input_tokens=300, cache_read_tokens=150)
    assert meter.room() == 50
    assert StreamMeter(ctx(), request).room() is None


def test_the_output_maximum_sent_is_one_past_what_the_run_has_left() -> None:
    assert capped_max_tokens(1024, ctx()) == 1024
    assert capped_max_tokens(1024, ctx(bl.Remaining(5, 5, output_tokens=5000))) == 1024
    assert capped_max_tokens(1024, ctx(bl.Remaining(5, 5, output_tokens=99))) == 100
    assert capped_max_tokens(1024, ctx(bl.Remaining(5, 5, output_tokens=0))) == 1
    assert capped_max_tokens(1024, ctx(bl.Remaining(5, 5, output_tokens=3)), floor=16) == 16


def test_pump_stops_at_the_limit_and_on_cancel() -> None:
    meter = StreamMeter(ctx(bl.Remaining(5, 5, output_tokens=2)), {})
    read: list[str] = []

    def reader(event: str) -> str:
        read.append(event)
        meter.count(event)
        return event

    assert pump(iter(["abcd", "efgh", "ijkl", "mnop"]), reader, ctx(), meter, None) == "limit"
    assert read == ["abcd", "efgh", "ijkl"]
    cancelled = ctx()
    cancelled.cancel.cancel()
    assert pump(iter(["a"]), reader, cancelled, StreamMeter(cancelled, {}), None) == \
        "cancelled"


# --- the loop: a malformed turn over a token limit ------------------------------------------

def test_a_malformed_turn_over_a_token_limit_ends_the_run_limit_exceeded(
        tmp_path: Path) -> None:
    cut = bl.Malformed("the model's output was cut", usage=bl.Usage(10, 61),
                       limit="output_tokens")
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=bl.ScriptedModel([cut]), prompt="go",
                            budget=bl.Budget(max_output_tokens=60, malformed_retries=3))
        names, _ = journal_of(runner, result)
    assert (result.status, result.exhausted_limit, result.model_steps) == (
        "limit_exceeded", "output_tokens", 1)
    assert "output was cut" in result.explanation and "NoticeAdded" not in names
    assert result.usage == bl.Usage(10, 61)


def test_a_malformed_turn_within_the_limits_is_still_retried(tmp_path: Path) -> None:
    script: list[Any] = [bl.Malformed("a length stop", usage=bl.Usage(10, 60)),
                         bl.Final("ok", usage=bl.Usage(5, 5))]
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=bl.ScriptedModel(script), prompt="go",
                            budget=bl.Budget(max_output_tokens=70, malformed_retries=1))
    assert result.status == "final" and result.usage == bl.Usage(15, 65)


@pytest.mark.parametrize("retries", [0, 2])
def test_a_cut_over_the_cost_limit_is_the_cost_limit(tmp_path: Path, retries: int) -> None:
    over = bl.Malformed("cut", usage=bl.Usage(10, 60, cost=2.0), limit="cost")
    with bl.Runner(tmp_path / "j") as runner:
        result = runner.run(model=bl.ScriptedModel([over]), prompt="go",
                            budget=bl.Budget(max_cost=1.0, malformed_retries=retries))
    assert (result.status, result.exhausted_limit, result.model_steps) == (
        "limit_exceeded", "cost", 1)


def test_a_length_stop_keeps_the_spec_order(tmp_path: Path) -> None:
    """A malformed turn the adapter did not cut (a provider's length stop) is malformed
    first (SPEC 5 step 5), its usage charged; a retry then meets the limit before the
    next model call."""
    over = bl.Malformed("a length stop", usage=bl.Usage(10, 60, cost=2.0))
    with bl.Runner(tmp_path / "j") as runner:
        plain = runner.run(model=bl.ScriptedModel([over]), prompt="go",
                           budget=bl.Budget(max_cost=1.0))
        retried = runner.run(model=bl.ScriptedModel([over, bl.Final("never")]), prompt="go",
                             budget=bl.Budget(max_cost=1.0, malformed_retries=2))
    assert (plain.status, plain.exhausted_limit) == ("malformed_response", None)
    assert plain.usage.cost == 2.0
    assert (retried.status, retried.exhausted_limit, retried.model_steps) == (
        "limit_exceeded", "cost", 1)


def test_a_priced_meter_leaves_room_for_what_the_cost_limit_buys() -> None:
    price = bl.Price(input_per_mtok=1.0, output_per_mtok=10.0)
    meter = StreamMeter(ctx(bl.Remaining(5, 5, cost=0.0011)), {}, price)
    meter.input_reported = bl.Usage(input_tokens=100)  # 0.0001 paid: 0.001 buys 100 out
    assert meter.rooms() == {"cost": 100}
    meter.count("x" * 404)
    assert meter.spent() and "the 100 output tokens its cost limit left" in meter.cut_reason()
    assert meter.usage(price).cost == pytest.approx(0.0001 + 101 * 10 / 1e6)
    unpriced = StreamMeter(ctx(bl.Remaining(5, 5, cost=0.0011)), {})
    assert unpriced.room() is None and not unpriced.bounded
