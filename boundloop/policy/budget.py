"""Moved to ``boundloop.core.budget`` (issue #21); this name stays importable for code
written against it."""

from boundloop.core.budget import *  # noqa: F403
