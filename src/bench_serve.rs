//! `sluice bench serve`: an open-loop load generator against any OpenAI-compatible endpoint
//! (our gateway or engine, vLLM, llama.cpp). The send schedule is generated whole from a seed
//! before the run; every latency is measured from a request's scheduled send, so a client that
//! falls behind shows up as latency (and as send lateness) instead of hiding it.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};
use sluice_bench::arrivals::{Arrival, Rng, schedule};
use sluice_bench::metrics::{Outcome, Slo, Summary, summarize};
use sluice_gateway::observe::{SseParser, tokens_carried};

/// `sluice bench serve`.
#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// Server base URL (`.../v1` is appended when missing).
    #[arg(long)]
    base_url: String,
    /// API key (Authorization: Bearer).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model name to send.
    #[arg(long)]
    model: Option<String>,
    /// `chat` or `completions`.
    #[arg(long, default_value = "completions")]
    endpoint: String,
    /// Requests to send.
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    /// Offered requests per second (`inf`: all at once).
    #[arg(long, default_value = "inf")]
    request_rate: f64,
    /// Gamma shape of the gaps (1 = Poisson).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Most requests in flight (sends wait for a slot; the wait counts as latency).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Prompt length in tokens (completions send token ids; chat sends that many words).
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Output tokens per request (end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// SLO thresholds for goodput, e.g. `ttft:500,tpot:50,e2el:10000` (milliseconds).
    #[arg(long)]
    goodput: Option<String>,
    /// Seed of the schedule and the prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the JSON result here.
    #[arg(long)]
    save_result: Option<std::path::PathBuf>,
    /// Include per-request arrays in the JSON result.
    #[arg(long)]
    save_detailed: bool,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
}

fn parse_slo(s: Option<&str>) -> anyhow::Result<Slo> {
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

/// One request's body: random token ids (completions) or random words (chat).
fn body(args: &BenchServeArgs, rng: &mut Rng, model: &str) -> Value {
    let mut b = if args.endpoint == "chat" {
        const WORDS: &[&str] = &[
            "river", "stone", "light", "paper", "window", "garden", "cloud", "number", "signal",
            "forest",
        ];
        let text: Vec<&str> = (0..args.input_len)
            .map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize])
            .collect();
        json!({"messages": [{"role": "user", "content": text.join(" ")}], "max_tokens": args.output_len})
    } else {
        // Ids in a range every vocabulary of interest has (plain tokens, no specials).
        let ids: Vec<u64> = (0..args.input_len).map(|_| 1000 + rng.next_u64() % 20_000).collect();
        json!({"prompt": ids, "max_tokens": args.output_len})
    };
    b["model"] = json!(model);
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    b["ignore_eos"] = json!(true);
    b["temperature"] = json!(0.0);
    b
}

async fn one(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: Value,
    start: tokio::time::Instant,
) -> Outcome {
    let mut o = Outcome::default();
    let mut req = c.post(url).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let elapsed = |i: tokio::time::Instant| i.saturating_duration_since(start).as_secs_f64();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            o.error = Some(format!("request failed: {e}"));
            o.end_s = elapsed(tokio::time::Instant::now());
            return o;
        }
    };
    let status = resp.status().as_u16();
    if status == 429 || status == 503 {
        o.rejected = true;
    }
    if !resp.status().is_success() {
        o.error = Some(format!("http {status}"));
        o.end_s = elapsed(tokio::time::Instant::now());
        return o;
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
                        o.output_len = u["completion_tokens"].as_u64().unwrap_or(0);
                    }
                    let k = tokens_carried(&v);
                    if k > 0 {
                        o.events.push((now, k));
                    }
                }
            }
            Ok(None) => break,
            Err(e) => {
                o.error = Some(format!("stream broke: {e}"));
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
    o
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

/// Runs `sluice bench serve`.
pub fn run_bench_serve(args: BenchServeArgs) -> anyhow::Result<()> {
    if args.endpoint != "chat" && args.endpoint != "completions" {
        bail!("--endpoint must be chat or completions");
    }
    if args.num_prompts == 0 || args.input_len == 0 || args.output_len == 0 {
        bail!("--num-prompts, --input-len and --output-len must be positive");
    }
    let slo = parse_slo(args.goodput.as_deref())?;
    let base = args.base_url.trim_end_matches('/');
    let base = if base.ends_with("/v1") { base.to_owned() } else { format!("{base}/v1") };
    let url = format!(
        "{base}/{}",
        if args.endpoint == "chat" { "chat/completions" } else { "completions" }
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let arrival = Arrival::Gamma { burstiness: args.burstiness };
    let times = schedule(arrival, args.request_rate, args.num_prompts, args.seed);
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout))
        .pool_max_idle_per_host(1024);
    if let Ok(ca) = std::env::var("SSL_CERT_FILE") {
        let pem = std::fs::read(&ca).with_context(|| format!("reading SSL_CERT_FILE {ca}"))?;
        builder = builder.add_root_certificate(reqwest::Certificate::from_pem(&pem)?);
    }
    let client = builder.build()?;
    let (outcomes, model, server) = rt.block_on(async {
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let mut req = client.get(format!("{base}/models"));
                if let Some(k) = &args.api_key {
                    req = req.bearer_auth(k);
                }
                let v: Value = req.send().await.context("GET /v1/models")?.json().await?;
                v["data"][0]["id"]
                    .as_str()
                    .context("the server lists no model; pass --model")?
                    .to_owned()
            }
        };
        let metrics_url = format!("{}/metrics", base.trim_end_matches("/v1"));
        let before = scrape(&client, &metrics_url).await;
        let mut rng = Rng::new(args.seed ^ 0x5eed);
        let bodies: Vec<Value> =
            (0..args.num_prompts).map(|_| body(&args, &mut rng, &model)).collect();
        let gate = args.max_concurrency.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
        let start = tokio::time::Instant::now() + Duration::from_millis(100);
        let mut tasks = Vec::with_capacity(bodies.len());
        for (t, b) in times.iter().zip(bodies) {
            let at = start + Duration::from_secs_f64(*t);
            let (c, url, key, gate) =
                (client.clone(), url.clone(), args.api_key.clone(), gate.clone());
            let t = *t;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let _permit = match &gate {
                    Some(g) => g.clone().acquire_owned().await.ok(),
                    None => None,
                };
                let mut o = one(&c, &url, key.as_deref(), b, at).await;
                o.scheduled_s = t;
                o
            }));
        }
        let mut outcomes = Vec::with_capacity(tasks.len());
        let total = tasks.len();
        for (i, t) in tasks.into_iter().enumerate() {
            outcomes.push(
                t.await.unwrap_or_else(|e| Outcome {
                    error: Some(e.to_string()),
                    ..Outcome::default()
                }),
            );
            eprint!("\r{}/{total} requests done", i + 1);
        }
        eprintln!();
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
        anyhow::Ok((outcomes, model, server))
    })?;
    let summary = summarize(&outcomes, args.request_rate, slo);
    let mut result = result_json(&args, &model, &summary, &outcomes, &times);
    result["server_metrics"] = json!(server);
    print_summary(&summary);
    if !server.is_empty() {
        println!("server-side (deltas over the run; gauges at the end):");
        for (k, v) in &server {
            println!("  {k} {v}");
        }
    }
    if let Some(path) = &args.save_result {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("result written to {}", path.display());
    }
    std::io::stdout().flush()?;
    Ok(())
}

fn result_json(
    args: &BenchServeArgs,
    model: &str,
    s: &Summary,
    outcomes: &[Outcome],
    times: &[f64],
) -> Value {
    let mut v = json!({
        "backend": "openai", "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "seed": args.seed, "open_loop": true, "streaming": true,
        "completed": s.completed, "failed": s.failed, "rejected": s.rejected, "duration": s.duration,
        "request_throughput": s.request_throughput, "input_throughput": s.input_throughput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
        "request_goodput": s.request_goodput, "slo_attainment": s.slo_attainment, "goodput_slo": s.slo,
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
        v[format!("{name}_samples")] = json!(d.count);
    }
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
        v["input_lens"] = json!(outcomes.iter().map(|o| o.input_len).collect::<Vec<_>>());
        v["output_lens"] = json!(outcomes.iter().map(|o| o.output_len).collect::<Vec<_>>());
        v["errors"] =
            json!(outcomes.iter().map(|o| o.error.clone().unwrap_or_default()).collect::<Vec<_>>());
        v["scheduled_send_times"] = json!(times);
    }
    v
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
            "{name:<5} ms  mean {:>9.2}  p50 {:>9.2}  p90 {:>9.2}  p99 {:>9.2}  (n={})",
            d.mean, d.median, d.p90, d.p99, d.count
        );
    }
    println!("SLO attainment {:.3}, goodput {:.2} req/s", s.slo_attainment, s.request_goodput);
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
