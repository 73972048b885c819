//! The ledger drill: concurrent streamed and whole requests through a gateway (Redis limits
//! and usage stream, Postgres ledger, `sluice billing` ingesting) with one client in ten
//! hanging up, while Redis restarts, the gateway is stopped with SIGINT mid-load and started
//! again, and Postgres restarts. Afterwards every request id a client was given has exactly
//! one row, rows of streams the client read to the end hold the tokens it received, refused
//! rows cost nothing, and `sluice audit reconcile` finds the ledger and the engine's own
//! record of every request in agreement.
//!
//! It stops the machine's Postgres, so it holds the Postgres test lock exclusively (as the
//! billing outage test does) and restarts the cluster on every exit path.

#[path = "../billing/tests/common/mod.rs"]
mod billing_common;
#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use futures_util::StreamExt;
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::query::RecordFilter;
use support::{
    Proc, free_port, reconcile, redis_server, signal_and_wait, spawn_engine, spawn_sluice,
    wait_healthy,
};

const MODEL_ID: &str = "smollm2-135m-instruct";
const TOKEN: &str = "drill-internal-token";
const JWT_SECRET: &str = "drill-secret-drill-secret-drill-0123";
const REQUESTS: usize = 80;

/// What a client saw of one request.
#[derive(Debug, Default, Clone)]
struct Seen {
    stream: bool,
    hung_up: bool,
    status: Option<u16>,
    request_id: Option<String>,
    /// The usage the stream carried (read to the end).
    tokens: Option<u64>,
    /// 503 before authentication (the ledger was down): not a tenant's request.
    auth_unavailable: bool,
}

async fn one(c: &reqwest::Client, base: &str, key: &str, i: usize) -> Seen {
    let stream = i.is_multiple_of(2);
    // One in ten: a whole answer abandoned after 150 ms, or a stream after its first chunk.
    let hung_up = i % 20 == 3 || i % 20 == 8;
    let mut seen = Seen { stream, hung_up, ..Seen::default() };
    let max_tokens = if hung_up { 200 } else { 8 + (i % 5) * 8 };
    let mut body = json!({"model": MODEL_ID, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": format!("Count from {i} upwards.")}]});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let mut req = c.post(format!("{base}/v1/chat/completions")).bearer_auth(key).json(&body);
    if hung_up && !stream {
        req = req.timeout(Duration::from_millis(150));
    }
    let Ok(r) = req.send().await else { return seen };
    seen.status = Some(r.status().as_u16());
    seen.request_id =
        r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    if !stream {
        let text = r.text().await.unwrap_or_default();
        seen.auth_unavailable =
            seen.status == Some(503) && text.contains("authentication is unavailable");
        return seen;
    }
    let mut body = r.bytes_stream();
    let mut text = String::new();
    while let Some(Ok(chunk)) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
        if hung_up {
            return seen;
        }
    }
    seen.auth_unavailable =
        seen.status == Some(503) && text.contains("authentication is unavailable");
    seen.tokens = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    seen
}

fn gateway(engine: &str, db: &str, redis: &str, model: &str) -> anyhow::Result<(Proc, String)> {
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (p, addr) = spawn_sluice(
        &["gateway", "--plain-http", "--listen", &listen, "--engine", engine, "--model", model]
            .into_iter()
            .chain(["--redis-url", redis, "--drain-timeout", "20"])
            .collect::<Vec<_>>(),
        &[("SLUICE_DATABASE_URL", db), ("SLUICE_INTERNAL_TOKEN", TOKEN)],
    )?;
    Ok((p, format!("http://{addr}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_survives_restarts_disconnects_and_a_shutdown() -> anyhow::Result<()> {
    let _lock = billing_common::postgres_lock(true).await?;
    let pg = billing_common::PgDatabase::create_unlocked().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let keys = support::tenants_with_keys(&ledger, &["drill", "capped"], Some("capped")).await?;
    ledger.close().await;

    let dir = tempfile::tempdir()?;
    let redis_port = free_port()?;
    let redis_url = format!("redis://127.0.0.1:{redis_port}");
    let mut redis_proc = redis_server(dir.path(), redis_port, true)?;
    let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
    let (_engine, engine) = spawn_engine(&model, TOKEN, "64", &[], None)?;
    let (_billing, admin) = spawn_sluice(
        &[
            "billing",
            "--database-url",
            &pg.url,
            "--redis-url",
            &redis_url,
            "--listen",
            "127.0.0.1:0",
        ],
        &[("SLUICE_JWT_SECRET", JWT_SECRET)],
    )?;
    let (gw_proc, gw) = gateway(&engine, &pg.url, &redis_url, &model)?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("{gw}/health")).await?;

    // Four clients take requests in turn; the chaos happens between them.
    let base = Arc::new(Mutex::new(gw));
    let next = Arc::new(Mutex::new(0usize));
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (c, base, next, seen, keys) =
                (c.clone(), base.clone(), next.clone(), seen.clone(), keys.clone());
            tokio::spawn(async move {
                loop {
                    let i = {
                        let mut n = next.lock().unwrap_or_else(|e| e.into_inner());
                        *n += 1;
                        *n - 1
                    };
                    if i >= REQUESTS {
                        return;
                    }
                    let key = if i.is_multiple_of(7) { &keys["capped"] } else { &keys["drill"] };
                    let url = base.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let s = one(&c, &url, key, i).await;
                    seen.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                }
            })
        })
        .collect();
    let done = || seen.lock().unwrap_or_else(|e| e.into_inner()).len();
    let until = |n: usize| async move {
        let deadline = Instant::now() + Duration::from_secs(120);
        while done() < n {
            ensure!(Instant::now() < deadline, "the load stalled at {} of {n}", done());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::Ok(())
    };
    until(REQUESTS / 5).await?;
    // Redis restarts (its append-only file keeps the usage stream).
    drop(redis_proc);
    redis_proc = redis_server(dir.path(), redis_port, true)?;
    until(2 * REQUESTS / 5).await?;
    // A new gateway takes the traffic and the old one is stopped with SIGINT mid-load (what it
    // is running drains; what reaches it meanwhile gets 503).
    let (_gw2, gw2) = gateway(&engine, &pg.url, &redis_url, &model)?;
    wait_healthy(&c, &format!("{gw2}/health")).await?;
    *base.lock().unwrap_or_else(|e| e.into_inner()) = gw2;
    let mut gw_proc = gw_proc;
    tokio::task::block_in_place(|| {
        signal_and_wait(&mut gw_proc.0, "INT", Duration::from_secs(40))
    })?;
    until(3 * REQUESTS / 5).await?;
    // Postgres restarts under load.
    let mut stopped = billing_common::PostgresStopped::stop()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stopped.start()?;
    for t in clients {
        t.await?;
    }
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    drop(redis_proc);

    // Every request a tenant was answered for, by id, has exactly its row (ingestion catches
    // up after the restarts).
    let redis_proc = redis_server(dir.path(), redis_port, true)?;
    let ledger = Ledger::connect(&pg.url).await?;
    let billed: Vec<&Seen> =
        seen.iter().filter(|s| s.request_id.is_some() && !s.auth_unavailable).collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    let rows = loop {
        let page = ledger.records(&RecordFilter { limit: 10_000, ..Default::default() }).await?;
        let rows: HashMap<String, serde_json::Map<String, Value>> = page
            .records
            .into_iter()
            .map(|r| (r["request_id"].as_str().unwrap_or_default().to_owned(), r))
            .collect();
        if billed.iter().all(|s| s.request_id.as_ref().is_some_and(|id| rows.contains_key(id))) {
            break rows;
        }
        if Instant::now() > deadline {
            let missing: Vec<_> = billed
                .iter()
                .filter(|s| !rows.contains_key(s.request_id.as_deref().unwrap_or("")))
                .collect();
            bail!("{} requests without a row after 90 s: {missing:?}", missing.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (mut refused, mut read_through, mut hung_up) = (0, 0, 0);
    for s in &billed {
        let r = &rows[s.request_id.as_deref().unwrap_or_default()];
        ensure!(Some(r["http_status"].as_u64().unwrap_or(0) as u16) == s.status, "{s:?} {r:?}");
        if r["http_status"].as_u64().is_some_and(|h| h >= 400 && h != 499) {
            refused += 1;
            ensure!(r["cost_micros"] == 0 && r["completion_tokens"] == 0, "a refused row: {r:?}");
        } else if s.hung_up {
            hung_up += 1;
        } else if let Some(t) = s.tokens {
            read_through += 1;
            ensure!(
                r["completion_tokens"] == t,
                "billed {} for {t} received",
                r["completion_tokens"]
            );
        }
    }
    ensure!(refused > 0 && read_through > 0 && hung_up > 0, "{refused} {read_through} {hung_up}");
    // Abandoned whole answers have no id at the client: their rows are found by finish reason,
    // and their tokens checked against the engine by the reconciliation below.
    let whole_hangups = seen.iter().filter(|s| s.hung_up && !s.stream).count();
    let abandoned = rows
        .values()
        .filter(|r| r["finish_reason"] == "client_disconnected" && r["http_status"] == 499)
        .count();
    ensure!(abandoned > 0, "no abandoned whole answer billed ({whole_hangups} abandoned)");

    // The engine's own record of every request it ran against the ledger.
    let report = reconcile(JWT_SECRET, &format!("http://{admin}"), &[&engine], TOKEN)?;
    let served = seen.iter().filter(|s| s.status.is_some()).count();
    let mut statuses: std::collections::BTreeMap<String, usize> = Default::default();
    for s in &seen {
        let k = format!("{:?}/{}", s.status, if s.request_id.is_some() { "id" } else { "no id" });
        *statuses.entry(k).or_default() += 1;
    }
    eprintln!("statuses: {statuses:?}");
    eprintln!(
        "drill: {REQUESTS} requests, {served} answered, {} rows checked by id ({refused} refused, \
         {read_through} streams read to the end, {hung_up} hang-ups with ids, {whole_hangups} whole \
         answers abandoned, {abandoned} rows of them), {} auth refusals while Postgres was down\n{report}",
        billed.len(),
        seen.iter().filter(|s| s.auth_unavailable).count()
    );
    ledger.close().await;
    drop(redis_proc);
    Ok(())
}
