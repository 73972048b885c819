"""The official OpenAI Python SDK against `sluice up`'s gateway over HTTPS, unmodified.

Reads OPENAI_BASE_URL, OPENAI_API_KEY and SSL_CERT_FILE from the environment (demo.env), runs
one phase (argv[1]) and prints one JSON line per request it made: the request id from the
`x-sluice-request-id` header, the HTTP status, and the completion tokens the client received.
"""

import json
import sys
import time

import openai
from openai import OpenAI

MODEL = "smollm2-135m-instruct"
client = OpenAI(max_retries=0, timeout=120)
results = []


def record(kind, status, request_id, tokens=0, **extra):
    results.append(dict(kind=kind, status=status, request_id=request_id, tokens=tokens, **extra))


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def basic():
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    chat = raw.parse()
    check(chat.choices[0].message.content, "empty chat reply")
    check(chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 5, chat.usage)
    check(float(raw.headers["x-sluice-gateway-overhead-ms"]) >= 0, raw.headers)
    check("x-ratelimit-limit-requests" in raw.headers, dict(raw.headers))
    record("chat", 200, raw.headers["x-sluice-request-id"], chat.usage.completion_tokens,
           prompt=chat.usage.prompt_tokens)

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16,
        stream=True, stream_options={"include_usage": True})
    tokens, usage = 0, None
    for chunk in raw.parse():
        extra = chunk.model_extra or {}
        tokens += (extra.get("sluice") or {}).get("tokens", 0)
        if chunk.usage:
            usage = chunk.usage
    check(usage is not None and usage.completion_tokens == tokens, (usage, tokens))
    record("chat_stream", 200, raw.headers["x-sluice-request-id"], tokens)

    # A tool-calling round trip: a forced call, then the tool's result and the answer, streamed.
    # One call (parallel calls off) in 40 tokens: fewer than the call's shortest form has bytes
    # (64), more than it has tokens, so the grammar leaves the model to end the call itself
    # (the model writes it in 33).
    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}}]
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=question, tools=weather, tool_choice="required", max_tokens=40,
        temperature=0, parallel_tool_calls=False)
    chat = raw.parse()
    choice = chat.choices[0]
    check(choice.finish_reason == "tool_calls" and choice.message.content is None, choice)
    call = choice.message.tool_calls[0]
    check(call.function.name == "get_weather" and call.id.startswith("call_"), call)
    check(isinstance(json.loads(call.function.arguments).get("city"), str), call)
    record("tools", 200, raw.headers["x-sluice-request-id"], chat.usage.completion_tokens)
    answer = question + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 degrees celsius, snow"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=answer, tools=weather, tool_choice="none", max_tokens=24,
        stream=True, stream_options={"include_usage": True})
    tokens, text, usage = 0, "", None
    for chunk in raw.parse():
        tokens += ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    check(text and usage is not None and usage.completion_tokens == tokens, (text, usage))
    record("tools_stream", 200, raw.headers["x-sluice-request-id"], tokens)

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6)
    comp = raw.parse()
    check(comp.usage.completion_tokens >= 1, comp.usage)
    record("completion", 200, raw.headers["x-sluice-request-id"], comp.usage.completion_tokens)

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="One, two,", max_tokens=8, stream=True)
    tokens = 0
    for chunk in raw.parse():
        tokens += ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
    record("completion_stream", 200, raw.headers["x-sluice-request-id"], tokens)

    try:
        OpenAI(api_key="sk-sluice-00000000-wrong", max_retries=0).models.list()
        check(False, "a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401 and "key" in e.message, e.message)
        record("bad_key", 401, None)

    try:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        check(False, "an unknown model was accepted")
    except openai.NotFoundError as e:
        check(e.code == "model_not_found", e)
        record("unknown_model", 404, e.response.headers.get("x-sluice-request-id"))

    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100000)
        check(False, "max_tokens over the cap was accepted")
    except openai.BadRequestError as e:
        check(e.param == "max_tokens", e)
        record("max_tokens_cap", 400, e.response.headers.get("x-sluice-request-id"))

    models = [m.id for m in client.models.list()]
    check(models == [MODEL], models)


def limits():
    try:
        client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=4)
        check(False, "a prompt over the tenant's limit was accepted")
    except openai.APIStatusError as e:
        check(e.status_code == 413, e)
        record("prompt_too_long", 413, e.response.headers.get("x-sluice-request-id"))
    refused = 0
    for i in range(5):
        try:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
            record("limited_ok", 200, raw.headers["x-sluice-request-id"], raw.parse().usage.completion_tokens)
        except openai.RateLimitError as e:
            h = e.response.headers
            check(int(h["retry-after"]) >= 1, dict(h))
            check(h["x-ratelimit-limit-requests"] == "3", dict(h))
            refused += 1
            record("rate_limited", 429, h.get("x-sluice-request-id"))
    check(refused == 2, f"{refused} of 5 refused with rpm 3")


def idempotency():
    # A retry with the same key and body gets the first response again: nothing runs, nothing
    # is billed again. Non-streamed and streamed.
    for stream, key in ((False, "retry-me-1"), (True, "retry-me-2")):
        runs = []
        for _ in range(2):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="Once upon a time", max_tokens=5, stream=stream,
                extra_body={"ignore_eos": True}, extra_headers={"Idempotency-Key": key})
            if stream:
                text, tokens = "", 0
                for chunk in raw.parse():
                    text += "".join(c.text for c in chunk.choices)
                    tokens += ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
            else:
                comp = raw.parse()
                text, tokens = comp.choices[0].text, comp.usage.completion_tokens
            runs.append((raw.headers, text, tokens))
        (first, text1, tokens1), (again, text2, tokens2) = runs
        check(again.get("idempotent-replayed") == "true", dict(again))
        check(first.get("idempotent-replayed") is None, dict(first))
        check(again["x-sluice-request-id"] == first["x-sluice-request-id"], (dict(first), dict(again)))
        check((text1, tokens1) == (text2, tokens2) and tokens1 == 5, (text1, text2, tokens1, tokens2))
        record("idempotent_stream" if stream else "idempotent", 200, first["x-sluice-request-id"], tokens1)
    # The same key with another body is refused, and billed as a refusal.
    try:
        client.completions.create(model=MODEL, prompt="Something else", max_tokens=5,
                                  extra_headers={"Idempotency-Key": "retry-me-1"})
        check(False, "a reused Idempotency-Key with another body was accepted")
    except openai.UnprocessableEntityError as e:
        check(e.code == "idempotency_key_reused", e.body)
        record("idempotency_mismatch", 422, e.response.headers.get("x-sluice-request-id"))


def disconnect():
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Tell a very long story.", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    stream = raw.parse()
    tokens = 0
    for chunk in stream:
        tokens += ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
        if tokens >= 5:
            break
    # Closing the stream mid-way closes the connection: the client went away.
    stream.close()
    record("disconnect", 200, raw.headers["x-sluice-request-id"], tokens)


def refused_model(model):
    """A request for `model`, which the tenant may not use: a 403 model_not_allowed."""
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        check(False, "a model outside the tenant's allowed list was served")
    except openai.PermissionDeniedError as e:
        check(e.code == "model_not_allowed", e)
        record("model_not_allowed", 403, e.response.headers.get("x-sluice-request-id"))


def forbidden_model():
    refused_model(MODEL)
    check([m.id for m in client.models.list()] == [], "listed a model the tenant may not use")


def suspended():
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        check(False, "a suspended tenant was served")
    except openai.PermissionDeniedError as e:
        check(e.code == "tenant_suspended", e)
        record("suspended", 403, e.response.headers.get("x-sluice-request-id"))


def metrics():
    import os
    import ssl
    import urllib.request
    import urllib.error
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    # Not on the tenants' port: it shows every tenant's traffic.
    tenant_port = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        urllib.request.urlopen(tenant_port, context=ctx)
        check(False, "/metrics is served on the tenants' port")
    except urllib.error.HTTPError as e:
        check(e.code in (401, 404), e.code)
    text = urllib.request.urlopen(os.environ["SLUICE_METRICS_URL"]).read().decode()
    for needle in ['sluice_gateway_requests_total{status="200",tier="standard"}',
                   'sluice_gateway_requests_total{status="429",tier="standard"}',
                   'sluice_gateway_admission_refusals_total{reason="rpm"}',
                   "sluice_gateway_overhead_seconds_count", "sluice_gateway_time_to_first_token_seconds_count"]:
        check(needle in text, f"{needle} missing from /metrics")
    record("metrics", 200, None)


def revoked():
    try:
        client.models.list()
        check(False, "a revoked key still works")
    except openai.AuthenticationError as e:
        record("revoked", 401, None)


def ttft():
    # The SDK as an independent client timing TTFT: from the call to the first chunk that
    # carries text (time.perf_counter), for a few streamed requests sent one at a time.
    for _ in range(5):
        t0 = time.perf_counter()
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=list(range(1000, 1008)), max_tokens=3, stream=True,
            extra_body={"ignore_eos": True})
        first, tokens = None, 0
        for chunk in raw.parse():
            carried = ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
            if carried and first is None:
                first = time.perf_counter()
            tokens += carried
        check(first is not None and tokens == 3, tokens)
        record("sdk_ttft_stream", 200, raw.headers["x-sluice-request-id"], tokens,
               sdk_ttft_ms=(first - t0) * 1000.0)


def two_models():
    # `sluice up --model <default> --model <gemma>`: both listed; Gemma 3 (a base model, no
    # chat template) completes text and refuses chat with a 400 naming `messages`.
    models = [m.id for m in client.models.list()]
    gemma = [m for m in models if m.startswith("gemma")]
    check(MODEL in models and len(gemma) == 1 and len(models) == 2, models)
    gemma = gemma[0]
    card = client.models.retrieve(gemma)
    check(card.id == gemma and (card.model_extra or {}).get("max_model_len", 0) > 0, card)
    raw = client.completions.with_raw_response.create(
        model=gemma, prompt="The capital of France is", max_tokens=8, temperature=0)
    comp = raw.parse()
    check(comp.model == gemma and comp.usage.completion_tokens >= 1, comp)
    # llama.cpp's greedy continuation (engine/tests/golden) begins " the capital of the country".
    check(comp.choices[0].text.startswith(" the capital of"), comp.choices[0].text)
    record("gemma_completion", 200, raw.headers["x-sluice-request-id"],
           comp.usage.completion_tokens, model=gemma)
    raw = client.completions.with_raw_response.create(
        model=gemma, prompt="One, two, three,", max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    tokens, usage = 0, None
    for chunk in raw.parse():
        tokens += ((chunk.model_extra or {}).get("sluice") or {}).get("tokens", 0)
        usage = chunk.usage or usage
    check(usage is not None and usage.completion_tokens == tokens >= 1, (usage, tokens))
    record("gemma_completion_stream", 200, raw.headers["x-sluice-request-id"], tokens,
           model=gemma)
    try:
        client.chat.completions.create(model=gemma, messages=[{"role": "user", "content": "x"}])
        check(False, "a chat request for a model without a chat template was served")
    except openai.BadRequestError as e:
        check(e.param == "messages" and "chat template" in e.message, e.message)
        record("gemma_chat", 400, e.response.headers.get("x-sluice-request-id"), model=gemma)


def only_gemma():
    # The tenant may use Gemma only: it sees just that model and gets 403 on the default.
    models = [m.id for m in client.models.list()]
    check(len(models) == 1 and models[0].startswith("gemma"), models)
    refused_model(MODEL)
    comp = client.completions.create(model=models[0], prompt="Hello", max_tokens=2)
    check(comp.usage.completion_tokens >= 1, comp)


PHASES = {"two_models": two_models, "only_gemma": only_gemma, "basic": basic, "limits": limits, "idempotency": idempotency,
          "disconnect": disconnect, "metrics": metrics, "revoked": revoked,
          "forbidden_model": forbidden_model, "suspended": suspended, "ttft": ttft}
PHASES[sys.argv[1]]()
for r in results:
    print(json.dumps(r))
