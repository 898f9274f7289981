"""Small text helpers shared by boundloop.ops, the figures and the command line."""

from __future__ import annotations


def plain(value: float, digits: int = 6) -> str:
    """``value`` to ``digits`` significant digits as a plain decimal, never in scientific
    notation: ``0.000033``, ``1234.5``, ``123456789``."""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    from decimal import Decimal

    # Below 1, significant digits; from 1 on, every integer digit and ``digits`` decimals.
    text = format(Decimal(f"{value:.{digits}g}"), "f") if abs(value) < 1 \
        else f"{value:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def money(value: float) -> str:
    """A cost as a plain decimal with a dollar sign: ``$0.000033``."""
    return f"${plain(value)}"
