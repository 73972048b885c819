//! `sluice engine` end to end: a real server process on the default model, driven over HTTP
//! (and by the official OpenAI Python SDK, unmodified).

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use sluice_wire::{EngineLoad, EngineTimings, ExecutionIdentity, ModelList, Usage, route};

const GOLDEN_PROMPT: &str = "The capital of France is";

/// A running `sluice engine`; killed when dropped, also when a test fails.
struct Server {
    child: Child,
    url: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(extra: &[&str]) -> anyhow::Result<Server> {
        let model = common::default_model()?;
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("engine")
            .arg("--model")
            .arg(&model)
            .args(["--listen", "127.0.0.1:0", "--kv-cache-mb", "64", "--threads", "1"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting sluice engine")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut err_pipe = child.stderr.take().context("no stderr")?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server { child, url: String::new(), stderr };
        // The line comes once the model is loaded and the port is bound.
        let line = rx.recv_timeout(Duration::from_secs(120)).map_err(|_| {
            anyhow::anyhow!("sluice engine printed no listening line: {}", server.log())
        })?;
        server.url = line
            .strip_prefix("listening on ")
            .with_context(|| format!("unexpected first line {line:?}"))?
            .to_string();
        ensure!(server.url.starts_with("http://127.0.0.1:"), "{line}");
        Ok(server)
    }

    fn log(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }
}

fn client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?)
}

/// POSTs `body` and returns (status, headers, JSON).
async fn post(
    c: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, reqwest::header::HeaderMap, Value)> {
    let mut req = c.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    let text = resp.text().await?;
    let v = serde_json::from_str(&text).with_context(|| format!("not JSON: {text:?}"))?;
    Ok((status, h, v))
}

/// The `data:` payloads of an SSE body, `[DONE]` last.
fn sse_events(body: &str) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for block in body.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let data = block.strip_prefix("data: ").with_context(|| format!("bad event {block:?}"))?;
        out.push(data.to_string());
    }
    ensure!(out.last().map(String::as_str) == Some("[DONE]"), "no [DONE] at the end");
    Ok(out)
}

async fn stream(c: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Vec<Value>> {
    let resp = c.post(url).json(body).send().await?;
    ensure!(resp.status() == 200, "status {}", resp.status());
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    ensure!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let events = sse_events(&resp.text().await?)?;
    let mut chunks = Vec::new();
    for e in &events[..events.len() - 1] {
        chunks.push(serde_json::from_str::<Value>(e)?);
    }
    Ok(chunks)
}

fn sluice_run(args: &[&str]) -> anyhow::Result<Value> {
    let m = common::default_model()?;
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("run")
        .arg("--model")
        .arg(&m)
        .args(["--json", "--threads", "1"])
        .args(args)
        .output()?;
    ensure!(out.status.success(), "sluice run failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn uint(v: &Value) -> anyhow::Result<u64> {
    v.as_u64().with_context(|| format!("{v} is not an unsigned integer"))
}

/// Checks a streamed response: every chunk says how many tokens it carries, they add up to
/// the usage, the choice's last chunk carries timings and identity, the usage chunk is last.
/// Returns the concatenated text.
fn check_stream(chunks: &[Value], object: &str, chat: bool) -> anyhow::Result<String> {
    let mut text = String::new();
    let mut tokens = 0;
    let mut finished = 0;
    let id = &chunks.first().context("no chunks")?["id"];
    for c in chunks {
        ensure!(c["object"] == object && &c["id"] == id, "{c}");
        tokens += uint(&c["sluice"]["tokens"])?;
        for ch in c["choices"].as_array().context("choices")? {
            let piece = if chat { &ch["delta"]["content"] } else { &ch["text"] };
            text.push_str(piece.as_str().unwrap_or(""));
            if !ch["finish_reason"].is_null() {
                finished += 1;
                let ext = &c["sluice"];
                ensure!(ext["execution_identity"]["model_revision"].is_string(), "{c}");
                let t = &ext["timings"];
                for k in ["queue", "prefill", "decode", "ttft", "e2e"] {
                    ensure!(t[k].as_f64().is_some_and(|x| x >= 0.0), "timing {k}: {c}");
                }
            }
        }
    }
    ensure!(finished == 1, "{finished} finishing chunks");
    let last = chunks.last().context("no chunks")?;
    ensure!(last["choices"].as_array().is_some_and(Vec::is_empty), "usage chunk: {last}");
    let usage = &last["usage"];
    ensure!(uint(&usage["completion_tokens"])? == tokens, "chunks carry {tokens}: {usage}");
    ensure!(usage["prompt_tokens_details"]["cached_tokens"].is_u64(), "{usage}");
    Ok(text)
}

#[tokio::test]
async fn completions_chat_streaming_and_identity() -> anyhow::Result<()> {
    let server = Server::start(&[])?;
    let c = client()?;

    // Greedy completion equals `sluice run` on the golden prompt.
    let run = sluice_run(&["--max-tokens", "16", GOLDEN_PROMPT])?;
    let expected = run["completion_text"].as_str().context("completion_text")?;
    ensure!(expected.starts_with(" Paris."), "sluice run: {expected:?}");
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, h, v) = post(
        &c,
        &server.at("/v1/completions"),
        &json!({"model": "smollm2-135m-instruct", "prompt": GOLDEN_PROMPT,
                "max_tokens": 16, "temperature": 0, "user": "end-user-7"}),
        &[("x-sluice-request-id", "req-golden-1"), ("traceparent", trace)],
    )
    .await?;
    ensure!(status == 200, "{v}");
    ensure!(v["object"] == "text_completion" && v["id"] == "cmpl-req-golden-1", "{v}");
    ensure!(
        v["choices"][0]["text"] == expected,
        "server {:?} vs run {expected:?}",
        v["choices"][0]
    );
    ensure!(v["choices"][0]["finish_reason"] == "length");
    ensure!(v["usage"]["completion_tokens"] == 16 && v["usage"]["prompt_tokens"] == 5, "{v}");
    ensure!(v["usage"]["total_tokens"] == 21, "{v}");
    // A gateway bills by the wire's usage, read whole.
    let usage = Usage::deserialize(&v["usage"])?;
    ensure!(usage == Usage::new(5, 16, usage.prompt_tokens_details.cached_tokens), "{v}");
    ensure!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let ext = &v["sluice"];
    ensure!(ext["request_id"] == "req-golden-1", "{ext}");
    ensure!(ext["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736", "{ext}");
    ensure!(ext["execution_identity"] == run["execution_identity"], "{ext}");
    let t = &ext["timings"];
    ensure!(t["ttft"].as_f64() <= t["e2e"].as_f64() && t["e2e"].as_f64() > Some(0.0), "{t}");
    // What a gateway reads of a body is the wire's types, whole.
    let typed = EngineTimings::deserialize(t)?;
    ensure!(typed.e2e > 0.0 && typed.in_batch() <= typed.e2e, "{t}");
    let identity = ExecutionIdentity::deserialize(&ext["execution_identity"])?;
    ensure!(serde_json::to_value(&identity)? == run["execution_identity"], "{ext}");
    ensure!(ext["parameters"]["max_tokens"] == 16 && ext["parameters"]["temperature"] == 0.0);
    let header = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    ensure!(header("x-sluice-request-id") == "req-golden-1");
    let revision = run["execution_identity"]["model_revision"].as_str().context("revision")?;
    ensure!(header("x-sluice-model-revision") == revision);
    let short = &revision["sha256:".len()..][..16];
    let ident = header("x-sluice-execution-identity");
    ensure!(ident.starts_with(&format!("smollm2-135m-instruct@{short};")), "{ident}");

    // Chat: greedy equals `sluice run --chat`; streamed deltas add up to the same text.
    let question = "What is the capital of France?";
    let run = sluice_run(&["--chat", "--max-tokens", "24", question])?;
    let body = json!({"messages": [{"role": "user", "content": question}],
                      "max_tokens": 24, "temperature": 0});
    let (status, h, v) = post(&c, &server.at("/v1/chat/completions"), &body, &[]).await?;
    ensure!(status == 200, "{v}");
    ensure!(v["object"] == "chat.completion", "{v}");
    let id = h.get("x-sluice-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
    ensure!(v["id"] == format!("chatcmpl-{id}"), "{v}");
    let msg = &v["choices"][0]["message"];
    ensure!(msg["role"] == "assistant" && msg["content"] == run["completion_text"], "{v} vs {run}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&c, &server.at("/v1/chat/completions"), &streamed).await?;
    ensure!(chunks[0]["choices"][0]["delta"]["role"] == "assistant", "{}", chunks[0]);
    let text = check_stream(&chunks, "chat.completion.chunk", true)?;
    ensure!(text == msg["content"], "streamed {text:?} vs {msg}");
    ensure!(chunks.last().map(|l| &l["usage"]) == Some(&v["usage"]), "usage differs");

    // Streamed legacy completion.
    let body = json!({"prompt": GOLDEN_PROMPT, "max_tokens": 16, "temperature": 0,
                      "stream": true, "stream_options": {"include_usage": true}});
    let chunks = stream(&c, &server.at("/v1/completions"), &body).await?;
    ensure!(check_stream(&chunks, "text_completion", false)? == expected);

    // Echo with logprobs: prompt and completion tokens in the legacy shape.
    let body = json!({"prompt": GOLDEN_PROMPT, "max_tokens": 3, "temperature": 0,
                      "echo": true, "logprobs": 2});
    let (status, _, v) = post(&c, &server.at("/v1/completions"), &body, &[]).await?;
    ensure!(status == 200, "{v}");
    let ch = &v["choices"][0];
    ensure!(ch["text"].as_str().is_some_and(|t| t.starts_with(GOLDEN_PROMPT)), "{ch}");
    let lp = &ch["logprobs"];
    let len = |k: &str| lp[k].as_array().map_or(0, Vec::len);
    ensure!(
        ["tokens", "token_logprobs", "top_logprobs", "text_offset"].iter().all(|k| len(k) == 8),
        "{lp}"
    );
    ensure!(lp["token_logprobs"][0].is_null() && lp["token_logprobs"][7].is_f64(), "{lp}");
    ensure!(lp["top_logprobs"][5].as_object().is_some_and(|m| m.len() == 2), "{lp}");
    ensure!(lp["text_offset"][0] == 0 && lp["tokens"][5] == " Paris", "{lp}");

    // The prompt as token ids, n choices: each greedy choice is the same golden text.
    let m = common::default_model()?;
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("tokenize")
        .arg("--model")
        .arg(&m)
        .arg(GOLDEN_PROMPT)
        .output()?;
    let ids: Value = serde_json::from_slice(&out.stdout)?;
    let body = json!({"prompt": ids, "max_tokens": 16, "n": 3, "temperature": 0});
    let (status, _, v) = post(&c, &server.at("/v1/completions"), &body, &[]).await?;
    ensure!(status == 200, "{v}");
    let choices = v["choices"].as_array().context("choices")?;
    ensure!(choices.len() == 3, "{v}");
    ensure!(choices.iter().enumerate().all(|(i, c)| c["index"] == i && c["text"] == expected));
    ensure!(v["sluice"]["choices"].as_array().map(Vec::len) == Some(3), "{v}");
    ensure!(v["usage"]["completion_tokens"] == 48 && v["usage"]["prompt_tokens"] == 5, "{v}");

    // Models, health, metrics.
    let m: Value = c.get(server.at("/v1/models")).send().await?.json().await?;
    // Named after its file, lowercased, without the quantization tag: the id gateways and
    // policies/sampling.json know it by, whose defaults apply (the file recommends nothing).
    ensure!(m["object"] == "list" && m["data"][0]["id"] == "smollm2-135m-instruct", "{m}");
    ensure!(m["data"][0]["sluice"]["execution_identity"]["model_revision"] == revision);
    // The cards read as the wire's model list, as a gateway reads them.
    let cards = ModelList::deserialize(&m)?;
    ensure!(
        cards.data.len() == 1 && cards.data[0].sluice.execution_identity.model_revision == revision
    );
    ensure!(cards.data[0].max_model_len > 0, "{m}");
    let d = &m["data"][0]["sluice"]["sampling_defaults"];
    ensure!(d["temperature"] == 0.2 && d["top_p"] == 0.9, "{m}");
    ensure!(d["from"]["temperature"] == "policies/sampling.json", "{m}");
    ensure!(d["from"]["top_k"] == "openai" && d["top_k"] == 0, "{m}");
    let hl: Value = c.get(server.at("/health")).send().await?.json().await?;
    ensure!(hl["status"] == "ok" && hl["total_blocks"].as_u64() > Some(0), "{hl}");
    // Liveness and readiness are separate probes; both hold on a serving engine.
    let live = c.get(server.at("/livez")).send().await?;
    ensure!(live.status() == 200, "livez: {}", live.status());
    let ready: Value = c.get(server.at("/readyz")).send().await?.json().await?;
    ensure!(ready["status"] == "ready" && ready["model"] == "smollm2-135m-instruct", "{ready}");
    let resp = c.get(server.at("/metrics")).send().await?;
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    ensure!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let text = resp.text().await?;
    for name in ["time_to_first_token_seconds", "num_requests_running", "prefix_cache_hits"] {
        ensure!(text.contains(&format!("sluice_engine_{name}")), "metrics lack {name}");
    }

    // The log has counts, never prompt text.
    let log = server.log();
    ensure!(log.contains("req-golden-1") && !log.contains("capital"), "{log}");
    Ok(())
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_parameter() -> anyhow::Result<()> {
    let server = Server::start(&[])?;
    let c = client()?;
    let long = "word ".repeat(9000);
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        ("/v1/completions", json!({"prompt": ""}), 400, Some("prompt")),
        ("/v1/completions", json!({}), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": [1, 49152]}), 400, Some("prompt[1]")),
        ("/v1/completions", json!({"prompt": [1, -2]}), 400, Some("prompt[1]")),
        ("/v1/completions", json!({"prompt": long}), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}), 400, Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 8192}), 400, Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": "9"}), 400, Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "x", "n": 17}), 400, Some("n")),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
            400,
            Some("stop"),
        ),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 21}), 400, Some("logprobs")),
        ("/v1/completions", json!({"prompt": "x", "temperature": -1}), 400, Some("temperature")),
        ("/v1/completions", json!({"prompt": "x", "top_p": 1.5}), 400, Some("top_p")),
        ("/v1/completions", json!({"prompt": "x", "model": "gpt-4"}), 404, Some("model")),
        ("/v1/chat/completions", json!({}), 400, Some("messages")),
        ("/v1/chat/completions", json!({"messages": []}), 400, Some("messages")),
        ("/v1/chat/completions", json!({"messages": "hi"}), 400, Some("messages")),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}]}),
            400,
            Some("messages[0].content"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": 3, "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9000}),
            400,
            Some("max_completion_tokens"),
        ),
    ];
    for (path, body, status, param) in &cases {
        let (got, _, v) = post(&c, &server.at(path), body, &[]).await?;
        let err = &v["error"];
        ensure!(got == *status, "{path} {body}: status {got}: {v}");
        ensure!(err["param"].as_str() == *param, "{path} {body}: {v}");
        ensure!(err["message"].as_str().is_some_and(|m| !m.is_empty()) && err["type"].is_string());
    }
    // Malformed JSON, a non-object body and unknown routes are JSON errors too.
    for (path, raw, status) in [
        ("/v1/completions", "{\"prompt\": ", 400),
        ("/v1/chat/completions", "[1, 2]", 400),
        ("/v1/nope", "{}", 404),
    ] {
        let resp = c.post(server.at(path)).body(raw).send().await?;
        ensure!(resp.status().as_u16() == status, "{path} {raw}: {}", resp.status());
        let v: Value = resp.json().await?;
        ensure!(v["error"]["message"].is_string(), "{v}");
    }
    let resp = c.get(server.at("/v1/completions")).send().await?;
    ensure!(resp.status() == 405 && resp.json::<Value>().await?["error"].is_object());
    let resp = c
        .post(server.at("/v1/completions"))
        .header("x-sluice-priority", "urgent")
        .json(&json!({"prompt": "x"}))
        .send()
        .await?;
    ensure!(resp.status() == 400);
    ensure!(resp.json::<Value>().await?["error"]["param"] == "x-sluice-priority");
    // Nothing leaked: every block is free again.
    let h: Value = c.get(server.at("/health")).send().await?.json().await?;
    ensure!(h["running"] == 0 && h["free_blocks"] == h["total_blocks"], "{h}");
    Ok(())
}

#[tokio::test]
async fn internal_token_is_required_when_configured() -> anyhow::Result<()> {
    let server = Server::start(&["--internal-token", "s3cret-token"])?;
    let c = client()?;
    let body = json!({"prompt": "Hi", "max_tokens": 1});
    for auth in [None, Some("Bearer wrong"), Some("s3cret-token"), Some("Bearer s3cret-token2")] {
        let mut req = c.post(server.at("/v1/completions")).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await?;
        ensure!(resp.status() == 401, "{auth:?}: {}", resp.status());
        let v: Value = resp.json().await?;
        ensure!(v["error"]["code"] == "invalid_api_key", "{v}");
    }
    let resp = c.get(server.at("/v1/models")).send().await?;
    ensure!(resp.status() == 401);
    let (status, _, v) =
        post(&c, &server.at("/v1/completions"), &body, &[("authorization", "Bearer s3cret-token")])
            .await?;
    ensure!(status == 200, "{v}");
    // Probes and scrapers need no token; the per-tenant series (who uses the engine, how
    // much) do.
    ensure!(c.get(server.at("/health")).send().await?.status() == 200);
    // The load gateways poll is theirs alone, and typed.
    ensure!(c.get(server.at(route::LOAD)).send().await?.status() == 401);
    let load = c.get(server.at(route::LOAD)).bearer_auth("s3cret-token").send().await?;
    let load: EngineLoad = load.json().await?;
    ensure!(load.requests() == 0 && !load.batch_full && load.pending_prompt_tokens == 0);
    let tenant = [("authorization", "Bearer s3cret-token"), ("x-sluice-tenant", "acme-private")];
    let (status, _, _) = post(&c, &server.at("/v1/completions"), &body, &tenant).await?;
    ensure!(status == 200);
    // The request's tenant series is written as it ends, just after its answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let behind = c.get(server.at("/metrics")).bearer_auth("s3cret-token").send().await?;
        let behind = behind.text().await?;
        if behind.contains("tenant=\"acme-private\"") {
            break;
        }
        ensure!(Instant::now() < deadline, "no series of the tenant behind the token: {behind}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let open = c.get(server.at("/metrics")).send().await?.text().await?;
    ensure!(open.contains("sluice_engine_num_requests_running"), "{open}");
    ensure!(!open.contains("acme-private") && !open.contains("sluice_engine_tenant_"), "{open}");
    ensure!(!server.log().contains("s3cret"));
    // Token ids handed over with the prompt (as the gateway does) are used as sent behind the
    // token, and ignored by an engine that has none: there anybody could send them.
    let revision = v["sluice"]["execution_identity"]["tokenizer_revision"].clone();
    ensure!(revision.is_string(), "{v}");
    let prompt = "The capital of France is a city of many bridges";
    let handed = json!({"prompt": prompt, "max_tokens": 1,
        "sluice_prompt": {"ids": [1, 2], "tokenizer_revision": revision}});
    let auth = [("authorization", "Bearer s3cret-token")];
    let (status, _, v) = post(&c, &server.at("/v1/completions"), &handed, &auth).await?;
    ensure!(status == 200 && v["usage"]["prompt_tokens"] == 2, "{v}");
    let open = Server::start(&[])?;
    let (status, _, v) = post(&c, &open.at("/v1/completions"), &handed, &[]).await?;
    let own = json!({"prompt": prompt, "max_tokens": 1});
    let (_, _, mine) = post(&c, &open.at("/v1/completions"), &own, &[]).await?;
    let n = &mine["usage"]["prompt_tokens"];
    ensure!(status == 200 && v["usage"]["prompt_tokens"] == *n && n.as_u64() > Some(2), "{v}");
    Ok(())
}

#[tokio::test]
async fn prefix_cache_is_scoped_by_the_tenant_header_only() -> anyhow::Result<()> {
    let server = Server::start(&[])?;
    let c = client()?;
    let prompt =
        "The quick brown fox jumps over the lazy dog while the farmer counts sheep. ".repeat(6);
    let cached = |tenant: Option<&'static str>| {
        let c = c.clone();
        let url = server.at("/v1/completions");
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
        async move {
            let headers: Vec<(&str, &str)> =
                tenant.map(|t| vec![("x-sluice-tenant", t)]).unwrap_or_default();
            let (status, _, v) = post(&c, &url, &body, &headers).await?;
            ensure!(status == 200, "{v}");
            let u = &v["usage"];
            ensure!(uint(&u["prompt_tokens"])? > 64, "{u}");
            uint(&u["prompt_tokens_details"]["cached_tokens"])
        }
    };
    ensure!(cached(Some("A")).await? == 0, "first request of A");
    let hit = cached(Some("A")).await?;
    ensure!(hit >= 64, "A's repeat hit only {hit} tokens");
    ensure!(cached(Some("B")).await? == 0, "B must not see A's blocks");
    // The body's cache_salt neither opens a new scope nor picks another tenant's: it is
    // refused by name (once accepted and ignored).
    let salted = json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "A"});
    let (status, _, v) = post(&c, &server.at("/v1/completions"), &salted, &[]).await?;
    ensure!(status == 400 && v["error"]["param"] == "cache_salt", "{status} {v}");
    ensure!(cached(Some("A")).await? == hit, "A's scope changed");
    // Without a tenant every request has a scope of its own.
    ensure!(cached(None).await? == 0 && cached(None).await? == 0);
    Ok(())
}

async fn wait_idle(c: &reqwest::Client, server: &Server) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h: Value = c.get(server.at("/health")).send().await?.json().await?;
        if h["running"] == 0 && h["waiting"] == 0 && h["free_blocks"] == h["total_blocks"] {
            return Ok(h);
        }
        if Instant::now() > deadline {
            bail!("the engine did not free its blocks within 10 s: {h}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_running(c: &reqwest::Client, server: &Server) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h: Value = c.get(server.at("/health")).send().await?.json().await?;
        if h["running"] == 1 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the request never started running: {h}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn client_disconnect_aborts_the_request_and_frees_blocks() -> anyhow::Result<()> {
    let server = Server::start(&[])?;
    let c = client()?;
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": true,
                      "stream": true});

    // Streaming: read a couple of chunks, then hang up.
    let resp = c.post(server.at("/v1/completions")).json(&body).send().await?;
    ensure!(resp.status() == 200);
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while seen.matches("data: ").count() < 2 {
        let chunk = bytes.next().await.context("the stream ended early")??;
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(bytes);
    wait_idle(&c, &server).await?;

    // Not streaming: hang up while it runs.
    let mut body = body;
    body["stream"] = json!(false);
    let pending = {
        let c = c.clone();
        let url = server.at("/v1/completions");
        tokio::spawn(async move { c.post(url).json(&body).send().await })
    };
    wait_running(&c, &server).await?;
    // The typed load says so too, with the request's blocks in use.
    let load: EngineLoad = c.get(server.at(route::LOAD)).send().await?.json().await?;
    ensure!(load.running == 1 && load.waiting == 0 && load.kv_usage > 0.0, "{load:?}");
    pending.abort();
    wait_idle(&c, &server).await?;

    let metrics = c.get(server.at("/metrics")).send().await?.text().await?;
    let aborted = metrics
        .lines()
        .find(|l| l.contains("finished_reason=\"abort\"") && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<f64>().ok());
    ensure!(aborted == Some(2.0), "aborted requests in metrics: {aborted:?}");
    let log = server.log();
    ensure!(log.matches("outcome=client_disconnected").count() == 2, "{log}");
    Ok(())
}

/// Served as the default model's id, the engine samples what a request leaves out as
/// `policies/sampling.json` says for it, and its model card says so.
#[tokio::test]
async fn a_name_the_policy_does_not_know_takes_openais_defaults() -> anyhow::Result<()> {
    // The same file served under another name: policies/sampling.json has no entry for it,
    // and the file recommends nothing: OpenAI's defaults, said to be so.
    let server = Server::start(&["--served-model-name", "my-assistant"])?;
    let c = client()?;
    let m: Value = c.get(server.at("/v1/models")).send().await?.json().await?;
    ensure!(m["data"][0]["id"] == "my-assistant", "{m}");
    let d = &m["data"][0]["sluice"]["sampling_defaults"];
    ensure!(d["temperature"] == 1.0 && d["top_p"] == 1.0, "{m}");
    ensure!(d["from"]["temperature"] == "openai" && d["from"]["top_p"] == "openai", "{m}");
    Ok(())
}

#[tokio::test]
async fn official_openai_python_sdk_works_unmodified() -> anyhow::Result<()> {
    run_sdk_script("tests/sdk/test_openai_sdk.py")
}

/// `client.chat.completions.parse` on 20 pydantic models: every answer parses and validates.
#[tokio::test]
async fn structured_outputs_parse_with_the_official_sdk() -> anyhow::Result<()> {
    run_sdk_script("tests/sdk/test_structured.py")
}

/// Tools through the official SDK: forced calls validate against their schemas, a round trip
/// (call, result, answer) works, streamed the same as not; malformed tools are 400s.
#[tokio::test]
async fn tool_calls_round_trip_with_the_official_sdk() -> anyhow::Result<()> {
    run_sdk_script("tests/sdk/test_tools.py")
}

/// Runs a script of the official OpenAI Python SDK (installed if missing) against a fresh
/// engine server.
fn run_sdk_script(path: &str) -> anyhow::Result<()> {
    support::ensure_sdk()?;
    let server = Server::start(&[])?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path);
    let out = Command::new("python3")
        .arg(&script)
        .env("SLUICE_ENGINE_URL", &server.url)
        .output()
        .context("running the SDK script")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    ensure!(
        out.status.success(),
        "{} failed:\n{stdout}\n{}\nserver log:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    Ok(())
}

/// SIGTERM drains: the engine stops accepting, the running stream and whole answer go on until
/// `--drain-timeout`, then both are aborted and still end properly (the stream with its last
/// chunk, usage and [DONE]; the whole answer with its counts), and the process exits.
#[tokio::test]
async fn sigterm_drains_then_aborts_with_counts() -> anyhow::Result<()> {
    let mut server = Server::start(&["--drain-timeout", "1"])?;
    let c = client()?;
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 600, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let resp = c.post(server.at("/v1/completions")).json(&body).send().await?;
    ensure!(resp.status() == 200);
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("data: ") {
        let chunk = bytes.next().await.context("the stream ended early")??;
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let whole = {
        let (c, url) = (c.clone(), server.at("/v1/completions"));
        let mut body = body.clone();
        body["stream"] = json!(false);
        body.as_object_mut().map(|o| o.remove("stream_options"));
        tokio::spawn(async move { c.post(url).json(&body).send().await?.json::<Value>().await })
    };
    wait_running_n(&c, &server, 2).await?;
    ensure!(
        Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status()?.success()
    );
    // Draining, the engine is not ready: a probe is refused a connection or told 503.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Ok(r) = c.get(server.at("/readyz")).send().await {
        ensure!(r.status() == 503, "readyz while draining: {}", r.status());
    }
    while let Some(chunk) = bytes.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk?));
    }
    let events = sse_events(&seen)?;
    ensure!(events.last().map(String::as_str) == Some("[DONE]"), "{seen}");
    let values: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect();
    let finish = values.iter().find_map(|v| v["choices"][0]["finish_reason"].as_str());
    ensure!(finish == Some("abort"), "finish reason {finish:?}");
    let generated = values.iter().find_map(|v| v["usage"]["completion_tokens"].as_u64());
    ensure!(generated.is_some_and(|n| n > 0 && n < 600), "usage {generated:?}");
    let whole = whole.await??;
    ensure!(whole["choices"][0]["finish_reason"] == "abort", "{whole}");
    ensure!(whole["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0 && n < 600));
    let deadline = Instant::now() + Duration::from_secs(15);
    while server.child.try_wait()?.is_none() {
        ensure!(Instant::now() < deadline, "the engine did not exit after its drain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn wait_running_n(c: &reqwest::Client, server: &Server, n: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h: Value = c.get(server.at("/health")).send().await?.json().await?;
        if h["running"].as_u64().is_some_and(|r| r >= n) {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "the requests never ran together: {h}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads the stream `resp` until `marker` has come, notes `name` in `log` then, and reads the
/// rest of it.
async fn note_when_seen(
    resp: reqwest::Response,
    marker: &str,
    log: &Mutex<Vec<String>>,
    name: String,
) -> anyhow::Result<()> {
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains(marker) {
        let chunk = bytes.next().await.context("the stream ended early")??;
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    log.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push(name);
    while let Some(chunk) = bytes.next().await {
        chunk?;
    }
    Ok(())
}

/// The fair order over HTTP: two running slots taken by a flood and six of its requests
/// waiting, a quiet tenant's request is among the next to start; under `--scheduling fcfs` it
/// starts after all six. An ordering property, not a timing threshold.
#[tokio::test]
async fn a_quiet_tenant_goes_ahead_of_a_floods_backlog() -> anyhow::Result<()> {
    for (policy, fair) in [("fair", true), ("fcfs", false)] {
        let server = Server::start(&["--max-num-seqs", "2", "--scheduling", policy])?;
        let c = client()?;
        let started = Arc::new(Mutex::new(Vec::<String>::new()));
        let send = |name: String, tenant: &'static str| {
            let (c, url, started) = (c.clone(), server.at("/v1/completions"), started.clone());
            tokio::spawn(async move {
                let body = json!({"prompt": "Count slowly.", "max_tokens": 24,
                                  "ignore_eos": true, "stream": true});
                let resp = c.post(url).header("x-sluice-tenant", tenant).json(&body).send().await?;
                ensure!(resp.status() == 200, "{name}: {}", resp.status());
                note_when_seen(resp, "data: ", &started, name).await
            })
        };
        let mut tasks: Vec<_> = (0..8).map(|i| send(format!("flood-{i}"), "flood")).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let h: Value = c.get(server.at("/health")).send().await?.json().await?;
            if h["running"] == 2 && h["waiting"] == 6 {
                break;
            }
            ensure!(Instant::now() < deadline, "the flood never queued: {h}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tasks.push(send("quiet".into(), "quiet"));
        for t in tasks {
            t.await??;
        }
        let order = started.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
        let at = order.iter().position(|n| n == "quiet").context("quiet never started")?;
        if fair {
            // The quiet request starts among the next ones: it takes a place one of the flood's
            // running requests leaves, or one a flood request is preempted for.
            ensure!(at <= 3, "fair: the quiet request started {at}th of 9: {order:?}");
        } else {
            ensure!(at == 8, "fcfs: the quiet request started {at}th of 9: {order:?}");
        }
    }
    Ok(())
}

/// A flood's long prompt does not hold the step: while its prefill goes on in chunks (a budget
/// of 64 tokens a step, some 1,500 tokens), a quiet tenant's prompt, longer than a step's
/// budget and so chunked too, is prefilled first and its first token comes before the
/// flood's; under `--scheduling fcfs` it waits for the long prefill to finish. An ordering
/// property, not a timing threshold.
#[tokio::test]
async fn a_quiet_first_token_comes_before_a_floods_long_prefill_ends() -> anyhow::Result<()> {
    for (policy, fair) in [("fair", true), ("fcfs", false)] {
        let server = Server::start(&["--max-num-batched-tokens", "64", "--scheduling", policy])?;
        let c = client()?;
        let firsts = Arc::new(Mutex::new(Vec::<String>::new()));
        let send = |name: &'static str, words: usize| {
            let (c, url, firsts) = (c.clone(), server.at("/v1/completions"), firsts.clone());
            tokio::spawn(async move {
                let prompt = vec!["river"; words].join(" ");
                let body =
                    json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true, "stream": true});
                let resp = c.post(url).header("x-sluice-tenant", name).json(&body).send().await?;
                ensure!(resp.status() == 200, "{name}: {}", resp.status());
                note_when_seen(resp, "\"text\"", &firsts, name.to_owned()).await
            })
        };
        let flood = send("flood", 1500);
        wait_running_n(&c, &server, 1).await?;
        let quiet = send("quiet", 100);
        flood.await??;
        quiet.await??;
        let order = firsts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
        let expected = if fair { ["quiet", "flood"] } else { ["flood", "quiet"] };
        ensure!(order == expected, "{policy}: first tokens in the order {order:?}");
    }
    Ok(())
}

/// One cap on `n`, agreed: the engine runs every `n` the billing service lets a tier or an
/// override allow (once the enterprise tier allowed 16 and the engine refused past 8).
#[test]
fn the_engine_runs_every_n_a_tier_may_allow() {
    let engine = sluice_engine::server::ServerConfig::default().max_n;
    assert_eq!(i64::try_from(engine).ok(), Some(sluice_billing::control::MAX_N));
    for (name, tier) in sluice_billing::control::TIERS.iter() {
        assert!(tier.max_n.is_some_and(|n| n <= sluice_billing::control::MAX_N), "tier {name}");
    }
}
