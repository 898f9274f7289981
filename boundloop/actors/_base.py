"""The base of boundloop's actors: pykka threading actors with a lighter inbox."""

from __future__ import annotations

import queue
from typing import Any

import pykka


class Actor(pykka.ThreadingActor):
    """A pykka ThreadingActor on a daemon thread whose inbox is a ``queue.SimpleQueue``.

    pykka's default inbox is a ``queue.Queue``: a put and a get each take its Python-level
    Condition (measured here: ~40 % of a hand-off's CPU). The inbox is unbounded either
    way, and pykka only puts, gets and asks ``empty()``, which SimpleQueue does in C.
    """

    # Daemon threads: a runner that is never closed must not keep the process alive.
    use_daemon_thread = True

    @staticmethod
    def _create_actor_inbox() -> Any:
        return queue.SimpleQueue()
