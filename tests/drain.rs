//! Shutdown loses nothing: SIGINT to `sluice up` with requests running. Within the drain
//! timeout they finish as if nothing happened; past it, what is left is cancelled (a stream
//! ends with an SSE error event, a whole answer is a 503 with OpenAI's error JSON), and every
//! request has its ledger row with the tokens the engine generated for it.

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use futures_util::StreamExt;
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::query::RecordFilter;
use support::{Up, signal_and_wait, start_up_with, wait_exit};

const MODEL: &str = "smollm2-135m-instruct";

/// What a client saw of one request.
#[derive(Debug, Default)]
struct Seen {
    request_id: String,
    status: u16,
    /// SSE `data:` payloads, in order (streams), or the body (whole answers).
    events: Vec<String>,
}

impl Seen {
    fn json_events(&self) -> Vec<Value> {
        self.events.iter().filter_map(|e| serde_json::from_str(e).ok()).collect()
    }
    /// The engine's usage as the client received it.
    fn usage_tokens(&self) -> Option<u64> {
        self.json_events().iter().rev().find_map(|e| e["usage"]["completion_tokens"].as_u64())
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Client {
    fn new(up: &Up) -> anyhow::Result<Self> {
        let env = up.envs()?;
        let ca = reqwest::Certificate::from_pem(&std::fs::read(&env["SSL_CERT_FILE"])?)?;
        let http = reqwest::Client::builder()
            .add_root_certificate(ca)
            .timeout(Duration::from_secs(120))
            .build()?;
        Ok(Self { http, base: env["OPENAI_BASE_URL"].clone(), key: env["OPENAI_API_KEY"].clone() })
    }

    /// Starts a request; for streams, returns once its first event arrived, with a task
    /// reading the rest.
    async fn start(
        &self,
        stream: bool,
        max_tokens: u64,
    ) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<Seen>>> {
        let mut body = json!({"model": MODEL, "prompt": "Tell me a long story.",
            "max_tokens": max_tokens, "ignore_eos": true, "stream": stream});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let req =
            self.http.post(format!("{}/completions", self.base)).bearer_auth(&self.key).json(&body);
        if !stream {
            return Ok(tokio::spawn(async move {
                let r = req.send().await?;
                let request_id = header_id(&r);
                let status = r.status().as_u16();
                Ok(Seen { request_id, status, events: vec![r.text().await?] })
            }));
        }
        let r = req.send().await?;
        let mut seen =
            Seen { request_id: header_id(&r), status: r.status().as_u16(), ..Seen::default() };
        let mut body = r.bytes_stream();
        let mut buf = String::new();
        // The first event, then the rest in the background.
        while seen.events.is_empty() {
            let chunk = body.next().await.context("the stream ended before its first event")??;
            buf.push_str(std::str::from_utf8(&chunk)?);
            take_events(&mut buf, &mut seen.events);
        }
        Ok(tokio::spawn(async move {
            while let Some(chunk) = body.next().await {
                buf.push_str(std::str::from_utf8(&chunk?)?);
                take_events(&mut buf, &mut seen.events);
            }
            Ok(seen)
        }))
    }
}

fn header_id(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-sluice-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn take_events(buf: &mut String, out: &mut Vec<String>) {
    while let Some(end) = buf.find("\n\n") {
        let event: String = buf.drain(..end + 2).collect();
        if let Some(data) = event.trim().strip_prefix("data: ") {
            out.push(data.to_owned());
        }
    }
}

async fn ledger_rows(up: &Up) -> anyhow::Result<HashMap<String, serde_json::Map<String, Value>>> {
    let ledger =
        Ledger::connect(&format!("sqlite://{}", up.dir.join("ledger.db").display())).await?;
    let page = ledger.records(&RecordFilter { limit: 1000, ..Default::default() }).await?;
    ledger.close().await;
    Ok(page
        .records
        .into_iter()
        .map(|r| (r["request_id"].as_str().unwrap_or_default().to_owned(), r))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_requests_finish_within_the_drain_timeout() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut up = start_up_with(tmp.path(), &["--kv-cache-mb", "128", "--drain-timeout", "60"])?;
    let c = Client::new(&up)?;
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(c.start(true, 120).await?);
    }
    let sent = Command::new("kill").args(["-INT", &up.child.id().to_string()]).status()?;
    ensure!(sent.success());
    // While it drains, new requests are refused (nothing runs, nothing is billed).
    let deadline = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        let r = c.http.get(format!("{}/models", c.base)).bearer_auth(&c.key).send().await?;
        if r.status() == 503 {
            break r.json::<Value>().await?;
        }
        ensure!(Instant::now() < deadline, "new requests still admitted 20 s after SIGINT");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(refused["error"]["code"] == "shutting_down", "{refused}");
    // A generation refused meanwhile is the tenant's request: it has its row, free.
    let r = c
        .http
        .post(format!("{}/completions", c.base))
        .bearer_auth(&c.key)
        .json(&json!({"model": MODEL, "prompt": "Hi", "max_tokens": 4}))
        .send()
        .await?;
    let refused_id = header_id(&r);
    ensure!(r.status() == 503, "a generation while draining: {}", r.status());
    let mut seen = Vec::new();
    for r in running {
        seen.push(r.await??);
    }
    let status = wait_exit(&mut up.child, Duration::from_secs(60), "INT")?;
    ensure!(status.success(), "sluice up exited with {status}");
    let mut rows = ledger_rows(&up).await?;
    let refused_row = rows.remove(&refused_id).context("no row for the refused generation")?;
    ensure!(
        refused_row["http_status"] == 503
            && refused_row["cost_micros"] == 0
            && refused_row["completion_tokens"] == 0,
        "{refused_row:?}"
    );
    ensure!(rows.len() == 3, "{} rows for 3 requests: {rows:?}", rows.len());
    for s in &seen {
        ensure!(s.status == 200 && s.events.last().map(String::as_str) == Some("[DONE]"), "{s:?}");
        // An error event is one with a top-level `error` (the model's text may say "error").
        ensure!(!s.json_events().iter().any(|e| e.get("error").is_some()), "an error event: {s:?}");
        let r = rows.get(&s.request_id).context("no row")?;
        ensure!(r["finish_reason"] == "length" && r["completion_tokens"] == 120, "{r:?}");
        ensure!(s.usage_tokens() == Some(120), "{s:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_outlasts_the_drain_is_cancelled_and_billed() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut up = start_up_with(tmp.path(), &["--kv-cache-mb", "256", "--drain-timeout", "1"])?;
    let c = Client::new(&up)?;
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(c.start(false, 1500).await?);
    }
    for _ in 0..5 {
        running.push(c.start(true, 1500).await?);
    }
    let status = signal_and_wait(&mut up.child, "INT", Duration::from_secs(40))?;
    ensure!(status.success(), "sluice up exited with {status}");
    let mut seen = Vec::new();
    for r in running {
        seen.push(r.await??);
    }
    let rows = ledger_rows(&up).await?;
    ensure!(rows.len() == 8, "{} rows for 8 requests", rows.len());
    for (i, s) in seen.iter().enumerate() {
        let r = rows.get(&s.request_id).with_context(|| format!("no row for {s:?}"))?;
        ensure!(
            r["finish_reason"] == "error" && r["error_type"] == "cancelled_at_shutdown",
            "{r:?}"
        );
        ensure!(
            r["http_status"] == s.status,
            "row {} for a client that got {}",
            r["http_status"],
            s.status
        );
        let billed = r["completion_tokens"].as_u64().context("tokens")?;
        ensure!(billed > 0 && billed < 1500, "{r:?}");
        let last: Value = serde_json::from_str(
            s.events.iter().rev().find(|e| e.as_str() != "[DONE]").context("no event")?,
        )?;
        ensure!(last["error"]["code"] == "shutting_down", "{i}: the last event: {last}");
        if i < 3 {
            // A whole answer: a 503 with the error, free (it never reached the client).
            ensure!(s.status == 503 && r["cost_micros"] == 0, "{s:?} {r:?}");
        } else {
            // A stream: served until cancelled, billed for the engine's count, which its
            // final usage chunk told the client too; then the error event and [DONE].
            ensure!(s.status == 200 && s.events.last().map(String::as_str) == Some("[DONE]"));
            ensure!(
                s.usage_tokens() == Some(billed),
                "client {:?} billed {billed}",
                s.usage_tokens()
            );
            ensure!(r["cost_micros"].as_u64().is_some_and(|c| c > 0), "{r:?}");
        }
    }
    Ok(())
}
