"""OpenAI adapters (SPEC 13): Chat Completions and the Responses API, on the official SDK.

Install the extra: ``pip install 'boundloop[openai]'``. ``import boundloop`` never imports
``openai``; this module imports it only when an adapter is made.

```python
import openai
import boundloop as bl
from boundloop.models.openai import OpenAIChatModel, OpenAIResponsesModel

model = OpenAIChatModel(client=openai.OpenAI(), model="gpt-4.1", max_tokens=1024)
model = OpenAIResponsesModel(client=openai.AsyncOpenAI(), model="o4-mini")   # async def model
```

Both take ``(client, model, max_tokens=1024, system=None, price=None, retry=None,
stream=False, on_text=None, **extra)``:

- ``client``: ``openai.OpenAI`` (a sync model) or ``openai.AsyncOpenAI`` (the model is an
  ``async def`` callable, run on the caller's event loop by ``runner.arun``). The adapter uses
  ``client.with_options(max_retries=0)``: the SDK's own retries could outlive the run's
  deadline; ``retry`` replaces them.
- ``max_tokens``: sent as ``max_completion_tokens`` (Chat) / ``max_output_tokens``
  (Responses), and declared as the model's ``max_output_tokens`` for the runner's reservation.
  When the run has less left of its output tokens, one token past that is sent instead (at
  least 16 for Responses, its minimum), so the provider stops a turn just past the run's limit.
- ``system``: a ``system`` message first (Chat) / ``instructions`` (Responses).
- ``price``: a ``bl.Price``; each step's usage then carries its cost. ``"auto"``: the runner
  prices each step from the genai-prices catalogue (``boundloop[prices]``) for the model
  the response reports.
- ``retry``: a ``bl.RetryPolicy``. Without it, a provider error (timeout, connection error,
  408/409/429, 5xx) ends the step as a model error. With it, such errors that are instances
  of ``retry.retry_on`` are retried within the step, up to ``retry.max_attempts`` attempts in
  all, after the delay the response asks for (``retry-after-ms``, else ``Retry-After``) or
  else ``retry.delay(attempt)``; a delay that would not end before ``ctx.deadline``, or a
  ``Retry-After`` above 60 s, is not taken (the error is raised). Cancelling the run ends a
  delay early.
- ``stream``: use the streaming API (``create(stream=True)``; Chat adds
  ``stream_options={"include_usage": True}``). The response is the one the plain call gives:
  Chat chunks are joined (text, refusal, tool calls by index with their argument deltas, the
  finish reason, the last chunk's usage); Responses takes the response of its
  ``response.completed`` (or ``.incomplete`` / ``.failed``) event; a stream that ends without
  it raises. The output is counted as it streams (4 characters a token of text, arguments,
  refusals and reasoning), and once the turn has said more than the run has left of its
  output tokens (or of its total tokens, less the request's input estimated at 4 bytes of
  its JSON a token; or than its remaining cost buys, with a ``price``), the stream is closed
  (the HTTP request is cut) and the turn is returned as ``bl.Malformed`` with that usage,
  which ends the run ``limit_exceeded``. Cancelling the run or its deadline cut the stream
  too. A stream that fails before any text was delivered
  is retried like a request (with ``retry``); after, it is not.
- ``on_text``: with ``stream=True``, ``on_text(delta, ctx)`` gets each piece of text as it
  comes (``ctx``: the step's ``bl.ModelContext``); with ``AsyncOpenAI`` it may be ``async``.
  A ``bl.TextStream`` is one, to read with ``async for``. If it raises, the step ends as a
  model error naming it.
- ``**extra``: passed to ``create`` as they are (``temperature``, ``reasoning=...``,
  ``extra_headers=...``, ...). The arguments the adapter builds (``model``, the messages or
  input, ``tools``, ``tool_choice``, the token maximum, ``timeout``, ``stream``, and for
  Responses ``instructions``, ``previous_response_id``, ``conversation``) are refused with
  ``ConfigError``. Responses: ``store`` (default False) and ``include`` (default
  ``["reasoning.encrypted_content"]``) may be overridden, e.g. ``include=[]`` for a model that
  does not support encrypted reasoning.

What is sent:

- the history, rebuilt: ``user`` messages and the runner's ``notice`` messages as user
  messages; each model step with tool calls as ONE assistant turn (its text and every call
  of the step), followed by one result per call, paired by call id; ``final`` messages as
  assistant text.
- Chat has no error flag on a tool message: a result whose status is not ``ok`` is sent as
  text starting ``error: `` (status ``error``) or ``error (<status>): `` (``denied``,
  ``invalid_arguments``, ``unknown_tool``, ``outcome_unknown``, ``too_large``). Responses
  ``function_call_output`` items are flagged the same way. A non-string result is sent as
  JSON. A call with no result in the history gets an ``error (no_result)`` result (the
  providers refuse a call left unanswered); a result whose call is not in the history is
  sent as user text.
- Responses is used statelessly (``store=False``): the step's output items, saved in the
  step's ``AssistantMessage.content`` (reasoning items with their ``encrypted_content`` and
  ids, messages, function calls), are sent back verbatim and in order with the next request.
- tools as the provider's function tools, their JSON Schemas with ``$ref`` inlined and an
  object root (Responses: ``strict: false``, since strict mode would refuse optional
  parameters), names within ``^[a-zA-Z0-9_-]{1,64}$`` (a name outside it is sent as a stable
  stand-in and mapped back in the response).
- on a step where ``ctx.tools_allowed`` is False: ``tool_choice="none"`` (the tools are still
  listed, so prompt caching holds, but none can be called).
- each HTTP request's ``timeout`` is the time left before ``ctx.deadline``.

What comes back: ``bl.Final(text)`` or ``bl.CallTools(calls, text=..., content=...)``, with
``bl.Usage`` where ``input_tokens`` excludes cached input (``cached_tokens`` is reported as
``cache_read_tokens``, ``cache_write_tokens`` as ``cache_write_tokens``). Arguments that are
not valid JSON are returned as the raw string (the runner reports the response malformed,
naming the call and the parse error). A turn without a usable answer (``finish_reason``
``length`` or ``content_filter``, a refusal, Responses ``status: incomplete``, or no text and
no call at all) is returned as ``bl.Malformed(reason)``, never raised. A Responses
``status: failed`` is raised (the step ends ``model_error``).
"""

from __future__ import annotations

from boundloop.models._openai_chat import AsyncOpenAIChatModel, OpenAIChatModel
from boundloop.models._openai_common import EXTRA as EXTRA
from boundloop.models._openai_responses import AsyncOpenAIResponsesModel, OpenAIResponsesModel

__all__ = ["AsyncOpenAIChatModel", "AsyncOpenAIResponsesModel", "OpenAIChatModel",
           "OpenAIResponsesModel"]

