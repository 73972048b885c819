//! `sluice bench serve`: an open-loop load generator against any OpenAI-compatible endpoint
//! (our gateway or engine, vLLM, llama.cpp). The send schedule is generated whole from a seed
//! before the run; every latency is measured from a request's scheduled send, so a client that
//! falls behind shows up as latency (and as send lateness) instead of hiding it.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use crate::arrivals::{Arrival, schedule};
use crate::metrics::{Dist, Outcome, Slo, Summary, summarize};
use crate::svg::{Series, cdf, line_chart};
use crate::workload::{Content, Lengths, Request, Workload, generate, parse_sharegpt};
use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};
use sluice_text::stream::{SseParser, tokens_carried};
use sluice_wire::header as internal;

/// `sluice bench serve`.
#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Server base URL (`.../v1` is appended when missing).
    #[arg(long)]
    pub(crate) base_url: String,
    /// API key (Authorization: Bearer).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model name to send.
    #[arg(long)]
    model: Option<String>,
    /// `chat` or `completions`.
    #[arg(long, default_value = "completions")]
    endpoint: String,
    /// Requests to send (in the measured window, warm-up excluded).
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    /// Offered requests per second (`inf`: all at once).
    #[arg(long, default_value = "inf")]
    pub(crate) request_rate: f64,
    /// Gamma shape of the gaps (1 = Poisson).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Most requests in flight (sends wait for a slot; the wait counts as latency unless
    /// --from-send).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Time each request from when it is sent, after any wait for a --max-concurrency slot,
    /// not from its place in the schedule: a closed loop's latencies (as vLLM's benchmark
    /// reports them), where the client's own queue is not the server's time.
    #[arg(long)]
    from_send: bool,
    /// Prompt length in tokens: `N`, `uniform:LO:HI`, `normal:MEAN:SD`,
    /// `lognormal:MEDIAN:SIGMA` or `file:PATH` (lengths, whitespace-separated). Completions
    /// send token ids; chat sends that many words.
    #[arg(long, default_value = "128")]
    input_len: String,
    /// Output tokens per request (end-of-sequence ignored), same forms as --input-len.
    #[arg(long, default_value = "128")]
    output_len: String,
    /// `random`, `shared-prefix`, `multi-turn` or `sharegpt` (with --dataset).
    #[arg(long, default_value = "random")]
    workload: String,
    /// shared-prefix: distinct prefixes.
    #[arg(long, default_value_t = 8)]
    prefixes: usize,
    /// shared-prefix: tokens per prefix.
    #[arg(long, default_value_t = 256)]
    prefix_len: usize,
    /// multi-turn: conversations.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// sharegpt: the ShareGPT-format JSON file.
    #[arg(long)]
    dataset: Option<std::path::PathBuf>,
    /// Several tenants at once: a JSON array of `{"name", "api_key" | "api_key_env",
    /// "request_rate", "burstiness", "num_prompts", "input_len", "output_len", "workload"}`
    /// (fields left out take the command line's values); each gets its own schedule.
    #[arg(long)]
    pub(crate) mix: Option<std::path::PathBuf>,
    /// A mix given in memory (a named scenario's, its keys included): read as `--mix`'s file
    /// is, under the label `scenario NAME`.
    #[arg(skip)]
    pub(crate) mix_entries: Option<(String, Vec<Value>)>,
    /// Makes the prompts' first tokens this run's own ([`crate::workload::salt`]): the phases
    /// of an isolation run offer the same requests without hitting each other's prefix cache.
    #[arg(skip)]
    pub(crate) prompt_salt: Option<u64>,
    /// Requests sent one at a time before the window, and left out of every figure.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Seconds of load: sets --num-prompts to rate x duration (per tenant).
    #[arg(long)]
    pub(crate) duration: Option<f64>,
    /// Seconds over which the rate rises linearly from 0 to --request-rate.
    #[arg(long, default_value_t = 0.0)]
    ramp_up: f64,
    /// Ask for whole responses instead of streams (no TTFT: recorded as absent).
    #[arg(long)]
    no_stream: bool,
    /// SLO thresholds for goodput, e.g. `ttft:500,tpot:50,e2el:10000` (milliseconds).
    #[arg(long)]
    pub(crate) goodput: Option<String>,
    /// Seed of the schedule and the prompts.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Write the JSON result here.
    #[arg(long)]
    pub(crate) save_result: Option<std::path::PathBuf>,
    /// Include per-request arrays in the JSON result.
    #[arg(long)]
    save_detailed: bool,
    /// Write a Markdown report with the experiment's identity here.
    #[arg(long)]
    report: Option<std::path::PathBuf>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Write SVG plots (latency CDFs) into this directory.
    #[arg(long)]
    plots: Option<std::path::PathBuf>,
    /// Sluice's admin API: the gateway's own records of the same requests are fetched from
    /// it and their TTFT put beside the client's.
    #[arg(long, env = "SLUICE_ADMIN_URL")]
    pub(crate) records_url: Option<String>,
    /// Token with the auditor role for --records-url.
    #[arg(long, env = "SLUICE_AUDITOR_TOKEN", hide_env_values = true)]
    records_token: Option<String>,
    /// More gateways of the same platform: requests are spread over --base-url and these in
    /// turn, and a retried request goes to the next one.
    #[arg(long = "failover-url", value_name = "URL")]
    pub(crate) failover_urls: Vec<String>,
    /// Each request carries an `Idempotency-Key` and is retried with it, the same body, up to
    /// N times (on the next gateway, after 0.25 s doubling to 2 s) when it failed in a way a
    /// client should retry: no connection, 409 (the first try still running), 429 with a
    /// Retry-After (after what it says, at most 10 s), 502, 503, 504, or a stream broken off or
    /// ended by an error event. Figures are the last try's, timed
    /// from the schedule.
    #[arg(long, default_value_t = 0, value_name = "N")]
    idempotent_retries: u32,
    /// Write one JSON line per request here: its index, stream or not, Idempotency-Key, and
    /// every try's URL, status, request id, error code and tokens received (to reconcile a
    /// ledger by request id).
    #[arg(long, value_name = "FILE")]
    requests_log: Option<std::path::PathBuf>,
    /// An extra header on every request, `NAME:VALUE` (repeatable): e.g. `x-sluice-tenant:a`
    /// to load an engine directly as one tenant, whose prompts then share its prefix cache.
    #[arg(long = "header", value_name = "NAME:VALUE")]
    headers: Vec<String>,
}

pub(crate) fn parse_slo(s: Option<&str>) -> anyhow::Result<Slo> {
    let mut slo = Slo::default();
    for part in s.unwrap_or("").split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once(':').context("--goodput takes NAME:MS pairs")?;
        let v: f64 = v.parse().with_context(|| format!("--goodput {k}: {v:?} is not a number"))?;
        match k {
            "ttft" => slo.ttft_ms = Some(v),
            "tpot" => slo.tpot_ms = Some(v),
            "e2el" => slo.e2el_ms = Some(v),
            _ => bail!("--goodput: unknown metric {k:?} (ttft, tpot, e2el)"),
        }
    }
    Ok(slo)
}

/// A length distribution from the command line or a mix file (`file:PATH` read here).
fn lengths(flag: &str, spec: &str) -> anyhow::Result<Lengths> {
    if let Some(path) = spec.strip_prefix("file:") {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("{flag}: reading {path}"))?;
        let v: Vec<usize> = text
            .split_whitespace()
            .map(|w| w.parse::<usize>().ok().filter(|n| *n >= 1))
            .collect::<Option<_>>()
            .with_context(|| format!("{flag}: {path} must hold whole numbers >= 1"))?;
        if v.is_empty() {
            bail!("{flag}: {path} holds no lengths");
        }
        return Ok(Lengths::Sample(v));
    }
    Lengths::parse(spec).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

/// One tenant of the load: its key, schedule and workload.
#[derive(Clone, Debug)]
struct Tenant {
    name: String,
    key: Option<String>,
    rate: f64,
    burstiness: f64,
    num: usize,
    workload: Workload,
    workload_name: String,
    input: Lengths,
    output: Lengths,
    input_spec: String,
    output_spec: String,
}

fn workload(args: &BenchServeArgs, name: &str) -> anyhow::Result<Workload> {
    Ok(match name {
        "random" => Workload::Random,
        "shared-prefix" => {
            Workload::SharedPrefix { prefixes: args.prefixes, prefix_len: args.prefix_len }
        }
        "multi-turn" => Workload::MultiTurn { sessions: args.sessions, turns: args.turns },
        "sharegpt" => {
            let path = args.dataset.as_ref().context("--workload sharegpt needs --dataset FILE")?;
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--dataset: reading {}", path.display()))?;
            Workload::ShareGpt(
                parse_sharegpt(&text)
                    .map_err(|e| anyhow::anyhow!("--dataset {}: {e}", path.display()))?,
            )
        }
        other => {
            bail!("--workload: {other:?} is not random, shared-prefix, multi-turn or sharegpt")
        }
    })
}

/// The tenants of the run: the command line's one, or the mix file's.
fn tenants(args: &BenchServeArgs) -> anyhow::Result<Vec<Tenant>> {
    let count = |rate: f64, num: usize| -> anyhow::Result<usize> {
        match args.duration {
            Some(d) if rate.is_finite() && rate > 0.0 && d > 0.0 => Ok((rate * d).ceil() as usize),
            Some(_) => bail!("--duration needs a finite, positive rate and duration"),
            None => Ok(num),
        }
    };
    let base = Tenant {
        name: "default".into(),
        key: args.api_key.clone(),
        rate: args.request_rate,
        burstiness: args.burstiness,
        num: count(args.request_rate, args.num_prompts)?,
        workload: workload(args, &args.workload)?,
        workload_name: args.workload.clone(),
        input: lengths("--input-len", &args.input_len)?,
        output: lengths("--output-len", &args.output_len)?,
        input_spec: args.input_len.clone(),
        output_spec: args.output_len.clone(),
    };
    let label: String;
    let read: Value;
    let entries = match (&args.mix_entries, &args.mix) {
        (Some((name, entries)), _) => {
            label = name.clone();
            entries
        }
        (None, Some(path)) => {
            label = format!("--mix {}", path.display());
            let text =
                std::fs::read_to_string(path).with_context(|| format!("{label}: reading"))?;
            let v: Value =
                serde_json::from_str(&text).with_context(|| format!("{label}: not JSON"))?;
            read = v;
            read.as_array().with_context(|| format!("{label}: must be a JSON array"))?
        }
        (None, None) => return Ok(vec![base]),
    };
    let what = || label.clone();
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let field = |k: &str| format!("{} entry {i}: {k}", what());
        let known = [
            "name",
            "api_key",
            "api_key_env",
            "request_rate",
            "burstiness",
            "num_prompts",
            "input_len",
            "output_len",
            "workload",
        ];
        let obj = e.as_object().with_context(|| field("must be an object"))?;
        if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
            bail!("{}", field(&format!("unknown field {k:?}")));
        }
        let text = |k: &str| -> anyhow::Result<Option<String>> {
            match obj.get(k) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Number(n)) if k.ends_with("_len") => Ok(Some(n.to_string())),
                Some(_) => bail!("{}", field(&format!("{k} must be a string"))),
            }
        };
        let num = |k: &str| -> anyhow::Result<Option<f64>> {
            match obj.get(k) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| *x > 0.0)
                    .map(Some)
                    .with_context(|| field(&format!("{k} must be a positive number"))),
            }
        };
        let mut t = base.clone();
        t.name = text("name")?.unwrap_or_else(|| format!("tenant-{i}"));
        if let Some(k) = text("api_key")? {
            t.key = Some(k);
        }
        if let Some(var) = text("api_key_env")? {
            t.key =
                Some(std::env::var(&var).with_context(|| field(&format!("${var} is not set")))?);
        }
        t.rate = num("request_rate")?.unwrap_or(t.rate);
        t.burstiness = num("burstiness")?.unwrap_or(t.burstiness);
        let n = num("num_prompts")?.map_or(args.num_prompts, |n| n as usize);
        t.num = count(t.rate, n)?;
        if let Some(w) = text("workload")? {
            t.workload = workload(args, &w)?;
            t.workload_name = w;
        }
        if let Some(spec) = text("input_len")? {
            t.input = lengths(&field("input_len"), &spec)?;
            t.input_spec = spec;
        }
        if let Some(spec) = text("output_len")? {
            t.output = lengths(&field("output_len"), &spec)?;
            t.output_spec = spec;
        }
        out.push(t);
    }
    if out.is_empty() {
        bail!("{}: lists no tenant", what());
    }
    Ok(out)
}

/// Stretches a constant-rate schedule so the rate rises linearly from 0 over `ramp` seconds:
/// with cumulative arrivals R t^2 / 2S during the ramp and R (t - S/2) after it, the request
/// due at `tau` at the full rate is sent at sqrt(2 S tau), or tau + S/2 once past the ramp.
fn ramp(times: &mut [f64], ramp: f64) {
    if ramp <= 0.0 {
        return;
    }
    for t in times.iter_mut() {
        *t = if *t < ramp / 2.0 { (2.0 * ramp * *t).sqrt() } else { *t + ramp / 2.0 };
    }
}

/// The prompt tokens a server's prefix cache served, from its `usage`
/// (`prompt_tokens_details.cached_tokens`; 0 when it does not say).
fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

/// One request's body: its turns as chat messages, or concatenated into one prompt.
fn body(req: &Request, chat: bool, stream: bool, model: &str) -> Value {
    let mut b = if chat {
        let messages: Vec<Value> = req
            .turns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let text = match c {
                    Content::Text(t) => t.clone(),
                    Content::Tokens(t) => {
                        t.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
                    }
                };
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": text})
            })
            .collect();
        json!({"messages": messages})
    } else {
        let tokens: Vec<u64> = req
            .turns
            .iter()
            .flat_map(|c| match c {
                Content::Tokens(t) => t.clone(),
                Content::Text(_) => Vec::new(),
            })
            .collect();
        let texts: Vec<&str> = req
            .turns
            .iter()
            .filter_map(|c| match c {
                Content::Text(t) => Some(t.as_str()),
                Content::Tokens(_) => None,
            })
            .collect();
        if texts.is_empty() {
            json!({"prompt": tokens})
        } else {
            json!({"prompt": texts.join("\n")})
        }
    };
    b["model"] = json!(model);
    b["max_tokens"] = json!(req.output_len);
    b["stream"] = json!(stream);
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b["ignore_eos"] = json!(true);
    b["temperature"] = json!(0.0);
    b
}

/// What came back beside the measurements.
#[derive(Clone, Debug, Default)]
struct Extra {
    request_id: Option<String>,
    model_revision: Option<String>,
    identity: Option<String>,
    status: Option<u16>,
    /// The OpenAI error `code` of an error answer or of a stream's error event.
    error_code: Option<String>,
    /// The answer's `Retry-After`, in seconds (a 429 or 503 that says when to come back).
    retry_after: Option<u64>,
    /// The server's `usage.completion_tokens`, when it sent one.
    usage_tokens: Option<u64>,
    /// Every try, as `--requests-log` writes them (the last one is this).
    tries: Vec<Value>,
    idempotency_key: Option<String>,
}

impl Extra {
    fn record(&self, url: &str, o: &Outcome) -> Value {
        json!({
            "url": url, "status": self.status, "request_id": self.request_id,
            "error": o.error, "error_code": self.error_code, "ok": o.ok,
            "usage_tokens": self.usage_tokens, "streamed_tokens": o.streamed_tokens(),
        })
    }

    /// Whether a client should retry this try with the same Idempotency-Key. A 429 is retried
    /// when it says when to come back (`Retry-After`: a share or a rate that frees); one that
    /// does not is final.
    fn retryable(&self, o: &Outcome) -> bool {
        match self.status {
            None => !o.timed_out,
            Some(409 | 502 | 503 | 504) => true,
            Some(429) => self.retry_after.is_some(),
            Some(200) => !o.ok && !o.timed_out,
            Some(_) => false,
        }
    }
}

/// The longest `Retry-After` a retrying client waits: a longer one (a quota's window) is
/// capped, so a run ends.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// Sends one planned request, with retries under one Idempotency-Key when `retries` > 0:
/// try `k` goes to `urls[(first + k) % len]`.
#[expect(clippy::too_many_arguments, reason = "one request's whole description")]
async fn send_with_retries(
    c: &reqwest::Client,
    urls: &[String],
    first: usize,
    key: Option<&str>,
    body: Value,
    scheduled: tokio::time::Instant,
    retries: u32,
    idempotency_key: Option<String>,
) -> (Outcome, Extra) {
    let mut tries = Vec::new();
    let mut delay = Duration::from_millis(250);
    let mut k = 0;
    loop {
        let url = &urls[(first + k) % urls.len()];
        let (o, mut extra) =
            one(c, url, key, idempotency_key.as_deref(), body.clone(), scheduled).await;
        tries.push(extra.record(url, &o));
        if k as u32 >= retries || !extra.retryable(&o) {
            extra.tries = tries;
            extra.idempotency_key = idempotency_key;
            return (o, extra);
        }
        // The server's Retry-After where it gave one (at most MAX_RETRY_AFTER), else the
        // backoff.
        let asked = extra.retry_after.map(|s| Duration::from_secs(s).min(MAX_RETRY_AFTER));
        tokio::time::sleep(asked.unwrap_or(delay).max(delay)).await;
        delay = (delay * 2).min(Duration::from_secs(2));
        k += 1;
    }
}

async fn one(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    idempotency_key: Option<&str>,
    body: Value,
    scheduled: tokio::time::Instant,
) -> (Outcome, Extra) {
    let mut o = Outcome::default();
    let mut extra = Extra::default();
    let now = tokio::time::Instant::now();
    o.lateness_s = now.saturating_duration_since(scheduled).as_secs_f64();
    let stream = body["stream"].as_bool().unwrap_or(false);
    let mut req = c.post(url).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    if let Some(k) = idempotency_key {
        req = req.header("idempotency-key", k);
    }
    let elapsed = |i: tokio::time::Instant| i.saturating_duration_since(scheduled).as_secs_f64();
    let fail = |o: &mut Outcome, e: reqwest::Error, what: &str| {
        o.timed_out = e.is_timeout();
        o.error = Some(if o.timed_out { "timeout".into() } else { format!("{what}: {e}") });
        o.end_s = elapsed(tokio::time::Instant::now());
    };
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            fail(&mut o, e, "request failed");
            return (o, extra);
        }
    };
    let header =
        |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    extra.request_id = header(internal::REQUEST_ID);
    extra.model_revision = header(internal::MODEL_REVISION);
    extra.identity = header(internal::EXECUTION_IDENTITY);
    extra.retry_after = header("retry-after").and_then(|v| v.trim().parse().ok());
    let status = resp.status().as_u16();
    extra.status = Some(status);
    if status == 429 || status == 503 {
        o.rejected = true;
    }
    if !resp.status().is_success() {
        o.error = Some(format!("http {status}"));
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        extra.error_code = body["error"]["code"].as_str().map(str::to_owned);
        o.end_s = elapsed(tokio::time::Instant::now());
        return (o, extra);
    }
    if !stream {
        // A whole response: no observable first token (absent, not E2E).
        match resp.bytes().await {
            Ok(b) => {
                o.end_s = elapsed(tokio::time::Instant::now());
                match serde_json::from_slice::<Value>(&b) {
                    Ok(v) => {
                        o.input_len = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                        o.cached_len = cached_tokens(&v["usage"]);
                        o.output_len = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        extra.usage_tokens = v["usage"]["completion_tokens"].as_u64();
                        o.ok = true;
                    }
                    Err(e) => o.error = Some(format!("not JSON: {e}")),
                }
            }
            Err(e) => fail(&mut o, e, "body broke"),
        }
        return (o, extra);
    }
    let mut parser = SseParser::default();
    let mut stream = resp;
    let mut done = false;
    loop {
        match stream.chunk().await {
            Ok(Some(bytes)) => {
                let now = elapsed(tokio::time::Instant::now());
                for data in parser.feed(&bytes) {
                    if data.trim() == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let Ok(v) = serde_json::from_str::<Value>(&data) else { continue };
                    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                        o.input_len = u["prompt_tokens"].as_u64().unwrap_or(0);
                        o.cached_len = cached_tokens(u);
                        o.output_len = u["completion_tokens"].as_u64().unwrap_or(0);
                        extra.usage_tokens = u["completion_tokens"].as_u64();
                    }
                    // An error event ends the answer short (the server failed mid-stream).
                    if let Some(e) = v.get("error") {
                        extra.error_code = e["code"].as_str().map(str::to_owned);
                        o.error = Some(format!(
                            "error event: {}",
                            extra.error_code.as_deref().unwrap_or("no code")
                        ));
                    }
                    let k = tokens_carried(&v);
                    if k > 0 {
                        o.events.push(now, k);
                    }
                }
            }
            Ok(None) => break,
            Err(e) => {
                fail(&mut o, e, "stream broke");
                break;
            }
        }
    }
    o.end_s = elapsed(tokio::time::Instant::now());
    if o.output_len == 0 {
        o.output_len = o.streamed_tokens();
    }
    o.ok = o.error.is_none() && done;
    if !done && o.error.is_none() {
        o.error = Some("stream ended without [DONE]".into());
    }
    (o, extra)
}

/// Counters and gauges of the server's Prometheus endpoint worth putting beside the client's
/// numbers (Sluice's `sluice_engine_*`/`sluice_gateway_*` and vLLM's `vllm:*` names).
async fn scrape(c: &reqwest::Client, url: &str) -> Option<std::collections::BTreeMap<String, f64>> {
    let text = c.get(url).send().await.ok()?.text().await.ok()?;
    let wanted = [
        "preemptions",
        "prefix_cache",
        "prompt_tokens",
        "generation_tokens",
        "num_requests",
        "kv_cache_usage",
        "device_",
    ];
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        if wanted.iter().any(|w| name.contains(w))
            && !name.contains("_bucket")
            && let Ok(v) = value.parse::<f64>()
        {
            *out.entry(name.to_owned()).or_default() += v;
        }
    }
    Some(out)
}

/// `--header NAME:VALUE` flags as a header map.
fn extra_headers(flags: &[String]) -> anyhow::Result<reqwest::header::HeaderMap> {
    use reqwest::header::{HeaderName, HeaderValue};
    let mut map = reqwest::header::HeaderMap::new();
    for flag in flags {
        let (name, value) = flag
            .split_once(':')
            .with_context(|| format!("--header {flag:?}: expected NAME:VALUE"))?;
        let name = HeaderName::from_bytes(name.trim().as_bytes())
            .with_context(|| format!("--header {flag:?}: {name:?} is not a header name"))?;
        let value = HeaderValue::from_str(value.trim())
            .with_context(|| format!("--header {flag:?}: the value is not a header value"))?;
        map.append(name, value);
    }
    Ok(map)
}

/// How much of the time the engine's device had work it spent between passes (Sluice's
/// `sluice_engine_device_*` counters over the run).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DeviceIdle {
    /// Gap time over gap and pass time.
    pub share: f64,
    /// Mean gap between consecutive passes, ms.
    pub gap_ms: f64,
    /// Mean pass, ms.
    pub pass_ms: f64,
}

/// [`DeviceIdle`] from the run's server metrics (deltas), when the server reports them.
pub fn device_idle(server: &std::collections::BTreeMap<String, f64>) -> Option<DeviceIdle> {
    let get = |name: &str| server.iter().find(|(k, _)| k.ends_with(name)).map(|(_, v)| *v);
    let busy = get("engine_device_busy_seconds_total")?;
    let gap = get("engine_device_gap_seconds_total")?;
    let gaps = get("engine_device_gaps_total")?;
    let passes = get("engine_device_passes_total")?;
    (busy + gap > 0.0).then(|| DeviceIdle {
        share: gap / (busy + gap),
        gap_ms: 1e3 * gap / gaps.max(1.0),
        pass_ms: 1e3 * busy / passes.max(1.0),
    })
}

/// One planned request of the measured window.
struct Planned {
    tenant: usize,
    at: f64,
    req: Request,
}

/// Upper bounds of the input-length buckets (tokens); the last bucket is open.
const BUCKETS: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];

fn bucket(input_len: usize) -> String {
    let mut lo = 1;
    for hi in BUCKETS {
        if input_len <= hi {
            return format!("{lo}-{hi}");
        }
        lo = hi + 1;
    }
    format!(">{}", BUCKETS[BUCKETS.len() - 1])
}

/// What the run learned about the target and this client.
#[derive(Debug, Default, serde::Serialize)]
struct Identity {
    model_id: String,
    model_revision: Option<String>,
    execution_identity: Option<Value>,
    client_host: String,
    client_cpu: String,
    client_cores: usize,
    sluice_version: String,
    started_at: String,
}

fn identity(
    model: &str,
    first: Option<&Extra>,
    started: chrono::DateTime<chrono::Utc>,
) -> Identity {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    Identity {
        model_id: model.to_owned(),
        model_revision: first.and_then(|e| e.model_revision.clone()),
        execution_identity: first
            .and_then(|e| e.identity.as_deref())
            .map(|i| serde_json::from_str(i).unwrap_or_else(|_| Value::from(i))),
        client_host: std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default(),
        client_cpu: cpu,
        client_cores: std::thread::available_parallelism().map_or(1, usize::from),
        sluice_version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at: started.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    }
}

/// The gateway's records of these request ids (TTFT and E2E, ms) from Sluice's admin API.
async fn gateway_records(
    c: &reqwest::Client,
    url: &str,
    token: &str,
    since: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<std::collections::HashMap<String, (Option<f64>, Option<f64>)>> {
    let mut out = std::collections::HashMap::new();
    let mut cursor: Option<String> = None;
    let since = since.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    for _ in 0..100 {
        let mut q = vec![("since", since.clone()), ("limit", "10000".to_owned())];
        if let Some(c) = &cursor {
            q.push(("cursor", c.clone()));
        }
        let resp = c
            .get(format!("{}/v1/records", url.trim_end_matches('/')))
            .bearer_auth(token)
            .query(&q)
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!("GET /v1/records: {} {}", resp.status(), resp.text().await.unwrap_or_default());
        }
        let page: Value = resp.json().await?;
        for r in page["records"].as_array().into_iter().flatten() {
            if let Some(id) = r["request_id"].as_str() {
                out.insert(id.to_owned(), (r["ttft_ms"].as_f64(), r["e2e_ms"].as_f64()));
            }
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    Ok(out)
}

/// One measured run: the aggregates, the JSON result and what the terminal summary shows.
pub struct Run {
    /// The whole window's aggregates.
    pub summary: Summary,
    /// The JSON result (vLLM's field names and ours).
    pub result: Value,
    /// Every request of the window.
    pub outcomes: Vec<Outcome>,
    tenants: Vec<Tenant>,
    /// Each tenant's aggregates, in the mix's order (empty with one tenant).
    pub per_tenant: Vec<(String, Summary)>,
    /// Aggregates per input-length bucket, shortest first.
    pub buckets: Vec<(String, Summary)>,
    /// The server's metrics over the run: counters as deltas, gauges at the end.
    pub server: std::collections::BTreeMap<String, f64>,
    /// The engine's device idle between passes over the run, when the server reports it.
    pub device_idle: Option<DeviceIdle>,
}

/// Plans, sends and measures one run (`quiet`: no progress bar).
pub fn measure(args: &BenchServeArgs, quiet: bool) -> anyhow::Result<Run> {
    measure_tenants(args, None, quiet)
}

/// The tenants of the run, by name, in the mix's order.
pub fn tenant_names(args: &BenchServeArgs) -> anyhow::Result<Vec<String>> {
    Ok(tenants(args)?.into_iter().map(|t| t.name).collect())
}

/// As [`measure`], with only the mix's tenant `only` when given: its schedule and requests are
/// the ones it has in the whole mix (the same seed), so a run alone and a run together offer
/// it the same load.
pub fn measure_tenants(
    args: &BenchServeArgs,
    only: Option<usize>,
    quiet: bool,
) -> anyhow::Result<Run> {
    if args.endpoint != "chat" && args.endpoint != "completions" {
        bail!("--endpoint must be chat or completions");
    }
    if args.num_prompts == 0 {
        bail!("--num-prompts must be positive");
    }
    if !(args.ramp_up.is_finite() && args.ramp_up >= 0.0) {
        bail!("--ramp-up must be a non-negative number of seconds");
    }
    let slo = parse_slo(args.goodput.as_deref())?;
    // Each tenant keeps its index in the mix: its seed comes from it.
    let (indices, tenants): (Vec<usize>, Vec<Tenant>) = tenants(args)?
        .into_iter()
        .enumerate()
        .filter(|(i, _)| only.is_none_or(|o| o == *i))
        .unzip();
    if tenants.is_empty() {
        bail!("the mix has no tenant {}", only.unwrap_or_default());
    }
    let chat = args.endpoint == "chat";
    let stream = !args.no_stream;
    let base = args.base_url.trim_end_matches('/');
    let base = if base.ends_with("/v1") { base.to_owned() } else { format!("{base}/v1") };
    let route = if chat { "chat/completions" } else { "completions" };
    let url = format!("{base}/{route}");
    let urls: Vec<String> = std::iter::once(url.clone())
        .chain(args.failover_urls.iter().map(|u| {
            let u = u.trim_end_matches('/');
            if u.ends_with("/v1") { format!("{u}/{route}") } else { format!("{u}/v1/{route}") }
        }))
        .collect();
    // The whole plan, before anything is sent: each tenant's schedule and requests.
    let mut plan = Vec::new();
    let mut schedules = Vec::new();
    for (i, (t, index)) in tenants.iter().zip(&indices).enumerate() {
        let seed = args.seed ^ (*index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut times = schedule(Arrival::Gamma { burstiness: t.burstiness }, t.rate, t.num, seed);
        ramp(&mut times, args.ramp_up);
        let mut reqs = generate(&t.workload, t.num, &t.input, &t.output, chat, seed ^ 0x5eed);
        if let Some(s) = args.prompt_salt {
            crate::workload::salt(&mut reqs, s);
        }
        schedules.push(times.clone());
        plan.extend(times.into_iter().zip(reqs).map(|(at, req)| Planned { tenant: i, at, req }));
    }
    plan.sort_by(|a, b| a.at.total_cmp(&b.at));
    let warmups = generate(
        &tenants[0].workload,
        args.warmup,
        &tenants[0].input,
        &tenants[0].output,
        chat,
        args.seed ^ 0x3a3a,
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout))
        .pool_max_idle_per_host(1024)
        .default_headers(extra_headers(&args.headers)?);
    if let Ok(ca) = std::env::var("SSL_CERT_FILE") {
        let pem = std::fs::read(&ca).with_context(|| format!("reading SSL_CERT_FILE {ca}"))?;
        builder = builder.add_root_certificate(reqwest::Certificate::from_pem(&pem)?);
    }
    let client = builder.build()?;
    let started = chrono::Utc::now();
    let (results, model, server, gateway) = rt.block_on(async {
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let mut req = client.get(format!("{base}/models"));
                if let Some(k) = &tenants[0].key {
                    req = req.bearer_auth(k);
                }
                let resp = req.send().await.context("GET /v1/models")?;
                let status = resp.status();
                let v: Value = resp.json().await.context("GET /v1/models: not JSON")?;
                if !status.is_success() {
                    bail!("GET /v1/models: {status}: {v}");
                }
                v["data"][0]["id"]
                    .as_str()
                    .context("the server lists no model; pass --model")?
                    .to_owned()
            }
        };
        for (i, w) in warmups.iter().enumerate() {
            let (o, _) = one(
                &client,
                &url,
                tenants[0].key.as_deref(),
                None,
                body(w, chat, stream, &model),
                tokio::time::Instant::now(),
            )
            .await;
            if let Some(e) = o.error {
                eprintln!("warm-up request {i} failed: {e}");
            }
        }
        let metrics_url = format!("{}/metrics", base.trim_end_matches("/v1"));
        let before = scrape(&client, &metrics_url).await;
        let gate = args.max_concurrency.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
        let bar = if quiet {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(plan.len() as u64)
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let window_start = chrono::Utc::now();
        let start = tokio::time::Instant::now() + Duration::from_millis(100);
        let mut tasks = Vec::with_capacity(plan.len());
        let retries = args.idempotent_retries;
        let from_send = args.from_send;
        for (i, p) in plan.iter().enumerate() {
            let at = start + Duration::from_secs_f64(p.at);
            let b = body(&p.req, chat, stream, &model);
            let (c, urls, key, gate) =
                (client.clone(), urls.clone(), tenants[p.tenant].key.clone(), gate.clone());
            // Unique per run and request: a retry is recognised, another run is not.
            let idem = (retries > 0).then(|| {
                format!("bench-{}-{i}", started.timestamp_nanos_opt().unwrap_or_default())
            });
            let t = p.at;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                // The client's own lateness, before any wait for a concurrency slot (that wait
                // is latency the capped client imposes, measured from the schedule like all).
                let late = tokio::time::Instant::now().saturating_duration_since(at);
                let _permit = match &gate {
                    Some(g) => g.clone().acquire_owned().await.ok(),
                    None => None,
                };
                let origin = if from_send { tokio::time::Instant::now() } else { at };
                let (mut o, extra) =
                    send_with_retries(&c, &urls, i, key.as_deref(), b, origin, retries, idem).await;
                // Timed from the send, a request counts from when it went (the run's duration
                // runs from the first one's send to the last one's end either way).
                o.scheduled_s = t + origin.saturating_duration_since(at).as_secs_f64();
                o.lateness_s = late.as_secs_f64();
                (o, extra)
            }));
        }
        let mut results = Vec::with_capacity(tasks.len());
        let mut failed = 0;
        for t in tasks {
            let r = t.await.unwrap_or_else(|e| {
                (Outcome { error: Some(e.to_string()), ..Outcome::default() }, Extra::default())
            });
            failed += usize::from(!r.0.ok);
            bar.inc(1);
            bar.set_message(format!("({failed} not ok)"));
            results.push(r);
        }
        bar.finish();
        // Counters as deltas over the run; gauges (running, waiting, KV usage) as at the end.
        let after = scrape(&client, &metrics_url).await;
        let server = match (before, after) {
            (Some(b), Some(a)) => a
                .iter()
                .map(|(k, v)| {
                    let counter =
                        k.ends_with("_total") || k.contains("_count") || k.contains("_sum");
                    (k.clone(), if counter { v - b.get(k).copied().unwrap_or(0.0) } else { *v })
                })
                .collect(),
            _ => std::collections::BTreeMap::new(),
        };
        let gateway = match (&args.records_url, &args.records_token) {
            (Some(u), Some(t)) => {
                // The ledger writes in batches: give the last requests' records a moment.
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let since = window_start - chrono::TimeDelta::seconds(5);
                match gateway_records(&client, u, t, since).await {
                    Ok(r) => Some(r),
                    Err(e) => {
                        eprintln!("warning: the gateway's records could not be read: {e}");
                        None
                    }
                }
            }
            _ => None,
        };
        anyhow::Ok((results, model, server, gateway))
    })?;
    if let Some(path) = &args.requests_log {
        let mut text = String::new();
        for (i, ((_, extra), p)) in results.iter().zip(&plan).enumerate() {
            let line = json!({"index": i, "tenant": tenants[p.tenant].name, "stream": stream,
                "idempotency_key": extra.idempotency_key, "tries": extra.tries});
            text.push_str(&line.to_string());
            text.push('\n');
        }
        std::fs::write(path, text)
            .with_context(|| format!("--requests-log: writing {}", path.display()))?;
    }
    let outcomes: Vec<Outcome> = results.iter().map(|r| r.0.clone()).collect();
    let total_rate: f64 = tenants.iter().map(|t| t.rate).sum();
    let summary = summarize(&outcomes, total_rate, slo);
    let first = results.iter().find(|r| r.0.ok).map(|r| &r.1);
    let ident = identity(&model, first, started);
    let mut result = result_json(args, &tenants, &summary, &outcomes, &schedules);
    result["model_id"] = json!(model);
    result["identity"] = json!(ident);
    result["server_metrics"] = json!(server);
    let device_idle = device_idle(&server);
    if let Some(idle) = device_idle {
        result["device_idle"] = json!(idle);
    }
    // Breakdowns: per tenant (with several) and per input-length bucket.
    let mut per_tenant = Vec::new();
    if tenants.len() > 1 {
        for (i, t) in tenants.iter().enumerate() {
            let mine: Vec<Outcome> = plan
                .iter()
                .zip(&outcomes)
                .filter(|(p, _)| p.tenant == i)
                .map(|(_, o)| o.clone())
                .collect();
            per_tenant.push((t.name.clone(), summarize(&mine, t.rate, slo)));
        }
        let by_name: serde_json::Map<String, Value> =
            per_tenant.iter().map(|(n, s)| (n.clone(), brief(s))).collect();
        result["tenants"] = Value::Object(by_name);
    }
    let mut per_bucket = std::collections::BTreeMap::<(usize, String), Vec<Outcome>>::new();
    for (p, o) in plan.iter().zip(&outcomes) {
        let b = bucket(p.req.input_len);
        let order = BUCKETS.iter().position(|hi| p.req.input_len <= *hi).unwrap_or(BUCKETS.len());
        per_bucket.entry((order, b)).or_default().push(o.clone());
    }
    // In length order (an array: JSON objects do not keep it).
    let buckets: Vec<(String, Summary)> =
        per_bucket.iter().map(|((_, b), os)| (b.clone(), summarize(os, f64::NAN, slo))).collect();
    result["length_buckets"] = json!(
        buckets
            .iter()
            .map(|(b, s)| {
                let mut v = brief(s);
                v["bucket"] = json!(b);
                v
            })
            .collect::<Vec<_>>()
    );
    // The gateway's TTFT for the same request ids, beside the client's.
    if let Some(g) = &gateway {
        let mut diffs = Vec::new();
        let (mut client_ttft, mut gateway_ttft) = (Vec::new(), Vec::new());
        for (o, e) in &results {
            let Some((Some(gt), _)) = e.request_id.as_ref().and_then(|id| g.get(id)) else {
                continue;
            };
            // The client's TTFT from its actual send (its own lateness left out), so the
            // difference is the network, TLS and the two ends' HTTP handling.
            if let Some(ct) = o.ttft().map(|t| t - o.lateness_s) {
                diffs.push(ct - gt / 1000.0);
                client_ttft.push(ct);
                gateway_ttft.push(gt / 1000.0);
            }
        }
        result["gateway_ttft"] = json!({
            "matched": diffs.len(),
            "client_ttft_ms": Dist::of_seconds(client_ttft),
            "gateway_ttft_ms": Dist::of_seconds(gateway_ttft),
            "client_minus_gateway_ms": Dist::of_seconds(diffs),
        });
    }
    Ok(Run { summary, result, outcomes, tenants, per_tenant, buckets, server, device_idle })
}

/// Runs `sluice bench serve`.
pub fn run_bench_serve(args: BenchServeArgs) -> anyhow::Result<()> {
    let Run { summary, result, outcomes, tenants, per_tenant, buckets, server, device_idle } =
        measure(&args, false)?;
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--plots: creating {}", dir.display()))?;
        let ms = |f: &dyn Fn(&Outcome) -> Option<f64>| {
            cdf(&outcomes
                .iter()
                .filter(|o| o.ok)
                .filter_map(f)
                .map(|s| s * 1000.0)
                .collect::<Vec<_>>())
        };
        let series = [
            Series { name: "TTFT".into(), points: ms(&|o| o.ttft()) },
            Series { name: "TPOT".into(), points: ms(&|o| o.tpot()) },
            Series { name: "E2E".into(), points: ms(&|o| Some(o.end_s)) },
        ];
        let path = dir.join("latency_cdf.svg");
        std::fs::write(&path, line_chart("Latency CDF", "ms", "fraction of requests", &series))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("plot written to {}", path.display());
    }
    print_summary(&summary);
    if tenants.len() > 1 {
        println!("per tenant:");
        for (name, s) in &per_tenant {
            println!("  {name:<12} {}", brief_line(s));
        }
    }
    println!("per input length (tokens):");
    for (b, s) in &buckets {
        println!("  {b:<12} {}", brief_line(s));
    }
    if let Some(g) = result.get("gateway_ttft") {
        println!(
            "gateway-recorded TTFT for {} of these requests: median {:.2} ms (client {:.2} ms; client - gateway median {:.2} ms)",
            g["matched"],
            g["gateway_ttft_ms"]["median"].as_f64().unwrap_or(0.0),
            g["client_ttft_ms"]["median"].as_f64().unwrap_or(0.0),
            g["client_minus_gateway_ms"]["median"].as_f64().unwrap_or(0.0),
        );
    }
    if !server.is_empty() {
        println!("server-side (deltas over the run; gauges at the end):");
        for (k, v) in &server {
            println!("  {k} {v}");
        }
        if let Some(d) = device_idle {
            println!(
                "  the engine's device sat idle {:.1}% of the time between consecutive passes \
                 ({:.3} ms a gap, {:.3} ms a pass)",
                100.0 * d.share,
                d.gap_ms,
                d.pass_ms
            );
        }
    }
    if let Some(path) = &args.save_result {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("result written to {}", path.display());
    }
    if let Some(path) = &args.report {
        std::fs::write(path, report(&args, &tenants, &result))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("report written to {}", path.display());
    }
    std::io::stdout().flush()?;
    Ok(())
}

/// A breakdown's figures.
pub(crate) fn brief(s: &Summary) -> Value {
    json!({
        "completed": s.completed, "failed": s.failed, "rejected": s.rejected,
        "request_throughput": s.request_throughput, "output_throughput": s.output_throughput,
        "median_ttft_ms": s.ttft_ms.median, "p99_ttft_ms": s.ttft_ms.p99,
        "median_tpot_ms": s.tpot_ms.median, "p99_tpot_ms": s.tpot_ms.p99,
        "median_e2el_ms": s.e2el_ms.median, "p99_e2el_ms": s.e2el_ms.p99,
        "slo_attainment": s.slo_attainment,
        "prefix_hit_rate": s.prefix_hit_rate,
    })
}

pub(crate) fn brief_line(s: &Summary) -> String {
    // An empty group's percentiles print as 0, as they did from the JSON result.
    let f = |x: f64| if x.is_finite() { x } else { 0.0 };
    format!(
        "ok {} failed {} rejected {}  TTFT p50/p99 {:.1}/{:.1} ms  TPOT p50/p99 {:.1}/{:.1} ms  attainment {:.3}  prefix hits {}",
        s.completed,
        s.failed,
        s.rejected,
        f(s.ttft_ms.median),
        f(s.ttft_ms.p99),
        f(s.tpot_ms.median),
        f(s.tpot_ms.p99),
        f(s.slo_attainment),
        if s.prefix_hit_rate.is_finite() {
            format!("{:.1}%", 100.0 * s.prefix_hit_rate)
        } else {
            "-".to_owned()
        }
    )
}

fn result_json(
    args: &BenchServeArgs,
    tenants: &[Tenant],
    s: &Summary,
    outcomes: &[Outcome],
    schedules: &[Vec<f64>],
) -> Value {
    let t0 = &tenants[0];
    let mut v = json!({
        "backend": "openai", "base_url": args.base_url, "endpoint": args.endpoint,
        "num_prompts": outcomes.len(), "request_rate": tenants.iter().map(|t| t.rate).sum::<f64>(),
        "burstiness": t0.burstiness, "max_concurrency": args.max_concurrency, "from_send": args.from_send,
        "input_len": t0.input_spec, "output_len": t0.output_spec, "workload": t0.workload_name,
        "warmup": args.warmup, "ramp_up_s": args.ramp_up, "timeout_s": args.timeout,
        "seed": args.seed, "open_loop": true, "streaming": !args.no_stream,
        "completed": s.completed, "failed": s.failed, "rejected": s.rejected, "duration": s.duration,
        "request_throughput": s.request_throughput, "input_throughput": s.input_throughput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
        "request_goodput": s.request_goodput, "output_goodput": s.output_goodput,
        "slo_attainment": s.slo_attainment, "goodput_slo": s.slo,
        "error_rate": s.error_rate, "rejection_rate": s.rejection_rate, "timeout_rate": s.timeout_rate,
        "send_lateness_ms": s.send_lateness_ms,
        "mean_in_flight": s.mean_in_flight, "littles_law_estimate": s.littles_law_estimate,
    });
    for (name, d) in
        [("ttft", &s.ttft_ms), ("tpot", &s.tpot_ms), ("itl", &s.itl_ms), ("e2el", &s.e2el_ms)]
    {
        v[format!("mean_{name}_ms")] = json!(d.mean);
        v[format!("median_{name}_ms")] = json!(d.median);
        v[format!("p90_{name}_ms")] = json!(d.p90);
        v[format!("p95_{name}_ms")] = json!(d.p95);
        v[format!("p99_{name}_ms")] = json!(d.p99);
        v[format!("p99.9_{name}_ms")] = json!(d.p999);
        v[format!("median_{name}_ms_ci95")] = json!(d.median_ci95);
        v[format!("p99_{name}_ms_ci95")] = json!(d.p99_ci95);
        v[format!("{name}_samples")] = json!(d.count);
    }
    v["schedules"] = json!(
        tenants
            .iter()
            .zip(schedules)
            .map(|(t, times)| json!({"tenant": t.name, "request_rate": t.rate, "burstiness": t.burstiness,
                "num_prompts": t.num, "workload": t.workload_name, "input_len": t.input_spec,
                "output_len": t.output_spec, "scheduled_send_times": times}))
            .collect::<Vec<_>>()
    );
    if args.save_detailed {
        let sec = |x: Option<f64>| x.map_or(json!(null), |x| json!(x));
        v["ttfts"] = json!(outcomes.iter().map(|o| sec(o.ttft())).collect::<Vec<_>>());
        v["tpots"] = json!(outcomes.iter().map(|o| o.tpot().unwrap_or(0.0)).collect::<Vec<_>>());
        v["e2els"] = json!(outcomes.iter().map(|o| o.end_s).collect::<Vec<_>>());
        v["itls"] = json!(
            outcomes
                .iter()
                .map(|o| o.itls().iter().map(|g| g.0).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        // Tokens each gap delivered: a gap before a chunk of k > 1 tokens is a chunk gap.
        v["itl_tokens"] = json!(
            outcomes
                .iter()
                .map(|o| o.itls().iter().map(|g| g.1).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        v["input_lens"] = json!(outcomes.iter().map(|o| o.input_len).collect::<Vec<_>>());
        v["output_lens"] = json!(outcomes.iter().map(|o| o.output_len).collect::<Vec<_>>());
        v["errors"] =
            json!(outcomes.iter().map(|o| o.error.clone().unwrap_or_default()).collect::<Vec<_>>());
        v["scheduled_send_times"] =
            json!(outcomes.iter().map(|o| o.scheduled_s).collect::<Vec<_>>());
        v["send_lateness"] = json!(outcomes.iter().map(|o| o.lateness_s).collect::<Vec<_>>());
    }
    v
}

/// The Markdown report: the experiment's identity (seed 000, section 9), then the figures.
fn report(args: &BenchServeArgs, tenants: &[Tenant], r: &Value) -> String {
    let id = &r["identity"];
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    let mut md = String::new();
    md.push_str("# sluice bench serve\n\n## Experiment identity\n\n| | |\n|---|---|\n");
    let rows = [
        ("started", text(&id["started_at"])),
        ("target", args.base_url.clone()),
        ("endpoint", args.endpoint.clone()),
        ("model", text(&id["model_id"])),
        ("model revision", text(&id["model_revision"])),
        ("execution identity", text(&id["execution_identity"])),
        (
            "client",
            format!(
                "{} ({} cores, {})",
                text(&id["client_cpu"]),
                id["client_cores"],
                text(&id["client_host"])
            ),
        ),
        ("load generator", format!("sluice {}", text(&id["sluice_version"]))),
        ("loop", "open (latency from each scheduled send)".into()),
        ("streaming", (!args.no_stream).to_string()),
        ("warm-up", format!("{} requests, excluded", args.warmup)),
        ("ramp-up", format!("{} s", args.ramp_up)),
        ("window", format!("{} requests, {:.2} s", r["num_prompts"], f("duration"))),
        ("concurrency cap", args.max_concurrency.map_or("none".into(), |c| c.to_string())),
        ("timeout", format!("{} s per request", args.timeout)),
        ("seed", args.seed.to_string()),
        ("SLO", r["goodput_slo"].to_string()),
    ];
    for (k, v) in rows {
        md.push_str(&format!("| {k} | {} |\n", v.replace('|', "\\|")));
    }
    md.push_str("\n## Load\n\n| tenant | arrivals | rate (req/s) | requests | workload | input len | output len |\n|---|---|---|---|---|---|---|\n");
    for t in tenants {
        md.push_str(&format!(
            "| {} | gamma, burstiness {} | {} | {} | {} | {} | {} |\n",
            t.name, t.burstiness, t.rate, t.num, t.workload_name, t.input_spec, t.output_spec
        ));
    }
    md.push_str(&format!(
        "\n## Results\n\ncompleted {} / failed {} / rejected {}; error rate {:.3}, rejection rate {:.3}, timeout rate {:.3}.\n\n",
        r["completed"], r["failed"], r["rejected"], f("error_rate"), f("rejection_rate"), f("timeout_rate")
    ));
    md.push_str(&format!(
        "Throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s; goodput {:.2} req/s ({:.1} output tok/s), SLO attainment {:.3}.\n\n",
        f("request_throughput"), f("output_throughput"), f("total_token_throughput"),
        f("request_goodput"), f("output_goodput"), f("slo_attainment")
    ));
    md.push_str("| metric (ms) | n | mean | p50 [95% CI] | p90 | p99 [95% CI] | p99.9 |\n|---|---|---|---|---|---|---|\n");
    for name in ["ttft", "tpot", "itl", "e2el"] {
        let ci = |k: &str| {
            let c = &r[format!("{k}_{name}_ms_ci95")];
            format!("[{:.2}, {:.2}]", c[0].as_f64().unwrap_or(0.0), c[1].as_f64().unwrap_or(0.0))
        };
        md.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} {} | {:.2} | {:.2} {} | {:.2} |\n",
            name.to_uppercase(),
            r[format!("{name}_samples")],
            f(&format!("mean_{name}_ms")),
            f(&format!("median_{name}_ms")),
            ci("median"),
            f(&format!("p90_{name}_ms")),
            f(&format!("p99_{name}_ms")),
            ci("p99"),
            f(&format!("p99.9_{name}_ms")),
        ));
    }
    let late = &r["send_lateness_ms"];
    md.push_str(&format!(
        "\nSend lateness (the client's own delay against the schedule): p50 {:.2} ms, p99 {:.2} ms.\n\
         Little's law: mean in flight {:.2} vs offered rate x mean latency {:.2}.\n",
        late["median"].as_f64().unwrap_or(0.0),
        late["p99"].as_f64().unwrap_or(0.0),
        f("mean_in_flight"),
        f("littles_law_estimate")
    ));
    let per_bucket: Vec<(String, Value)> = r["length_buckets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| (text(&b["bucket"]), b.clone()))
        .collect();
    let per_tenant: Vec<(String, Value)> = r["tenants"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (title, m) in [("Per tenant", per_tenant), ("Per input length (tokens)", per_bucket)] {
        if m.is_empty() {
            continue;
        }
        md.push_str(&format!("\n## {title}\n\n| | ok | failed | rejected | TTFT p50 / p99 | TPOT p50 / p99 | attainment |\n|---|---|---|---|---|---|---|\n"));
        for (name, v) in m {
            let g = |k: &str| v[k].as_f64().unwrap_or(0.0);
            md.push_str(&format!(
                "| {name} | {} | {} | {} | {:.1} / {:.1} | {:.1} / {:.1} | {:.3} |\n",
                v["completed"],
                v["failed"],
                v["rejected"],
                g("median_ttft_ms"),
                g("p99_ttft_ms"),
                g("median_tpot_ms"),
                g("p99_tpot_ms"),
                g("slo_attainment")
            ));
        }
    }
    if let Some(g) = r.get("gateway_ttft") {
        let m = |k: &str, p: &str| g[k][p].as_f64().unwrap_or(0.0);
        md.push_str(&format!(
            "\n## TTFT: client vs the gateway's record\n\n{} requests matched by request id. Client TTFT p50 {:.2} ms, gateway-recorded p50 {:.2} ms; client minus gateway p50 {:.2} ms, p99 {:.2} ms. Both from the actual send (the client's lateness against its schedule left out) and from the request's arrival at the gateway: the difference is connection and TLS setup, the network both ways and the two ends' HTTP handling.\n",
            g["matched"], m("client_ttft_ms", "median"), m("gateway_ttft_ms", "median"),
            m("client_minus_gateway_ms", "median"), m("client_minus_gateway_ms", "p99")
        ));
    }
    if let Some(m) = r["server_metrics"].as_object().filter(|m| !m.is_empty()) {
        md.push_str("\n## Server-side (Prometheus deltas over the run; gauges at the end)\n\n| metric | value |\n|---|---|\n");
        for (k, v) in m {
            md.push_str(&format!("| `{k}` | {v} |\n"));
        }
    }
    md
}

fn print_summary(s: &Summary) {
    println!("============ Serving Benchmark Result ============");
    println!("completed / failed / rejected:  {} / {} / {}", s.completed, s.failed, s.rejected);
    println!("duration (s):                   {:.2}", s.duration);
    println!("request throughput (req/s):     {:.2}", s.request_throughput);
    println!("output token throughput (tok/s):{:.2}", s.output_throughput);
    println!("total token throughput (tok/s): {:.2}", s.total_token_throughput);
    for (name, d) in
        [("TTFT", &s.ttft_ms), ("TPOT", &s.tpot_ms), ("ITL", &s.itl_ms), ("E2E", &s.e2el_ms)]
    {
        println!(
            "{name:<5} ms  mean {:>9.2}  p50 {:>9.2}  p90 {:>9.2}  p99 {:>9.2} [{:.2}, {:.2}]  (n={})",
            d.mean, d.median, d.p90, d.p99, d.p99_ci95[0], d.p99_ci95[1], d.count
        );
    }
    println!(
        "send lateness ms  p50 {:.2}  p99 {:.2}",
        s.send_lateness_ms.median, s.send_lateness_ms.p99
    );
    println!(
        "SLO attainment {:.3}, goodput {:.2} req/s ({:.1} output tok/s)",
        s.slo_attainment, s.request_goodput, s.output_goodput
    );
    println!(
        "error rate {:.3}, rejection rate {:.3}, timeout rate {:.3}",
        s.error_rate, s.rejection_rate, s.timeout_rate
    );
    println!(
        "Little's law: mean in flight {:.2} vs offered rate x mean latency {:.2}",
        s.mean_in_flight, s.littles_law_estimate
    );
    if s.littles_law_estimate.is_finite()
        && s.mean_in_flight > 0.0
        && (s.littles_law_estimate / s.mean_in_flight - 1.0).abs() > 0.2
    {
        println!(
            "warning: these disagree by more than 20%: the server did not keep up with the offered rate, or the window is too short"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_429_is_retried_only_when_it_says_when() {
        let refused = Outcome { rejected: true, ..Outcome::default() };
        let with =
            |status, retry_after| Extra { status: Some(status), retry_after, ..Extra::default() };
        assert!(with(429, Some(1)).retryable(&refused));
        assert!(!with(429, None).retryable(&refused));
        assert!(with(503, None).retryable(&refused));
        assert!(!with(400, Some(1)).retryable(&refused));
    }
}
