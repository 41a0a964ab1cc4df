"""Structured outputs against the tiny random model: only the grammar mask can make its answers
valid, so every answer parsing and validating is the mask at work. OpenAI SDK (parse with
Pydantic, json_schema, json_object, tool_choice required/named), LangChain, SGLang-native
fields, vLLM's structured_outputs, hostile grammars, and the generator's contracts (free rows
untouched in a mixed batch, logprobs of the masked distribution)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import PROMPT, call

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Give me a point."}]


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Literal["a", "b", "c"]
    x: int = Field(ge=0, le=99)
    name: str = Field(max_length=6)


ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMS},
    },
    {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "enum": ["hi", "yo"]}},
                "required": ["word"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, "max_batch_size=8")
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _model(client) -> str:
    return client.models.list().data[0].id


def test_openai_parse_with_a_pydantic_model_always_validates(client):
    for seed in range(4):
        out = client.chat.completions.parse(
            model=_model(client),
            messages=MESSAGES,
            response_format=Point,
            max_tokens=200,
            seed=seed,
            n=2,
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice
            assert isinstance(choice.message.parsed, Point), choice.message.content


def test_response_format_json_schema_and_json_object_give_valid_json(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = Point.model_json_schema()
    for strict in (True, False):
        out = client.chat.completions.create(
            model=_model(client),
            messages=MESSAGES,
            max_tokens=200,
            n=4,
            seed=1,
            temperature=1.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": schema, "strict": strict},
            },
        )
        for choice in out.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)
    greedy = client.chat.completions.create(
        model=_model(client),
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert greedy.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(greedy.choices[0].message.content), dict)


def test_strict_refuses_unsupported_schema_keywords_and_lenient_ignores_them(client):
    openai = pytest.importorskip("openai")
    schema = {"type": "string", "format": "no-such-format", "maxLength": 3}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    with pytest.raises(openai.BadRequestError, match="no-such-format") as e:
        client.chat.completions.create(model=_model(client), messages=MESSAGES, response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    fmt["json_schema"]["strict"] = False
    out = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, response_format=fmt, max_tokens=20
    )
    assert isinstance(json.loads(out.choices[0].message.content), str)


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_and_named_always_produce_calls_matching_the_schemas(client, parallel):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        out = client.chat.completions.create(
            model=_model(client),
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=400,
            n=4,
            seed=3,
        )
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            assert parallel or len(c.message.tool_calls) == 1
            for call_ in c.message.tool_calls:
                assert choice == "required" or call_.function.name == "add"
                jsonschema.validate(
                    json.loads(call_.function.arguments), schemas[call_.function.name]
                )


def test_a_forced_call_cut_by_max_tokens_reports_length(client):
    out = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=5
    )
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_langchain_structured_output_and_bound_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    llm = lc.ChatOpenAI(
        base_url=f"{server}/v1",
        api_key="unused",
        model=call(f"{server}/v1/models")[1]["data"][0]["id"],
        max_tokens=300,
        temperature=1.0,
        seed=0,
    )
    for method in ("json_schema", "function_calling"):
        assert isinstance(
            llm.with_structured_output(Point, method=method).invoke("a point"), Point
        ), method

    @tool
    def add(a: int = Field(ge=0, le=9), b: int = Field(ge=0, le=9)) -> int:
        """Add a and b."""
        return a + b

    msg = llm.bind_tools([add], tool_choice="add", strict=True).invoke(
        "1+2?"
    )  # strict: no other keys
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "add"
    assert set(msg.tool_calls[0]["args"]) == {"a", "b"}


def test_sglang_native_json_schema_regex_and_ebnf(server):
    jsonschema = pytest.importorskip("jsonschema")
    schema = Point.model_json_schema()
    cases = [
        ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        (
            {"regex": r"(yes|no)-[0-9]{2,4}"},
            lambda t: re.fullmatch(r"(yes|no)-[0-9]{2,4}", t) or 1 / 0,
        ),
        (
            {"ebnf": 'root ::= "red" | "green" | "blue" ("!")?'},
            lambda t: t in ("red", "green", "blue", "blue!") or 1 / 0,
        ),
    ]
    for fields, check in cases:
        body = {
            "input_ids": [PROMPT, PROMPT[:3]],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 1.0, **fields},
        }
        status, out = call(f"{server}/generate", body)
        assert status == 200, out
        for one in out:
            assert one["meta_info"]["finish_reason"]["type"] == "stop", one
            check(one["text"])
    status, out = call(
        f"{server}/generate",
        {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
    )
    assert status == 400 and out["error"]["param"] == "sampling_params.ebnf"


def test_a_choice_list_and_a_regex_through_vllms_structured_outputs(client):
    out = client.completions.create(
        model=_model(client),
        prompt="Colour:",
        max_tokens=20,
        n=6,
        seed=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert {c.text for c in out.choices} <= {"red", "green", "blue"}
    out = client.chat.completions.create(
        model=_model(client),
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].message.content)


def _deep_ref_schema(depth: int) -> dict:
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x"],
        }
        for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize(
    "name,fields,param",
    [
        (
            "1 MB schema",
            {
                "json_schema": {
                    "type": "object",
                    "properties": {
                        f"p{i}": {"type": "string", "description": "x" * 200} for i in range(5000)
                    },
                }
            },
            "sampling_params.json_schema",
        ),
        ("catastrophic regex", {"regex": "((a{100}){100}){100}"}, "sampling_params.regex"),
        (
            "pattern unrolled at decode",
            {"json_schema": {"type": "string", "pattern": "^((a{50}){50}){50}$"}},
            "sampling_params.json_schema",
        ),
        (
            "deep $ref",
            {"json_schema": _deep_ref_schema(3000)},
            "sampling_params.json_schema",
        ),  # past max_grammar_chars
        (
            "cyclic $ref",
            {
                "json_schema": {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            },
            "sampling_params.json_schema",
        ),
        ("bad regex", {"regex": "(abc"}, "sampling_params.regex"),
        ("bad grammar", {"ebnf": "root ::= ("}, "sampling_params.ebnf"),
    ],
)
def test_hostile_grammars_get_400_in_bounded_time_and_the_server_keeps_serving(
    server, name, fields, param
):
    free = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    t0 = time.monotonic()
    status, out = call(
        f"{server}/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **fields}},
        timeout=30,
    )
    assert time.monotonic() - t0 < 15, name
    # a body past server.max_text_chars (the 1 MB schema) is refused before parsing, naming
    # sampling_params
    assert status == 400 and out["error"]["param"] in (param, "sampling_params"), (name, out)
    assert call(f"{server}/generate", free)[0] == 200


def test_the_deepest_ref_chain_under_the_size_cap_compiles_without_crashing(server):
    depth = 1
    while len(json.dumps(_deep_ref_schema(depth * 2))) < 100_000:
        depth *= 2
    schema = _deep_ref_schema(
        depth
    )  # llguidance recurses through it: the compile thread's big stack holds it
    status, out = call(
        f"{server}/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "json_schema": schema}},
        timeout=60,
    )
    assert status == 200 and out["text"] == '{"x": {"', out[
        "text"
    ]  # 8 byte tokens into the nesting


def test_free_requests_batched_with_constrained_ones_get_their_greedy_outputs_alone(
    generator, tiny_tokenizer
):
    from areal.serving.constraints import (
        Constraint,
        GrammarCompiler,
        GrammarLimits,
        compile_guides,
    )
    from areal.serving.sampling import SamplingParams

    compiler = GrammarCompiler(
        tiny_tokenizer,
        generator.model.spec.vocab_size,
        [258],
        GrammarLimits(10**5, 10, 10**6, 8, 1, 4),
    )
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    free = [[5, 17, 99], [40, 41, 42, 43], [7]]
    alone = [r.output_ids for r in generator.generate(free, greedy)]
    guides = asyncio.run(compile_guides(compiler, [Constraint("regex", "[a-c]{12}", "regex")] * 2))
    futures = generator.submit_batch(
        [free[0], [9, 9], free[1], [9, 8], free[2]],
        [greedy] * 5,
        guides=[None, guides[0], None, guides[1], None],
    )
    mixed = [f.result(60) for f in futures]
    assert [mixed[i].output_ids for i in (0, 2, 4)] == alone
    assert all(
        re.fullmatch("[a-c]{12}", tiny_tokenizer.decode(mixed[i].output_ids)) for i in (1, 3)
    )


def test_constrained_logprobs_are_those_of_the_masked_distribution(
    generator, tiny_tokenizer, hf_model
):
    from areal.serving.constraints import (
        Constraint,
        GrammarCompiler,
        GrammarLimits,
        compile_guides,
    )
    from areal.serving.sampling import SamplingParams

    compiler = GrammarCompiler(
        tiny_tokenizer,
        generator.model.spec.vocab_size,
        [258],
        GrammarLimits(10**5, 10, 10**6, 8, 1, 4),
    )
    guide = asyncio.run(compile_guides(compiler, [Constraint("regex", "[a-c][0-9]", "regex")]))[0]
    prompt = [5, 17, 99]
    r = generator.submit_batch(
        [prompt], [SamplingParams(max_new_tokens=4, temperature=0.7)], guides=[guide]
    )[0].result(60)
    assert r.finish_reason == "stop" and re.fullmatch(
        "[a-c][0-9]", tiny_tokenizer.decode(r.output_ids)
    )
    with torch.no_grad():
        logits = (
            hf_model(torch.tensor([prompt + r.output_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
        )
    for k, allowed in enumerate(
        ["abc", "0123456789"]
    ):  # the log-softmax over the allowed tokens only
        ids = [tiny_tokenizer.convert_tokens_to_ids(ch) for ch in allowed]
        expected = logits[k, r.output_ids[k]] - torch.logsumexp(logits[k, ids], 0)
        assert r.output_logprobs[k] == pytest.approx(expected.item(), abs=1e-4)
