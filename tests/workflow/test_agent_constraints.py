"""What an agent's call asks the generation server for, in training as from ``areal serve``
(tier 1, over a scripted engine): ``response_format`` and a forced ``tool_choice`` travel as the
engine request's grammar (``gconfig.json_schema`` / ``gconfig.ebnf``, the server's own tool-call
grammar after the prompt's forced opening) and reach our server as it compiles them, a forced
answer cut by ``max_tokens`` is read as the server reads it (areal.utils.tool_calls.answer_calls),
conflicting grammars are refused by name, and the client checks calls against the run's server
limits, not the defaults.
tests/workflow/test_agent_proxy_live.py checks the answers of a real server parse."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import llguidance as llg
import openai
import pytest

from areal.api.config import GRPOConfig, load_config
from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.config.server import GenerationServerConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelResponse
from areal.api.sampling import RequestRejected
from areal.rollout.backends import NativeBackend
from areal.serving.constraints import to_grammar
from areal.serving.openai_api import chat_finish
from areal.serving.protocol import constraint_from_sglang
from areal.serving.tools import answer_calls, parse_tools
from areal.utils.tool_calls import tool_call_grammar, tool_choice_prefill
from areal.workflow.agent import AgentWorkflow
from areal.workflow.agent_proxy import AgentProxy
from areal.workflow.openai_client import ArealOpenAI

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
G = GenerationHyperparameters(max_new_tokens=64)
MESSAGES = [{"role": "user", "content": "12 * 7 = ?"}]
ARGS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": ARGS}}
    for name in ("calculator", "search")
]
NAMED = {"type": "function", "function": {"name": "search"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}


def _create(client: ArealOpenAI, **kw):
    return asyncio.run(client.chat.completions.create(messages=MESSAGES, **kw))


def test_response_format_reaches_the_engine_as_the_requests_json_schema(tiny_tokenizer, scripted):
    engine = scripted(['{"answer": 84}', "{}", "plain"])
    client = ArealOpenAI(engine, tiny_tokenizer, G)
    out = _create(client, response_format=FORMAT)
    assert json.loads(out.choices[0].message.content) == {"answer": 84}
    _create(client, response_format={"type": "json_object"})
    _create(client, response_format={"type": "text"})
    grammars = [r.gconfig.grammar for r in engine.requests]
    assert grammars == [
        {"json_schema": json.dumps(SCHEMA)},
        {"json_schema": '{"type": "object"}'},
        {},
    ]
    assert G.grammar == {}  # the run's settings are untouched
    # our server takes it as /generate's sampling_params.json_schema and compiles it closed
    # (forbid_unnamed_properties, server.json_schema_additional_properties false): the agent's
    # schema allows no key it does not name, as a response_format sent to `areal serve` does
    body = NativeBackend("areal").generate([1], engine.requests[0].gconfig, 8, 0, None).json
    constraint = constraint_from_sglang(body["sampling_params"], additional_properties=False)
    assert constraint is not None and constraint.kind == "json_schema"
    grammar = to_grammar(constraint)
    assert _accepts(grammar, '{"answer": 84}', tiny_tokenizer)
    assert not _accepts(grammar, '{"answer": 84, "note": 1}', tiny_tokenizer)


def _accepts(grammar: str, text: str, tokenizer) -> bool:
    """Whether llguidance's matcher over ``grammar`` takes ``text`` (tokenized) to its end."""
    import llguidance.hf

    matcher = llg.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_opened_in_the_prompt_and_its_rest_follows_the_servers_grammar(
    tiny_tokenizer, scripted, choice
):
    full = '<tool_call>\n{"name": "search", "arguments": {"x": 7}}\n</tool_call>'
    opening = "<tool_call>\n" if choice == "required" else full[: full.index("{", 13)]
    engine = scripted([full[len(opening) :]])
    client = ArealOpenAI(engine, tiny_tokenizer, G)
    out = _create(client, tools=TOOLS, tool_choice=choice)
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("search", {"x": 7})
    (request,) = engine.requests
    grammar = request.gconfig.ebnf
    assert request.gconfig.grammar == {"ebnf": grammar}
    opened = tiny_tokenizer(opening, add_special_tokens=False)["input_ids"]
    assert request.input_ids[-len(opened) :] == opened and client.calls[0].prefill == len(opened)
    # the grammar takes the rest of a valid call, refuses a wrong function or bad arguments,
    # and the server's grammar of the whole answer (the same tools) takes the opening + the rest
    assert _accepts(grammar, full[len(opening) :], tiny_tokenizer)
    assert not _accepts(grammar, full[len(opening) :].replace("7", '"7"'), tiny_tokenizer)
    if choice == NAMED:
        assert not _accepts(grammar, '{"x": 7}}\n</tool_call>'.replace("x", "y"), tiny_tokenizer)
        assert "calculator" not in grammar  # only the named tool may be called
    assert _accepts(tool_call_grammar([t["function"] for t in TOOLS], True), full, tiny_tokenizer)


def test_parallel_tool_calls_false_gives_one_call_and_a_one_call_grammar(tiny_tokenizer, scripted):
    call = '{"name": "search", "arguments": {"x": 1}}\n</tool_call>'
    engine = scripted([call + "\n<tool_call>\n" + call] * 2)
    client = ArealOpenAI(engine, tiny_tokenizer, G)
    several = _create(client, tools=TOOLS, tool_choice="required")
    one = _create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(several.choices[0].message.tool_calls) == 2
    assert len(one.choices[0].message.tool_calls) == 1
    assert engine.requests[0].gconfig.ebnf.startswith('start: first ("\\n" call)*')
    assert engine.requests[1].gconfig.ebnf.startswith("start: first\n")


@pytest.mark.parametrize("additional", [False, True])
def test_a_named_call_is_one_call_with_the_tools_objects_read_as_the_run_s_server_reads_them(
    tiny_tokenizer, scripted, additional
):
    """As on the server: a named tool_choice is exactly one call (parallel_tool_calls or not),
    and an object schema without additionalProperties allows only its named keys unless the
    run sets server.json_schema_additional_properties."""
    call = '{"x": 1}}\n</tool_call>'
    engine = scripted([call + "\n<tool_call>\n" + '{"name": "search", "arguments": ' + call])
    server = GenerationServerConfig(json_schema_additional_properties=additional)
    client = ArealOpenAI(engine, tiny_tokenizer, G, server=server)
    out = _create(client, tools=TOOLS, tool_choice=NAMED)
    assert len(out.choices[0].message.tool_calls) == 1
    grammar = engine.requests[0].gconfig.ebnf
    assert grammar.startswith("start: first\n")
    assert ('"additionalProperties": false' in grammar) is not additional


def test_a_call_asking_for_two_grammars_or_one_the_run_excludes_is_refused_by_name(
    tiny_tokenizer, scripted
):
    engine = scripted([])
    cases = [
        (G, {"tools": TOOLS, "tool_choice": NAMED, "response_format": FORMAT}, "tool_choice"),
        (G, {"response_format": {"type": "yaml"}}, "response_format.type"),
        (G, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            G,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "[1]"}}},
            "response_format.json_schema.schema",
        ),
        (G, {"tools": [{**TOOLS[0], "function": {"name": "f", "parameters": "{}"}}]},
         "tools[0].function.parameters"),
        (G, {"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (GenerationHyperparameters(regex="[0-9]+"), {"response_format": FORMAT}, "response_format"),
        (GenerationHyperparameters(min_new_tokens=2), {"tools": TOOLS, "tool_choice": "required"},
         "tool_choice"),
    ]  # fmt: skip
    for g, kw, field in cases:
        client = ArealOpenAI(engine, tiny_tokenizer, g)
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, **kw)
        assert e.value.field == field and str(e.value).startswith(f"{field}: "), (kw, e.value)
        assert client.n_rejected == 1
    assert engine.requests == []


class RefusesGrammars(InferenceEngine):
    """A server that refuses every grammar it is sent, as ours answers an uncompilable one."""

    async def agenerate(self, req):
        field = f"sampling_params.{next(iter(req.gconfig.grammar))}"
        raise RequestRejected(f"server refused (HTTP 400): {field}: cannot compile", field)

    def update_weights(self, meta) -> None: ...
    def get_version(self) -> int:
        return 0

    def set_version(self, version: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class Writes(RefusesGrammars):
    """Writes ``reply`` and ends with ``stop_reason`` (``length``: ``max_tokens`` cut it)."""

    def __init__(self, tokenizer, reply: str, stop_reason: str = "length"):
        self.ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        self.stop_reason = stop_reason

    async def agenerate(self, req):
        n = len(self.ids)
        return ModelResponse(list(req.input_ids), self.ids, [-0.5] * n, [0] * n, self.stop_reason)


@pytest.mark.parametrize(
    "choice,reply,calls",
    [  # the opening is the prompt's: a named call's reply starts inside its arguments
        (NAMED, '{"x": 12', [("search", '{"x": 12')]),
        (NAMED, "", [("search", "")]),
        ("required", '{"name": "search", "arguments": {"x"', [("search", '{"x"')]),
        (
            "required",
            '{"name": "search", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "ca',
            [("search", '{"x": 1}')],  # a call cut before its name is complete is dropped
        ),
    ],
)
def test_a_forced_call_cut_by_max_tokens_comes_back_partial_as_the_server_answers_it(
    tiny_tokenizer, choice, reply, calls
):
    """As ``areal serve`` answers (areal.utils.tool_calls.answer_calls): the calls written, the
    last one's arguments as far as written, no content, finish_reason length."""
    client = ArealOpenAI(Writes(tiny_tokenizer, reply), tiny_tokenizer, G)
    out = _create(client, tools=TOOLS, tool_choice=choice, max_tokens=8)
    (answer,) = out.choices
    got = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []]
    assert got == calls
    assert answer.message.content is None and answer.finish_reason == "length"


CALL = '<tool_call>\n{"name": "search", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    "choice,parallel",
    [("auto", None), ("auto", False), ("none", None), ("required", None), ("required", False),
     (NAMED, None)],
)  # fmt: skip
@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_the_client_answers_what_the_server_answers_for_the_same_text(
    tiny_tokenizer, choice, parallel, stop_reason
):
    """Equivalence with `areal serve`: the same answer text (the client's forced opening + what
    the engine wrote) gives the same content, calls and finish reason as the server's
    parse_tools + answer_calls + chat_finish."""
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    use = parse_tools(body, additional_properties=False)
    opening = tool_choice_prefill(choice, ["calculator", "search"])
    for text in [CALL + "\n" + CALL, CALL + "\n" + CALL[:30], "ok " + CALL, CALL[:40]]:
        if not text.startswith(opening):  # the grammar of a forced answer writes no other
            continue
        content, calls = answer_calls(text, use)
        finish = chat_finish(calls, SimpleNamespace(finish_reason=stop_reason))
        engine = Writes(tiny_tokenizer, text[len(opening) :], stop_reason)
        out = _create(ArealOpenAI(engine, tiny_tokenizer, G), **body)
        (answer,) = out.choices
        got = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []]
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in calls], text
        assert (answer.message.content, answer.finish_reason) == (content, finish), text


def test_the_servers_refusal_of_a_grammar_names_the_calls_own_argument(tiny_tokenizer):
    client = ArealOpenAI(RefusesGrammars(), tiny_tokenizer, G)
    for kw, field in [
        ({"response_format": FORMAT}, "response_format"),
        ({"tools": TOOLS, "tool_choice": NAMED}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError, match="cannot compile") as e:
            _create(client, **kw)
        assert e.value.field == field and client.engine_failure is None


def test_the_client_checks_calls_against_the_runs_server_limits(tiny_tokenizer, scripted):
    raised = GenerationServerConfig(max_stop_strings=100, max_n=300)
    stops = [f"stop{i}" for i in range(80)]  # over the default 64
    default = ArealOpenAI(scripted([]), tiny_tokenizer, G)
    with pytest.raises(openai.BadRequestError, match="80 stop strings; this server allows 64"):
        _create(default, stop=stops)
    with pytest.raises(openai.BadRequestError, match=r"n: expected an int in \[1, 256\]"):
        _create(default, n=257)
    engine = scripted(["x"] * 258)
    client = ArealOpenAI(engine, tiny_tokenizer, G, server=raised)
    _create(client, stop=stops)
    assert len(_create(client, n=257).choices) == 257
    with pytest.raises(openai.BadRequestError, match=r"n: expected an int in \[1, 300\]"):
        _create(client, n=301)
    # what builds the clients hands them the run's limits: the workflow, the proxy's sessions
    wf = AgentWorkflow(AgentConfig(), G, tiny_tokenizer, agent=_agent, server=raised)
    assert wf.server is raised
    proxy = AgentProxy(tiny_tokenizer, engine, 1 << 20, "token", server=raised)

    async def session_limits():
        _, session = proxy.open(G, "q", "q/0", 60.0)
        return session.client.server

    assert asyncio.run(session_limits()) is raised


def test_make_workflow_gives_the_agent_workflow_the_configs_server_limits(tiny_tokenizer, tmp_path):
    from areal.runtime.rl import make_workflow

    sys.path.insert(0, str(EXAMPLES))  # the agent module sits beside the entry script
    try:
        cfg = load_config(
            GRPOConfig,
            ["--config", str(EXAMPLES / "agent_arithmetic.yaml"), "server.max_stop_strings=100"],
        )
        workflow = make_workflow(cfg, reward=None, tokenizer=tiny_tokenizer, dump_dir=tmp_path)
    finally:
        sys.path.remove(str(EXAMPLES))
    assert isinstance(workflow, AgentWorkflow) and workflow.server.max_stop_strings == 100


async def _agent(client, item) -> float:
    return 0.0
