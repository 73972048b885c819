//! Two deployments sharing one Redis, each under its own `--redis-namespace`: a tenant of the
//! same name in both, each with its own ledger and a quota of 5 requests, is admitted 5 times
//! by each (not 5 in all, as one shared counter would); each deployment's billing consumes its
//! own usage stream into its own ledger, request id for request id; every key either writes
//! lies under its namespace (a private Redis: nothing else writes there); a namespace that
//! would move a hash tag is refused at start, by the gateway and by billing, naming the flag.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::{Limits, NewTenant, QuotaSettings};
use support::{
    Proc, ScratchDatabase, free_port, private_redis, redis_cmd, rows_for, spawn_sluice,
    wait_healthy,
};

const TOKEN: &str = "namespace-internal-token";
const JWT_SECRET: &str = "namespace-test-secret-namespace-test-secret";
const TENANT: &str = "shared";

/// One deployment: its ledger, its billing and its gateway.
struct Deployment {
    db: ScratchDatabase,
    key: String,
    gateway: String,
    _procs: Vec<Proc>,
}

async fn deploy(ns: &str, redis: &str, engine: &str, model: &str) -> anyhow::Result<Deployment> {
    let purpose: String =
        ns.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let db = ScratchDatabase::create(&format!("ns_{purpose}"))?;
    let ledger = Ledger::connect(&db.url).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let tier = Some("enterprise".into());
    let new = NewTenant { id: TENANT.into(), name: None, tier, overrides: None };
    ledger.create_tenant(&ops, &new).await?;
    // Each request reserves and uses 3 prompt + 2 output tokens: 25 a day afford 5.
    let limits = Limits { daily_tokens: Some(25), ..Default::default() };
    ledger.set_quota(&ops, TENANT, &QuotaSettings { limits, ..Default::default() }).await?;
    let (_, key) = ledger.issue_key(&ops, TENANT, None, None, Default::default()).await?;
    ledger.close().await;
    let common = ["--database-url", db.url.as_str(), "--redis-url", redis, "--redis-namespace", ns];
    let billing = ["billing", "--listen", "127.0.0.1:0", "--consumer", "billing-1"];
    let args: Vec<&str> = billing.into_iter().chain(common).collect();
    let (billing, _) = spawn_sluice(&args, &[("SLUICE_JWT_SECRET", JWT_SECRET)])?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let gateway = ["gateway", "--plain-http", "--listen", &listen, "--engine", engine];
    let more = ["--internal-token", TOKEN, "--model", model];
    let args: Vec<&str> = gateway.into_iter().chain(common).chain(more).collect();
    let (gateway, addr) = spawn_sluice(&args, &[])?;
    Ok(Deployment { db, key, gateway: format!("http://{addr}"), _procs: vec![billing, gateway] })
}

/// Six completions, one after another: the request ids of those admitted, and the statuses.
async fn six(c: &reqwest::Client, d: &Deployment) -> anyhow::Result<(Vec<String>, Vec<u16>)> {
    let body = json!({"model": "smollm2-135m-instruct", "prompt": [1, 2, 3], "max_tokens": 2,
        "ignore_eos": true});
    let (mut ids, mut statuses) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        let r = c
            .post(format!("{}/v1/completions", d.gateway))
            .bearer_auth(&d.key)
            .json(&body)
            .send()
            .await?;
        let status = r.status().as_u16();
        let id = r.headers().get(sluice_wire::header::REQUEST_ID).cloned();
        let v: Value = r.json().await?;
        match status {
            200 => ids.push(id.context("no request id")?.to_str()?.to_owned()),
            429 => ensure!(v["error"]["code"] == "insufficient_quota", "{v}"),
            other => bail!("unexpected {other}: {v}"),
        }
        statuses.push(status);
    }
    Ok((ids, statuses))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_sharing_a_redis_share_nothing_under_their_namespaces() -> anyhow::Result<()> {
    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let dir = tempfile::tempdir()?;
    let (_redis, redis) = private_redis(dir.path()).await?;
    let engine_listen = format!("127.0.0.1:{}", free_port()?);
    let (_engine, engine) = spawn_sluice(
        &["engine", "--model", model, "--listen", &engine_listen, "--internal-token", TOKEN]
            .into_iter()
            .chain(["--served-model-name", "smollm2-135m-instruct", "--kv-cache-mb", "64"])
            .collect::<Vec<_>>(),
        &[],
    )?;
    let blue = deploy("blue", &redis, &engine, model).await?;
    let green = deploy("green-2.b", &redis, &engine, model).await?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    wait_healthy(&c, &format!("http://{engine}/health")).await?;
    for d in [&blue, &green] {
        wait_healthy(&c, &format!("{}/health", d.gateway)).await?;
    }

    // Each deployment's quota holds on its own: one shared counter would refuse green's all.
    let mut admitted = Vec::new();
    for d in [&blue, &green] {
        let (ids, statuses) = six(&c, d).await?;
        ensure!(statuses == [200, 200, 200, 200, 200, 429], "{statuses:?}");
        admitted.push(ids);
    }

    // Each billing wrote its own deployment's requests, and none of the other's.
    for (d, ids) in [&blue, &green].into_iter().zip(&admitted) {
        let ledger = Ledger::connect(&d.db.url).await?;
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let rows = rows_for(&ledger, &ids, Duration::from_secs(30)).await?;
        let theirs = admitted.iter().flatten().filter(|id| !ids.contains(&id.as_str()));
        for id in theirs {
            ensure!(!rows.contains_key(id), "{} holds another deployment's request {id}", d.db.url);
        }
        ledger.close().await;
    }

    // Every key lies under one of the two namespaces, and each wrote its own.
    let keys = match redis_cmd(&redis, &["KEYS", "*"]).await? {
        redis::Value::Array(keys) => keys,
        other => bail!("KEYS answered {other:?}"),
    };
    let keys: BTreeSet<String> = keys
        .iter()
        .map(|k| match k {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => format!("{other:?}"),
        })
        .collect();
    for ns in ["blue", "green-2.b"] {
        for mine in [format!("{{{ns}}}:usage"), format!("{{{ns}:t:{TENANT}}}:windows")] {
            ensure!(keys.contains(&mine), "no {mine} among {keys:?}");
        }
    }
    let stray: Vec<&String> = keys
        .iter()
        .filter(|k| {
            !["blue", "green-2.b"]
                .iter()
                .any(|ns| k.starts_with(&format!("{{{ns}")) || k.starts_with(&format!("{ns}:")))
        })
        .collect();
    ensure!(stray.is_empty(), "keys outside both namespaces: {stray:?}");

    // A namespace with a brace or a colon would move the hash tags or the separators:
    // refused before anything starts, by the gateway and by billing.
    let gateway = ["gateway", "--plain-http", "--listen", "127.0.0.1:0", "--engine", &engine];
    refused(&gateway, &blue.db.url, &redis, "a{b")?;
    refused(&["billing", "--listen", "127.0.0.1:0"], &blue.db.url, &redis, "a:b")?;
    Ok(())
}

/// `sluice ARGS` with the namespace `ns` exits 2 within 30 s, naming the flag.
fn refused(args: &[&str], db: &str, redis: &str, ns: &str) -> anyhow::Result<()> {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .args(["--database-url", db, "--redis-url", redis, "--redis-namespace", ns])
        .env("SLUICE_JWT_SECRET", JWT_SECRET)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill()?;
            bail!("sluice {args:?} started with --redis-namespace {ns:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().context("stderr")?, &mut stderr)?;
    ensure!(
        status.code() == Some(2) && stderr.contains("--redis-namespace"),
        "sluice {args:?} with {ns:?}: {status:?}: {stderr}"
    );
    Ok(())
}
