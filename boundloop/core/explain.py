"""Why a run ended, in a person's words: the ``Stop`` a decision returns and its
explanation (pure)."""

from __future__ import annotations

import msgspec

from boundloop.core.budget import Budget


class Stop(msgspec.Struct, frozen=True):
    """The run ends with ``status`` (and ``limit`` when a budget stopped it)."""

    status: str
    limit: str | None = None
    detail: str = ""
    #: The detail is the whole explanation, without the status's own sentence (which
    #: would say what did not happen: the journal failed, an outcome is unknown, the model
    #: raised).
    plain: bool = False


def stop_limit(limit: str) -> Stop:
    """A ``limit_exceeded`` stop naming ``limit``."""
    return Stop("limit_exceeded", limit)


def _sentence(text: str) -> str:
    """``text`` as a sentence: a capital first letter and a full stop."""
    text = text.strip()
    if not text:
        return ""
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."


def unresolved_sentence(count: int) -> str:
    """SPEC 1: the explanation says how many actions are left unresolved, when any are."""
    if count <= 0:
        return ""
    # A sentence never starts with a numeral.
    return f"The run leaves {count} action{'' if count == 1 else 's'} unresolved."


def explain(stop: Stop, budget: Budget, unresolved: int = 0) -> str:
    """One or two plain sentences on why the run ended, and how many actions are left
    unresolved (SPEC 1) when ``unresolved`` is above 0."""
    text = _why(stop, budget)
    extra = unresolved_sentence(unresolved)
    return f"{text} {extra}" if extra else text


def _why(stop: Stop, budget: Budget) -> str:
    if stop.plain:
        return _sentence(stop.detail)
    if stop.status == "limit_exceeded" and stop.limit is not None:
        value = budget.limit(stop.limit)
        what = {
            "model_steps": f"the model-step limit (max_model_steps={value}) was reached",
            "tool_calls": f"the tool-call limit (max_tool_calls={value}) was reached",
            "deadline": f"the deadline (deadline_s={value}) passed",
            "input_tokens": f"the input-token limit (max_input_tokens={value}) was reached",
            "output_tokens": f"the output-token limit (max_output_tokens={value}) was reached",
            "total_tokens": f"the total-token limit (max_total_tokens={value}) was reached",
            "cost": f"the cost limit (max_cost={value}) was reached",
        }[stop.limit]
        text = f"The run stopped because {what}."
        return f"{text} {stop.detail}" if stop.detail else text
    base = {
        "final": "The model gave a final answer.",
        "repeated_call": f"The model reused call id {stop.detail!r}, which was already "
                         "reserved in this run; nothing in that batch ran.",
        "cancelled": "The run was cancelled.",
        "malformed_response": f"The model's response was malformed: {stop.detail}",
        "model_error": f"The model callback raised: {stop.detail}",
        "needs_review": "An action's outcome is unknown and the runner cannot settle it by the "
                        "tool's own means (reconcile, or a retry of an idempotent tool); a "
                        f"person must resolve it. {stop.detail}",
        "journal_unavailable": "The journal could not record the run; nothing more was "
                               f"dispatched (fail closed). {_sentence(stop.detail)}",
        "rejected": f"Admission refused the run: {stop.detail}",
        "awaiting_approval": "The run waits for a person to approve or deny a call before "
                             f"it is dispatched (`boundloop approve` or `deny`). {stop.detail}",
    }[stop.status]
    if stop.status in ("repeated_call", "malformed_response", "model_error"):
        return base
    if stop.status in ("cancelled", "final"):
        return f"{base} {stop.detail}".strip()
    return base.strip()
