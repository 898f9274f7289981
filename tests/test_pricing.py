"""Prices from a maintained catalogue (issue #24): ``price="auto"`` asks genai-prices for
the model each response reports; a step it cannot price is counted and said, and with a
``max_cost`` the run fails closed unless the user chose ``unpriced="partial"``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from fake_provider import FakeProvider, fake_provider
from loop_helpers import journal_of

import boundloop as bl
from boundloop import events as ev
from boundloop import pricing

genai_prices = pytest.importorskip("genai_prices")


def per_mtok(provider_id: str, model_id: str) -> dict[str, Decimal]:
    """The catalogue's own figures: currency units per million tokens of each kind, read
    from genai-prices' data (below its first tier, where these tests stay)."""
    from genai_prices.data import providers

    provider = next(p for p in providers if p.id == provider_id)
    model = next(m for m in provider.models if m.id == model_id)
    prices = model.prices
    assert not isinstance(prices, list), "a model priced by dates: pick another for the test"
    out = {}
    for key in ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok"):
        value = getattr(prices, key)
        out[key] = Decimal(0) if value is None else getattr(value, "base", value)
    return out


def by_hand(figures: dict[str, Decimal], usage: bl.Usage, *, cache_write_as_input: bool = False
            ) -> float:
    """A step's cost from the catalogue's figures, multiplied out by hand."""
    cw = figures["input_mtok"] if cache_write_as_input else figures["cache_write_mtok"]
    total = (usage.input_tokens * figures["input_mtok"]
             + usage.output_tokens * figures["output_mtok"]
             + usage.cache_read_tokens * figures["cache_read_mtok"]
             + usage.cache_write_tokens * cw)
    return float(total / 1_000_000)


def info(model: str | None) -> bl.ResponseInfo:
    return bl.ResponseInfo(id="r1", model=model)


@bl.tool
def look() -> str:
    return "seen"


# -- the cost equals a hand computation from the catalogue's figures -------------------------
def test_claude_cost_equals_the_catalogue_by_hand_with_cache_priced_apart(
        runner_auto: bl.Runner) -> None:
    figures = per_mtok("anthropic", "claude-sonnet-4-5")
    # Cache reads and writes have prices of their own, unlike plain input.
    assert len({figures["input_mtok"], figures["cache_read_mtok"],
                figures["cache_write_mtok"]}) == 3
    first = bl.Usage(input_tokens=1200, output_tokens=300, cache_write_tokens=2000,
                     cache_read_tokens=5000)
    second = bl.Usage(input_tokens=80, output_tokens=40, cache_read_tokens=7000)
    model = bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "look", {})], usage=first,
                     info=info("claude-sonnet-4-5")),
        bl.Final("done", usage=second, info=info("claude-sonnet-4-5")),
    ])
    result = runner_auto.run(model=model, tools=[look], prompt="go",
                             budget=bl.Budget(max_cost=5.0))
    assert result.status == "final" and result.usage.unpriced_steps == 0
    expected = by_hand(figures, first) + by_hand(figures, second)
    assert result.usage.cost == pytest.approx(expected, rel=1e-12)
    _, events = journal_of(runner_auto, result)
    charged = [e for e in events if isinstance(e, ev.UsageCharged)]
    assert [e.usage.cost for e in charged] == pytest.approx([by_hand(figures, first),
                                                             by_hand(figures, second)])
    assert not any(e.unpriced for e in charged)
    assert "partial" not in result.explanation


def test_gpt_cost_equals_the_catalogue_by_hand(runner_auto: bl.Runner) -> None:
    figures = per_mtok("openai", "gpt-4.1")
    usage = bl.Usage(input_tokens=900, output_tokens=120, cache_read_tokens=3000)
    model = bl.ScriptedModel([bl.Final("done", usage=usage, info=info("gpt-4.1"))])
    result = runner_auto.run(model=model, prompt="go")
    assert result.usage.cost == pytest.approx(by_hand(figures, usage), rel=1e-12)


def test_a_cost_the_model_reports_is_kept(runner_auto: bl.Runner) -> None:
    usage = bl.Usage(input_tokens=10, output_tokens=10, cost=0.25)
    result = runner_auto.run(model=bl.ScriptedModel([bl.Final("x", usage=usage,
                                                              info=info("nobody-knows"))]),
                             prompt="go")
    assert result.usage.cost == 0.25 and result.usage.unpriced_steps == 0


# -- a response that cannot be priced ------------------------------------------------------
def unknown_model_script() -> bl.ScriptedModel:
    usage = bl.Usage(input_tokens=100, output_tokens=10)
    return bl.ScriptedModel([
        bl.CallTools([bl.ToolCall("a", "look", {})], usage=usage, info=info("house-model-7")),
        bl.CallTools([bl.ToolCall("b", "look", {})], usage=usage),  # no model reported
        bl.Final("done", usage=usage, info=info("house-model-7")),
    ])


def test_unpriced_fails_closed_by_default_when_there_is_a_cost_limit(
        runner_auto: bl.Runner) -> None:
    ran: list[str] = []

    @bl.tool
    def act() -> str:
        ran.append("x")
        return "done"

    model = bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "act", {})],
                                           usage=bl.Usage(100, 10), info=info("house-model-7"))])
    result = runner_auto.run(model=model, tools=[act], prompt="go",
                             budget=bl.Budget(max_cost=1.0))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "cost")
    assert ran == [] and result.tool_calls == 0
    assert "cost limit (max_cost=1.0) cannot be enforced" in result.explanation
    assert "house-model-7" in result.explanation
    assert "Its cost is partial: one model step could not be priced." in result.explanation
    assert result.usage.unpriced_steps == 1 and result.usage.cost is None
    _, events = journal_of(runner_auto, result)
    [charged] = [e for e in events if isinstance(e, ev.UsageCharged)]
    assert "has no price for model 'house-model-7'" in charged.unpriced


def test_unpriced_partial_goes_on_and_says_so(journal_dir: Path) -> None:
    with bl.Runner(journal_dir, price="auto", unpriced="partial") as runner:
        result = runner.run(model=unknown_model_script(), tools=[look], prompt="go",
                            budget=bl.Budget(max_cost=1.0))
        assert result.status == "final" and result.tool_calls == 2
        assert result.usage.unpriced_steps == 3
        assert result.explanation == ("The model gave a final answer. Its cost is partial: "
                                      "3 model steps could not be priced.")
        _, events = journal_of(runner, result)
        reasons = [e.unpriced for e in events if isinstance(e, ev.UsageCharged)]
        assert "reported no model" in reasons[1]
        assert bl.replay(events).usage == result.usage


def test_without_a_cost_limit_an_unpriced_run_goes_on(runner_auto: bl.Runner) -> None:
    result = runner_auto.run(model=unknown_model_script(), tools=[look], prompt="go")
    assert result.status == "final" and result.usage.unpriced_steps == 3
    assert result.explanation.endswith("Its cost is partial: 3 model steps could not be "
                                       "priced.")


def test_a_final_answer_is_accepted_even_when_unpriced(runner_auto: bl.Runner) -> None:
    result = runner_auto.run(
        model=bl.ScriptedModel([bl.Final("done", usage=bl.Usage(5, 5), info=info("zzz"))]),
        prompt="go", budget=bl.Budget(max_cost=1.0))
    assert result.status == "final" and result.usage.unpriced_steps == 1


def test_a_step_without_usage_keeps_its_estimate_and_is_unpriced_without_a_model(
        runner_auto: bl.Runner) -> None:
    result = runner_auto.run(model=bl.ScriptedModel([bl.CallTools([bl.ToolCall("a", "look",
                                                                               {})])]),
                             tools=[look], prompt="go", budget=bl.Budget(max_cost=1.0))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "cost")
    assert "estimate could not be priced" in result.explanation
    assert bl.replay(runner_auto.journal.events(result.run_id)).usage.unpriced_steps == 1


def test_a_childs_unpriced_steps_count_in_its_parent(journal_dir: Path) -> None:
    @bl.tool
    def delegate(ctx: bl.ToolContext) -> str:
        child = bl.ScriptedModel([bl.Final("x", usage=bl.Usage(3, 3), info=info("zzz"))])
        return ctx.run_child(model=child, prompt="go").status

    with bl.Runner(journal_dir, price="auto", unpriced="partial") as runner:
        parent = bl.ScriptedModel([
            bl.CallTools([bl.ToolCall("d", "delegate", {})], usage=bl.Usage(10, 1),
                         info=info("gpt-4.1")),
            bl.Final("done", usage=bl.Usage(10, 1), info=info("gpt-4.1"))])
        result = runner.run(model=parent, tools=[delegate], prompt="go", run_id="p",
                            budget=bl.Budget(max_cost=1.0))
        assert result.status == "final" and result.usage.unpriced_steps == 1
        assert "Its cost is partial: one model step" in result.explanation


# -- configuration ---------------------------------------------------------------------------
def test_bad_options_are_config_errors(journal_dir: Path) -> None:
    with pytest.raises(bl.ConfigError, match='price must be a bl.Price, "auto"'):
        bl.Runner(journal_dir, price="automatic")  # type: ignore[arg-type]
    with pytest.raises(bl.ConfigError, match='unpriced must be "fail"'):
        bl.Runner(journal_dir, price="auto", unpriced="ignore")  # type: ignore[arg-type]


def test_a_missing_catalogue_names_the_extra(journal_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "genai_prices", None)
    with pytest.raises(bl.ConfigError, match=r"boundloop\[prices\]"):
        bl.Runner(journal_dir, price="auto")
    with pytest.raises(bl.ConfigError, match=r"boundloop\[prices\]"):
        pricing.check_price("auto", "AnthropicModel")


def test_the_quote_reads_struct_and_dict_responses() -> None:
    usage = bl.Usage(input_tokens=1000, output_tokens=100)
    struct = pricing.quote(bl.Final("x", usage=usage, info=info("gpt-4.1")), None)
    as_dict = pricing.quote({"kind": "final", "text": "x", "info": {"model": "gpt-4.1"},
                             "usage": {"input_tokens": 1000, "output_tokens": 100}}, None)
    assert struct is not None and as_dict is not None and struct.cost == as_dict.cost
    assert struct.cost == pytest.approx(by_hand(per_mtok("openai", "gpt-4.1"), usage))
    assert pricing.quote(bl.Final("x"), None) is None  # nothing reported: nothing to price


# -- a provider adapter ---------------------------------------------------------------------
@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    yield from fake_provider()


def test_an_adapter_with_price_auto_is_priced_for_the_model_it_reports(
        journal_dir: Path, fake: FakeProvider) -> None:
    anthropic = pytest.importorskip("anthropic")
    from boundloop.models.anthropic import AnthropicModel

    figures = per_mtok("anthropic", "claude-sonnet-4-5")
    fake.reply(200, {
        "id": "msg_1", "type": "message", "role": "assistant",
        "model": "claude-sonnet-4-5-20250929", "stop_reason": "end_turn",
        "stop_sequence": None, "content": [{"type": "text", "text": "hello"}],
        "usage": {"input_tokens": 50, "output_tokens": 20, "cache_creation_input_tokens": 400,
                  "cache_read_input_tokens": 3000}})
    with anthropic.Anthropic(api_key="test", base_url=fake.url) as client, \
            bl.Runner(journal_dir) as runner:
        model = AnthropicModel(client, "claude-sonnet-4-5", price="auto")
        result = runner.run(model=model, prompt="hi", budget=bl.Budget(max_cost=1.0))
    assert result.status == "final", result.explanation
    usage = bl.Usage(input_tokens=50, output_tokens=20, cache_write_tokens=400,
                     cache_read_tokens=3000)
    assert result.usage.cost == pytest.approx(by_hand(figures, usage), rel=1e-12)


@pytest.fixture
def runner_auto(journal_dir: Path) -> Iterator[bl.Runner]:
    with bl.Runner(journal_dir, price="auto") as r:
        yield r


def test_show_says_the_cost_is_partial(journal_dir: Path) -> None:
    from click.testing import CliRunner

    from boundloop.cli import cli

    with bl.Runner(journal_dir, price="auto", unpriced="partial") as runner:
        runner.run(model=unknown_model_script(), tools=[look], prompt="go", run_id="r")
    out = CliRunner().invoke(cli, ["--journal", str(journal_dir), "show", "r"])
    assert out.exit_code == 0, out.output
    assert "(partial: 3 unpriced)" in out.output
    assert "unpriced: genai-prices has no price" in out.output


def test_an_unpriced_malformed_step_ends_the_run_while_retries_remain(
        runner_auto: bl.Runner) -> None:
    bad = {"kind": "calls", "calls": [], "usage": {"input_tokens": 5, "output_tokens": 5},
           "info": {"model": "zzz"}}
    result = runner_auto.run(model=bl.ScriptedModel([bad, bl.Final("x")]), prompt="go",
                             budget=bl.Budget(max_cost=1.0, malformed_retries=2))
    assert (result.status, result.exhausted_limit) == ("limit_exceeded", "cost")
    assert "the run did not go on" in result.explanation
    assert result.model_steps == 1


def test_a_model_named_with_its_provider_is_priced_as_the_catalogue_names_it() -> None:
    """A framework's or a gateway's "provider:model" or "provider/model" was never priced."""
    from boundloop.pricing import catalogue_cost

    usage = bl.Usage(input_tokens=1000, output_tokens=100)
    plain = catalogue_cost(usage, "gpt-4.1").cost
    assert plain is not None and plain > 0
    assert catalogue_cost(usage, "openai:gpt-4.1").cost == plain
    assert catalogue_cost(usage, "openai/gpt-4.1").cost == plain
    assert catalogue_cost(usage, "no-such-provider:gpt-4.1").cost is None
