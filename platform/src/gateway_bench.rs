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
//!
//! On a machine this small the client, the engine and the gateway fight for the same cores,
//! and one run's p99 moves by milliseconds with the scheduler. Two things make the comparison
//! fair: each rate is offered in `--rounds` alternating rounds (straight, through, straight,
//! ...) whose samples are pooled, so a slow spell of the machine hits both sides; and with
//! `--layout isolated` (the default on two or more CPUs) the gateway's threads (pingora, its
//! own I/O runtime, the usage writer's SQLite thread) get the last CPU to themselves, as
//! gateways get their own machines in production, while the client and the engine share the
//! others in both phases: the same work there either way, so the difference is the gateway's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use sluice_bench::metrics::Dist;
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::NewTenant;
use sluice_engine::loader::LoadedModel;
use sluice_engine::quant::GgmlType;
use sluice_engine::serve::core::EngineConfig;
use sluice_engine::serve::handle::EngineHandle;
use sluice_engine::server::{ServerConfig, router as engine_router};
use sluice_engine::synth::{SynthSpec, write_gguf};
use sluice_gateway::admission::TokenCounter;
use sluice_gateway::door::SERVICE_NAME;
use sluice_gateway::local::RedisDownPolicy;
use sluice_gateway::proxy::{Gateway, GatewayConfig};
use sluice_policies::redis_conn::Namespace;

use sluice_gateway::platform::{IoRuntime, Usage, finish, run_proxy_until};

/// The Redis namespace of the bench's `--redis-url` runs: its tenant's counters and its
/// gateway's journal never mix with those of a deployment that shares the Redis.
const BENCH_NAMESPACE: &str = "sluice-bench";

/// `sluice bench gateway`.
#[derive(Args, Debug)]
pub struct BenchGatewayArgs {
    /// Offered request rates, one after another (requests/s).
    #[arg(long, value_delimiter = ',', default_value = "250,500,1000,2000")]
    rates: Vec<f64>,
    /// Seconds per rate and target.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Alternating rounds per rate (straight, then through the gateway), pooled.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// `isolated`: the gateway's threads on the last CPU, everything else on the others;
    /// `shared`: no pinning. Default: isolated where there are two CPUs or more.
    #[arg(long)]
    layout: Option<Layout>,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    /// The multi-machine path: limits, the usage stream and the in-flight journal in this
    /// Redis (a stream of the run's own, deleted at the end), instead of in-process limits
    /// and the embedded ledger's writer.
    #[arg(long)]
    redis_url: Option<String>,
    /// Search for the highest rate the gateway holds (no failed request, added e2e p99 under
    /// 1 ms in the median round): from the first of `--rates`, doubling while rates hold (or
    /// halving while they fail), then `--search-steps` bisections between the highest rate
    /// held and the lowest failed. Rates after the first are not used.
    #[arg(long)]
    search: bool,
    /// Bisections of `--search` once a rate has failed.
    #[arg(long, default_value_t = 4)]
    search_steps: usize,
}

/// The added e2e p99 under which a rate is held, ms.
const HELD_P99_MS: f64 = 1.0;

/// Most rates `--search` tries while doubling (or halving), before it gives up looking for
/// one that fails (or holds).
const MAX_STEPS_OUT: usize = 8;

/// Where the threads run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Layout {
    Isolated,
    Shared,
}

/// The CPUs this process may use.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above, for the calling thread (0).
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    // SAFETY: reads bits of an initialized set.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Threads of the gateway by name: pingora's workers and blocking pool (named after its
/// service), its I/O runtime, the usage writer and SQLite's worker threads (the ledger's and
/// the writer's connections; the engine has none).
fn is_gateway_thread(comm: &str) -> bool {
    [SERVICE_NAME, "sluice-gw-io", "sluice-usage", "sqlx-sqlite"]
        .iter()
        .any(|p| comm.starts_with(p))
}

/// Whether `comm` is one of pingora's own threads (the proxy's runtime).
fn is_proxy_thread(comm: &str) -> bool {
    comm.starts_with(SERVICE_NAME)
}

/// Pins every thread of this process: the gateway's to the last allowed CPU, the rest to the
/// others. Threads made later inherit their creator's set. Fails when none of pingora's own
/// threads was found (a renamed service would leave the proxy beside the client unnoticed).
fn pin_threads(cpus: &[usize]) -> anyhow::Result<()> {
    let (Some((&gw, rest)), true) = (cpus.split_last(), cpus.len() >= 2) else {
        anyhow::bail!("an isolated layout needs two CPUs");
    };
    let set_of = |list: &[usize]| {
        // SAFETY: cpu_set_t is plain data.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in list {
            // SAFETY: c < CPU_SETSIZE (it came from CPU_ISSET's range).
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        set
    };
    let (gw_set, rest_set) = (set_of(&[gw]), set_of(rest));
    let mut proxy_pinned = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let task = task?;
        let Ok(tid) = task.file_name().to_string_lossy().parse::<libc::pid_t>() else { continue };
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let gateway = is_gateway_thread(comm.trim());
        let set = if gateway { &gw_set } else { &rest_set };
        // SAFETY: tid is a thread of this process (it may have exited: then ESRCH, ignored).
        let rc =
            unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) };
        proxy_pinned += usize::from(is_proxy_thread(comm.trim()) && rc == 0);
    }
    anyhow::ensure!(
        proxy_pinned > 0,
        "found none of the proxy's threads (named {SERVICE_NAME:?}) to pin to the gateway's CPU"
    );
    Ok(())
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
    rounds: usize,
    ok: usize,
    errors: usize,
    /// Failed requests by what went wrong (an HTTP status, `timeout`, `connect`, ...).
    failures: std::collections::BTreeMap<String, usize>,
    e2e_p50_ms: f64,
    e2e_p99_ms: f64,
    overhead_p50_ms: Option<f64>,
    overhead_p99_ms: Option<f64>,
    send_lateness_p99_ms: f64,
    /// CPU time of this whole process (client, gateway and engine) per request, µs.
    cpu_us_per_request: Option<f64>,
    /// CPU time of the gateway's own threads ([`is_gateway_thread`]) per request, µs (in the
    /// straight phase, with no request of its own: health checks, the last round's usage
    /// batch still being written, and the like).
    gateway_cpu_us_per_request: f64,
    /// Each round's e2e p99 alone, ms.
    round_e2e_p99_ms: Vec<f64>,
}

/// What one round measured.
#[derive(Default)]
struct Round {
    ok: usize,
    errors: usize,
    e2e: Vec<f64>,
    overhead: Vec<f64>,
    late: Vec<f64>,
    cpu_s: Option<f64>,
    gateway_cpu_s: f64,
    /// Failed requests by what went wrong (an HTTP status, `timeout`, `connect`, ...).
    failures: std::collections::BTreeMap<String, usize>,
    sent: usize,
    busy_s: f64,
}

/// Pools `rounds` of one target at one rate.
fn pool(target: &'static str, rate: f64, rounds: &[Round]) -> Point {
    let mut p = Point { target, offered_rps: rate, rounds: rounds.len(), ..Point::default() };
    let (mut e2e, mut over, mut late) = (Vec::new(), Vec::new(), Vec::new());
    let (mut cpu, mut gateway_cpu, mut sent, mut busy) = (Some(0.0), 0.0, 0usize, 0.0);
    for r in rounds {
        p.ok += r.ok;
        p.errors += r.errors;
        for (why, n) in &r.failures {
            *p.failures.entry(why.clone()).or_default() += n;
        }
        e2e.extend_from_slice(&r.e2e);
        over.extend_from_slice(&r.overhead);
        late.extend_from_slice(&r.late);
        cpu = cpu.zip(r.cpu_s).map(|(a, b)| a + b);
        gateway_cpu += r.gateway_cpu_s;
        sent += r.sent;
        busy += r.busy_s;
        p.round_e2e_p99_ms.push(Dist::of_seconds(r.e2e.clone()).p99);
    }
    p.achieved_rps = p.ok as f64 / busy.max(1e-9);
    let e2e = Dist::of_seconds(e2e);
    (p.e2e_p50_ms, p.e2e_p99_ms) = (e2e.median, e2e.p99);
    if !over.is_empty() {
        let over = Dist::of_seconds(over);
        (p.overhead_p50_ms, p.overhead_p99_ms) = (Some(over.median), Some(over.p99));
    }
    p.send_lateness_p99_ms = Dist::of_seconds(late).p99;
    if sent > 0 {
        p.cpu_us_per_request = cpu.map(|c| c / sent as f64 * 1e6);
        p.gateway_cpu_us_per_request = gateway_cpu / sent as f64 * 1e6;
    }
    p
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

/// The scheduler run time (`/proc/self/task/*/schedstat`, nanoseconds) of each gateway thread
/// alive now, by thread id.
fn gateway_threads_ns() -> std::collections::HashMap<String, u64> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Default::default() };
    let mut by_thread = std::collections::HashMap::new();
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !is_gateway_thread(comm.trim()) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        if let Some(ns) = stat.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()) {
            by_thread.insert(task.file_name().to_string_lossy().into_owned(), ns);
        }
    }
    by_thread
}

/// CPU time the gateway's threads used between two [`gateway_threads_ns`] readings, seconds:
/// what each thread alive at the end used since the start (all of it, for one started since).
/// A thread that exited between them (an idle blocking-pool thread, a closed SQLite
/// connection) takes its share with it.
fn gateway_cpu_between(
    before: &std::collections::HashMap<String, u64>,
    after: &std::collections::HashMap<String, u64>,
) -> f64 {
    let ns: u64 = after
        .iter()
        .map(|(tid, ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    ns as f64 / 1e9
}

async fn offer(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    rate: f64,
    seconds: f64,
) -> Round {
    let n = (rate * seconds).round() as usize;
    let cpu_before = process_cpu_s();
    let gateway_before = gateway_threads_ns();
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
                r.headers()
                    .get(sluice_wire::header::GATEWAY_OVERHEAD_MS)?
                    .to_str()
                    .ok()?
                    .parse::<f64>()
                    .ok()
            });
            // `None` when it succeeded, else what went wrong (a status, or how it failed).
            let failed = match r {
                Ok(r) if !r.status().is_success() => Some(r.status().as_u16().to_string()),
                Ok(r) => r
                    .bytes()
                    .await
                    .err()
                    .map(|e| if e.is_timeout() { "timeout" } else { "body" }.to_owned()),
                Err(e) if e.is_timeout() => Some("timeout".into()),
                Err(e) if e.is_connect() => Some("connect".into()),
                Err(_) => Some("transport".into()),
            };
            // From the scheduled send, so a client that fell behind shows as latency.
            let e2e = tokio::time::Instant::now().saturating_duration_since(at);
            (failed, e2e, overhead, late)
        }));
    }
    let mut r = Round { sent: n, ..Round::default() };
    let mut last = start;
    for t in tasks {
        if let Ok((failed, d, o, l)) = t.await {
            match failed {
                None => {
                    r.ok += 1;
                    r.e2e.push(d.as_secs_f64());
                    r.overhead.extend(o.map(|ms| ms / 1000.0));
                }
                Some(why) => {
                    r.errors += 1;
                    *r.failures.entry(why).or_default() += 1;
                }
            }
            r.late.push(l.as_secs_f64());
        }
        last = last.max(tokio::time::Instant::now());
    }
    r.busy_s = last.saturating_duration_since(start).as_secs_f64();
    r.cpu_s = cpu_before.zip(process_cpu_s()).map(|(a, b)| b - a);
    r.gateway_cpu_s = gateway_cpu_between(&gateway_before, &gateway_threads_ns());
    r
}

/// Runs `sluice bench gateway`.
pub fn run_bench_gateway(args: BenchGatewayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.seconds > 0.0 && args.rates.iter().all(|r| *r > 0.0),
        "--rates and --seconds must be positive"
    );
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    let cpus = allowed_cpus();
    let layout =
        args.layout.unwrap_or(if cpus.len() >= 2 { Layout::Isolated } else { Layout::Shared });
    anyhow::ensure!(
        layout == Layout::Shared || cpus.len() >= 2,
        "--layout isolated needs two CPUs; this process may use {}",
        cpus.len()
    );
    // One stderr line per request would dominate a 2-core machine at these rates.
    sluice_engine::server::REQUEST_LOG.store(false, std::sync::atomic::Ordering::Relaxed);
    let dir = tempfile_dir()?;
    let model_path = dir.join("bench-tiny.gguf");
    write_gguf(&SynthSpec::tiny(), GgmlType::Q8_0, &model_path)
        .context("writing the synthetic model")?;
    let io = IoRuntime::start()?;
    let (engine_addr, tokens) = start_engine(&model_path, &io)?;
    let db = format!("sqlite://{}", dir.join("ledger.db").display());
    // The gateway's own I/O runtime (ledger, usage writer, health checks), apart from the
    // engine's HTTP server, so the layout can place each.
    let gw_io = IoRuntime::named("sluice-gw-io")?;
    let redis_url = args.redis_url.clone();
    let stream = format!("{{bench}}:usage:{}", uuid::Uuid::new_v4().simple());
    let (ledger, usage, key) = gw_io.handle.block_on(async {
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
        let usage = match &redis_url {
            Some(url) => {
                let ns = Namespace::new(BENCH_NAMESPACE).map_err(anyhow::Error::msg)?;
                Usage::connect(&ledger, &db, Some(url), &ns, &stream).await?
            }
            // As in `sluice up`: the usage writer at background priority on a thread of its
            // own.
            None => Usage::local(&db).await?,
        };
        anyhow::Ok((ledger, usage, key))
    })?;
    let gw_port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let gw_addr = format!("127.0.0.1:{gw_port}");
    // The synthetic model is priced (as the shipped default rates), as every served model
    // must be.
    let prices = sluice_policies::prices::PriceList::parse(
        r#"{"version": "bench-1", "default": {"input": 0.1, "cached_input": 0.05, "output": 0.2},
            "models": {"bench": {"default": {"input": 0.1, "cached_input": 0.05, "output": 0.2}}}}"#,
    )
    .map_err(|e| anyhow::anyhow!("the bench's price list: {e}"))?;
    let cfg = GatewayConfig {
        default_max_tokens: 16,
        name: "bench".into(),
        prices: Box::leak(Box::new(prices)),
        ..GatewayConfig::platform(
            &[engine_addr.to_string()],
            Some("bench-token".into()),
            RedisDownPolicy::Local,
        )
    };
    let gateway = Gateway::new(
        cfg,
        ledger.clone(),
        usage.limiter,
        vec![("bench".to_owned(), tokens)],
        usage.sink.clone(),
        gw_io.handle.clone(),
    );
    let journal = gateway.journal();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let listen = gw_addr.clone();
    let proxy = std::thread::spawn(move || {
        run_proxy_until(gateway, &listen, None, Box::new(ChannelShutdown(stop_rx)))
    });
    let client_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let (points, search) =
        client_rt.block_on(measure(&args, layout, &cpus, &gw_addr, engine_addr, &key))?;
    let _ = stop_tx.send(true);
    let stopped = proxy.join();
    finish(&gw_io, usage.ingest.as_deref(), &usage.sink, journal.as_deref(), &ledger)?;
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(url) = &redis_url {
        // The run's events are not billed anywhere.
        gw_io.handle.block_on(async {
            let mut conn =
                redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
            // Its gateway's entry in the journal's list, which no other gateway would sweep.
            let members = format!("{BENCH_NAMESPACE}:gateways:{stream}");
            redis::cmd("DEL").arg(&stream).arg(members).query_async::<()>(&mut conn).await
        })?;
    }
    match stopped {
        Ok(r) => r.context("running the gateway")?,
        Err(_) => anyhow::bail!("the gateway's thread panicked"),
    }
    report(&args, layout, &cpus, redis_url.is_some(), &points, search.as_ref())
}

/// Starts the engine on the synthetic model at `model_path`, its HTTP server on `io`: its
/// address and the gateway's token counter for the model.
fn start_engine(
    model_path: &std::path::Path,
    io: &IoRuntime,
) -> anyhow::Result<(std::net::SocketAddr, TokenCounter)> {
    let model = Arc::new(LoadedModel::load(model_path)?);
    let tokens = TokenCounter::open(model_path)?;
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
    let engine_addr = io.handle.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        anyhow::Ok(addr)
    })?;
    Ok((engine_addr, tokens))
}

/// Offers each rate, after a warm-up, in alternating rounds straight to the engine and through
/// the gateway: the pooled points, `(engine, gateway)`, per rate.
async fn measure(
    args: &BenchGatewayArgs,
    layout: Layout,
    cpus: &[usize],
    gw_addr: &str,
    engine_addr: std::net::SocketAddr,
    key: &str,
) -> anyhow::Result<(Vec<(Point, Point)>, Option<Search>)> {
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
    if layout == Layout::Isolated {
        pin_threads(cpus)?;
    }
    let sides = Sides { c, direct, via, key, layout, cpus };
    let mut points = Vec::new();
    if !args.search {
        for &rate in &args.rates {
            points.push(sides.at(args, rate).await?);
        }
        return Ok((points, None));
    }
    let search = search(args, &sides, &mut points).await?;
    Ok((points, Some(search)))
}

/// Prints the run: `--json` lines (the layout, each point, the search), or the table.
fn report(
    args: &BenchGatewayArgs,
    layout: Layout,
    cpus: &[usize],
    redis: bool,
    points: &[(Point, Point)],
    search: Option<&Search>,
) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::json!({"layout": layout, "cpus": cpus, "redis": redis}));
        for (d, g) in points {
            println!("{}", serde_json::to_string(d)?);
            println!("{}", serde_json::to_string(g)?);
        }
        if let Some(search) = search {
            println!("{}", serde_json::json!({ "search": search }));
        }
        return Ok(());
    }
    print_points(args, layout, cpus, redis, points);
    if let Some(s) = search {
        let rate =
            |r: Option<f64>| r.map_or_else(|| "none".to_owned(), |r| format!("{r:.0} req/s"));
        println!(
            "search ({}): highest rate held {}, lowest failed {}",
            s.criterion,
            rate(s.held_rps),
            rate(s.failed_rps)
        );
    }
    Ok(())
}

/// The two ways to the engine, and where the threads go.
struct Sides<'a> {
    c: reqwest::Client,
    direct: String,
    via: String,
    key: &'a str,
    layout: Layout,
    cpus: &'a [usize],
}

impl Sides<'_> {
    /// One rate: a warm-up both ways, then `--rounds` alternating rounds, pooled per side.
    async fn at(&self, args: &BenchGatewayArgs, rate: f64) -> anyhow::Result<(Point, Point)> {
        let (c, direct, via, key) = (&self.c, &self.direct, &self.via, Some(self.key));
        // Warm-up at this rate, both ways, left out (after pinning, so threads have settled
        // on their CPUs): connections, key cache, allocator, the SQLite connection, the
        // engine's KV pages at this concurrency. Without it the first round's p99 carried
        // tens of milliseconds of start-up.
        offer(c, via, key, rate, 1.0).await;
        offer(c, direct, Some("bench-token"), rate, 1.0).await;
        let (mut d, mut g) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds {
            if self.layout == Layout::Isolated {
                // Again each round: threads made since then (tokio's blocking pool, new
                // SQLite connections) inherit a set that may be the other side's.
                pin_threads(self.cpus)?;
            }
            d.push(offer(c, direct, Some("bench-token"), rate, args.seconds).await);
            g.push(offer(c, via, key, rate, args.seconds).await);
        }
        Ok((pool("engine", rate, &d), pool("gateway", rate, &g)))
    }
}

/// What `--search` found.
#[derive(Debug, serde::Serialize)]
struct Search {
    /// The highest rate held, requests/s (`None`: not even the first).
    held_rps: Option<f64>,
    /// The lowest rate that failed (`None`: every rate tried held).
    failed_rps: Option<f64>,
    /// What a rate must keep to be held.
    criterion: &'static str,
}

/// The added e2e p99 of the median round, ms: each round's p99 through the gateway less the
/// same round's straight to the engine. The median is robust to one round caught in a stall
/// of the machine, which moves a pooled p99 by tens of milliseconds either way.
fn added_p99_median_ms(d: &Point, g: &Point) -> f64 {
    let mut per_round: Vec<f64> =
        g.round_e2e_p99_ms.iter().zip(&d.round_e2e_p99_ms).map(|(a, b)| a - b).collect();
    per_round.sort_by(f64::total_cmp);
    per_round.get(per_round.len() / 2).copied().unwrap_or(0.0)
}

/// Whether the gateway held at this rate: requests served and none failed either way, and an
/// added e2e p99 under [`HELD_P99_MS`] in the median round.
fn held(d: &Point, g: &Point) -> bool {
    let served = |p: &Point| p.ok > 0 && p.errors == 0;
    served(d) && served(g) && added_p99_median_ms(d, g) < HELD_P99_MS
}

/// `--search`: from the first rate, doubling while rates hold (or halving while they fail),
/// then bisecting between the highest rate held and the lowest failed.
async fn search(
    args: &BenchGatewayArgs,
    sides: &Sides<'_>,
    points: &mut Vec<(Point, Point)>,
) -> anyhow::Result<Search> {
    let criterion = "0 failed requests, added e2e p99 (median round) < 1 ms";
    let mut try_rate = async |rate: f64| -> anyhow::Result<bool> {
        let (d, g) = sides.at(args, rate).await?;
        let ok = held(&d, &g);
        eprintln!("search: {rate:.0} req/s {}", if ok { "held" } else { "failed" });
        points.push((d, g));
        Ok(ok)
    };
    let first = args.rates.first().copied().unwrap_or(250.0);
    let (mut held_rps, mut failed_rps) = (None, None);
    let mut rate = first;
    for _ in 0..MAX_STEPS_OUT {
        if try_rate(rate).await? {
            held_rps = Some(rate);
            if failed_rps.is_some() {
                break;
            }
            rate *= 2.0;
        } else {
            failed_rps = Some(rate);
            if held_rps.is_some() {
                break;
            }
            rate /= 2.0;
        }
    }
    let (Some(mut lo), Some(mut hi)) = (held_rps, failed_rps) else {
        return Ok(Search { held_rps, failed_rps, criterion });
    };
    for _ in 0..args.search_steps {
        // Rates to the nearest 50 requests/s: finer is below the run-to-run noise.
        let mid = ((lo + hi) / 2.0 / 50.0).round() * 50.0;
        if mid <= lo || mid >= hi {
            break;
        }
        if try_rate(mid).await? { lo = mid } else { hi = mid }
    }
    Ok(Search { held_rps: Some(lo), failed_rps: Some(hi), criterion })
}

/// The table of `points`, with the run's layout and what the gateway used.
fn print_points(
    args: &BenchGatewayArgs,
    layout: Layout,
    cpus: &[usize],
    redis: bool,
    points: &[(Point, Point)],
) {
    println!(
        "gateway overhead: tiny synthetic model, completions of 3 prompt + 1 output token, open loop, {} rounds of {} s per point, alternating",
        args.rounds, args.seconds
    );
    println!(
        "layout: {}",
        match layout {
            Layout::Isolated => format!(
                "isolated (gateway threads on CPU {:?}, client and engine on {:?})",
                cpus.last().copied().unwrap_or(0),
                &cpus[..cpus.len().saturating_sub(1)]
            ),
            Layout::Shared => format!("shared (no pinning, {} CPUs)", cpus.len()),
        }
    );
    println!(
        "usage and limits: {}",
        if redis {
            "Redis (shared limits, the usage stream, the in-flight journal)"
        } else {
            "in-process limits, the embedded ledger's writer"
        }
    );
    println!(
        "baseline: target p99 overhead < 1 ms at 2,000 requests/s (issue 5); e2e compared with the same load straight to the engine"
    );
    println!(
        "offered  target    req/s   ok     err  e2e p50   e2e p99   overhead p50  overhead p99  (vs 1 ms)  send late p99"
    );
    for (d, g) in points {
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
            if !p.failures.is_empty() {
                let why: Vec<String> =
                    p.failures.iter().map(|(w, n)| format!("{w} x{n}")).collect();
                println!("         {} errors: {}", p.target, why.join(", "));
            }
        }
        let per_round = g.round_e2e_p99_ms.iter().zip(&d.round_e2e_p99_ms);
        let shown: Vec<String> = per_round.map(|(a, b)| format!("{:+.2}", a - b)).collect();
        let median = added_p99_median_ms(d, g);
        println!(
            "         added e2e: p50 {:+.2} ms, p99 {:+.2} ms pooled, {median:+.2} ms median round (rounds: {} ms)",
            g.e2e_p50_ms - d.e2e_p50_ms,
            g.e2e_p99_ms - d.e2e_p99_ms,
            shown.join(" / ")
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
        // The gateway's threads alone: what it costs, without the client's and the engine's
        // share of the extra hop's sockets.
        println!(
            "         gateway threads' CPU per request: {:.0} us (in the straight phase, serving nothing: {:.0} us)",
            g.gateway_cpu_us_per_request, d.gateway_cpu_us_per_request
        );
    }
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir()
        .join(format!("sluice-bench-gateway-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
