"""The official OpenAI Python SDK, unmodified, against a running `sluice engine`.

Usage: SLUICE_ENGINE_URL=http://127.0.0.1:PORT python3 tests/sdk/test_openai_sdk.py
Run by tests/engine_server.rs; plain asserts, a non-zero exit code on failure.
"""

import os
import sys

import openai
from openai import OpenAI

QUESTION = "What is the capital of France?"


def sluice_ext(obj):
    """The `sluice` extension object the SDK keeps among a model's extra fields."""
    return (obj.model_extra or {}).get("sluice") or {}


def check_models(client):
    models = client.models.list()
    assert len(models.data) == 1, models
    model = models.data[0]
    identity = sluice_ext(model)["execution_identity"]
    assert identity["model_revision"].startswith("sha256:"), identity
    return model.id


def check_completion(client, model):
    c = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert c.object == "text_completion", c
    assert c.id.startswith("cmpl-"), c.id
    text = c.choices[0].text
    assert text.startswith(" Paris."), repr(text)
    assert c.choices[0].finish_reason == "length", c.choices[0]
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 8, c.usage
    assert c.usage.prompt_tokens_details.cached_tokens == 0, c.usage
    assert sluice_ext(c)["timings"]["e2e"] > 0, sluice_ext(c)
    return text


def check_chat(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert r.object == "chat.completion", r
    choice = r.choices[0]
    assert choice.message.role == "assistant", choice
    assert choice.message.content, choice
    assert choice.finish_reason in ("stop", "length"), choice
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), content[0]
    return r


def check_chat_stream(client, model, reference):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, tokens, chunks, finish = [], None, 0, 0, None
    for chunk in stream:
        chunks += 1
        tokens += sluice_ext(chunk)["tokens"]
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    text = "".join(parts)
    assert text == reference.choices[0].message.content, (text, reference.choices[0])
    assert finish == reference.choices[0].finish_reason, finish
    assert usage is not None, "no usage chunk"
    assert usage.completion_tokens == reference.usage.completion_tokens == tokens, (usage, tokens)
    assert usage.prompt_tokens == reference.usage.prompt_tokens, usage
    return chunks


def check_completion_stream(client, model, reference):
    stream = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == reference, (text, reference)


def check_errors(client, model):
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        assert e.param == "messages", e.body
    else:
        raise AssertionError("empty messages were accepted")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=100000)
    except openai.BadRequestError as e:
        assert e.param == "max_tokens" and e.code == "context_length_exceeded", e.body
    else:
        raise AssertionError("max_tokens beyond the context was accepted")
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
    else:
        raise AssertionError("an unknown model was accepted")


def main():
    base = os.environ["SLUICE_ENGINE_URL"].rstrip("/") + "/v1"
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = check_models(client)
    completion = check_completion(client, model)
    check_completion_stream(client, model, completion)
    reference = check_chat(client, model)
    chunks = check_chat_stream(client, model, reference)
    check_errors(client, model)
    print(
        f"openai {openai.__version__} against {base}: models, completions (+stream), "
        f"chat with logprobs, streamed chat ({chunks} chunks, "
        f"{reference.usage.completion_tokens} tokens) and errors all passed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
