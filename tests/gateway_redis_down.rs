//! When the shared limiter's Redis goes away, each tenant gets its policy: the default keeps
//! serving under local limits, `on_limiter_down: refuse` gets 503 with Retry-After; and the
//! usage events of both still reach the ledger (written directly, since the stream is gone).

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::json;
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::NewTenant;
use sluice_billing::query::RecordFilter;
use support::{free_port, private_redis, spawn_sluice, wait_healthy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_gets_its_policy_when_redis_is_gone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // A Redis of this test's own, stopped half-way; the machine's Redis is not touched.
    let (mut redis, redis_url) = private_redis(dir.path()).await?;

    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let ledger = Ledger::connect(&db).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let mut keys = Vec::new();
    for (id, overrides) in
        [("lenient", None), ("strict", Some(json!({"on_limiter_down": "refuse"})))]
    {
        let new = NewTenant { id: id.into(), name: None, tier: None, overrides };
        ledger.create_tenant(&ops, &new).await?;
        keys.push(ledger.issue_key(&ops, id, None, None, Default::default()).await?.1);
    }

    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let engine_listen = format!("127.0.0.1:{}", free_port()?);
    let (_engine, engine_addr) = spawn_sluice(
        &[
            "engine",
            "--model",
            model,
            "--listen",
            &engine_listen,
            "--internal-token",
            "tok",
            "--served-model-name",
            "smollm2-135m-instruct",
            "--kv-cache-mb",
            "32",
        ],
        &[],
    )?;
    let gw_listen = format!("127.0.0.1:{}", free_port()?);
    let (_gateway, gw_addr) = spawn_sluice(
        &[
            "gateway",
            "--plain-http",
            "--listen",
            &gw_listen,
            "--engine",
            &engine_addr,
            "--database-url",
            &db,
            "--redis-url",
            &redis_url,
            "--internal-token",
            "tok",
            "--model",
            model,
        ],
        &[],
    )?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("http://{gw_addr}/health")).await?;
    // The keyless probes: alive, and ready with its one engine counted.
    let live = c.get(format!("http://{gw_addr}/livez")).send().await?;
    ensure!(live.status() == 200, "livez: {}", live.status());
    let ready: serde_json::Value =
        c.get(format!("http://{gw_addr}/readyz")).send().await?.json().await?;
    ensure!(ready["status"] == "ready" && ready["workers"] == 1, "{ready}");
    let body = json!({"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2});
    let call = |key: String| {
        let (c, url, body) = (c.clone(), format!("http://{gw_addr}/v1/completions"), body.clone());
        async move {
            let r = c.post(url).bearer_auth(key).json(&body).send().await?;
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").is_some();
            let id = r
                .headers()
                .get("x-sluice-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            anyhow::Ok((status, retry, id))
        }
    };
    for k in &keys {
        ensure!(call(k.clone()).await?.0 == 200, "with Redis up every tenant is served");
    }

    drop(redis.0.kill());
    let _ = redis.0.wait();
    let (status, _, lenient_id) = call(keys[0].clone()).await?;
    ensure!(status == 200, "the default policy keeps serving under local limits, got {status}");
    let (status, retry, strict_id) = call(keys[1].clone()).await?;
    ensure!(
        status == 503 && retry,
        "on_limiter_down=refuse gets 503 with Retry-After, got {status}"
    );

    // The usage stream is gone with Redis: both events were written to the ledger directly.
    let (lenient_id, strict_id) =
        (lenient_id.context("request id")?, strict_id.context("request id")?);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = ledger.records(&RecordFilter { limit: 100, ..Default::default() }).await?;
        let has = |id: &str| page.records.iter().any(|r| r["request_id"] == id);
        if has(&lenient_id) && has(&strict_id) {
            let strict = page.records.iter().find(|r| r["request_id"] == strict_id.as_str());
            ensure!(
                strict.is_some_and(|r| r["http_status"] == 503 && r["finish_reason"] == "rejected")
            );
            break;
        }
        ensure!(Instant::now() < deadline, "usage events lost while Redis was down");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ledger.close().await;
    Ok(())
}
