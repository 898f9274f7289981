"""Every span name, attribute and metric boundloop's telemetry reports (SPEC 11), in one place.

Spans follow the OpenTelemetry GenAI semantic conventions: ``invoke_agent`` for a run,
``chat {model}`` for a model step, ``execute_tool {tool}`` for a tool attempt. Attributes of
the conventions keep their ``gen_ai.*`` names; boundloop's own are ``boundloop.*``.

Metrics are described once here, as :class:`Metric` rows: the OpenTelemetry instrument
(name, kind, unit, attribute keys) and its Prometheus form (``boundloop_`` prefix, ``_total``
on counters, ``_seconds`` on durations, one label per attribute). The OpenTelemetry sink, the
Prometheus sink and ``boundloop stats`` all read this table, so their names cannot drift.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

# -- spans ----------------------------------------------------------------------------------
#: A run, from RunAdmitted (or RunResumed) to RunFinished.
SPAN_RUN = "invoke_agent"
#: A model step, from ModelStepStarted to ModelStepCompleted or ModelStepFailed.
SPAN_CHAT = "chat"
#: A tool attempt, from CallDispatched to its outcome.
SPAN_TOOL = "execute_tool"
#: The model name of ``chat`` spans when the model object does not say (no ``model`` str).
DEFAULT_MODEL = "boundloop"
#: ``gen_ai.provider.name`` when the model object does not say (no ``provider`` str): the
#: adapters say ``anthropic`` or ``openai``, ``ScriptedModel`` ``boundloop.scripted``.
DEFAULT_PROVIDER = "unknown"
#: The instrumentation scope (tracer and meter name).
SCOPE = "boundloop"

# -- attributes: OpenTelemetry GenAI conventions ---------------------------------------------
OPERATION = "gen_ai.operation.name"
#: The model's ``provider`` attribute (``anthropic``, ``openai``, ``boundloop.scripted``).
PROVIDER = "gen_ai.provider.name"
#: The run id: a run (and its steps and tool calls) is one conversation.
CONVERSATION_ID = "gen_ai.conversation.id"
REQUEST_MODEL = "gen_ai.request.model"
#: The model's declared ``max_output_tokens`` (the adapters' ``max_tokens``).
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
#: From the response's ``bl.ResponseInfo`` (the adapters fill it in).
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
#: The provider's finish reason when the response says it, else ``stop`` for a final
#: response and ``tool_calls`` for calls.
FINISH_REASONS = "gen_ai.response.finish_reasons"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
#: Always ``function``: boundloop's tools are functions the application runs.
TOOL_TYPE = "gen_ai.tool.type"
#: ``input`` (all input, cached or not) or ``output``, on ``gen_ai.client.token.usage``.
TOKEN_TYPE = "gen_ai.token.type"
#: All input, cached or not (the conventions' definition): input + cache write + cache read.
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CACHE_CREATION_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
ERROR_TYPE = "error.type"
#: Content attributes, set only with ``Telemetry(capture_content=True)``, from the journal's
#: (redacted) form of the events; redacted values appear as ``[redacted]``.
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"

# -- attributes: boundloop's own -------------------------------------------------------------
RUN_ID = "boundloop.run.id"
#: The agent a run runs (GenAI conventions) and, per label, ``boundloop.run.label.<key>``.
AGENT_NAME = "gen_ai.agent.name"
AGENT_VERSION = "gen_ai.agent.version"
RUN_LABEL_PREFIX = "boundloop.run.label."
RUN_STATUS = "boundloop.run.status"
LIMIT = "boundloop.limit"
EXECUTION_ID = "boundloop.execution.id"
ATTEMPT = "boundloop.attempt"
PARENT_RUN_ID = "boundloop.parent_run.id"
RESUMED = "boundloop.run.resumed"
STEP = "boundloop.step"
MODEL_STEPS = "boundloop.model_steps"
TOOL_CALLS = "boundloop.tool_calls"
COST = "boundloop.usage.cost"
ESTIMATED = "boundloop.usage.estimated"
MODEL_OUTCOME = "boundloop.model.outcome"
TOOL_OUTCOME = "boundloop.tool.outcome"
TOKEN_KIND = "boundloop.token.kind"
TOOK_EFFECT = "boundloop.took_effect"

#: ``boundloop.token.kind`` values (SPEC 7: ``input`` is input neither written to nor read
#: from a cache).
TOKEN_KINDS = ("input", "output", "cache_write", "cache_read")

#: ``boundloop.run.status`` of a run span that ended without a RunFinished being observed
#: (the runner stopped driving it: the journal failed, its lease was lost, or it closed).
UNFINISHED = "unfinished"


# -- metrics --------------------------------------------------------------------------------
class Metric(NamedTuple):
    """One metric: its OpenTelemetry instrument and its Prometheus form."""

    #: OpenTelemetry instrument name.
    name: str
    kind: Literal["counter", "histogram"]
    #: UCUM unit of the instrument.
    unit: str
    description: str
    #: Attribute keys, in the order the projection gives their values.
    attributes: tuple[str, ...]
    #: Prometheus metric name (a counter's ``_total`` is added by the client library).
    prom_name: str
    #: Prometheus label names, one per attribute.
    labels: tuple[str, ...]
    #: Histogram bucket boundaries (an advisory for the OpenTelemetry SDK).
    buckets: tuple[float, ...] = ()


#: Model calls may take minutes (long generations, reasoning): buckets reach 300 s.
MODEL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOOL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
               3600.0)
COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  1.0)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
#: The GenAI conventions' advisory buckets (powers of 4 to 4^13 tokens; 10 ms doubling).
TOKEN_USAGE_BUCKETS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0,
                       262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0)
OPERATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                     40.96, 81.92)
COST_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0)

RUNS = Metric(
    "boundloop.runs", "counter", "{run}",
    "Runs that finished (RunFinished events), by status; a resumed run that ends again counts "
    "again.", (RUN_STATUS,), "boundloop_runs", ("status",))
RUNS_UNRECORDED = Metric(
    "boundloop.runs.unrecorded", "counter", "{run}",
    "Runs that ended on this runner without a RunFinished in the journal (journal "
    "unavailable, lease lost, runner closed) or that admission refused, by status.",
    (RUN_STATUS,), "boundloop_runs_unrecorded", ("status",))
LIMIT_HITS = Metric(
    "boundloop.limit_hits", "counter", "{run}",
    "Runs that ended limit_exceeded, by the limit that stopped them.",
    (LIMIT,), "boundloop_limit_hits", ("limit",))
OUTCOME_UNKNOWN = Metric(
    "boundloop.actions.outcome_unknown", "counter", "{action}",
    "Actions whose result became outcome_unknown (CallOutcomeUnknown), by tool.",
    (TOOL_NAME,), "boundloop_actions_outcome_unknown", ("tool",))
RETRIES = Metric(
    "boundloop.retries", "counter", "{attempt}",
    "Attempts after the first (CallDispatched with attempt > 1, live or at resume), by tool.",
    (TOOL_NAME,), "boundloop_retries", ("tool",))
RECONCILIATIONS = Metric(
    "boundloop.reconciliations", "counter", "{action}",
    "Reconciliations (CallReconciled), by tool and whether the action took effect.",
    (TOOL_NAME, TOOK_EFFECT), "boundloop_reconciliations", ("tool", "took_effect"))
REVIEWS = Metric(
    "boundloop.reviews", "counter", "{action}",
    "Actions sent to review: the unresolved actions of a run that ended needs_review, by tool.",
    (TOOL_NAME,), "boundloop_reviews", ("tool",))
TOKENS = Metric(
    "boundloop.tokens", "counter", "{token}",
    "Tokens charged to model steps (UsageCharged: reported, else the step's estimate), by "
    "kind; a child run's tokens are counted once, in the child.",
    (TOKEN_KIND,), "boundloop_tokens", ("kind",))
RUN_COST = Metric(
    "boundloop.run.cost", "histogram", "{cost}",
    "Cost of each finished run that has one (price table or reported), children included, "
    "in the price table's currency units, by status.",
    (RUN_STATUS,), "boundloop_run_cost", ("status",), COST_BUCKETS)
RUN_DURATION = Metric(
    "boundloop.run.duration", "histogram", "s",
    "Active time of each finished run (RunFinished.elapsed_s, the RunResult's elapsed_s), by "
    "status.", (RUN_STATUS,), "boundloop_run_duration_seconds", ("status",), RUN_BUCKETS)
MODEL_LATENCY = Metric(
    "boundloop.model.latency", "histogram", "s",
    "Latency of each model call, by model and outcome (completed, error, malformed, "
    "cancelled, deadline).", (REQUEST_MODEL, MODEL_OUTCOME), "boundloop_model_latency_seconds",
    ("model", "outcome"), MODEL_BUCKETS)
TOOL_LATENCY = Metric(
    "boundloop.tool.latency", "histogram", "s",
    "Latency of each tool attempt, by tool and outcome (ok, too_large, error, timed_out).",
    (TOOL_NAME, TOOL_OUTCOME), "boundloop_tool_latency_seconds", ("tool", "outcome"),
    TOOL_BUCKETS)
COMMIT_LATENCY = Metric(
    "boundloop.journal.commit.latency", "histogram", "s",
    "Latency of each durable journal commit (one transaction, its fsync included).",
    (), "boundloop_journal_commit_latency_seconds", (), COMMIT_BUCKETS)
COMMIT_BATCH = Metric(
    "boundloop.journal.commit.batch_size", "histogram", "{append}",
    "Appends sharing one durable journal commit (group commit).",
    (), "boundloop_journal_commit_batch_size", (), BATCH_BUCKETS)

# The GenAI conventions' client metrics: one observation per model call (``chat``).
CLIENT_TOKENS = Metric(
    "gen_ai.client.token.usage", "histogram", "{token}",
    "Tokens of each model call the model reported (an estimate is not recorded), by type: "
    "input is all input, cached or not (the GenAI conventions' meaning; boundloop.tokens "
    "splits it by kind).", (OPERATION, PROVIDER, REQUEST_MODEL, TOKEN_TYPE),
    "boundloop_gen_ai_client_token_usage", ("operation", "provider", "model", "token_type"),
    TOKEN_USAGE_BUCKETS)
CLIENT_DURATION = Metric(
    "gen_ai.client.operation.duration", "histogram", "s",
    "Duration of each model call; error.type is the outcome of a call that did not complete "
    "(error, malformed, cancelled, deadline).", (OPERATION, PROVIDER, REQUEST_MODEL, ERROR_TYPE),
    "boundloop_gen_ai_client_operation_duration_seconds",
    ("operation", "provider", "model", "error_type"), OPERATION_BUCKETS)

#: Every metric, in the order the documentation (the telemetry guide) lists them.
METRICS: tuple[Metric, ...] = (RUNS, RUNS_UNRECORDED, LIMIT_HITS, OUTCOME_UNKNOWN, RETRIES,
                               RECONCILIATIONS, REVIEWS, TOKENS, RUN_COST, RUN_DURATION,
                               MODEL_LATENCY, TOOL_LATENCY, COMMIT_LATENCY, COMMIT_BATCH,
                               CLIENT_TOKENS, CLIENT_DURATION)


def metrics_table() -> str:
    """The metrics as a Markdown table (name, kind, unit, attributes, Prometheus form), for
    the documentation's telemetry guide."""
    rows = ["| name | kind | unit | attributes | Prometheus |", "|---|---|---|---|---|"]
    for m in METRICS:
        prom = m.prom_name + ("_total" if m.kind == "counter" else "")
        labels = f"{{{','.join(m.labels)}}}" if m.labels else ""
        attrs = ", ".join(f"`{a}`" for a in m.attributes) or "-"
        rows.append(f"| `{m.name}` | {m.kind} | `{m.unit}` | {attrs} | `{prom}{labels}` |")
    return "\n".join(rows)
