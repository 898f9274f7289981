"""Moved to ``boundloop.core.replay`` (issue #21); this name stays importable for code
written against it."""

from boundloop.core.replay import *  # noqa: F403
