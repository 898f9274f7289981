"""What ``Runner.recover`` reports: a run left open, as recovery found it.

Apart from ``boundloop.results`` because it holds a ``RunState``: ``core.replay`` builds
RunResults, so ``results`` cannot import the fold back (an import cycle, even one behind
``TYPE_CHECKING``, leaves ``RecoveredRun.state`` an annotation nothing can resolve).
"""

from __future__ import annotations

import msgspec

from boundloop.core.replay import RunState
from boundloop.results import UnresolvedAction

__all__ = ["RecoveredRun"]


class RecoveredRun(msgspec.Struct, frozen=True):
    """A run left open by a runner that is gone, now owned by the runner that recovered it.

    ``state`` is rebuilt by the replay fold; ``unresolved`` lists its actions whose outcome
    is not known. Nothing was executed to find them.
    """

    run_id: str
    state: RunState
    unresolved: list[UnresolvedAction]
