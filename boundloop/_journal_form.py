"""Events in the form the journal stores them (SPEC 9): what the interpreter does to every
event ``core.decide`` returns before it is folded and recorded. It holds the run's secret
scrubber, which is why it is not part of the pure core."""

from __future__ import annotations

from typing import Any

import msgspec

from boundloop import events as ev
from boundloop.core.replay import RunState
from boundloop.messages import AssistantMessage, CallMessage, CallTools, Message, ToolResultMessage
from boundloop.policy.redact import KEPT_FIELDS, Scrubber, same_value
from boundloop.tools import Tool

#: The events ``JournalForm.event`` redacts (or renames within) before it scrubs them.
_REDACTED = frozenset({ev.CallDecided, ev.CallFailed, ev.CallSucceeded, ev.CallReconciled,
                       ev.ModelStepCompleted, ev.RunAdmitted})


class JournalForm:
    """Redacts a run's events: credential and sensitive fields of arguments and results
    become keyed digests (and are remembered), then every text an event carries is
    scrubbed (remembered values, credential-shaped text)."""

    def __init__(self, tools: dict[str, Tool], scrubber: Scrubber) -> None:
        self.tools = tools
        self.scrubber = scrubber

    def _redact(self, tool_name: str, value: Any) -> tuple[Any, bool]:
        if value is None or (type(value) is dict and not value):  # nothing to redact
            return value, False
        tool = self.tools.get(tool_name)
        return self.scrubber.redact(value, tool.sensitive if tool else ())

    def event(self, event: ev.Event, state: RunState) -> ev.Event:
        """The event as the journal stores it (``state``: the run's, before the event)."""
        if type(event) not in _REDACTED:  # most of a round's events: only scrubbed
            scrubbed_only: ev.Event = self.scrubber.struct(event, self._kept)[0]
            return scrubbed_only
        replace = msgspec.structs.replace
        match event:
            case ev.CallDecided():
                args, changed = self._redact(event.tool, event.arguments)
                if event.validated is None:
                    validated, also = None, False
                elif same_value(event.validated, event.arguments):  # validation changed nothing
                    validated, also = args, changed
                else:
                    validated, also = self._redact(event.tool, event.validated)
                event = replace(event, arguments=args, redacted=changed or also,
                                validated=validated, tool=self._tool_name(event.tool))
            case ev.CallFailed():
                # An exception class's name is text its code chose (SPEC 9).
                category = self.scrubber.text(event.error_category)
                if category != event.error_category:
                    event = replace(event, error_category=category)
            case ev.CallSucceeded() | ev.CallReconciled():
                rec = state.calls[event.execution_id]
                content, changed = self._redact(rec.tool, event.content)
                if changed:
                    event = replace(event, content=content)
            case ev.ModelStepCompleted(response=CallTools() as resp):
                calls = [replace(c, arguments=self._redact(c.name, c.arguments)[0])
                         for c in resp.calls]
                calls = [replace(c, name=self._tool_name(c.name)) for c in calls]
                # Provider blocks (a server tool's input, say) hold credential keys too.
                content = resp.content if resp.content is None else \
                    self.scrubber.redact(resp.content)[0]
                event = replace(event, response=replace(resp, calls=calls, content=content))
            case ev.RunAdmitted():
                labels = self.scrubber.redact(event.labels)[0] if event.labels else {}
                event = replace(event, history=[self._redact_message(m)
                                                for m in event.history],
                                labels={str(k): str(v) for k, v in labels.items()})
            case _:
                pass
        scrubbed: ev.Event = self.scrubber.struct(event, self._kept)[0]
        return scrubbed

    @staticmethod
    def _kept(cls: type) -> frozenset[str]:
        """Fields the text scrubbing leaves alone: ids, names and categories (a failed
        step's ``reason``), and arguments already redacted with their ``redacted`` flag."""
        if cls is ev.ModelStepFailed:
            return KEPT_FIELDS | {"reason"}
        if cls is ev.CallDecided:
            return KEPT_FIELDS | {"arguments", "validated"}
        return KEPT_FIELDS

    def _tool_name(self, name: str) -> str:
        """A called tool's name as the journal keeps it: one of the run's tools as it is (a
        remembered value equal to it must not rename it), any other (an unknown tool the
        model named) scrubbed as the text the model wrote that it is (SPEC 9)."""
        if name in self.tools or not isinstance(name, str):
            return name
        return self.scrubber.text(name)

    def _redact_message(self, m: Message) -> Message:
        if isinstance(m, CallMessage):
            return msgspec.structs.replace(m, arguments=self._redact(m.name, m.arguments)[0],
                                           name=self._tool_name(m.name))
        if isinstance(m, ToolResultMessage | AssistantMessage) and m.content is not None:
            return msgspec.structs.replace(m, content=self.scrubber.redact(m.content)[0])
        return m
