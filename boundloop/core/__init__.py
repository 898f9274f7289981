"""The run as one pure state machine (issue #21): no I/O, no threads, no clock reads.

``decide(state, input, now) -> Step(events, effects)`` holds the order of a round and every
stop decision; ``replay.apply`` folds events into a ``RunState``; ``rules`` holds the checks
of SPEC 5 and 6 that ``decide`` applies; ``budget`` and ``kinds`` the values they use.
Whatever needs user code or secrets (a tool's ``validate``, ``permit``, a result's keyed
digest, redaction, the price catalogue) stays with the interpreter (``boundloop.loop``) and
enters ``decide`` as facts in its inputs.
"""
