//! Redis Cluster: the limiter, idempotency claims and the usage stream run unchanged against a
//! local Redis Cluster of 3 primaries with a replica each (`--redis-url` lists seed nodes),
//! and what a primary's failover under load does is measured.
//!
//! - Hash tags: every key of a tenant (windows, in-flight, reservations, a limited key's scope,
//!   idempotency claims) hashes to one slot, and so do the usage stream, its dead-letter stream
//!   and the control version; the scripts and transactions on them are therefore valid.
//! - Unchanged: a tenant capped at 2 requests a minute gets its 429 on the third; a retry with
//!   the same Idempotency-Key is the stored answer under the first id; billing consumes the
//!   stream from the cluster, so every id gets its row.
//! - Failover: under a `sluice bench serve` load with Idempotency-Key retries, the primary that
//!   holds the tenant's slot is killed, then the one that holds the usage stream's; a replica
//!   takes over each after the node timeout. The test prints how long that took, what the clients saw meanwhile (refusals by code), duplicates
//!   (a key with two completed rows) and rows missing; it requires that no request id is
//!   missing its row and every request ends answered.

#[path = "../billing/tests/common/mod.rs"]
mod billing_common;
#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::json;
use sluice_billing::Ledger;
use support::{read_tries, redis_cluster, rows_for, spawn_engine, spawn_sluice, wait_healthy};

const MODEL_ID: &str = "smollm2-135m-instruct";
const TOKEN: &str = "redis-cluster-token";
const JWT_SECRET: &str = "redis-cluster-secret-redis-cluster-0";

fn keyslot(port: u16, key: &str) -> anyhow::Result<u64> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "cluster", "keyslot", key])
        .output()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().with_context(|| format!("keyslot {key}"))
}

/// The port of the primary (not failed) that serves `slot`, as node `port` sees the cluster.
fn owner(port: u16, slot: u64) -> anyhow::Result<Option<u16>> {
    let out =
        Command::new("redis-cli").args(["-p", &port.to_string(), "cluster", "nodes"]).output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
            continue;
        }
        let serves = f[8..].iter().any(|r| match r.split_once('-') {
            Some((a, b)) => {
                a.parse::<u64>().is_ok_and(|a| a <= slot)
                    && b.parse::<u64>().is_ok_and(|b| slot <= b)
            }
            None => r.parse::<u64>().is_ok_and(|s| s == slot),
        });
        if serves {
            let addr = f[1].split('@').next().unwrap_or_default();
            return Ok(addr.rsplit(':').next().and_then(|p| p.parse().ok()));
        }
    }
    Ok(None)
}

/// Kills the primary serving `slot` (as node `seen_from` sees the cluster) and waits for a
/// replica to serve it; returns the killed port, a surviving one and how long that took.
async fn fail_over(
    nodes: &mut Vec<(support::Proc, u16)>,
    seen_from: u16,
    slot: u64,
) -> anyhow::Result<(u16, u16, Duration)> {
    let victim = owner(seen_from, slot)?.with_context(|| format!("no primary serves {slot}"))?;
    let index = nodes.iter().position(|(_, p)| *p == victim).context("the victim")?;
    let survivor =
        nodes.iter().find(|(_, p)| *p != victim).map(|(_, p)| *p).context("a survivor")?;
    let killed_at = Instant::now();
    drop(nodes.remove(index));
    loop {
        if owner(survivor, slot)?.is_some_and(|p| p != victim) {
            return Ok((victim, survivor, killed_at.elapsed()));
        }
        ensure!(killed_at.elapsed() < Duration::from_secs(30), "no replica took slot {slot} over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_platform_runs_unchanged_on_a_redis_cluster_and_through_a_failover()
-> anyhow::Result<()> {
    let pg = billing_common::PgDatabase::create().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let keys = support::tenants_with_keys(&ledger, &["rc", "rc-capped"], Some("rc-capped")).await?;

    let dir = tempfile::tempdir()?;
    let (mut nodes, url) = redis_cluster(dir.path(), 3, 2000)?;
    let port0 = nodes[0].1;

    // Hash tags: one slot per family.
    let tenant_keys = [
        "{sluice:t:rc}:windows",
        "{sluice:t:rc}:inflight",
        "{sluice:t:rc}:reservations",
        "{sluice:t:rc}:k:key-1:windows",
        "{sluice:t:rc}:idem:00ff",
    ];
    let tenant_slot = keyslot(port0, tenant_keys[0])?;
    for k in tenant_keys {
        ensure!(keyslot(port0, k)? == tenant_slot, "{k} is not in the tenant's slot");
    }
    let stream_slot = keyslot(port0, sluice_billing::ingest::USAGE_STREAM)?;
    let control = sluice_billing::redis_conn::Namespace::default().control_version_key();
    for k in [sluice_billing::ingest::DEAD_LETTER_STREAM, &control] {
        ensure!(keyslot(port0, k)? == stream_slot, "{k} is not in the usage stream's slot");
    }
    // Other tenants spread over the slots (the tag is per tenant, not one for all).
    ensure!(keyslot(port0, "{sluice:t:rc-capped}:windows")? != tenant_slot);

    let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
    let (_engine, engine) = spawn_engine(&model, TOKEN, "64", &[], None)?;
    let (_billing, _admin) = spawn_sluice(
        &["billing", "--database-url", &pg.url, "--redis-url", &url, "--listen", "127.0.0.1:0"],
        &[("SLUICE_JWT_SECRET", JWT_SECRET)],
    )?;
    let listen = format!("127.0.0.1:{}", support::free_port()?);
    let gw_args = ["gateway", "--plain-http", "--listen", &listen, "--engine", &engine]
        .into_iter()
        .chain(["--model", &model, "--redis-url", &url, "--redis-down", "refuse"])
        .collect::<Vec<_>>();
    let (_gateway, gw) = spawn_sluice(
        &gw_args,
        &[("SLUICE_DATABASE_URL", pg.url.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)],
    )?;
    let gw = format!("http://{gw}");
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("{gw}/readyz")).await?;

    // Unchanged: the limiter's refusal, an idempotent replay, rows through the stream.
    let body = json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4});
    let post = |key: &str, idem: Option<&str>| {
        let mut r = c.post(format!("{gw}/v1/completions")).bearer_auth(key).json(&body);
        if let Some(k) = idem {
            r = r.header("idempotency-key", k);
        }
        r.send()
    };
    // The three in one calendar minute (the window the limit counts).
    let second = chrono::Utc::now().timestamp().rem_euclid(60) as u64;
    if second > 45 {
        tokio::time::sleep(Duration::from_secs(62 - second)).await;
    }
    let mut ids = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let r = post(&keys["rc-capped"], None).await?;
        statuses.push(r.status().as_u16());
        ids.extend(
            r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned),
        );
    }
    ensure!(statuses == [200, 200, 429], "a tenant capped at 2 a minute: {statuses:?}");
    let first = post(&keys["rc"], Some("cluster-same")).await?;
    ensure!(first.status() == 200, "{}", first.status());
    let first_id = first.headers()["x-sluice-request-id"].to_str()?.to_owned();
    // The first completes its claim as it is logged, just after its answer went out: a retry
    // sent before that gets 409 (still running) and, as a client would, tries again.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut in_progress = Vec::new();
    let retry = loop {
        let r = post(&keys["rc"], Some("cluster-same")).await?;
        if r.status() != 409 || Instant::now() > deadline {
            break r;
        }
        // Refused, so a row of its own that costs nothing.
        in_progress.extend(
            r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        retry.status() == 200 && retry.headers().get("idempotent-replayed").is_some(),
        "the retry was not replayed: {} {:?}",
        retry.status(),
        retry.headers()
    );
    ensure!(retry.headers()["x-sluice-request-id"].to_str()? == first_id);
    ids.push(first_id.clone());
    ids.extend(in_progress.iter().cloned());
    // Through the cluster's stream, one row each (the replay has none of its own).
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let rows = rows_for(&ledger, &id_refs, Duration::from_secs(30)).await?;
    let count: usize = rows.values().map(Vec::len).sum();
    ensure!(count == ids.len(), "{count} rows for {} ids: {rows:?}", ids.len());
    for id in &in_progress {
        let r = &rows[id][0];
        ensure!(r["http_status"] == 409 && r["cost_micros"] == 0, "a 409's row: {r:?}");
    }

    // Failover under load.
    let log = dir.path().join("load.jsonl");
    let out = std::fs::File::create(dir.path().join("load.out"))?;
    let mut load = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &gw, "--model", MODEL_ID])
        .args(["--request-rate", "3", "--duration", "30", "--max-concurrency", "12"])
        .args(["--input-len", "24", "--output-len", "uniform:8:24", "--timeout", "120"])
        .args(["--idempotent-retries", "8", "--requests-log"])
        .arg(&log)
        .env("OPENAI_API_KEY", &keys["rc"])
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()?;
    let load_started = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (victim, survivor, promoted) = fail_over(&mut nodes, port0, tenant_slot).await?;
    // Then the usage stream's primary: entries no replica had yet were written to the ledger
    // by the gateway too, so nothing is lost with it.
    tokio::time::sleep_until((load_started + Duration::from_secs(18)).into()).await;
    let (stream_victim, _, stream_promoted) = fail_over(&mut nodes, survivor, stream_slot).await?;
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = load.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = load.kill();
            bail!("the load did not finish");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let text = std::fs::read_to_string(dir.path().join("load.out")).unwrap_or_default();
    ensure!(status.success(), "bench serve: {status}\n{text}");

    let requests = read_tries(&log)?;
    let tries: Vec<_> = requests.iter().flatten().collect();
    let with_id: Vec<_> = tries.iter().filter(|t| t.request_id.is_some()).collect();
    let ids: Vec<&str> = with_id.iter().filter_map(|t| t.request_id.as_deref()).collect();
    let rows = rows_for(&ledger, &ids, Duration::from_secs(60)).await?;
    for t in &with_id {
        let id = t.request_id.as_deref().unwrap_or_default();
        ensure!(rows[id].len() == 1, "{} rows for {id}", rows[id].len());
    }
    let mut completed: HashMap<&str, usize> = HashMap::new();
    for r in rows.values().flatten() {
        // Requests sent without a key (the first checks above) are not the load's.
        let Some(k) = r["idempotency_key"].as_str() else { continue };
        if r["http_status"] == 200 && r["completion_tokens"].as_u64().is_some_and(|n| n > 0) {
            *completed.entry(k.split('#').next().unwrap_or_default()).or_default() += 1;
        }
    }
    let duplicates = completed.values().filter(|n| **n > 1).count();
    let failed = requests.iter().filter(|r| !r.last().is_some_and(|t| t.ok)).count();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for t in &tries {
        let k = match (&t.status, &t.error_code) {
            (Some(s), Some(c)) => format!("{s} {c}"),
            (Some(200), None) => format!("200{}", if t.ok { "" } else { " cut short" }),
            (Some(s), None) => format!("{s} (no code)"),
            (None, _) => "no answer".to_owned(),
        };
        *outcomes.entry(k).or_default() += 1;
    }
    eprintln!(
        "\n| Redis Cluster failover | value |\n|---|---|\n| primary killed at 8 s | 127.0.0.1:{victim} \
         (the tenant's slot {tenant_slot}) |\n\
         | replica serving the slot after | {:.2} s (cluster-node-timeout 2 s) |\n\
         | primary killed at 18 s | 127.0.0.1:{stream_victim} (the usage stream's slot {stream_slot}) |\n\
         | replica serving the stream after | {:.2} s |\n\
         | requests | {} |\n| tries | {} |\n| requests retried | {} |\n\
         | keys billed for two completions | {duplicates} |\n| request ids without a row | 0 |\n\
         | requests failed after retries | {failed} |",
        promoted.as_secs_f64(),
        stream_promoted.as_secs_f64(),
        requests.len(),
        tries.len(),
        requests.iter().filter(|r| r.len() > 1).count()
    );
    for (k, n) in &outcomes {
        eprintln!("| tries {k} | {n} |");
    }
    ensure!(failed == 0, "{failed} requests failed after their retries");
    ledger.close().await;
    Ok(())
}
