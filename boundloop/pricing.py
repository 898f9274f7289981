"""Prices from a maintained catalogue: ``price="auto"`` (the ``boundloop[prices]`` extra).

A run priced by the catalogue asks [genai-prices](https://github.com/pydantic/genai-prices)
what each model step cost, for the model the response reports (``bl.ResponseInfo.model``,
which the provider adapters fill in; else the model the adapter was asked for) and the
adapter's provider, with cache reads and cache writes at the catalogue's own prices. The
lookup is an effect (this module); the decider in ``policy/`` only reads its answer, a
``Quote``. A step the catalogue cannot price (an unknown model, no model reported) is
*unpriced*: counted in ``Usage.unpriced_steps`` and, as the Runner's ``unpriced`` option
says, either ends a run that has a ``max_cost`` (``"fail"``, the default) or lets it go on
with a cost that says it is partial (``"partial"``).
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

import msgspec

from boundloop.core.budget import Price, Quote, Usage
from boundloop.errors import ConfigError
from boundloop.messages import CallTools, Final, Malformed

__all__ = ["AUTO", "PriceOption", "Unpriced", "catalogue_cost", "require_catalogue"]

#: The ``price`` that asks the catalogue.
AUTO: Literal["auto"] = "auto"
#: What ``price=`` accepts: a table, the catalogue (``"auto"``), or None (no cost).
PriceOption = Price | Literal["auto"] | None
#: What a run priced by the catalogue does with a step it cannot price.
Unpriced = Literal["fail", "partial"]

_EXTRA = "pip install 'boundloop[prices]'"


def require_catalogue() -> Any:
    """The ``genai_prices`` module, with its catalogue loaded (so a run's first step does
    not wait for it).

    Raises:
        ConfigError: genai-prices is not installed (it names the extra to install).
    """
    try:
        module = importlib.import_module("genai_prices")
        snapshot = importlib.import_module("genai_prices.data_snapshot")
    except ImportError:
        raise ConfigError(f'price="auto" needs the genai-prices package: {_EXTRA}') from None
    snapshot.get_snapshot()
    return module


def check_price(price: Any, where: str) -> PriceOption:
    """``price`` when it is a ``bl.Price``, ``"auto"`` (genai-prices is then loaded) or None.

    Raises:
        ConfigError: anything else (the message names ``where`` and what is valid), or
            ``"auto"`` without genai-prices installed.
    """
    if price is None or isinstance(price, Price):
        return price
    if price == AUTO:
        require_catalogue()
        return AUTO
    raise ConfigError(f'{where}: price must be a bl.Price, "auto" (the genai-prices '
                      f"catalogue) or None, got {price!r}")


def check_unpriced(unpriced: Any) -> Unpriced:
    """``unpriced`` when it is ``"fail"`` or ``"partial"``.

    Raises:
        ConfigError: anything else.
    """
    if unpriced == "fail":
        return "fail"
    if unpriced == "partial":
        return "partial"
    raise ConfigError(f'unpriced must be "fail" (a run with max_cost stops at a step it '
                      f'cannot price) or "partial" (it goes on, its cost said to be partial), '
                      f"got {unpriced!r}")


def catalogue_cost(usage: Usage, model: str | None, provider: str | None = None) -> Quote:
    """What ``usage`` cost on ``model`` (at ``provider``, else the provider the catalogue
    finds for the model), by the catalogue; a Quote without a cost says why not."""
    if not model:
        return Quote(None, "the response reported no model to price it by")
    genai_prices = require_catalogue()
    # genai-prices counts all input in input_tokens, cached or not (SPEC 7 does not).
    counts = genai_prices.Usage(input_tokens=usage.all_input_tokens,
                                output_tokens=usage.output_tokens,
                                cache_write_tokens=usage.cache_write_tokens,
                                cache_read_tokens=usage.cache_read_tokens)
    if provider is not None and not _known_provider(provider):
        # A name the catalogue does not know (a test model's, a gateway's): let the
        # catalogue find the provider by the model's name instead.
        provider = None
    try:
        try:
            calc = genai_prices.calc_price(counts, model, provider_id=provider)
        except LookupError:
            # "openai:gpt-4.1", "anthropic/claude-sonnet-4-5": a gateway's or a framework's
            # way of naming a model; the catalogue knows it by its own name at that provider.
            prefix, _, bare = model.replace("/", ":", 1).partition(":")
            if not bare or not _known_provider(prefix):
                raise
            calc = genai_prices.calc_price(counts, bare, provider_id=prefix)
    except LookupError:
        at = f" at provider {provider!r}" if provider else ""
        return Quote(None, f"genai-prices has no price for model {model[:80]!r}{at}")
    except Exception as exc:  # noqa: BLE001 - a catalogue that fails prices nothing
        return Quote(None, f"genai-prices could not price model {model[:80]!r}: "
                           f"{type(exc).__name__}")
    return Quote(float(calc.total_price))


def _known_provider(provider: str) -> bool:
    """True when the catalogue has a provider of that id (or alias)."""
    snapshot = importlib.import_module("genai_prices.data_snapshot")
    try:
        found = snapshot.find_provider_by_id(snapshot.get_snapshot().providers, provider)
    except (AttributeError, TypeError):  # another version's internals: ask with it anyway
        return True
    return found is not None


def _declared(model: Any, name: str) -> str | None:
    """The model callable's ``name`` attribute when it is a non-empty string (an
    attribute that raises is none: user code never stops the run here)."""
    try:
        value = getattr(model, name, None)
    except Exception:  # noqa: BLE001 - a property of the user's object
        return None
    return value if isinstance(value, str) and value else None


def prices_by_catalogue(price: Any, model: Any) -> bool:
    """True when a run is priced by the catalogue: its Runner's ``price`` is ``"auto"``,
    or the model adapter's is."""
    return price == AUTO or _declared(model, "price") == AUTO


def quote(response: Any, model: Any) -> Quote | None:
    """The catalogue's price of a model reply's reported usage, or None when there is
    nothing to price (no usage reported, or the model reported its cost).

    ``response`` is what the model returned (a Struct or the dict form); ``model`` the
    model callable: its ``model`` (the name an adapter asks for) stands in when the
    response reports none, and its ``provider`` names the catalogue's provider.
    """
    usage: Any = None
    name: Any = None
    if isinstance(response, Final | CallTools):
        usage, info = response.usage, response.info
        name = info.model if info is not None else None
    elif isinstance(response, Malformed):
        usage = response.usage
    elif isinstance(response, dict):
        usage, info = response.get("usage"), response.get("info")
        name = info.get("model") if isinstance(info, dict) else None
        if isinstance(usage, dict):
            try:
                usage = msgspec.convert(usage, Usage)
            except (msgspec.ValidationError, TypeError, ValueError):
                return None  # the decider finds the response malformed
    if not isinstance(usage, Usage) or usage.cost is not None:
        return None
    if not isinstance(name, str) or not name:
        name = _declared(model, "model")
    return catalogue_cost(usage, name, _declared(model, "provider"))


def reservation_cost(reservation: Usage, model: Any) -> Usage:
    """A step's reservation priced by the catalogue, for the model the adapter asks for;
    left without a cost when that model is not known (the reply then prices the step)."""
    if reservation.cost is not None:
        return reservation
    found = catalogue_cost(reservation, _declared(model, "model"), _declared(model, "provider"))
    if found.cost is None:
        return reservation
    return msgspec.structs.replace(reservation, cost=found.cost)
