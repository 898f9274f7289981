"""Make the zstd dictionary of journal format 3 (``boundloop/journal/_dictionary.py``).

    python tests/golden/make_dictionary.py > boundloop/journal/_dictionary.py

The dictionary is a "raw content" one: the msgpack bytes of one made-up run's events (with
the run id cut out, as ``codec.pack`` cuts it before compressing), so a stored record
refers back to the field names, tags and shapes every run repeats instead of spelling them
out again (a W1 round's bodies shrink from ~1,700 to ~500 bytes). Events that
occur once a run come first and the ones of every round last (zstd reaches recent bytes most
cheaply). The values are generic (a ``search`` tool, a question, a few tokens), not those of
any benchmark.

Records written with it name it (``codec.DICTIONARY_ID``), and it is never changed: old
records must keep decoding. ``tests/test_codec.py`` pins its digest. A better dictionary is a
new one with a new id, beside this one.
"""

from __future__ import annotations

import base64
import hashlib
import textwrap

from boundloop import events as ev
from boundloop import messages as m
from boundloop.journal import codec
from boundloop.core.budget import Budget, Usage

RUN = "019a0c4e5b7d7e3f8c2a1b4d6e8f0a1c"
EXE = f"{RUN}:1:0"
KEY = "5e0c7d1f2a3b4c5d6e7f8091a2b3c4d5"
DIGEST = "3f6a8b0c1d2e3f405162738495a6b7c8d9eaf0b1c2d3e4f5061728394a5b6c7d"
TS = 1796160185.6027272


def events() -> list[ev.Event]:
    """One made-up run's events, the once-a-run ones first."""
    usage = Usage(input_tokens=1200, output_tokens=85)
    at = {"run_id": RUN, "ts": TS, "elapsed_s": 0.0042}
    call = m.ToolCall("call_1", "search", {"query": "weather in Paris"})
    return [
        ev.CallFailed(execution_id=EXE, attempt=1, error_category="error",
                      content="ValueError: the service answered 503", retrying=True,
                      latency_s=0.0031, **at),
        ev.CallTimedOut(execution_id=EXE, attempt=1, timeout_s=5.0, latency_s=5.0, **at),
        ev.CallOutcomeUnknown(execution_id=EXE, attempt=1, content="timed out after 5.0 s",
                              **at),
        ev.CallReconciled(execution_id=EXE, attempt=1, took_effect=True, content="ok",
                          size=4, digest=DIGEST, **at),
        ev.CallSkipped(execution_id=EXE, reason="cancelled", **at),
        ev.CallResolved(execution_id=EXE, outcome="succeeded", note="checked by hand",
                        by="vm:16614:23f62101", **at),
        ev.ModelStepFailed(step=1, reason="malformed", detail="the response is not a "
                           "Final or CallTools", latency_s=0.0021, **at),
        ev.NoticeAdded(text="Your last response was malformed: call 1 (`search`) has "
                       "arguments that are a string, not an object.", **at),
        ev.ChildCharged(child_run_id=RUN, tool_calls=1, usage=usage, **at),
        ev.OwnerClaimed(owner="vm:16614:23f62101", epoch=2, **at),
        ev.RunResumed(owner="vm:16614:23f62101", **at),
        ev.RunAdmitted(budget=Budget(max_model_steps=8, max_tool_calls=20, deadline_s=120.0),
                       history=[m.UserMessage("what is the weather in Paris today?")],
                       tools=["search", "read_file"], owner="vm:16614:23f62101", **at),
        ev.RunFinished(status="final", exhausted_limit=None,
                       explanation="The model gave a final answer.", model_steps=2,
                       tool_calls=1, usage=usage, **at),
        ev.ModelStepCompleted(step=2, response=m.Final("It is sunny in Paris, 21 °C.",
                                                       usage=usage),
                              latency_s=0.82, **at),
        ev.ModelStepStarted(step=1, tools_allowed=True, reservation=Usage(input_tokens=12),
                            **at),
        ev.ModelStepCompleted(step=1, response=m.CallTools([call], usage=usage),
                              latency_s=0.82, **at),
        ev.UsageCharged(step=1, usage=usage, estimated=False, **at),
        ev.CallDecided(execution_id=EXE, idempotency_key=KEY, step=1, round=1, index=0,
                       call_id="call_1", tool="search",
                       arguments={"query": "weather in Paris"}, decision="allow",
                       read_only=True, idempotent=True,
                       validated={"query": "weather in Paris"}, **at),
        ev.CallDispatched(execution_id=EXE, attempt=1, **at),
        ev.CallSucceeded(execution_id=EXE, attempt=1, content=["sunny", "21 °C"], status="ok",
                         latency_s=0.00012, size=27, digest=DIGEST, **at),
        ev.RoundCompleted(step=1, **at),
    ]


def main() -> None:
    data = b"".join(codec.encode(e).replace(RUN.encode(), b"") for e in events())
    text = base64.b64encode(data).decode()
    print('"""The zstd dictionary of journal format 3: made by '
          "``tests/golden/make_dictionary.py``, never\nchanged (records written with it must "
          'keep decoding)."""\n')
    print("import base64\n")
    print(f"#: BLAKE2b-256 {hashlib.blake2b(data, digest_size=32).hexdigest()}")
    print("V1 = base64.b64decode(")
    for line in textwrap.wrap(text, 92):
        print(f'    "{line}"')
    print(")")


if __name__ == "__main__":
    main()
