"""Moved to ``boundloop.core.kinds`` (issue #21); this name stays importable for code
written against it."""

from boundloop.core.kinds import *  # noqa: F403
