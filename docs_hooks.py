"""mkdocs hooks: the reference pages are generated from docstrings, which cite the project's
internal contract and design notes by section ("SPEC 5", "DESIGN rule 7") for its
maintainers. Users do not have those documents, so the rendered reference leaves the
citations out (the docstrings say the rule itself)."""

from __future__ import annotations

import re
from typing import Any

_CITE = r"(?:SPEC|DESIGN rule)\s+\d+(?:\.\d+)?(?:\s+steps?\s+[\d-]+)?"
_RULES = [
    (re.compile(rf"\s*\((?:see\s+)?{_CITE}(?:\s+and\s+\d+)?\)"), ""),  # " (SPEC 5)"
    (re.compile(rf",\s*{_CITE}"), ""),  # "(PostgreSQL, SPEC 12)"
    (re.compile(rf"\s+(?:of|by)\s+{_CITE}"), ""),  # "metrics of SPEC 11"
    (re.compile(_CITE), "the contract"),  # anything else
]


def strip_citations(html: str) -> str:
    for pattern, replacement in _RULES:
        html = pattern.sub(replacement, html)
    return html


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri.startswith("reference/"):
        return strip_citations(html)
    return html
