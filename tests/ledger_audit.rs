//! The ledger as an auditor reads it, per request id, against what the client got and what the
//! engine did: `sluice gateway` (no Redis: in-process limits, the usage writer beside it) in
//! front of a real `sluice engine` running the default model.
//!
//! - Refused requests (413, 429, an engine's 400, an unreachable engine's 502) cost nothing;
//!   each row records the status the client got, and the client got OpenAI's error JSON.
//! - A non-streamed request whose client hung up is billed for the tokens the engine generated
//!   (the engine's own count: its outcome record and its Prometheus counter).
//! - Daily token quotas hold without Redis, counting usage already in the ledger, also across
//!   a gateway restart.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::{Limits, NewTenant, QuotaSettings};
use sluice_billing::query::RecordFilter;
use sluice_policies::prices::PRICES;
use support::{Proc, free_port, spawn_sluice, wait_healthy};

const MODEL_ID: &str = "smollm2-135m-instruct";
const TOKEN: &str = "internal-tok";

struct Platform {
    model: String,
    db: String,
    engine: String,
    _engine_proc: Proc,
}

impl Platform {
    fn gateway(&self, engine: &str) -> anyhow::Result<(Proc, String)> {
        let listen = format!("127.0.0.1:{}", free_port()?);
        spawn_sluice(
            &[
                "gateway",
                "--plain-http",
                "--listen",
                &listen,
                "--engine",
                engine,
                "--model",
                &self.model,
            ],
            &[("SLUICE_DATABASE_URL", self.db.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)],
        )
        .map(|(p, a)| (p, format!("http://{a}")))
    }
}

async fn records(
    ledger: &Ledger,
    tenant: &str,
) -> anyhow::Result<Vec<serde_json::Map<String, Value>>> {
    let filter =
        RecordFilter { tenant: Some(tenant.to_owned()), limit: 1000, ..Default::default() };
    Ok(ledger.records(&filter).await?.records)
}

/// Polls the ledger until `tenant` has `n` rows (the usage writer commits in batches).
async fn wait_rows(
    ledger: &Ledger,
    tenant: &str,
    n: usize,
) -> anyhow::Result<Vec<serde_json::Map<String, Value>>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = records(ledger, tenant).await?;
        if rows.len() >= n {
            ensure!(rows.len() == n, "{tenant}: {} rows, expected {n}", rows.len());
            return Ok(rows);
        }
        ensure!(Instant::now() < deadline, "{tenant}: {} of {n} rows after 30 s", rows.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn engine_generated(c: &reqwest::Client, engine: &str) -> anyhow::Result<u64> {
    let text = c.get(format!("http://{engine}/metrics")).send().await?.text().await?;
    let line = text
        .lines()
        .find(|l| l.starts_with("sluice_engine_generation_tokens_total "))
        .context("no generation token counter")?;
    Ok(line.split_whitespace().nth(1).context("value")?.parse::<f64>()? as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_free_abandoned_work_is_billed_and_day_quotas_hold() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let ledger = Ledger::connect(&db).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let mut keys = HashMap::new();
    for id in ["refused", "abandon", "daily"] {
        let new = NewTenant { id: id.into(), name: None, tier: None, overrides: None };
        ledger.create_tenant(&ops, &new).await?;
        keys.insert(id, ledger.issue_key(&ops, id, None, None, Default::default()).await?.1);
    }
    let refusing = QuotaSettings {
        limits: Limits { rpm: Some(4), ..Default::default() },
        max_prompt_tokens: Some(40),
        ..Default::default()
    };
    ledger.set_quota(&ops, "refused", &refusing).await?;

    let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
    let (engine_proc, engine) = support::spawn_engine(&model, TOKEN, "64", &[], None)?;
    let p = Platform { model, db: db.clone(), engine, _engine_proc: engine_proc };
    let (gw_proc, gw) = p.gateway(&p.engine)?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    wait_healthy(&c, &format!("{gw}/health")).await?;

    // ---- refusals: what the client got, and what the ledger charged ----
    let post = |body: Value, key: &str, base: &str| {
        let (c, url, key) = (c.clone(), format!("{base}/v1/completions"), key.to_owned());
        async move {
            let r = c.post(url).bearer_auth(key).json(&body).send().await?;
            let status = r.status().as_u16();
            let id = r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok());
            let id = id.map(str::to_owned);
            let body: Value = serde_json::from_slice(&r.bytes().await?).unwrap_or(Value::Null);
            anyhow::Ok((status, id, body))
        }
    };
    let k = keys["refused"].clone();
    let ok = json!({"model": MODEL_ID, "prompt": "One, two,", "max_tokens": 3});
    let long = json!({"model": MODEL_ID, "prompt": "word ".repeat(60), "max_tokens": 3});
    let bad_temp = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 3, "temperature": -1});
    let mut seen = Vec::new();
    seen.push(("served", post(ok.clone(), &k, &gw).await?));
    seen.push(("prompt_too_long", post(long, &k, &gw).await?));
    seen.push(("engine_400", post(bad_temp, &k, &gw).await?));
    for _ in 0..3 {
        seen.push(("rpm", post(ok.clone(), &k, &gw).await?));
    }
    // A gateway whose only engine is gone: 502 with a body the SDKs can read.
    let dead = format!("127.0.0.1:{}", free_port()?);
    let (mut dead_gw, dead_url) = p.gateway(&dead)?;
    wait_healthy(&c, &format!("{dead_url}/health")).await?;
    seen.push(("unreachable", post(ok.clone(), &keys["abandon"], &dead_url).await?));
    dead_gw.stop()?;
    let statuses: Vec<(&str, u16)> = seen.iter().map(|(k, (s, _, _))| (*k, *s)).collect();
    ensure!(
        statuses
            == [
                ("served", 200),
                ("prompt_too_long", 413),
                ("engine_400", 400),
                ("rpm", 200),
                ("rpm", 200),
                ("rpm", 429),
                ("unreachable", 502),
            ],
        "{statuses:?}"
    );
    for (kind, (status, id, body)) in &seen {
        ensure!(id.is_some(), "{kind}: no request id");
        if *status != 200 {
            ensure!(
                body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{kind}: {body}"
            );
        }
    }
    let rows = wait_rows(&ledger, "refused", 6).await?;
    let mut rows_by_id: HashMap<String, _> = rows
        .into_iter()
        .map(|r| (r["request_id"].as_str().unwrap_or_default().to_owned(), r))
        .collect();
    rows_by_id.extend(
        wait_rows(&ledger, "abandon", 1)
            .await?
            .into_iter()
            .map(|r| (r["request_id"].as_str().unwrap_or_default().to_owned(), r)),
    );
    for (kind, (status, id, _)) in &seen {
        let r = rows_by_id
            .get(id.as_deref().unwrap_or_default())
            .with_context(|| format!("{kind}: no row"))?;
        ensure!(
            r["http_status"] == *status,
            "{kind}: the row says {} to a client that got {status}",
            r["http_status"]
        );
        ensure!(
            r["prompt_tokens"].as_u64().is_some_and(|n| n > 0),
            "{kind}: prompt not recorded: {r:?}"
        );
        // Priced by the shipped list, at the rates of its model for the tenants' tier.
        let rates = PRICES.rates(r["model_id"].as_str().unwrap_or_default(), "standard");
        ensure!(
            r["price_list_version"] == PRICES.version.as_str()
                && r["price_input_micros"] == rates.input
                && r["price_cached_input_micros"] == rates.cached_input
                && r["price_output_micros"] == rates.output,
            "{kind}: not priced by policies/prices.json: {r:?}"
        );
        if *status == 200 {
            ensure!(
                r["cost_micros"].as_u64().is_some_and(|c| c > 0),
                "{kind}: served for free: {r:?}"
            );
        } else {
            ensure!(r["cost_micros"] == 0, "{kind}: a refused request was charged: {r:?}");
            ensure!(r["completion_tokens"] == 0, "{kind}: {r:?}");
            let want = if *status == 502 { "error" } else { "rejected" };
            ensure!(r["finish_reason"] == want, "{kind}: {r:?}");
        }
    }
    // Usage: billed requests apart from refused ones.
    let usage = ledger
        .usage(&sluice_billing::query::UsageFilter {
            period: "day".into(),
            tenant: Some("refused".into()),
            model: None,
            since: None,
            until: None,
        })
        .await?;
    let (billed, refused): (i64, i64) =
        usage.iter().fold((0, 0), |(b, r), u| (b + u.requests, r + u.refused_requests));
    ensure!((billed, refused) == (3, 3), "usage: {usage:?}");

    // ---- abandoned non-streamed requests: billed for what the engine generated ----
    let before = engine_generated(&c, &p.engine).await?;
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(1500)).build()?;
    let long_answer = json!({
        "model": MODEL_ID, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
        "ignore_eos": true
    });
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (c, url, key, body) = (
            impatient.clone(),
            format!("{gw}/v1/completions"),
            keys["abandon"].clone(),
            long_answer.clone(),
        );
        tasks.push(tokio::spawn(
            async move { c.post(url).bearer_auth(key).json(&body).send().await },
        ));
    }
    for t in tasks {
        ensure!(t.await?.is_err(), "a 400-token answer arrived within 1.5 s");
    }
    let rows = wait_rows(&ledger, "abandon", 4).await?;
    let abandoned: Vec<_> = rows.iter().filter(|r| r["http_status"] != 502).collect();
    ensure!(abandoned.len() == 3, "{rows:?}");
    let mut billed = 0;
    for r in &abandoned {
        let id = r["request_id"].as_str().context("id")?;
        let o: Value = c
            .get(format!("http://{}/v1/internal/requests/{id}", p.engine))
            .bearer_auth(TOKEN)
            .send()
            .await?
            .json()
            .await?;
        ensure!(o["state"] == "finished" && o["finish_reason"] == "abort", "{o}");
        let generated = o["completion_tokens"].as_u64().context("count")?;
        ensure!(generated > 0, "the engine generated nothing in 1.5 s: {o}");
        ensure!(
            r["completion_tokens"] == generated,
            "billed {} of the {generated} tokens the engine generated: {r:?}",
            r["completion_tokens"]
        );
        ensure!(r["finish_reason"] == "client_disconnected" && r["http_status"] == 499, "{r:?}");
        ensure!(r["cost_micros"].as_u64().is_some_and(|c| c > 0), "{r:?}");
        billed += generated;
    }
    let generated = engine_generated(&c, &p.engine).await? - before;
    ensure!(
        billed == generated,
        "billed {billed} tokens; the engine's counter rose by {generated}"
    );

    // ---- a daily quota, with usage already in the ledger, across a restart ----
    let d = keys["daily"].clone();
    for _ in 0..2 {
        ensure!(post(ok.clone(), &d, &gw).await?.0 == 200);
    }
    let used: u64 = wait_rows(&ledger, "daily", 2)
        .await?
        .iter()
        .map(|r| {
            r["prompt_tokens"].as_u64().unwrap_or(0) + r["completion_tokens"].as_u64().unwrap_or(0)
        })
        .sum();
    let cap = QuotaSettings {
        limits: Limits { daily_tokens: Some(i64::try_from(used)? + 5), ..Default::default() },
        ..Default::default()
    };
    ledger.set_quota(&ops, "daily", &cap).await?;
    // Key grants are cached for 2 s.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (status, _, body) = post(ok.clone(), &d, &gw).await?;
    ensure!(status == 429 && body["error"]["code"] == "insufficient_quota", "{status} {body}");
    let mut gw_proc = gw_proc;
    gw_proc.stop()?;
    let (_gw2, gw2) = p.gateway(&p.engine)?;
    wait_healthy(&c, &format!("{gw2}/health")).await?;
    let (status, _, body) = post(ok.clone(), &d, &gw2).await?;
    ensure!(
        status == 429 && body["error"]["code"] == "insufficient_quota",
        "a restarted gateway handed out a fresh day: {status} {body}"
    );

    // ---- the auditor's reconciliation: no difference, then one tampered row ----
    // Everything above is in the ledger first (the last refusal too).
    wait_rows(&ledger, "daily", 4).await?;
    let (_billing, admin_url) = spawn_sluice(
        &["billing", "--database-url", &db, "--listen", "127.0.0.1:0"],
        &[("SLUICE_JWT_SECRET", JWT_SECRET)],
    )?;
    let admin_url = format!("http://{admin_url}");
    let auditor =
        sluice(&["admin", "token", "--role", "auditor", "--sub", "audit"], &admin_url, "")?;
    let auditor = String::from_utf8(auditor.stdout)?.trim().to_owned();
    let reconcile = ["audit", "reconcile", "--since", "1h", "--engine", p.engine.as_str()];
    let out = sluice(&reconcile, &admin_url, &auditor)?;
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success() && report.contains("reconciled: no difference"),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(report.contains("abandon") && report.contains("refused"), "{report}");
    let costs = format!("price lists {} (", PRICES.version);
    ensure!(report.contains(&costs) && report.contains("rates, price lists"), "{report}");
    eprintln!("{report}");
    // One row altered behind the ledger's back: the rollup and the engine both disagree.
    let tampered = abandoned[0]["request_id"].as_str().context("id")?.to_owned();
    let pool = sqlx::SqlitePool::connect(&db).await?;
    sqlx::query("UPDATE request_records SET completion_tokens = completion_tokens + 1 WHERE request_id = $1")
        .bind(&tampered)
        .execute(&pool)
        .await?;
    // And one served request charged a micro-dollar more than its rates say.
    let served =
        rows_by_id.values().find(|r| r["http_status"] == 200 && r["request_id"] != tampered);
    let overcharged = served.and_then(|r| r["request_id"].as_str()).context("a served row")?;
    sqlx::query("UPDATE request_records SET cost_micros = cost_micros + 1 WHERE request_id = $1")
        .bind(overcharged)
        .execute(&pool)
        .await?;
    let out = sluice(&reconcile, &admin_url, &auditor)?;
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(!out.status.success(), "a tampered row reconciled: {report}");
    let diffs: Vec<&str> = report.lines().filter(|l| l.contains("DIFF")).collect();
    ensure!(
        diffs.iter().any(|l| l.contains("rollup") && l.contains("abandon"))
            && diffs.iter().any(|l| l.contains(&tampered))
            && diffs.iter().any(|l| l.contains("DIFF cost") && l.contains(overcharged)),
        "{report}"
    );
    ledger.close().await;
    Ok(())
}

const JWT_SECRET: &str = "ledger-audit-secret-ledger-audit-0123";

fn sluice(args: &[&str], admin_url: &str, token: &str) -> anyhow::Result<std::process::Output> {
    Ok(std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("SLUICE_ADMIN_URL", admin_url)
        .env("SLUICE_ADMIN_TOKEN", token)
        .env("SLUICE_JWT_SECRET", JWT_SECRET)
        .env("SLUICE_INTERNAL_TOKEN", TOKEN)
        .output()?)
}

/// A SQLite ledger in a directory of its own with one tenant and its key.
async fn one_tenant(id: &str) -> anyhow::Result<(tempfile::TempDir, String, Ledger, String)> {
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let ledger = Ledger::connect(&db).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let new = NewTenant { id: id.into(), name: None, tier: None, overrides: None };
    ledger.create_tenant(&ops, &new).await?;
    let key = ledger.issue_key(&ops, id, None, None, Default::default()).await?.1;
    Ok((dir, db, ledger, key))
}

/// One tenant (held to `quota` when given) at a gateway on its own engine, with a client: all
/// alive while held.
struct Door {
    _dir: tempfile::TempDir,
    ledger: Ledger,
    key: String,
    gw: String,
    c: reqwest::Client,
    _gw_proc: Proc,
    platform: Platform,
}

impl Door {
    async fn open(tenant: &str, quota: Option<QuotaSettings>) -> anyhow::Result<Door> {
        let (dir, db, ledger, key) = one_tenant(tenant).await?;
        if let Some(q) = quota {
            let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
            ledger.set_quota(&ops, tenant, &q).await?;
        }
        let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
        let (engine_proc, engine) = support::spawn_engine(&model, TOKEN, "32", &[], None)?;
        let p = Platform { model, db, engine, _engine_proc: engine_proc };
        let (gw_proc, gw) = p.gateway(&p.engine)?;
        let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        wait_healthy(&c, &format!("{gw}/health")).await?;
        Ok(Door { _dir: dir, ledger, key, gw, c, _gw_proc: gw_proc, platform: p })
    }
}

/// A schema that is a chain of `n` references.
fn deep_refs(n: usize) -> Value {
    let defs: serde_json::Map<String, Value> = (0..n)
        .map(|i| {
            let d = if i + 1 < n {
                json!({"$ref": format!("#/$defs/d{}", i + 1)})
            } else {
                json!({"type": "string"})
            };
            (format!("d{i}"), d)
        })
        .collect();
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// The front door as an OpenAI client sees it: the scheme's case, one model's card, 405s,
/// OpenAI's parameter ranges, refusals of what is not implemented, streams without the
/// gateway's own usage chunk, client headers kept from the engine, no metrics for tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_speaks_openai() -> anyhow::Result<()> {
    let door = Door::open("door", None).await?;
    let (ledger, key, gw, c) = (&door.ledger, &door.key, &door.gw, &door.c);
    let p = &door.platform;

    let r = c
        .get(format!("{gw}/v1/models/{MODEL_ID}"))
        .header("authorization", format!("bearer {key}"))
        .send()
        .await?;
    let card: Value = r.json().await?;
    ensure!(
        card["id"] == MODEL_ID && card["object"] == "model",
        "lowercase bearer, one model: {card}"
    );
    let r = c.get(format!("{gw}/v1/models/gpt-4o")).bearer_auth(key).send().await?;
    ensure!(r.status() == 404, "{}", r.status());
    let r = c.get(format!("{gw}/v1/chat/completions")).bearer_auth(key).send().await?;
    ensure!(r.status() == 405 && r.headers().get("allow").is_some(), "{}", r.status());
    let body: Value = r.json().await?;
    ensure!(body["error"]["code"] == "method_not_allowed", "{body}");
    let r = c.get(format!("{gw}/metrics")).send().await?;
    ensure!(r.status() == 404, "tenants can read /metrics: {}", r.status());

    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL_ID, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().into_iter().flatten() {
            b[k] = v.clone();
        }
        c.post(format!("{gw}/v1/chat/completions")).bearer_auth(key).json(&b)
    };
    for (extra, param) in [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                "schema": {"type": "string", "pattern": "^a"}}}}),
            "response_format.json_schema.schema",
        ),
        // Schemas past the compiler's bounds: once a stack overflow that aborted the engine,
        // and an allocation of gigabytes.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                "schema": deep_refs(3000)}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                "schema": {"type": "array", "minItems": 3000, "items": {"type": "array",
                    "minItems": 3000, "items": {"type": "string"}}}}}}),
            "response_format.json_schema.schema",
        ),
        // A budget below the format's shortest answer: once a 200 whose content did not parse.
        (
            json!({"max_tokens": 3, "response_format": {"type": "json_schema", "json_schema":
                {"name": "p", "schema": {"type": "object", "required": ["answer", "reason"],
                    "properties": {"answer": {"type": "string"}, "reason": {"type": "string"}}}}}}),
            "max_tokens",
        ),
    ] {
        let r = chat(extra.clone()).send().await?;
        let status = r.status();
        let body: Value = r.json().await?;
        ensure!(status == 400 && body["error"]["param"] == param, "{extra}: {status} {body}");
    }
    // A request naming the empty model is refused, and still has its row.
    let r = chat(json!({"model": ""})).send().await?;
    let status = r.status().as_u16();
    let id = r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok());
    let id = id.context("no request id for model \"\"")?.to_owned();
    ensure!((400..500).contains(&status), "model \"\": {status}");
    let rows = support::rows_for(ledger, &[id.as_str()], Duration::from_secs(30)).await?;
    ensure!(rows[&id].len() == 1 && rows[&id][0]["http_status"] == status, "{:?}", rows[&id]);
    // `user` is kept on the row as a hash scoped by the tenant, filterable, never as text.
    let r = chat(json!({"user": "end-user-42"})).send().await?;
    ensure!(r.status() == 200, "a request with a user: {}", r.status());
    let id = r.headers()["x-sluice-request-id"].to_str()?.to_owned();
    let rows = support::rows_for(ledger, &[id.as_str()], Duration::from_secs(30)).await?;
    let hash = sluice_billing::event::user_sha256("door", "end-user-42");
    ensure!(rows[&id][0]["user_sha256"] == hash.as_str(), "{:?}", rows[&id][0]);
    ensure!(!format!("{:?}", rows[&id][0]).contains("end-user-42"), "the user's id is stored");
    let filter = sluice_billing::query::RecordFilter {
        tenant: Some("door".into()),
        user_sha256: Some(hash),
        limit: 100,
        ..Default::default()
    };
    let mine = ledger.records(&filter).await?.records;
    ensure!(mine.len() == 1 && mine[0]["request_id"] == id.as_str(), "{mine:?}");
    // A JSON answer asked for through the gateway is one.
    let r = chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 48}));
    let body: Value = r.send().await?.json().await?;
    let content = body["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    // Ended by the model or closed by the grammar in the tokens left: JSON either way.
    let reason = body["choices"][0]["finish_reason"].as_str().unwrap_or_default();
    ensure!(["stop", "length"].contains(&reason), "{body}");
    ensure!(serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()), "{body}");
    // 100 extra client headers (and cookies, forwarding headers) stay at the gateway.
    let mut many =
        chat(json!({})).header("cookie", "session=secret").header("x-forwarded-for", "10.0.0.1");
    for i in 0..100 {
        many = many.header(format!("x-extra-{i}"), "1");
    }
    let r = many.send().await?;
    ensure!(r.status() == 200, "a request with 100 extra headers: {}", r.status());
    // A stream carries a usage chunk only when the client asked for one.
    for asked in [false, true] {
        let mut extra = json!({"stream": true});
        if asked {
            extra["stream_options"] = json!({"include_usage": true});
        }
        let text = chat(extra).send().await?.text().await?;
        let usage = text
            .lines()
            .filter(|l| l.contains("\"choices\":[]") && l.contains("\"usage\""))
            .count();
        ensure!(
            usage == usize::from(asked),
            "include_usage {asked}: {usage} usage chunks:\n{text}"
        );
        ensure!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }

    // Two pipelined requests get two answers, in order; a long query string is not the
    // engine's business.
    let (addr, key2) = (gw.trim_start_matches("http://").to_owned(), key.clone());
    tokio::task::spawn_blocking(move || pipelined(&addr, &key2)).await??;
    let (addr, key2) = (gw.trim_start_matches("http://").to_owned(), key.clone());
    tokio::task::spawn_blocking(move || long_query(&addr, &key2)).await??;

    // Slow and idle clients: a gateway with 2 s limits.
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (_strict, strict) = spawn_sluice(
        &["gateway", "--plain-http", "--listen", &listen, "--engine", &p.engine]
            .into_iter()
            .chain(["--model", &p.model, "--idle-timeout", "2", "--body-timeout", "2"])
            .chain(["--header-timeout", "2", "--max-per-client", "2"])
            .collect::<Vec<_>>(),
        &[("SLUICE_DATABASE_URL", p.db.as_str()), ("SLUICE_INTERNAL_TOKEN", TOKEN)],
    )?;
    wait_healthy(c, &format!("http://{strict}/health")).await?;
    let key2 = key.clone();
    let strict2 = strict.clone();
    tokio::task::spawn_blocking(move || slow_clients(&strict2, &key2)).await??;
    // 200 idle connections do not keep anyone else from being served.
    let idle: Vec<std::net::TcpStream> =
        (0..200).map(|_| std::net::TcpStream::connect(&strict)).collect::<Result<_, _>>()?;
    let r = c
        .post(format!("http://{strict}/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}))
        .send()
        .await?;
    ensure!(r.status() == 200, "served beside 200 idle connections: {}", r.status());
    drop(idle);
    let key2 = key.clone();
    tokio::task::spawn_blocking(move || address_cap(&strict, &key2)).await??;
    ledger.close().await;
    Ok(())
}

/// A long query string (60,000 bytes; pingora itself refuses request lines much longer) never
/// reaches the engine, whose URI limit answered an empty 414 that was billed.
fn long_query(addr: &str, key: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}).to_string();
    let head = format!(
        "POST /v1/completions?pad={} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        "x".repeat(60_000),
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    ensure!(
        out.starts_with("HTTP/1.1 200"),
        "a long query string got: {}",
        &out[..out.len().min(300)]
    );
    Ok(())
}

/// Two long answers hold this address's two slots (`--max-per-client 2`): a third request is
/// refused at once, and a client quietly waiting longer than `--body-timeout` for a long
/// answer gets it.
fn address_cap(addr: &str, key: &str) -> anyhow::Result<()> {
    // The previous request's slot frees just after its answer is out; a held request sent in
    // that moment is refused, and the pair is sent again.
    let mut last = String::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        match hold_two_and_probe(addr, key)? {
            Ok(()) => return quiet_wait(addr, key),
            Err(got) => last = got,
        }
    }
    anyhow::bail!("no per-address cap: {last}")
}

/// One try of [`address_cap`]: `Err` with what was seen when a held request was itself refused
/// (a slot was still taken).
///
/// The held requests stream, so their answers' heads say they were admitted before the probe
/// is sent: a probe sent earlier would race them for the slots (its own slot frees just after
/// its answer is out, and a held request judged in that moment was refused).
fn hold_two_and_probe(addr: &str, key: &str) -> anyhow::Result<Result<(), String>> {
    use std::io::{Read, Write};
    // Both at once within the engine's KV capacity (32 MiB: 711 positions), so neither waits
    // for the other and the gateway never refuses one for its TTFT; long enough to stay in
    // flight while we probe (two of 400 tokens did not fit, and under load the second was
    // refused at once, leaving one slot held).
    let long = json!({"model": MODEL_ID, "prompt": "Tell a long story.", "max_tokens": 250,
        "ignore_eos": true, "stream": true})
    .to_string();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = std::net::TcpStream::connect(addr)?;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n\
             {long}",
            long.len()
        );
        s.write_all(head.as_bytes())?;
        held.push(s);
    }
    let mut heads = Vec::new();
    for s in &mut held {
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut b = [0u8; 600];
        let n = s.read(&mut b).unwrap_or(0);
        heads.push(String::from_utf8_lossy(&b[..n]).into_owned());
    }
    if let Some(refused) = heads.iter().find(|h| !h.starts_with("HTTP/1.1 200")) {
        let refused = refused.clone();
        // The other one keeps its slot until its answer is out: wait for it, so the next try
        // starts with both slots free.
        drain(&mut held);
        return Ok(Err(format!("a held request got {refused:?}")));
    }
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut buf = [0u8; 2048];
    let n = s.read(&mut buf).unwrap_or(0);
    let probe = String::from_utf8_lossy(&buf[..n]).into_owned();
    let answers = drain(&mut held);
    ensure!(
        probe.starts_with("HTTP/1.1 429") && probe.contains("too_many_connections"),
        "no per-address cap: with two answers streaming the probe got {probe:?}"
    );
    for a in answers {
        ensure!(a.contains("data: [DONE]"), "a held answer was cut short: {a:?}");
    }
    Ok(Ok(()))
}

/// Each held request's answer to its end (waiting up to a minute for each read): once it is
/// out, the request's slot is free (just after).
fn drain(held: &mut [std::net::TcpStream]) -> Vec<String> {
    use std::io::Read;
    held.iter_mut()
        .map(|s| {
            let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got);
            String::from_utf8_lossy(&got).into_owned()
        })
        .collect()
}

/// A client that sends a long request and then waits, quietly, longer than `--body-timeout`
/// (2 s) for its answer gets it: the body's deadline is over the body's arrival only.
fn quiet_wait(addr: &str, key: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let long = json!({"model": MODEL_ID, "prompt": "Tell a long story.", "max_tokens": 250,
        "ignore_eos": true})
    .to_string();
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n\
             {long}",
            long.len()
        )
        .as_bytes(),
    )?;
    std::thread::sleep(Duration::from_secs(3));
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)?;
    let answer = String::from_utf8_lossy(&got);
    ensure!(answer.starts_with("HTTP/1.1 200"), "a long answer: {answer}");
    Ok(())
}

/// Two requests written at once on one connection: both answered, in order.
fn pipelined(addr: &str, key: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let one = |id: &str| {
        format!("GET /v1/models/{id} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n")
    };
    s.write_all(format!("{}{}", one(MODEL_ID), one("nope")).as_bytes())?;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let text = String::from_utf8_lossy(&got);
        if text.matches("HTTP/1.1 ").count() >= 2 && text.trim_end().ends_with('}') {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    let first = text.find("HTTP/1.1 200").context(format!("no first answer: {text}"))?;
    let second =
        text.find("HTTP/1.1 404").context(format!("the pipelined request was dropped: {text}"))?;
    ensure!(first < second, "answers out of order: {text}");
    Ok(())
}

/// An idle kept-alive connection is closed; a body or a head trickled in gets a 408 when its
/// deadline passes, and its connection is closed; so is a connection that sends nothing; heads
/// pingora cannot parse get OpenAI error JSON.
fn slow_clients(addr: &str, key: &str) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf)?;
    ensure!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    let t = Instant::now();
    let n = s.read(&mut buf)?;
    ensure!(n == 0, "an idle kept-alive connection sent {n} bytes");
    ensure!(t.elapsed() < Duration::from_secs(10), "closed only after {:?}", t.elapsed());

    // A body trickled at 2 bytes/s gets a 408 when --body-timeout (2 s) passes.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{{"
    );
    let t = Instant::now();
    let got = trickle(addr, head.as_bytes(), b" ", Duration::from_millis(500))?;
    let text = String::from_utf8_lossy(&got);
    ensure!(text.starts_with("HTTP/1.1 408"), "a trickled body got: {text:?}");
    ensure!(text.contains("request_timeout"), "{text}");
    ensure!(t.elapsed() < Duration::from_secs(8), "cut off only after {:?}", t.elapsed());

    // A head trickled a byte at a time gets a 408 when --header-timeout (2 s) passes, though
    // every single read is quick.
    let t = Instant::now();
    let head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    let got = trickle(addr, head, b"a", Duration::from_millis(200))?;
    let text = String::from_utf8_lossy(&got);
    ensure!(text.starts_with("HTTP/1.1 408"), "a trickled head got: {text:?}");
    ensure!(text.contains("request_timeout"), "{text}");
    ensure!(t.elapsed() < Duration::from_secs(8), "cut off only after {:?}", t.elapsed());

    // A connection that never sends a byte is closed at the same deadline.
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    let t = Instant::now();
    ensure!(s.read(&mut buf)? == 0, "a silent connection got bytes");
    ensure!(t.elapsed() < Duration::from_secs(8), "closed only after {:?}", t.elapsed());

    // Heads pingora cannot parse get OpenAI error JSON, not an empty 400.
    let no_colon = b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n".to_vec();
    let fields: String = (0..300).map(|i| format!("X-Field-{i}: v\r\n")).collect();
    let many = format!("GET /health HTTP/1.1\r\nHost: x\r\n{fields}\r\n").into_bytes();
    let line = format!("GET /health?pad={} HTTP/1.1\r\nHost: x\r\n\r\n", "x".repeat(70_000));
    for (head, status, code) in [
        (no_colon, 400, "malformed_request"),
        (many, 431, "request_header_fields_too_large"),
        (line.into_bytes(), 414, "uri_too_long"),
    ] {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        // The server may close before all of an over-long head is written.
        let _ = s.write_all(&head);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        let (top, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        ensure!(top.starts_with(&format!("HTTP/1.1 {status} ")), "{status} expected: {text:?}");
        let body: Value = serde_json::from_str(body).context(format!("not JSON: {text:?}"))?;
        ensure!(body["error"]["code"] == code, "{status}: {body}");
    }
    Ok(())
}

/// Sends `start`, then `byte` once per `pace` until the server answers whole or closes (at
/// most 15 s): what it answered.
fn trickle(addr: &str, start: &[u8], byte: &[u8], pace: Duration) -> anyhow::Result<Vec<u8>> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(pace))?;
    s.write_all(start)?;
    let t = Instant::now();
    let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
    while t.elapsed() < Duration::from_secs(15) {
        if s.write_all(byte).is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"}") {
            break;
        }
    }
    Ok(got)
}

/// No log level prints a secret or a prompt: gateway and engine at `RUST_LOG=trace`, every
/// line searched for the API key, the internal token, words of the prompts and the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_logs_hold_no_secret_and_no_text() -> anyhow::Result<()> {
    let (dir, db, ledger, key) = one_tenant("quiet").await?;
    let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
    let trace = [("RUST_LOG", "trace")];
    let (engine_log, gw_log) = (dir.path().join("engine.log"), dir.path().join("gateway.log"));
    let (_engine, engine) = support::spawn_engine(&model, TOKEN, "32", &trace, Some(&engine_log))?;
    let gw_listen = format!("127.0.0.1:{}", free_port()?);
    let (_gw, gw) = support::spawn_sluice_logged(
        &[
            "gateway",
            "--plain-http",
            "--listen",
            &gw_listen,
            "--engine",
            &engine,
            "--model",
            &model,
        ],
        // Asking for the revealing crates by name changes nothing either.
        &[
            ("SLUICE_DATABASE_URL", db.as_str()),
            ("SLUICE_INTERNAL_TOKEN", TOKEN),
            ("RUST_LOG", "trace,pingora_proxy=trace,pingora_core=trace,h2=trace"),
        ],
        &gw_log,
    )?;
    let gw = format!("http://{gw}");
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("{gw}/health")).await?;
    let marker = "zebrakumquat";
    let mut answers = Vec::new();
    for stream in [false, true] {
        // Greedy and 24 tokens long: an answer too long to turn up in a log by chance.
        let body = json!({"model": MODEL_ID, "max_tokens": 24, "stream": stream,
            "temperature": 0, "ignore_eos": true,
            "messages": [{"role": "user", "content": format!("Say {marker} twice.")}]});
        let r = c
            .post(format!("{gw}/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await?;
        ensure!(r.status() == 200, "{}", r.status());
        answers.push(r.text().await?);
        let body = json!({"model": MODEL_ID, "max_tokens": 24, "stream": stream,
            "prompt": format!("The word {marker} means")});
        let r = c.post(format!("{gw}/v1/completions")).bearer_auth(&key).json(&body).send().await?;
        ensure!(r.status() == 200, "{}", r.status());
    }
    let wrong = "sk-sluice-deadbeef-0000000000000000wrongsecret";
    let r = c.get(format!("{gw}/v1/models")).bearer_auth(wrong).send().await?;
    ensure!(r.status() == 401, "{}", r.status());
    // The whole answer's text (more than a word or two, so it cannot occur by chance).
    let v: Value = serde_json::from_str(&answers[0])?;
    let answer = v["choices"][0]["message"]["content"].as_str().context("answer")?.to_owned();
    ensure!(answer.len() >= 12, "a short answer proves nothing: {answer:?}");
    // Every request reached the engine and got its line there (written once its response
    // is sent, so the last one may land a moment after the client has its answer).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (engine_text, served) = loop {
        let text = std::fs::read_to_string(&engine_log)?;
        let served = text.lines().filter(|l| l.contains("prompt_tokens=")).count();
        if served >= 4 || std::time::Instant::now() > deadline {
            break (text, served);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(served == 4, "the engine logged {served} of 4 requests");
    let needles = [key.as_str(), TOKEN, marker, wrong, answer.as_str()];
    for log in [&engine_log, &gw_log] {
        let text = std::fs::read_to_string(log)?;
        // Trace logging is on: trace-level lines are there (the engine's own are few now
        // that it no longer tokenizes prompts the gateway already did).
        ensure!(
            text.contains("TRACE"),
            "{} has no trace line: trace logging is off",
            log.display()
        );
        for needle in needles {
            if let Some(line) = text.lines().find(|l| l.contains(needle)) {
                anyhow::bail!("{} logs {needle:?}: {line}", log.display());
            }
        }
        // Below info, only our own crates log (other crates' debug and trace lines print
        // headers and bodies: `tokenizers` once logged a prompt one character a line).
        let foreign = text.lines().find(|l| {
            let low = l.split_whitespace().any(|w| matches!(w, "TRACE" | "DEBUG"));
            low && !l.contains(" sluice_") && !l.contains(" sluice::")
        });
        ensure!(foreign.is_none(), "{} logs another crate below info: {foreign:?}", log.display());
    }
    // The engine used the gateway's token ids: its tokenizer never ran on a prompt (the engine
    // traces each prompt it tokenizes itself, by its length).
    let tokenized = engine_text.lines().find(|l| l.contains("tokenizing the prompt in the engine"));
    ensure!(tokenized.is_none(), "the engine tokenized a prompt again: {tokenized:?}");
    ledger.close().await;
    Ok(())
}

/// A tenant's bodies being read count against its concurrency limit before they are read:
/// with a limit of 1, a request whose body trickles in holds the tenant's one place, and a
/// second request is refused at once (429 `concurrency`) rather than the trickler holding
/// the gateway's slots past its limit; once the trickle ends, the tenant is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_body_holds_no_more_than_its_tenants_concurrency() -> anyhow::Result<()> {
    use std::io::Write;
    let one = QuotaSettings {
        limits: Limits { concurrency: Some(1), ..Default::default() },
        ..Default::default()
    };
    let door = Door::open("trickler", Some(one)).await?;
    let (ledger, key, gw, c) = (&door.ledger, &door.key, &door.gw, &door.c);
    let addr = gw.trim_start_matches("http://").to_owned();
    let body = json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}).to_string();
    // Its head and half its body, then nothing for now.
    let mut slow = std::net::TcpStream::connect(&addr)?;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes())?;
    slow.write_all(&body.as_bytes()[..body.len() / 2])?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let post = || c.post(format!("{gw}/v1/completions")).bearer_auth(key).body(body.clone());
    let r = post().header("content-type", "application/json").send().await?;
    let status = r.status();
    let err: Value = r.json().await?;
    ensure!(status == 429, "a second request while the first's body trickles: {status} {err}");
    ensure!(err["error"]["message"].as_str().is_some_and(|m| m.contains("concurren")), "{err}");
    // The trickle ends: its request is served, and the tenant's next one too.
    slow.write_all(&body.as_bytes()[body.len() / 2..])?;
    slow.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut got = [0u8; 64];
    let n = std::io::Read::read(&mut slow, &mut got)?;
    ensure!(got[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got[..n]));
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = post().header("content-type", "application/json").send().await?;
        if r.status() == 200 {
            break;
        }
        ensure!(Instant::now() < deadline, "the tenant's place was never freed: {}", r.status());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ledger.close().await;
    Ok(())
}

/// A served model the price list does not name is never billed at a guess: its requests are
/// refused (503 `model_not_priced`), each with a row that charges nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpriced_model_is_not_served() -> anyhow::Result<()> {
    let (_dir, db, ledger, key) = one_tenant("pricing").await?;
    let model = common::default_model()?.to_str().context("utf-8")?.to_owned();
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (_engine, engine) = spawn_sluice(
        &["engine", "--model", &model, "--listen", &listen, "--internal-token", TOKEN]
            .into_iter()
            .chain(["--served-model-name", "nobody-priced-me", "--kv-cache-mb", "32"])
            .collect::<Vec<_>>(),
        &[],
    )?;
    let p = Platform { model, db, engine, _engine_proc: _engine };
    let (_gw, gw) = p.gateway(&p.engine)?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    wait_healthy(&c, &format!("{gw}/health")).await?;
    let body = json!({"model": "nobody-priced-me", "prompt": "Hi", "max_tokens": 2});
    let deadline = Instant::now() + Duration::from_secs(20);
    // The gateway learns what the engine serves at its first poll.
    let (status, id, err) = loop {
        let r = c.post(format!("{gw}/v1/completions")).bearer_auth(&key).json(&body).send().await?;
        let status = r.status().as_u16();
        let id = r.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok());
        let id = id.map(str::to_owned);
        let err: Value = r.json().await?;
        if status != 404 || Instant::now() > deadline {
            break (status, id, err);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(status == 503 && err["error"]["code"] == "model_not_priced", "{status} {err}");
    let id = id.context("no request id")?;
    let rows = support::rows_for(&ledger, &[id.as_str()], Duration::from_secs(30)).await?;
    let row = &rows[&id][0];
    ensure!(row["http_status"] == 503 && row["cost_micros"] == 0, "{row:?}");
    ledger.close().await;
    Ok(())
}
