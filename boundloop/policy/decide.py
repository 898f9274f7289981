"""Moved to ``boundloop.core.rules`` (issue #21); this name stays importable for code
written against it."""

from boundloop.core.rules import *  # noqa: F403
