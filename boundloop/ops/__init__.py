"""Looking after a journal: list runs, show a run's timeline, rebuild and check it, verify,
prune, compact, export.

These are the functions behind ``boundloop runs | show | replay | recover | verify | prune |
compact | export``; the command line is a thin layer over them. Nothing here imports
``click`` or ``rich``, and ``import boundloop`` does not import this package.

Each job has its own private module: ``_open`` (opening a journal, naming runs by prefix),
``_runs`` (listing, state words, what recovery would take over), ``_timeline`` (``show``),
``_check`` (``replay``: rebuild and check; ``_recorded``: what a recording feeds the
check), ``_verify`` (hash chains, in a child process),
``_maintenance`` (prune, compact) and ``_events`` (export, load, event names).
"""

from __future__ import annotations

from boundloop.ops._check import (
    CheckReport,
    Divergence,
    Rebuilt,
    RecordedModelError,
    check,
    describe,
    rebuild,
    recorded_budget,
)
from boundloop.ops._events import event_name, event_type, export_lines, load_events
from boundloop.ops._maintenance import CompactReport, PruneReport, compact, prune
from boundloop.ops._open import (
    journal_dir,
    open_journal,
    parse_duration,
    read_events,
    resolve_execution_id,
    resolve_run_id,
)
from boundloop.ops._runs import (
    DAMAGED,
    LIMITS,
    OPEN_EXPLANATIONS,
    STATUSES,
    RunList,
    RunSummary,
    find_runs,
    list_runs,
    owner_alive,
    recoverable,
    run_children,
    state_word,
    waiting_note,
)
from boundloop.ops._timeline import AwaitingCall, Timeline, TimelineRow, run_timeline, timeline
from boundloop.ops._verify import ChainReport, key_file_warning, verify_chains, verify_journal

__all__ = [
    "STATUSES", "LIMITS", "journal_dir", "open_journal", "parse_duration", "read_events",
    "load_events", "RunSummary", "list_runs", "TimelineRow", "Timeline", "timeline",
    "Rebuilt", "rebuild", "Divergence", "CheckReport", "check", "recorded_budget",
    "PruneReport", "prune", "export_lines", "event_name", "event_type", "describe",
    "owner_alive", "state_word", "RunList", "find_runs", "run_children", "run_timeline",
    "RecordedModelError", "recoverable", "ChainReport", "verify_chains",
    "key_file_warning", "CompactReport", "compact", "verify_journal", "AwaitingCall",
    "waiting_note",
    # what the command line uses besides (boundloop.inspection did not list them)
    "DAMAGED", "OPEN_EXPLANATIONS", "resolve_run_id", "resolve_execution_id",
]
