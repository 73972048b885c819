"""Tool calling through the official OpenAI Python SDK, unmodified.

The default model's chat template knows no tools, so the server uses its generic format: the
tools described in a system message, the answer constrained to `{"tool_calls": [...]}` or
`{"response": "..."}`. Checked: a forced call (a named function; `required` with
`parallel_tool_calls=False`) comes back as `message.tool_calls` whose arguments validate
against the function's schema (`client.chat.completions.parse` fills `parsed_arguments`),
`finish_reason` `tool_calls`, content null; streamed, the deltas add up to the same calls; a
round trip (the call, the tool's result, the answer) ends with text, streamed the same as not;
malformed tools are a 400 naming the parameter.

Usage: SLUICE_ENGINE_URL=http://127.0.0.1:PORT python3 tests/sdk/test_tools.py (an engine), or with
demo.env's OPENAI_* variables (a gateway; SLUICE_SDK_MODEL picks the model). Run by
tests/engine_server.rs and, through `sluice up`, tests/up.rs; plain asserts, a non-zero exit code on failure.
"""

import json

import openai
from sdk_client import sdk_client
from pydantic import BaseModel


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str
    unit: str


class GetTime(BaseModel):
    """The local time in a time zone."""

    zone: str


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
SCHEMAS = {"GetWeather": GetWeather, "GetTime": GetTime}


def check_calls(calls, names):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_"), c
        assert c.function.name in names, c
        SCHEMAS[c.function.name].model_validate_json(c.function.arguments)
    assert len({c.id for c in calls}) == len(calls), calls


def forced(client, model):
    named = {"type": "function", "function": {"name": "GetWeather"}}
    r = client.chat.completions.parse(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=80,
        temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None, choice.message
    check_calls(choice.message.tool_calls, {"GetWeather"})
    for c in choice.message.tool_calls:
        assert isinstance(c.function.parsed_arguments, GetWeather), c

    r = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1, choice.message.tool_calls
    check_calls(choice.message.tool_calls, set(SCHEMAS))

    # Streamed: the same request, the same calls.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(
            model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    whole = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert streamed == whole, (streamed, whole)
    return r.choices[0].message


def round_trip(client, model, call):
    c = call.tool_calls[0]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}]},
        {"role": "tool", "tool_call_id": c.id, "content": "18 degrees celsius, sunny"},
    ]
    # With tools still offered, the model may answer or call again; either is well formed.
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls", "length"), choice
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls, set(SCHEMAS))
    else:
        assert choice.message.content, choice.message
    # The final answer: text, the same streamed as not.
    kwargs = dict(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                  max_tokens=60, temperature=0, seed=1)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content and not whole.message.tool_calls, whole
    assert whole.finish_reason in ("stop", "length"), whole
    text = "".join(ch.delta.content or ""
                   for chunk in client.chat.completions.create(stream=True, **kwargs)
                   for ch in chunk.choices)
    assert text == whole.message.content, (text, whole.message.content)

    # An auto answer that replies streams its text as it comes, the same as the whole one.
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Say hello to Bob."}],
                  tools=TOOLS, max_tokens=60, temperature=0, seed=1)
    whole = client.chat.completions.create(**kwargs).choices[0]
    pieces, calls = [], 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            pieces += [ch.delta.content] if ch.delta.content else []
            calls += len(ch.delta.tool_calls or [])
    if whole.message.tool_calls:
        check_calls(whole.message.tool_calls, set(SCHEMAS))
        assert calls == len(whole.message.tool_calls) and not pieces, (calls, pieces)
    else:
        assert "".join(pieces) == whole.message.content, (pieces, whole.message.content)
    return whole


def refusals(client, model):
    bad = [
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}}}],
         None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "Nope"}}, "tool_choice"),
    ]
    for tools, choice, param in bad:
        extra = {} if choice is None else {"tool_choice": choice}
        try:
            client.chat.completions.create(model=model, messages=QUESTION, tools=tools, **extra)
        except openai.BadRequestError as e:
            assert e.param == param, (param, e.body)
        else:
            raise AssertionError(f"accepted bad {param}: {tools} {choice}")
    try:
        client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                       response_format={"type": "json_object"})
    except openai.BadRequestError as e:
        assert e.param == "response_format", e.body
    else:
        raise AssertionError("tools with response_format were accepted")



def main():
    client, model = sdk_client()
    call = forced(client, model)
    answer = round_trip(client, model, call)
    refusals(client, model)
    print(json.dumps({"call": call.tool_calls[0].function.model_dump(),
                      "auto_answer": answer.message.model_dump(exclude_none=True)}))


main()
