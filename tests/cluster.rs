//! The cluster drill: 2 gateways, 3 engines and 2 billing consumers as separate processes on
//! loopback, with Postgres and Redis, under two `sluice bench serve` loads (one streamed, one of
//! whole answers; every request with an Idempotency-Key, spread over both gateways and retried
//! on the other one with the same key when it fails in a retryable way). Meanwhile the drill,
//! in turn:
//!
//! 1. SIGTERMs an engine: it drains, the gateways stop routing to it, no request fails; it is
//!    started again.
//! 2. SIGKILLs an engine: its streams end with a terminal error event and are billed for what
//!    the client received; new requests go elsewhere; it is started again.
//! 3. Restarts a gateway (SIGTERM, drained, down 4 s, started again on its port): clients retry
//!    on the other one with the same Idempotency-Key and are billed once.
//! 4. Stops Postgres while a long request of its own runs (its usage is published during the
//!    outage), SIGKILLs the billing consumer that holds a batch it could not commit
//!    (read, unacknowledged), starts Postgres and the consumer again.
//! 5. Restarts Redis (its append-only file keeps the stream, the windows and the claims).
//!
//! Then it reconciles: every request id a client was given has exactly one row with the status
//! the client saw; completion tokens equal what the client received; no Idempotency-Key is
//! billed for two completions; the tenant's day counter in Redis equals the ledger's usage and
//! nothing is left reserved; nothing is pending in the usage stream; `sluice audit reconcile`
//! finds every engine's record of what it ran in agreement with the ledger. It prints a table
//! of the faults, the requests each touched, and the reconciliation's counts.
//!
//! It stops the machine's Postgres, so it holds the Postgres test lock exclusively and starts
//! the cluster again on every exit path.

#[path = "../billing/tests/common/mod.rs"]
mod billing_common;
#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use chrono::{Datelike, DurationRound};
use sluice_billing::Ledger;
use support::{
    Proc, Try, free_port, read_tries, reconcile, redis_cmd, redis_server, rows_for,
    signal_and_wait, spawn_sluice_logged, wait_healthy,
};

const MODEL_ID: &str = "smollm2-135m-instruct";
const TOKEN: &str = "cluster-internal-token";
const JWT_SECRET: &str = "cluster-secret-cluster-secret-0123";
const STREAM: &str = "{sluice}:usage:cluster";
/// Seconds of offered load per client process.
const LOAD_SECONDS: u64 = 60;

/// The processes of the fleet, each restartable on its own address.
struct Fleet {
    dir: tempfile::TempDir,
    model: String,
    pg: String,
    redis_port: u16,
    engines: Vec<(Option<Proc>, String)>,
    gateways: Vec<(Option<Proc>, String)>,
    billing: Vec<(Option<Proc>, String)>,
}

impl Fleet {
    fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.redis_port)
    }

    fn log(&self, name: &str) -> std::path::PathBuf {
        // One log per start: a restarted process does not overwrite its first life's.
        let mut n = 0;
        loop {
            let p = self.dir.path().join(format!("{name}.{n}.log"));
            if !p.exists() {
                return p;
            }
            n += 1;
        }
    }

    /// `sluice ARGS`, logging to a file of its own, and the address it says it listens on;
    /// a start that fails says what it logged.
    fn spawn(
        &self,
        args: &[&str],
        envs: &[(&str, &str)],
        name: &str,
    ) -> anyhow::Result<(Proc, String)> {
        let log = self.log(name);
        spawn_sluice_logged(args, envs, &log).map_err(|e| {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            anyhow::anyhow!("{e}\n--- {name}'s log:\n{text}")
        })
    }

    fn start_engine(&mut self, i: usize) -> anyhow::Result<()> {
        let listen = address(&self.engines[i].1);
        let args = ["engine", "--model", &self.model, "--listen", &listen]
            .into_iter()
            .chain(["--internal-token", TOKEN, "--served-model-name", MODEL_ID])
            .chain(["--kv-cache-mb", "64", "--threads", "1", "--drain-timeout", "20"])
            .collect::<Vec<_>>();
        let (p, at) = self.spawn(&args, &[], &format!("engine{i}"))?;
        self.engines[i] = (Some(p), bound(&at)?);
        Ok(())
    }

    fn start_gateway(&mut self, i: usize) -> anyhow::Result<()> {
        // The gateway's proxy binds after it prints its address, so it cannot say which port
        // the system gave it: it gets one picked here, just before it starts.
        let listen = match self.gateways[i].1.as_str() {
            "" => format!("127.0.0.1:{}", free_port()?),
            at => at.to_string(),
        };
        let redis = self.redis_url();
        let mut args = vec!["gateway", "--plain-http", "--listen", &listen, "--model", &self.model];
        for (_, e) in &self.engines {
            args.extend(["--engine", e.as_str()]);
        }
        // Refused (503, retried by the client) rather than admitted on local limits while
        // Redis is away, so the shared counters see every admitted request.
        args.extend(["--redis-url", &redis, "--redis-down", "refuse", "--drain-timeout", "20"]);
        args.extend(["--usage-stream", STREAM]);
        let envs = [("SLUICE_DATABASE_URL", self.pg.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)];
        let (p, at) = self.spawn(&args, &envs, &format!("gateway{i}"))?;
        self.gateways[i] = (Some(p), bound(&at)?);
        Ok(())
    }

    fn start_billing(&mut self, i: usize) -> anyhow::Result<()> {
        let listen = address(&self.billing[i].1);
        let (redis, consumer) = (self.redis_url(), format!("billing-{}", i + 1));
        let args = ["billing", "--database-url", &self.pg, "--redis-url", &redis]
            .into_iter()
            .chain(["--listen", &listen, "--consumer", &consumer, "--usage-stream", STREAM])
            .chain(["--claim-min-idle", "5", "--drain-timeout", "10"])
            .collect::<Vec<_>>();
        let envs = [("SLUICE_JWT_SECRET", JWT_SECRET)];
        let (p, at) = self.spawn(&args, &envs, &format!("billing{i}"))?;
        self.billing[i] = (Some(p), bound(&at)?);
        Ok(())
    }
}

/// `n` process slots, each with the address its process keeps across restarts (for engines
/// and billing consumers, the one it bound at its first start, on a port the system chose: a
/// port picked by the test and bound later could meanwhile serve as another connection's
/// ephemeral port).
fn slots(n: usize) -> Vec<(Option<Proc>, String)> {
    (0..n).map(|_| (None, String::new())).collect()
}

/// The slot's address, picked now if it has none yet.
/// Where a slot's process listens: its first start's address, or any free port at the first.
fn address(slot: &str) -> String {
    if slot.is_empty() { "127.0.0.1:0".into() } else { slot.to_string() }
}

/// `HOST:PORT` of the `SCHEME://HOST:PORT` a process said it listens on.
fn bound(url: &str) -> anyhow::Result<String> {
    let at = url.split_once("://").map_or(url, |(_, rest)| rest).trim_end_matches('/');
    anyhow::ensure!(at.rsplit_once(':').is_some_and(|(_, p)| p != "0"), "listening on {url:?}");
    Ok(at.to_string())
}

fn int(v: &redis::Value) -> i64 {
    match v {
        redis::Value::Int(n) => *n,
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).parse().unwrap_or(0),
        _ => 0,
    }
}

/// Entries a consumer of the group holds unacknowledged (`XPENDING` summary).
async fn pending_of(url: &str, consumer: &str) -> anyhow::Result<i64> {
    let v = redis_cmd(url, &["XPENDING", STREAM, "billing"]).await?;
    let redis::Value::Array(parts) = v else { return Ok(0) };
    let Some(redis::Value::Array(per)) = parts.get(3) else { return Ok(0) };
    for c in per {
        if let redis::Value::Array(pair) = c
            && let [redis::Value::BulkString(name), count] = pair.as_slice()
            && name == consumer.as_bytes()
        {
            return Ok(int(count));
        }
    }
    Ok(0)
}

/// A `sluice bench serve` load against both gateways.
fn load(fleet: &Fleet, key: &str, stream: bool, log: &Path) -> anyhow::Result<std::process::Child> {
    let base = format!("http://{}", fleet.gateways[0].1);
    let other = format!("http://{}", fleet.gateways[1].1);
    let secs = LOAD_SECONDS.to_string();
    let log_s = log.to_str().context("utf-8")?;
    let mut args = vec!["bench", "serve", "--base-url", &base, "--failover-url", &other];
    args.extend(["--model", MODEL_ID, "--endpoint", "completions", "--request-rate", "1.5"]);
    args.extend(["--duration", &secs, "--max-concurrency", "12", "--input-len", "24"]);
    args.extend(["--output-len", "uniform:16:48", "--timeout", "120"]);
    args.extend(["--idempotent-retries", "8", "--requests-log", log_s]);
    args.extend(["--seed", if stream { "1" } else { "2" }]);
    if !stream {
        args.push("--no-stream");
    }
    let out = std::fs::File::create(log.with_extension("out"))?;
    Ok(Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .env("OPENAI_API_KEY", key)
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()?)
}

/// The faults, in order, with when each began (seconds into the load) and what it did.
#[derive(Default)]
struct Faults(Vec<(String, f64, f64, String)>);

impl Faults {
    fn add(&mut self, what: &str, began: Instant, t0: Instant, note: String) {
        let (from, to) = (began - t0, Instant::now() - t0);
        self.0.push((what.to_owned(), from.as_secs_f64(), to.as_secs_f64(), note));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_loses_nothing_through_restarts_kills_and_outages() -> anyhow::Result<()> {
    let _lock = billing_common::postgres_lock(true).await?;
    let pg = billing_common::PgDatabase::create_unlocked().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let key = support::tenants_with_keys(&ledger, &["fleet"], None).await?.remove("fleet");
    let key = key.context("the tenant's key")?;
    ledger.close().await;

    let mut fleet = Fleet {
        dir: tempfile::tempdir()?,
        model: common::default_model()?.to_str().context("utf-8")?.to_owned(),
        pg: pg.url.clone(),
        redis_port: free_port()?,
        engines: slots(3),
        gateways: slots(2),
        billing: slots(2),
    };
    let redis_url = fleet.redis_url();
    let mut redis_proc = Some(redis_server(fleet.dir.path(), fleet.redis_port, true)?);
    for i in 0..3 {
        fleet.start_engine(i)?;
    }
    for i in 0..2 {
        fleet.start_billing(i)?;
        fleet.start_gateway(i)?;
    }
    let c = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    for (_, e) in &fleet.engines {
        wait_healthy(&c, &format!("http://{e}/health")).await?;
    }
    for (_, g) in &fleet.gateways {
        wait_healthy(&c, &format!("http://{g}/readyz")).await?;
    }

    let logs = [fleet.dir.path().join("stream.jsonl"), fleet.dir.path().join("whole.jsonl")];
    let mut loads = vec![load(&fleet, &key, true, &logs[0])?, load(&fleet, &key, false, &logs[1])?];
    let t0 = Instant::now();
    let at = |s: u64| async move {
        let when = t0 + Duration::from_secs(s);
        tokio::time::sleep_until(when.into()).await;
    };
    let mut faults = Faults::default();
    let block = |f: &mut dyn FnMut() -> anyhow::Result<std::process::ExitStatus>| {
        tokio::task::block_in_place(f)
    };

    // 1. An engine drains on SIGTERM and comes back.
    at(6).await;
    let began = Instant::now();
    let mut p = fleet.engines[0].0.take().context("engine 0")?;
    let status = block(&mut || signal_and_wait(&mut p.0, "TERM", Duration::from_secs(40)))?;
    ensure!(status.success(), "engine 0 exited with {status} after SIGTERM");
    fleet.start_engine(0)?;
    wait_healthy(&c, &format!("http://{}/health", fleet.engines[0].1)).await?;
    faults.add("SIGTERM engine 0, restart", began, t0, format!("exit {status}"));

    // 2. An engine is killed with requests running on it, and comes back.
    at(16).await;
    let began = Instant::now();
    let metrics = format!("http://{}/metrics", fleet.engines[1].1);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut running = 0;
    while running == 0 && Instant::now() < deadline {
        let text = c.get(&metrics).send().await?.text().await?;
        running = text
            .lines()
            .find_map(|l| l.strip_prefix("sluice_engine_num_requests_running "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(running > 0, "engine 1 ran nothing to kill within 15 s");
    let mut p = fleet.engines[1].0.take().context("engine 1")?;
    p.0.kill()?;
    p.0.wait()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    fleet.start_engine(1)?;
    wait_healthy(&c, &format!("http://{}/health", fleet.engines[1].1)).await?;
    faults.add("SIGKILL engine 1, restart", began, t0, format!("{running} requests running"));

    // 3. A rolling restart of a gateway.
    at(26).await;
    let began = Instant::now();
    let mut p = fleet.gateways[0].0.take().context("gateway 0")?;
    let status = block(&mut || signal_and_wait(&mut p.0, "TERM", Duration::from_secs(60)))?;
    ensure!(status.success(), "gateway 0 exited with {status} after SIGTERM");
    // Down for 4 s, as a replaced pod is: its clients retry on the other one.
    tokio::time::sleep(Duration::from_secs(4)).await;
    fleet.start_gateway(0)?;
    wait_healthy(&c, &format!("http://{}/readyz", fleet.gateways[0].1)).await?;
    faults.add("SIGTERM gateway 0, restart", began, t0, format!("exit {status}"));

    // 4. Postgres stops; a consumer dies holding a batch it could not commit.
    at(36).await;
    let began = Instant::now();
    // A long request of the test's own is running when Postgres stops, so a usage entry is
    // published while it is down whatever the load has in flight then (its requests are short,
    // and at times none was running: no consumer held anything).
    let long = c
        .post(format!("http://{}/v1/completions", fleet.gateways[1].1))
        .bearer_auth(&key)
        .timeout(Duration::from_secs(120))
        .json(&serde_json::json!({"model": MODEL_ID, "prompt": "Tell a long story.",
            "max_tokens": 300, "ignore_eos": true, "stream": true}))
        .send()
        .await?;
    ensure!(long.status() == 200, "a long request across the outage: {}", long.status());
    let long = tokio::spawn(long.text());
    let mut stopped = billing_common::PostgresStopped::stop()?;
    // Whichever consumer first holds entries it cannot commit (the requests running when
    // Postgres stopped still end and publish their usage).
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut held, mut victim) = (0, 0);
    'wait: while Instant::now() < deadline {
        for i in 0..2 {
            held = pending_of(&redis_url, &format!("billing-{}", i + 1)).await?;
            if held > 0 {
                victim = i;
                break 'wait;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut p = fleet.billing[victim].0.take().context("billing")?;
    p.0.kill()?;
    p.0.wait()?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stopped.start()?;
    fleet.start_billing(victim)?;
    faults.add(
        "Postgres stop, SIGKILL a consumer mid-batch, restart both",
        began,
        t0,
        format!("billing-{} held {held} unacknowledged entries", victim + 1),
    );
    ensure!(held > 0, "no consumer held a batch while Postgres was down");
    let long = long.await??;
    ensure!(long.contains("data: [DONE]"), "the long request was cut short: {long}");

    // 5. Redis restarts.
    at(48).await;
    let began = Instant::now();
    drop(redis_proc.take());
    redis_proc = Some(redis_server(fleet.dir.path(), fleet.redis_port, true)?);
    faults.add("Redis restart (append-only file)", began, t0, String::new());

    let mut exits = Vec::new();
    for l in &mut loads {
        let deadline = Instant::now() + Duration::from_secs(LOAD_SECONDS + 180);
        loop {
            if let Some(s) = l.try_wait()? {
                exits.push(s);
                break;
            }
            if Instant::now() > deadline {
                let _ = l.kill();
                bail!("a load did not finish within {} s", LOAD_SECONDS + 180);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    for (s, l) in exits.iter().zip(&logs) {
        let out = std::fs::read_to_string(l.with_extension("out")).unwrap_or_default();
        ensure!(s.success(), "bench serve exited with {s}:\n{out}");
    }

    // Reconcile.
    let requests: Vec<Vec<Try>> =
        logs.iter().map(|l| read_tries(l)).collect::<anyhow::Result<Vec<_>>>()?.concat();
    let tries: Vec<&Try> = requests.iter().flatten().collect();
    // A refusal before authentication (the ledger away) is nobody's request: no row.
    let with_id: Vec<&Try> = tries
        .iter()
        .copied()
        .filter(|t| t.request_id.is_some() && t.error_code.as_deref() != Some("auth_unavailable"))
        .collect();
    let ledger = Ledger::connect(&pg.url).await?;
    let ids: Vec<&str> = with_id.iter().filter_map(|t| t.request_id.as_deref()).collect();
    let rows = rows_for(&ledger, &ids, Duration::from_secs(90)).await?;
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut replays = 0;
    for t in &with_id {
        let id = t.request_id.as_deref().unwrap_or_default();
        let rs = &rows[id];
        ensure!(rs.len() == 1, "{} rows for {id}", rs.len());
        let r = &rs[0];
        let status = r["http_status"].as_u64().unwrap_or(0) as u16;
        let billed = r["completion_tokens"].as_u64().unwrap_or(0);
        if t.status == Some(200) && status == 200 && t.ok {
            // Read to the end: billed what it received (a replay: what the first received).
            let got = t.usage_tokens.context("a completed answer without usage")?;
            ensure!(billed == got, "{id}: billed {billed} for {got} received: {t:?} {r:?}");
            if t.stream {
                ensure!(got == t.streamed_tokens, "{id}: usage {got}, streamed {t:?}");
            }
            *counts.entry("completed, billed as received").or_default() += 1;
            let billed_key = rs[0]["idempotency_key"].as_str().unwrap_or_default();
            ensure!(billed_key.starts_with(&format!("{}#", t.key)), "{id}: billed under {r:?}");
        } else if t.status == Some(200) && t.stream {
            // Cut short by a failure after the stream began: billed what the client got.
            ensure!(
                status == 200 && billed == t.streamed_tokens,
                "{id}: billed {billed} ({status}) for {} streamed: {t:?} {r:?}",
                t.streamed_tokens
            );
            ensure!(t.error_code.is_some(), "{id}: a stream cut short without an error event");
            *counts.entry("streams cut short, billed as received").or_default() += 1;
        } else {
            ensure!(Some(status) == t.status, "{id}: row {status}, client {:?}", t.status);
            ensure!(
                r["cost_micros"] == 0 && billed == 0,
                "{id}: an error answer that cost something: {r:?}"
            );
            *counts.entry("refused or failed, free").or_default() += 1;
        }
        if t.status == Some(200)
            && tries.iter().filter(|u| u.request_id == t.request_id).count() > 1
        {
            replays += 1;
        }
    }
    // Billed once: no Idempotency-Key has two completed rows.
    let mut completed_per_key: HashMap<&str, usize> = HashMap::new();
    for r in rows.values().flatten() {
        if r["http_status"] == 200 && r["completion_tokens"].as_u64().is_some_and(|n| n > 0) {
            let k = r["idempotency_key"].as_str().unwrap_or_default();
            let k = k.split('#').next().unwrap_or_default();
            *completed_per_key.entry(k).or_default() += 1;
        }
    }
    let keys_with_retries = requests.iter().filter(|r| r.len() > 1).count();
    // The restarted gateway's clients were refused while it drained or found nobody there
    // (the only times gateway 0 answered 503 `shutting_down` or nothing), and went to the
    // other one.
    let gateway0 = format!("http://{}/", fleet.gateways[0].1);
    let restart_retries = tries
        .iter()
        .filter(|t| {
            t.url.starts_with(&gateway0)
                && (t.status.is_none() || t.error_code.as_deref() == Some("shutting_down"))
        })
        .count();
    ensure!(restart_retries > 0, "no client retried while gateway 0 restarted");
    for req in &requests {
        let Some(k) = req.first().map(|t| t.key.as_str()) else { bail!("a request without tries") };
        let done = completed_per_key.get(k).copied().unwrap_or(0);
        let cut = req.iter().filter(|t| t.status == Some(200) && !t.ok).count();
        ensure!(done <= 1 + cut, "key {k}: {done} completed rows for {} tries: {req:?}", req.len());
    }
    // Every request ends answered: what a fault cut short was retried under its key.
    let failed: Vec<_> = requests.iter().filter(|r| !r.last().is_some_and(|t| t.ok)).collect();
    ensure!(failed.is_empty(), "{} requests failed after their retries: {failed:?}", failed.len());
    let failed = failed.len();
    // The killed engine's streams ended with an error event (its whole answers, not begun at
    // the client, the gateway retried on another engine itself).
    let killed = tries.iter().filter(|t| t.error_code.as_deref() == Some("upstream_error")).count();

    // The tenant's day counter in Redis against the ledger; nothing left reserved.
    let now = chrono::Utc::now();
    let day_start = now.duration_trunc(chrono::TimeDelta::days(1))?;
    let month_start = day_start.with_day(1).context("month")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let (counter, ledger_day, reserved) = loop {
        let (day, _) = ledger.tokens_used("fleet", None, day_start, month_start).await?;
        let win = "{sluice:t:fleet}:windows";
        let counter = int(&redis_cmd(&redis_url, &["HGET", win, "day_n"]).await?);
        let reserved =
            int(&redis_cmd(&redis_url, &["HLEN", "{sluice:t:fleet}:reservations"]).await?);
        if counter as u64 == day && reserved == 0 || Instant::now() > deadline {
            break (counter, day, reserved);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    ensure!(reserved == 0, "{reserved} reservations left in Redis");
    ensure!(
        counter as u64 == ledger_day,
        "Redis counts {counter} tokens today, the ledger {ledger_day}"
    );
    // Nothing pending in the usage stream.
    let pending = redis_cmd(&redis_url, &["XPENDING", STREAM, "billing"]).await?;
    let pending = match &pending {
        redis::Value::Array(p) => p.first().map(int).unwrap_or(0),
        _ => 0,
    };
    ensure!(pending == 0, "{pending} usage entries left pending");

    // Every engine's record of what it ran, against the ledger.
    let engines: Vec<&str> = fleet.engines.iter().map(|(_, e)| e.as_str()).collect();
    let admin = format!("http://{}", fleet.billing[0].1);
    let report = reconcile(JWT_SECRET, &admin, &engines, TOKEN)?;

    // The drill's table.
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for t in &tries {
        let k = match (&t.status, &t.error_code) {
            (Some(s), Some(c)) => format!("{s} {c}"),
            (Some(s), None) => format!("{s}{}", if t.ok { "" } else { " cut short" }),
            (None, _) => "no answer".to_owned(),
        };
        *statuses.entry(k).or_default() += 1;
    }
    eprintln!("\n| fault | from s | to s | note |\n|---|---|---|---|");
    for (what, from, to, note) in &faults.0 {
        eprintln!("| {what} | {from:.1} | {to:.1} | {note} |");
    }
    eprintln!("\n| tries by outcome | count |\n|---|---|");
    for (k, n) in &statuses {
        eprintln!("| {k} | {n} |");
    }
    eprintln!(
        "\n| reconciliation | count |\n|---|---|\n| requests | {} |\n| tries | {} |\n\
         | request ids checked, one row each | {} |\n| requests retried under their key | {keys_with_retries} |\n\
         | tries refused or unanswered by the restarting gateway | {restart_retries} |\n\
         | retries answered by replay | {replays} |\n| requests failed after retries | {failed} |\n\
         | Redis day counter = ledger day tokens | {counter} = {ledger_day} |\n\
         | usage entries pending | {pending} |\n| tries ended by the killed engine | {killed} |",
        requests.len(),
        tries.len(),
        with_id.len()
    );
    for (k, n) in &counts {
        eprintln!("| {k} | {n} |");
    }
    eprintln!("\n{report}");
    ledger.close().await;
    drop(redis_proc);
    Ok(())
}
