//! Two gateway processes sharing Redis in front of one engine (one of them also configured
//! with a worker that is down): many concurrent requests
//! against a small exact quota; exactly the affordable number succeed, the rest get 429 with
//! OpenAI's rate-limit headers, and every request is one usage event on the stream.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::time::{Duration, Instant};

use support::{free_port, spawn_sluice, wait_healthy};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::{Limits, NewTenant, QuotaSettings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_never_overdraw_a_shared_quota() -> anyhow::Result<()> {
    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let tenant = format!("race-{}", &tag[..12]);
    let stream = format!("{{gwtest-{tag}}}:usage");

    // Tenant, key and an exact quota: each request reserves 3 prompt + 2 output tokens and
    // uses all of them (ignore_eos), so 50 daily tokens afford exactly 10 requests.
    let ledger = Ledger::connect(&db).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let new = NewTenant {
        id: tenant.clone(),
        name: None,
        tier: Some("enterprise".into()),
        overrides: None,
    };
    ledger.create_tenant(&ops, &new).await?;
    let quota = QuotaSettings {
        limits: Limits { daily_tokens: Some(50), ..Default::default() },
        ..Default::default()
    };
    ledger.set_quota(&ops, &tenant, &quota).await?;
    let (_, key) = ledger.issue_key(&ops, &tenant, None, None, Default::default()).await?;
    let other = format!("{tenant}-b");
    let new = NewTenant {
        id: other.clone(),
        name: None,
        tier: Some("enterprise".into()),
        overrides: None,
    };
    ledger.create_tenant(&ops, &new).await?;
    let (_, other_key) = ledger.issue_key(&ops, &other, None, None, Default::default()).await?;
    // A key held to less than its (unlimited) tenant: 15 daily tokens, exactly 3 requests.
    let limits = Limits { daily_tokens: Some(15), ..Default::default() };
    let (_, limited_key) = ledger.issue_key(&ops, &other, None, None, limits).await?;
    ledger.close().await;

    let token = "race-internal-token";
    let engine_port = free_port()?.to_string();
    let (_engine, engine_addr) = spawn_sluice(
        &[
            "engine",
            "--model",
            model,
            "--listen",
            &format!("127.0.0.1:{engine_port}"),
            "--internal-token",
            token,
            "--served-model-name",
            "smollm2-135m-instruct",
            "--kv-cache-mb",
            "64",
        ],
        &[],
    )?;
    let mut gateways = Vec::new();
    let mut urls = Vec::new();
    // The first gateway also lists a worker that is down: requests that land there (before
    // the health check notices) are retried on the live one, since nothing reached the client.
    let dead = format!("127.0.0.1:{}", free_port()?);
    for g in 0..2 {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec!["gateway", "--plain-http", "--listen", &listen];
        if g == 0 {
            args.extend(["--engine", &dead]);
        }
        args.extend(["--engine", &engine_addr, "--database-url", &db]);
        args.extend(["--redis-url", common_redis(), "--internal-token", token]);
        args.extend(["--model", model, "--usage-stream", &stream]);
        let (p, addr) = spawn_sluice(&args, &[])?;
        gateways.push(p);
        urls.push(format!("http://{addr}"));
    }
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    wait_healthy(&c, &format!("http://{engine_addr}/health")).await?;
    for u in &urls {
        wait_healthy(&c, &format!("{u}/health")).await?;
    }

    let body = json!({"model": "smollm2-135m-instruct", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": true});
    let (mut ok, mut limited) = (0, 0);
    for (status, headers, v) in concurrently(&c, &urls, &key, &body, 40).await? {
        match status {
            200 => {
                ensure!(
                    v["usage"]["completion_tokens"] == 2 && v["usage"]["prompt_tokens"] == 3,
                    "{v}"
                );
                ok += 1;
            }
            429 => {
                ensure!(v["error"]["code"] == "insufficient_quota", "{v}");
                ensure!(headers.get("retry-after").is_some(), "{headers:?}");
                limited += 1;
            }
            other => bail!("unexpected {other}: {v}"),
        }
    }
    ensure!(
        ok == 10 && limited == 30,
        "{ok} succeeded, {limited} refused; the quota affords exactly 10"
    );

    // The key's own limit holds across both gateways, beside its tenant's quota.
    let (mut ok, mut limited) = (0, 0);
    for (status, _, v) in concurrently(&c, &urls, &limited_key, &body, 20).await? {
        match (status, v) {
            (200, _) => ok += 1,
            (429, v) => {
                ensure!(v["error"]["code"] == "insufficient_quota", "{v}");
                let msg = v["error"]["message"].as_str().unwrap_or_default();
                ensure!(msg.contains("this API key's"), "{msg}");
                limited += 1;
            }
            (other, v) => bail!("unexpected {other}: {v}"),
        }
    }
    ensure!(ok == 3 && limited == 17, "{ok} succeeded, {limited} refused; the key affords 3");

    // A body well over pingora's 64 KiB retry buffer goes through whole (a long `user`, the
    // end user's id, which the ledger keeps as a hash); one over the 2 MiB cap is refused
    // before it is read.
    let mut big = body.clone();
    big["user"] = Value::from("x".repeat(300_000));
    let (status, _, v) = post(&c, &urls[0], &other_key, &big).await?;
    ensure!(status == 200 && v["usage"]["completion_tokens"] == 2, "{status}: {v}");
    big["user"] = Value::from("x".repeat(3 << 20));
    let (status, _, v) = post(&c, &urls[1], &other_key, &big).await?;
    ensure!(status == 413 && v["error"]["type"] == "invalid_request_error", "{status}: {v}");

    // A client that goes away mid-stream: the engine aborts (its running requests and KV
    // blocks return to zero) and the request is billed with the tokens it received.
    let body = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 300,
        "ignore_eos": true, "stream": true});
    let mut resp = c
        .post(format!("{}/v1/completions", urls[1]))
        .bearer_auth(&other_key)
        .json(&body)
        .send()
        .await?;
    ensure!(resp.status() == 200, "{}", resp.status());
    let mut received = 0u64;
    let mut buf = String::new();
    while received < 3 {
        let Some(chunk) = resp.chunk().await? else { bail!("the stream ended early") };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            if let Some(data) = event.trim().strip_prefix("data: ")
                && let Ok(v) = serde_json::from_str::<Value>(data)
            {
                received += v["sluice"]["tokens"].as_u64().unwrap_or(0);
            }
        }
    }
    drop(resp);
    let metrics = format!("http://{engine_addr}/metrics");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = c.get(&metrics).send().await?.text().await?;
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.split_whitespace().last()?.parse::<f64>().ok())
        };
        if value("sluice_engine_num_requests_running ") == Some(0.0)
            && value("sluice_engine_kv_cache_usage_perc ") == Some(0.0)
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the engine kept working for a client that left:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // One usage event per request, refused ones included, on the stream billing consumes.
    let client = redis::Client::open(common_redis())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: usize = redis::AsyncCommands::xlen(&mut conn, &stream).await?;
        if n == 63 {
            break;
        }
        ensure!(Instant::now() < deadline, "{n} usage events for 63 requests");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let entries: redis::streams::StreamRangeReply =
        redis::AsyncCommands::xrange_all(&mut conn, &stream).await?;
    let events: Vec<Value> = entries
        .ids
        .iter()
        .filter_map(|e| e.get::<String>("event"))
        .filter_map(|j| serde_json::from_str(&j).ok())
        .collect();
    ensure!(events.iter().filter(|e| e["tenant_id"] == tenant.as_str()).count() == 40);
    let gone = events
        .iter()
        .find(|e| e["tenant_id"] == other.as_str() && e["finish_reason"] == "client_disconnected")
        .context("no event for the disconnect")?;
    ensure!(
        gone["finish_reason"] == "client_disconnected" && gone["client_disconnected"] == true,
        "{gone}"
    );
    let billed = gone["completion_tokens"].as_u64().unwrap_or(0);
    ensure!(billed >= received && billed < 300, "billed {billed}, the client received {received}");
    let _: usize = redis::AsyncCommands::del(&mut conn, &stream).await?;
    Ok(())
}

/// One completion: status, headers and body.
async fn post(
    c: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
) -> anyhow::Result<(u16, reqwest::header::HeaderMap, Value)> {
    let r = c.post(format!("{url}/v1/completions")).bearer_auth(key).json(body).send().await?;
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    Ok((status, headers, r.json().await?))
}

/// `n` completions sent at once, alternating between the gateways.
async fn concurrently(
    c: &reqwest::Client,
    urls: &[String],
    key: &str,
    body: &Value,
    n: usize,
) -> anyhow::Result<Vec<(u16, reqwest::header::HeaderMap, Value)>> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let (c, url, key, body) = (c.clone(), urls[i % 2].clone(), key.to_owned(), body.clone());
        tasks.push(tokio::spawn(async move { post(&c, &url, &key, &body).await }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

fn common_redis() -> &'static str {
    "redis://127.0.0.1:6379"
}
