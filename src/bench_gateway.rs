//! `sluice bench gateway`: the gateway's own added time and what it adds end to end.
//!
//! In one process: an engine worker serving a tiny synthetic model (written through the real
//! GGUF writer and loader, so the engine answers in about a millisecond and the gateway's
//! share is visible), the embedded ledger with a tenant and key, and the pingora gateway with
//! authentication, admission, routing and usage events all on. An open-loop client offers each
//! rate for a fixed time, first straight to the engine, then through the gateway, and reports
//! latency from each request's scheduled send time (no coordinated omission) and the
//! gateway's `x-sluice-gateway-overhead-ms`. Baseline: the issue's target, p99 overhead under
//! 1 ms at 2,000 requests/s on this machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use sluice_bench::metrics::Dist;
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::NewTenant;
use sluice_billing::local::{LocalIngest, LocalIngestConfig};
use sluice_engine::loader::LoadedModel;
use sluice_engine::quant::GgmlType;
use sluice_engine::serve::core::EngineConfig;
use sluice_engine::serve::handle::EngineHandle;
use sluice_engine::server::{ServerConfig, router as engine_router};
use sluice_engine::synth::{SynthSpec, write_gguf};
use sluice_gateway::local::RedisDownPolicy;
use sluice_gateway::proxy::{Gateway, GatewayConfig, TokenCounter};
use sluice_gateway::sink::UsageSink;

use crate::up::{IoRuntime, finish, gateway_config, server_conf};

/// `sluice bench gateway`.
#[derive(Args, Debug)]
pub struct BenchGatewayArgs {
    /// Offered request rates, one after another (requests/s).
    #[arg(long, value_delimiter = ',', default_value = "250,500,1000,2000")]
    rates: Vec<f64>,
    /// Seconds per rate and target.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

struct ChannelShutdown(tokio::sync::watch::Receiver<bool>);

#[async_trait::async_trait]
impl ShutdownSignalWatch for ChannelShutdown {
    async fn recv(&self) -> ShutdownSignal {
        let mut rx = self.0.clone();
        while !*rx.borrow() {
            if rx.changed().await.is_err() {
                break;
            }
        }
        ShutdownSignal::FastShutdown
    }
}

#[derive(Debug, Default, serde::Serialize)]
struct Point {
    target: &'static str,
    offered_rps: f64,
    achieved_rps: f64,
    ok: usize,
    errors: usize,
    e2e_p50_ms: f64,
    e2e_p99_ms: f64,
    overhead_p50_ms: Option<f64>,
    overhead_p99_ms: Option<f64>,
    send_lateness_p99_ms: f64,
    /// CPU time of this whole process (client, gateway and engine) per request, µs.
    cpu_us_per_request: Option<f64>,
}

/// CPU time this process has used (user + system), seconds, from /proc/self/stat.
fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime) = (f.get(11)?.parse::<f64>().ok()?, f.get(12)?.parse::<f64>().ok()?);
    // Linux reports these in USER_HZ, 100 on every supported architecture.
    Some((utime + stime) / 100.0)
}

async fn offer(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    rate: f64,
    seconds: f64,
    target: &'static str,
) -> Point {
    let n = (rate * seconds).round() as usize;
    let cpu_before = process_cpu_s();
    let body = serde_json::json!({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0});
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        let (c, url, body) = (c.clone(), url.to_owned(), body.clone());
        let key = key.map(str::to_owned);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let late = tokio::time::Instant::now().saturating_duration_since(at);
            let mut req = c.post(&url).json(&body);
            if let Some(k) = &key {
                req = req.bearer_auth(k);
            }
            let r = req.send().await;
            let overhead = r.as_ref().ok().and_then(|r| {
                r.headers().get("x-sluice-gateway-overhead-ms")?.to_str().ok()?.parse::<f64>().ok()
            });
            let ok = match r {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            // From the scheduled send, so a client that fell behind shows as latency.
            let e2e = tokio::time::Instant::now().saturating_duration_since(at);
            (ok, e2e, overhead, late)
        }));
    }
    let mut p = Point { target, offered_rps: rate, ..Point::default() };
    let (mut e2e, mut over, mut late) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = start;
    for t in tasks {
        if let Ok((ok, d, o, l)) = t.await {
            if ok {
                p.ok += 1;
                e2e.push(d.as_secs_f64());
                over.extend(o.map(|ms| ms / 1000.0));
            } else {
                p.errors += 1;
            }
            late.push(l.as_secs_f64());
        }
        last = last.max(tokio::time::Instant::now());
    }
    p.achieved_rps = p.ok as f64 / last.saturating_duration_since(start).as_secs_f64().max(1e-9);
    let e2e = Dist::of_seconds(e2e);
    (p.e2e_p50_ms, p.e2e_p99_ms) = (e2e.median, e2e.p99);
    if !over.is_empty() {
        let over = Dist::of_seconds(over);
        (p.overhead_p50_ms, p.overhead_p99_ms) = (Some(over.median), Some(over.p99));
    }
    p.send_lateness_p99_ms = Dist::of_seconds(late).p99;
    if let (Some(a), Some(b)) = (cpu_before, process_cpu_s())
        && n > 0
    {
        p.cpu_us_per_request = Some((b - a) / n as f64 * 1e6);
    }
    p
}

/// Runs `sluice bench gateway`.
pub fn run_bench_gateway(args: BenchGatewayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.seconds > 0.0 && args.rates.iter().all(|r| *r > 0.0),
        "--rates and --seconds must be positive"
    );
    // One stderr line per request would dominate a 2-core machine at these rates.
    sluice_engine::server::REQUEST_LOG.store(false, std::sync::atomic::Ordering::Relaxed);
    let dir = tempfile_dir()?;
    let model_path = dir.join("bench-tiny.gguf");
    write_gguf(&SynthSpec::tiny(), GgmlType::Q8_0, &model_path)
        .context("writing the synthetic model")?;
    let model = Arc::new(LoadedModel::load(&model_path)?);
    let tokens = TokenCounter::from_gguf(&model_path)?;
    let io = IoRuntime::start()?;
    let handle = EngineHandle::start(
        Arc::clone(&model),
        EngineConfig { kv_cache_bytes: 64 << 20, threads: 1, ..EngineConfig::default() },
    )?;
    let app = engine_router(
        handle,
        ServerConfig {
            served_model_name: Some("bench".into()),
            internal_token: Some("bench-token".into()),
            ..ServerConfig::default()
        },
    );
    let db = format!("sqlite://{}", dir.join("ledger.db").display());
    let (engine_addr, ledger, ingest, key) = io.handle.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        let ledger = Ledger::connect(&db).await?;
        let ops = Principal { actor: "bench".into(), role: Role::Ops, tenant: None };
        let new = NewTenant {
            id: "bench".into(),
            name: None,
            tier: Some("enterprise".into()),
            overrides: None,
        };
        ledger.create_tenant(&ops, &new).await?;
        let (_, key) = ledger.issue_key(&ops, "bench", None, None, Default::default()).await?;
        let ingest = Arc::new(LocalIngest::start(ledger.clone(), LocalIngestConfig::default()));
        anyhow::Ok((addr, ledger, ingest, key))
    })?;
    let gw_port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let gw_addr = format!("127.0.0.1:{gw_port}");
    let cfg = GatewayConfig {
        default_max_tokens: 16,
        name: "bench".into(),
        ..gateway_config(
            &[engine_addr.to_string()],
            Some("bench-token".into()),
            "bench",
            RedisDownPolicy::Local,
        )
    };
    let gateway = Gateway::new(
        cfg,
        ledger.clone(),
        None,
        tokens,
        UsageSink::Local(ingest.clone()),
        io.handle.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let listen = gw_addr.clone();
    let proxy = std::thread::spawn(move || {
        let mut server = pingora::server::Server::new_with_opt_and_conf(None, server_conf());
        server.bootstrap();
        let mut service = pingora::proxy::http_proxy_service(&server.configuration, gateway);
        service.add_tcp(&listen);
        server.add_service(service);
        server
            .run(pingora::server::RunArgs { shutdown_signal: Box::new(ChannelShutdown(stop_rx)) });
    });
    let client_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let points = client_rt.block_on(async {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(256)
            .build()?;
        let health = format!("http://{gw_addr}/health");
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.get(&health).send().await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "the gateway did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let direct = format!("http://{engine_addr}/v1/completions");
        let via = format!("http://{gw_addr}/v1/completions");
        // Warm-up: connections, key cache, allocator.
        offer(&c, &via, Some(&key), 200.0, 0.5, "gateway").await;
        let mut points = Vec::new();
        for &rate in &args.rates {
            let d = offer(&c, &direct, Some("bench-token"), rate, args.seconds, "engine").await;
            let g = offer(&c, &via, Some(&key), rate, args.seconds, "gateway").await;
            points.push((d, g));
        }
        anyhow::Ok(points)
    })?;
    let _ = stop_tx.send(true);
    let _ = proxy.join();
    finish(&io, Some(&ingest), &ledger);
    let _ = std::fs::remove_dir_all(&dir);
    if args.json {
        for (d, g) in &points {
            println!("{}", serde_json::to_string(d)?);
            println!("{}", serde_json::to_string(g)?);
        }
        return Ok(());
    }
    println!(
        "gateway overhead: tiny synthetic model, completions of 3 prompt + 1 output token, open loop, {} s per point",
        args.seconds
    );
    println!(
        "baseline: target p99 overhead < 1 ms at 2,000 requests/s (issue 5); e2e compared with the same load straight to the engine"
    );
    println!(
        "offered  target    req/s   ok     err  e2e p50   e2e p99   overhead p50  overhead p99  (vs 1 ms)  send late p99"
    );
    for (d, g) in &points {
        for p in [d, g] {
            let (o50, o99, ratio) = match (p.overhead_p50_ms, p.overhead_p99_ms) {
                (Some(a), Some(b)) => {
                    (format!("{a:.3} ms"), format!("{b:.3} ms"), format!("{:.2}x", b / 1.0))
                }
                _ => ("-".into(), "-".into(), "-".into()),
            };
            println!(
                "{:>7.0}  {:<8} {:>6.0} {:>6} {:>5}  {:>6.2} ms {:>7.2} ms  {:>12} {:>13} {:>10}  {:>8.2} ms",
                p.offered_rps,
                p.target,
                p.achieved_rps,
                p.ok,
                p.errors,
                p.e2e_p50_ms,
                p.e2e_p99_ms,
                o50,
                o99,
                ratio,
                p.send_lateness_p99_ms
            );
        }
        println!(
            "         added e2e: p50 {:+.2} ms, p99 {:+.2} ms",
            g.e2e_p50_ms - d.e2e_p50_ms,
            g.e2e_p99_ms - d.e2e_p99_ms
        );
        if let (Some(dc), Some(gc)) = (d.cpu_us_per_request, g.cpu_us_per_request) {
            // The same client and engine work either way: the difference is the gateway's
            // (proxying, auth, admission, usage event) and the extra hop's sockets.
            println!(
                "         CPU per request: {dc:.0} us straight, {gc:.0} us through the gateway ({:+.0} us: {:.0}% of one core at this rate)",
                gc - dc,
                (gc - dc) * g.offered_rps / 1e4
            );
        }
    }
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir()
        .join(format!("sluice-bench-gateway-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
