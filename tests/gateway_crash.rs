//! A gateway SIGKILLed with requests in flight at an engine loses no usage: the other gateway
//! finds its journal in Redis once its heartbeat stops, and bills each of those requests by
//! what the engine did. Checked as an auditor would, per request id: every request the engine
//! ran has exactly one row with the tokens the engine counted, the dead gateway's Redis
//! reservations are settled (the tenant's day counter equals the ledger), its running
//! Idempotency-Key claim is released (a retry runs, not 409), nothing is left in any journal,
//! and `sluice audit reconcile` over the engine finds no difference.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use chrono::{Datelike, DurationRound};
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_policies::prices::Rates;
use support::{
    ScratchDatabase, free_port, private_redis, reconcile, redis_cmd, rows_for, spawn_engine,
    spawn_sluice_logged, tenants_with_keys, wait_healthy,
};

const MODEL_ID: &str = "smollm2-135m-instruct";
const TOKEN: &str = "crash-internal-token";
const JWT_SECRET: &str = "crash-secret-crash-secret-0123456";
const STREAM: &str = "{sluice}:usage:crash";
const TENANT: &str = "crash-a";

fn int(v: &redis::Value) -> u64 {
    match v {
        redis::Value::Int(n) => u64::try_from(*n).unwrap_or(0),
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).parse().unwrap_or(0),
        _ => 0,
    }
}

fn uint(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// How many usage events the stream holds for each request id.
async fn events_per_request(url: &str) -> anyhow::Result<HashMap<String, usize>> {
    let mut conn = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
    let reply: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(STREAM).arg("-").arg("+").query_async(&mut conn).await?;
    let mut sent = HashMap::new();
    for e in &reply.ids {
        let json: String = e.get("event").context("a stream entry without its event")?;
        let v: Value = serde_json::from_str(&json)?;
        *sent.entry(v["request_id"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    Ok(sent)
}

/// A billing consumer of `stream` on the ledger at `pg`, logging into `dir`.
fn spawn_billing(
    pg: &str,
    redis: &str,
    stream: &str,
    dir: &std::path::Path,
) -> anyhow::Result<(support::Proc, String)> {
    let args = ["billing", "--database-url", pg, "--redis-url", redis]
        .into_iter()
        .chain(["--listen", "127.0.0.1:0", "--consumer", "billing-1", "--usage-stream", stream])
        .collect::<Vec<_>>();
    spawn_sluice_logged(&args, &[("SLUICE_JWT_SECRET", JWT_SECRET)], &dir.join("billing.log"))
}

/// The engine's record of every request it ran.
async fn outcomes(c: &reqwest::Client, engine: &str) -> anyhow::Result<Vec<Value>> {
    let v: Value = c
        .get(format!("http://{engine}/v1/internal/outcomes"))
        .bearer_auth(TOKEN)
        .send()
        .await?
        .json()
        .await?;
    Ok(v["data"].as_array().cloned().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_request_loses_no_usage() -> anyhow::Result<()> {
    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let dir = tempfile::tempdir()?;
    let pg = ScratchDatabase::create("crash")?;
    let ledger = Ledger::connect(&pg.url).await?;
    let key = tenants_with_keys(&ledger, &[TENANT], None).await?.remove(TENANT).context("key")?;
    let (_redis, redis_url) = private_redis(dir.path()).await?;

    let (_engine, engine) =
        spawn_engine(model, TOKEN, "256", &[], Some(&dir.path().join("engine.log")))?;
    let (_billing, billing) = spawn_billing(&pg.url, &redis_url, STREAM, dir.path())?;
    let gateway = |name: &str| -> anyhow::Result<(support::Proc, String)> {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let args = ["gateway", "--plain-http", "--listen", &listen, "--model", model]
            .into_iter()
            .chain(["--engine", &engine, "--redis-url", &redis_url, "--usage-stream", STREAM])
            .collect::<Vec<_>>();
        let envs = [("SLUICE_DATABASE_URL", pg.url.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)];
        spawn_sluice_logged(&args, &envs, &dir.path().join(format!("{name}.log")))
    };
    let (mut doomed, a) = gateway("gateway-a")?;
    let (_survivor, b) = gateway("gateway-b")?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    wait_healthy(&c, &format!("http://{engine}/health")).await?;
    for g in [&a, &b] {
        wait_healthy(&c, &format!("http://{g}/readyz")).await?;
    }

    // One request through A that completes: billed by A itself.
    let r = c
        .post(format!("http://{a}/v1/completions"))
        .bearer_auth(&key)
        .json(&json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4}))
        .send()
        .await?;
    ensure!(r.status() == 200, "a first request: {}", r.status());
    let served = r.headers()["x-sluice-request-id"].to_str()?.to_owned();

    // Long requests through A, running at the engine when A dies: three streamed (one with an
    // Idempotency-Key) and one whole answer (its client never learns its request id).
    let long = |stream: bool| {
        json!({"model": MODEL_ID, "prompt": "Tell a long story about a river.",
            "max_tokens": 1000, "ignore_eos": true, "stream": stream})
    };
    let mut streams = Vec::new();
    for i in 0..3 {
        let mut req = c.post(format!("http://{a}/v1/completions")).bearer_auth(&key);
        if i == 0 {
            req = req.header("Idempotency-Key", "crash-retry-1");
        }
        let mut r = req.json(&long(true)).send().await?;
        ensure!(r.status() == 200, "stream {i}: {}", r.status());
        let id = r.headers()["x-sluice-request-id"].to_str()?.to_owned();
        // Its first tokens arrived: it runs at the engine.
        r.chunk().await?.context("a stream with no first chunk")?;
        streams.push((id, r));
    }
    let whole = {
        let req = c.post(format!("http://{a}/v1/completions")).bearer_auth(&key).json(&long(false));
        tokio::spawn(async move { req.send().await.map(|r| r.status()) })
    };
    // All four run at the engine (the whole one too) before A dies.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let running =
            outcomes(&c, &engine).await?.iter().filter(|o| o["state"] == "running").count();
        if running == 4 {
            break;
        }
        ensure!(Instant::now() < deadline, "{running} requests running at the engine, not 4");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    doomed.0.kill()?;
    doomed.0.wait()?;
    let killed = Instant::now();
    // What each stream's client received before the connection broke.
    let mut received = HashMap::new();
    for (id, mut r) in streams {
        let mut text = String::new();
        while let Ok(Some(chunk)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        ensure!(!text.contains("[DONE]"), "{id} completed before the kill");
        received.insert(id, text);
    }
    ensure!(whole.await?.is_err(), "the whole answer came through a gateway that was killed");

    // Every request the engine ran for the tenant, once it has ended them all.
    let outcomes = loop {
        let data = outcomes(&c, &engine).await?;
        if data.iter().all(|o| o["state"] == "finished") {
            break data;
        }
        ensure!(killed.elapsed() < Duration::from_secs(60), "the engine still runs: {data:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(outcomes.len() == 5, "the engine ran {} requests: {outcomes:?}", outcomes.len());
    let ids: Vec<&str> = outcomes.iter().filter_map(|o| o["request_id"].as_str()).collect();
    // Billed within the heartbeat's expiry and a sweep.
    let rows = rows_for(&ledger, &ids, Duration::from_secs(60)).await?;
    let recovered_after = killed.elapsed();
    // What the README promises: 10 s without a heartbeat, the next sweep, the ingestion.
    ensure!(
        recovered_after < Duration::from_secs(25),
        "the lost requests were billed {recovered_after:?} after the kill, not within 25 s"
    );
    // Each was sent to billing once: by A, or by B's recovery.
    let sent = events_per_request(&redis_url).await?;
    for o in &outcomes {
        let id = o["request_id"].as_str().unwrap_or_default();
        ensure!(sent.get(id) == Some(&1), "{id} was sent {:?} times", sent.get(id));
        let mine = &rows[id];
        ensure!(mine.len() == 1, "{id} has {} rows", mine.len());
        let row = &mine[0];
        ensure!(row["tenant_id"] == TENANT, "{id}: {row:?}");
        ensure!(
            uint(&row["completion_tokens"]) == uint(&o["completion_tokens"])
                && uint(&row["prompt_tokens"]) == uint(&o["prompt_tokens"]),
            "{id}: the ledger has {} + {} tokens, the engine counted {} + {}",
            row["prompt_tokens"],
            row["completion_tokens"],
            o["prompt_tokens"],
            o["completion_tokens"]
        );
        let lost = id != served;
        ensure!(
            (row["error_type"] == "gateway_lost") == lost,
            "{id}: error_type {} (in flight at the kill: {lost})",
            row["error_type"]
        );
        if lost {
            ensure!(uint(&o["completion_tokens"]) > 0, "{id} generated nothing: {o}");
            ensure!(row["http_status"] == 200, "{id}: {row:?}");
            let rates = Rates {
                input: uint(&row["price_input_micros"]),
                cached_input: uint(&row["price_cached_input_micros"]),
                output: uint(&row["price_output_micros"]),
            };
            let cost = rates.charge(
                200,
                uint(&row["prompt_tokens"]),
                uint(&row["cached_prompt_tokens"]),
                uint(&row["completion_tokens"]),
            );
            ensure!(cost > 0 && uint(&row["cost_micros"]) == cost, "{id}: {row:?}");
            ensure!(row["model_revision"] != "unknown", "{id}: {row:?}");
        }
    }
    // The streams' clients received no more than the engine counted.
    for (id, text) in &received {
        let chunks = text.matches("\"text\"").count() as u64;
        let counted = outcomes
            .iter()
            .find(|o| o["request_id"] == id.as_str())
            .map_or(0, |o| uint(&o["completion_tokens"]));
        ensure!(chunks <= counted, "{id}: {chunks} chunks received, {counted} counted");
    }

    // The dead gateway's reservations were settled with what was used: the tenant's day
    // counter equals the ledger's, nothing is left reserved or journaled.
    let day_start = chrono::Utc::now().duration_trunc(chrono::TimeDelta::days(1))?;
    let month_start = day_start.with_day(1).context("month")?;
    let tag = format!("{{sluice:t:{TENANT}}}");
    // Settled just after the events are emitted.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (day, counter, reserved) = loop {
        let (day, _) = ledger.tokens_used(TENANT, None, day_start, month_start).await?;
        let counter =
            int(&redis_cmd(&redis_url, &["HGET", &format!("{tag}:windows"), "day_n"]).await?);
        let reserved =
            int(&redis_cmd(&redis_url, &["HLEN", &format!("{tag}:reservations")]).await?);
        if counter == day && reserved == 0 || Instant::now() > deadline {
            break (day, counter, reserved);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(reserved == 0, "{reserved} reservations left in Redis");
    ensure!(counter == day, "Redis counts {counter} tokens today, the ledger {day}");
    let journals = redis_cmd(&redis_url, &["KEYS", "sluice:journal:*"]).await?;
    ensure!(journals == redis::Value::Array(vec![]), "journals left: {journals:?}");
    // B says so on its metrics.
    let log = std::fs::read_to_string(dir.path().join("gateway-b.log"))?;
    let metrics = log
        .lines()
        .find_map(|l| l.strip_prefix("metrics on "))
        .context("gateway B's metrics address")?;
    let text = c.get(metrics).send().await?.text().await?;
    let recovered = text
        .lines()
        .find_map(|l| l.strip_prefix("sluice_gateway_journal_recovered_total "))
        .context("no journal_recovered metric")?;
    ensure!(recovered.trim() == "4", "gateway B recovered {recovered}");

    // The key's claim was released: a retry through B runs (and is billed) anew.
    let r = c
        .post(format!("http://{b}/v1/completions"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "crash-retry-1")
        .json(&long(true))
        .send()
        .await?;
    ensure!(r.status() == 200, "a retry of the lost request's key: {}", r.status());
    let retry = r.headers()["x-sluice-request-id"].to_str()?.to_owned();
    let text = r.text().await?;
    ensure!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let rows = rows_for(&ledger, &[retry.as_str()], Duration::from_secs(30)).await?;
    ensure!(rows[&retry][0]["completion_tokens"] == 1000, "{:?}", rows[&retry]);

    // The auditor's reconciliation over the engine agrees.
    let report = reconcile(JWT_SECRET, &format!("http://{billing}"), &[&engine], TOKEN)?;
    eprintln!("recovered {} requests {recovered_after:?} after the kill\n{report}", ids.len() - 1);
    ledger.close().await;
    Ok(())
}

/// An engine that dies under a whole (not streamed) answer, with no other engine to retry on:
/// the client gets a 502 in OpenAI's error JSON (once a panic in the gateway's request task
/// left it with a dropped connection), the request has exactly one ledger row with that status,
/// its Redis reservation is settled, the address's slot is freed (the next request is served),
/// and a SIGTERM finds nothing left to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dying_under_a_whole_answer_is_answered_billed_and_settled() -> anyhow::Result<()>
{
    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let dir = tempfile::tempdir()?;
    let pg = ScratchDatabase::create("engine_death")?;
    let ledger = Ledger::connect(&pg.url).await?;
    let tenant = "death-a";
    let key = tenants_with_keys(&ledger, &[tenant], None).await?.remove(tenant).context("key")?;
    let (_redis, redis_url) = private_redis(dir.path()).await?;
    let stream = "{sluice}:usage:death";
    let (mut engine_proc, engine) =
        spawn_engine(model, TOKEN, "256", &[], Some(&dir.path().join("engine.log")))?;
    let (_billing, _) = spawn_billing(&pg.url, &redis_url, stream, dir.path())?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let args = ["gateway", "--plain-http", "--listen", &listen, "--model", model]
        .into_iter()
        .chain(["--engine", &engine, "--redis-url", &redis_url, "--usage-stream", stream])
        .chain(["--max-per-client", "1", "--drain-timeout", "30"])
        .collect::<Vec<_>>();
    let envs = [("SLUICE_DATABASE_URL", pg.url.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)];
    let (mut gateway_proc, gateway) =
        spawn_sluice_logged(&args, &envs, &dir.path().join("gateway.log"))?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("http://{engine}/health")).await?;
    wait_healthy(&c, &format!("http://{gateway}/readyz")).await?;

    let body = json!({"model": MODEL_ID, "prompt": "Tell a long story about a river.",
        "max_tokens": 1000, "ignore_eos": true});
    let whole = {
        let req = c.post(format!("http://{gateway}/v1/completions")).bearer_auth(&key).json(&body);
        tokio::spawn(async move {
            let r = req.send().await?;
            let id = r.headers().get("x-sluice-request-id").map(|v| v.to_str().map(str::to_owned));
            let status = r.status();
            let text = r.text().await?;
            anyhow::Ok((status, id.transpose()?, text))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !outcomes(&c, &engine).await?.iter().any(|o| o["state"] == "running") {
        ensure!(Instant::now() < deadline, "the request never ran at the engine");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine_proc.0.kill()?;
    engine_proc.0.wait()?;

    let (status, id, text) = tokio::time::timeout(Duration::from_secs(30), whole)
        .await
        .context("no answer within 30 s of the engine's death")???;
    ensure!(status == 502, "status {status}: {text}");
    let err: Value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
    ensure!(err["error"]["code"] == "upstream_error", "{err}");
    let id = id.context("no x-sluice-request-id on the error")?;
    let rows = rows_for(&ledger, &[id.as_str()], Duration::from_secs(30)).await?;
    ensure!(rows[&id].len() == 1, "{id}: {:?}", rows[&id]);
    ensure!(rows[&id][0]["http_status"] == 502, "{id}: {:?}", rows[&id][0]);
    let tag = format!("{{sluice:t:{tenant}}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reserved =
            int(&redis_cmd(&redis_url, &["HLEN", &format!("{tag}:reservations")]).await?);
        if reserved == 0 {
            break;
        }
        ensure!(Instant::now() < deadline, "{reserved} reservations left in Redis");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The address's one slot was freed: the next request is answered (502, no engine), not
    // refused for too many connections.
    let r = c.post(format!("http://{gateway}/v1/completions")).bearer_auth(&key).json(&body);
    let r = r.send().await?;
    ensure!(r.status() == 502, "a request after the death: {}", r.status());
    // Nothing left in flight: the drain ends at once.
    let began = Instant::now();
    let exit = tokio::task::block_in_place(|| {
        support::signal_and_wait(&mut gateway_proc.0, "TERM", Duration::from_secs(20))
    })?;
    ensure!(exit.success(), "the gateway exited with {exit}");
    ensure!(began.elapsed() < Duration::from_secs(10), "the drain took {:?}", began.elapsed());
    ledger.close().await;
    Ok(())
}
