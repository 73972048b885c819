//! The admin, audit and usage API over real HTTP against real Postgres and SQLite (and Redis
//! for change announcements): every role against every endpoint, audit rows written with
//! their changes, secrets never stored or shown twice, filters, keyset pagination, exports.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use chrono::TimeDelta;
use common::{
    Inspect, PgDatabase, REDIS_URL, SqliteFile, base_time, event, stream_names, wait_until,
};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sluice_billing::api::{ApiState, ServiceStatus, router};
use sluice_billing::auth::{Principal, Role, Verifier, mint_hs256};
use sluice_billing::ingest::{IngestConfig, UsageConsumer, publish_to};
use sluice_billing::query::RECORD_COLUMNS;
use sluice_billing::redis_conn::Namespace;
use sluice_billing::{FinishReason, Ledger};

const SECRET: &[u8] = b"test-secret-test-secret-test-secret!";

struct Api {
    base: String,
    http: reqwest::Client,
    ledger: Ledger,
    service: Arc<ServiceStatus>,
    /// The Redis namespace announcements go under (the test's own).
    namespace: Namespace,
    _server: tokio::task::JoinHandle<()>,
}

async fn start(url: &str, redis: bool) -> anyhow::Result<Api> {
    let ledger = Ledger::connect(url).await?;
    let namespace = Namespace::new(&format!("admin-test-{}", uuid::Uuid::new_v4().simple()))
        .map_err(anyhow::Error::msg)?;
    let redis = if redis {
        let conn = sluice_billing::redis_conn::RedisTarget::open(REDIS_URL)?.connect().await?;
        Some((conn, namespace.clone()))
    } else {
        None
    };
    let verifier = Verifier::hs256(SECRET, None, None)?;
    let service = Arc::new(ServiceStatus::default());
    let app = router(Arc::new(ApiState {
        ledger: ledger.clone(),
        verifier,
        redis,
        service: service.clone(),
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(Api {
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        ledger,
        service,
        namespace,
        _server: server,
    })
}

fn token(role: Role, tenant: Option<&str>) -> anyhow::Result<String> {
    let who = Principal {
        actor: format!("{}-tester", role.as_str()),
        role,
        tenant: tenant.map(str::to_owned),
    };
    Ok(mint_hs256(SECRET, &who, 300, None, None)?)
}

impl Api {
    async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> anyhow::Result<(StatusCode, String)> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await?;
        Ok((resp.status(), resp.text().await?))
    }

    async fn ok(
        &self,
        method: Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let (status, text) = self.call(method.clone(), path, Some(token), body).await?;
        ensure!(status.is_success(), "{method} {path}: {status} {text}");
        Ok(serde_json::from_str(&text)?)
    }

    /// Asserts an OpenAI-style error with this status (and parameter, when given).
    async fn err(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        want: StatusCode,
        param: Option<&str>,
    ) -> anyhow::Result<()> {
        let (status, text) = self.call(method.clone(), path, token, body).await?;
        ensure!(status == want, "{method} {path}: want {want}, got {status} {text}");
        let v: Value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
        ensure!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        if let Some(p) = param {
            ensure!(v["error"]["param"] == p, "{method} {path}: param should be {p}: {text}");
        }
        Ok(())
    }
}

/// Every route, each with the roles that may call it.
fn routes() -> Vec<(Method, &'static str, Option<Value>, Vec<Role>)> {
    use Role::*;
    vec![
        (Method::GET, "/v1/tenants", None, vec![Ops]),
        (Method::POST, "/v1/tenants", Some(json!({"id": "made-by-matrix"})), vec![Ops]),
        (Method::GET, "/v1/whoami", None, vec![Ops, Billing, Auditor, TenantAdmin]),
        (Method::GET, "/v1/tiers", None, vec![Ops, TenantAdmin]),
        (Method::GET, "/v1/tenants/acme", None, vec![Ops, TenantAdmin]),
        (Method::PATCH, "/v1/tenants/acme", Some(json!({"name": "Acme Inc"})), vec![Ops]),
        (Method::POST, "/v1/tenants/acme/activate", None, vec![Ops]),
        (Method::GET, "/v1/tenants/acme/keys", None, vec![Ops, TenantAdmin]),
        (Method::POST, "/v1/tenants/acme/keys", Some(json!({})), vec![Ops, TenantAdmin]),
        (Method::GET, "/v1/tenants/acme/quota", None, vec![Ops, TenantAdmin]),
        (Method::PUT, "/v1/tenants/acme/quota", Some(json!({"rpm": 10})), vec![Ops]),
        (Method::GET, "/v1/tenants/acme/adapters", None, vec![Ops, TenantAdmin, Auditor]),
        (Method::GET, "/v1/records", None, vec![Auditor]),
        (Method::GET, "/v1/audit-log", None, vec![Auditor, Ops]),
        (Method::GET, "/v1/audit/reconcile", None, vec![Auditor, Billing]),
        (Method::GET, "/v1/usage", None, vec![Billing, TenantAdmin]),
        (Method::GET, "/v1/dashboard/data", None, vec![Billing]),
    ]
}

async fn role_matrix(url: &str) -> anyhow::Result<()> {
    let api = start(url, false).await?;
    let ops = token(Role::Ops, None)?;
    api.ok(Method::POST, "/v1/tenants", &ops, Some(json!({"id": "acme", "name": "Acme"}))).await?;
    api.ok(Method::POST, "/v1/tenants", &ops, Some(json!({"id": "globex"}))).await?;
    for (method, path, body, allowed) in routes() {
        api.err(method.clone(), path, None, body.clone(), StatusCode::UNAUTHORIZED, None).await?;
        api.err(
            method.clone(),
            path,
            Some("not.a.jwt"),
            body.clone(),
            StatusCode::UNAUTHORIZED,
            None,
        )
        .await?;
        for role in [Role::Ops, Role::Billing, Role::Auditor, Role::TenantAdmin] {
            let t = token(role, (role == Role::TenantAdmin).then_some("acme"))?;
            let (status, text) = api.call(method.clone(), path, Some(&t), body.clone()).await?;
            if allowed.contains(&role) {
                ensure!(status.is_success(), "{} {method} {path}: {status} {text}", role.as_str());
                if path == "/v1/tenants" && method == Method::POST {
                    // Created once; the route is exercised, not the conflict.
                    api.ok(Method::POST, "/v1/tenants/made-by-matrix/suspend", &ops, None).await?;
                }
            } else {
                ensure!(
                    status == StatusCode::FORBIDDEN,
                    "{} {method} {path}: want 403, got {status} {text}",
                    role.as_str()
                );
            }
        }
    }
    // A tenant-admin never reaches another tenant, by any route.
    let acme_admin = token(Role::TenantAdmin, Some("acme"))?;
    for (method, path) in [
        (Method::GET, "/v1/tenants/globex"),
        (Method::GET, "/v1/tenants/globex/keys"),
        (Method::POST, "/v1/tenants/globex/keys"),
        (Method::PUT, "/v1/tenants/globex/keys/nokey/limits"),
        (Method::GET, "/v1/usage?tenant=globex"),
        (Method::GET, "/v1/tenants/globex/quota"),
        (Method::GET, "/v1/tenants/globex/adapters"),
        (Method::POST, "/v1/tenants/globex/adapters"),
        (Method::POST, "/v1/tenants/globex/adapters/support/retire"),
        (Method::PUT, "/v1/tenants/globex/adapters/support/sharing"),
    ] {
        api.err(method, path, Some(&acme_admin), None, StatusCode::FORBIDDEN, None).await?;
    }
    // Its usage is its own even when it asks for everything.
    ingest_usage(&api.ledger).await?;
    let mine = api.ok(Method::GET, "/v1/usage?since=2026-11-01", &acme_admin, None).await?;
    let tenants: BTreeSet<&str> = mine["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["tenant_id"].as_str())
        .collect();
    ensure!(tenants == BTreeSet::from(["acme"]), "tenant-admin usage leaked: {mine}");
    Ok(())
}

/// Tenants' adapters through the API and the ledger: registration (a revision twice is a
/// conflict, another base model under the same name a 400 naming it, bad fields 400s naming
/// them), resolution (the newest active revision, or a pinned one; nothing for another
/// tenant until shared), retirement rolling the name back, and an audit row for each change.
async fn adapter_registry(url: &str) -> anyhow::Result<()> {
    let api = start(url, false).await?;
    let ops = token(Role::Ops, None)?;
    for t in ["acme", "globex", "initech"] {
        api.ok(Method::POST, "/v1/tenants", &ops, Some(json!({"id": t}))).await?;
    }
    let acme = token(Role::TenantAdmin, Some("acme"))?;
    let rev = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    let new = |name: &str, r: &str, base: &str| {
        json!({"name": name, "revision": r, "base_model": base, "base_revision": rev('b'),
            "rank": 8, "targets": ["q_proj", "v_proj"], "bytes": 4096})
    };
    let path = "/v1/tenants/acme/adapters";
    let first = api.ok(Method::POST, path, &acme, Some(new("support", &rev('1'), "m"))).await?;
    ensure!(first["status"] == "active" && first["shared_with"] == json!([]), "{first}");
    api.err(
        Method::POST,
        path,
        Some(&acme),
        Some(new("support", &rev('1'), "m")),
        StatusCode::CONFLICT,
        None,
    )
    .await?;
    api.err(
        Method::POST,
        path,
        Some(&acme),
        Some(new("support", &rev('2'), "other")),
        StatusCode::BAD_REQUEST,
        Some("base_model"),
    )
    .await?;
    let mut bad = new("x", &rev('4'), "m");
    for (field, value) in [
        ("rank", json!(0)),
        ("targets", json!(["lm_head"])),
        ("revision", json!("abc")),
        ("name", json!("Has Space")),
        ("shared_with[0]", json!(["acme"])),
    ] {
        let mut b = bad.clone();
        b[field.trim_end_matches("[0]")] = value;
        api.err(Method::POST, path, Some(&acme), Some(b), StatusCode::BAD_REQUEST, Some(field))
            .await?;
    }
    bad["shared_with"] = json!(["nobody"]);
    api.err(Method::POST, path, Some(&acme), Some(bad), StatusCode::NOT_FOUND, None).await?;
    api.ok(Method::POST, path, &acme, Some(new("support", &rev('3'), "m"))).await?;
    let l = &api.ledger;
    let resolved = |caller: &'static str, r: Option<String>| async move {
        l.resolve_adapter(caller, "acme", "support", r.as_deref())
            .await
            .map(|a| a.map(|a| a.revision))
    };
    ensure!(resolved("acme", None).await? == Some(rev('3')), "the newest revision runs");
    ensure!(resolved("acme", Some(rev('1'))).await? == Some(rev('1')), "a pinned revision runs");
    ensure!(resolved("acme", Some(rev('9'))).await?.is_none(), "an unknown revision resolves");
    ensure!(resolved("globex", None).await?.is_none(), "another tenant's adapter resolved");
    // Shared with globex: it resolves there and is listed there, not at initech.
    let sharing = "/v1/tenants/acme/adapters/support/sharing";
    api.ok(Method::PUT, sharing, &acme, Some(json!({"shared_with": ["globex"]}))).await?;
    ensure!(resolved("globex", None).await? == Some(rev('3')), "a shared adapter did not resolve");
    ensure!(resolved("initech", None).await?.is_none(), "shared too widely");
    let globex = token(Role::TenantAdmin, Some("globex"))?;
    let listed = api.ok(Method::GET, "/v1/tenants/globex/adapters", &globex, None).await?;
    ensure!(listed["data"].as_array().map(Vec::len) == Some(2), "{listed}");
    // Retiring the newest rolls the name back; retiring the rest leaves nothing to run.
    let retire = "/v1/tenants/acme/adapters/support/retire";
    api.ok(Method::POST, retire, &acme, Some(json!({"revision": rev('3')}))).await?;
    ensure!(resolved("acme", None).await? == Some(rev('1')), "no rollback to the revision before");
    ensure!(resolved("acme", Some(rev('3'))).await?.is_none(), "a retired revision resolves");
    api.ok(Method::POST, retire, &acme, None).await?;
    ensure!(resolved("acme", None).await?.is_none(), "a retired adapter resolves");
    api.err(Method::POST, retire, Some(&acme), None, StatusCode::NOT_FOUND, None).await?;
    let log = api.ok(Method::GET, "/v1/audit-log", &ops, None).await?;
    let actions: Vec<&str> =
        log["data"].as_array().into_iter().flatten().filter_map(|e| e["action"].as_str()).collect();
    for (action, n) in [("adapter.register", 2), ("adapter.share", 1), ("adapter.retire", 2)] {
        let seen = actions.iter().filter(|a| **a == action).count();
        ensure!(seen == n, "{action}: {seen} audit rows, want {n}: {actions:?}");
    }
    Ok(())
}

#[tokio::test]
async fn adapters_as_ledger_objects_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    adapter_registry(&db.url).await
}

#[tokio::test]
async fn adapters_as_ledger_objects_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    adapter_registry(&db.url).await
}

/// 25 records: acme 15 (5 of them `length`, 2 with status 429), globex 10.
async fn ingest_usage(ledger: &Ledger) -> anyhow::Result<()> {
    let mut events = Vec::new();
    for i in 0..25 {
        let tenant = if i < 15 { "acme" } else { "globex" };
        let mut e = event(&format!("req-{i:03}"), tenant);
        // Several records share an arrival time, so the cursor must break ties by id.
        let shift = TimeDelta::seconds(i / 3);
        e.arrival_at += shift;
        e.first_token_at = e.first_token_at.map(|t| t + shift);
        e.last_token_at = e.last_token_at.map(|t| t + shift);
        if i % 3 == 0 && i < 15 {
            e.finish_reason = FinishReason::Length;
        }
        if i == 4 || i == 7 {
            e.http_status = 429;
            e.finish_reason = FinishReason::Rejected;
            e.completion_tokens = 0;
            e.cost_micros = 0;
        }
        e.ttft_ms = Some(100.0 + i as f64);
        events.push(e);
    }
    ledger.insert_batch(&events).await?;
    Ok(())
}

async fn lifecycle_and_audit(url: &str) -> anyhow::Result<()> {
    let api = start(url, false).await?;
    let ops = token(Role::Ops, None)?;
    let auditor = token(Role::Auditor, None)?;
    let t = api
        .ok(
            Method::POST,
            "/v1/tenants",
            &ops,
            Some(json!({"id": "acme", "name": "Acme", "tier": "free"})),
        )
        .await?;
    ensure!(t["status"] == "active" && t["tier"] == "free", "{t}");
    api.err(
        Method::POST,
        "/v1/tenants",
        Some(&ops),
        Some(json!({"id": "acme"})),
        StatusCode::CONFLICT,
        None,
    )
    .await?;
    // Keys: the secret comes back once, is stored only as a hash, and never listed.
    let issued = api
        .ok(Method::POST, "/v1/tenants/acme/keys", &ops, Some(json!({"scopes": ["chat"]})))
        .await?;
    let secret = issued["secret"].as_str().context("no secret")?.to_owned();
    let key_id = issued["id"].as_str().context("no id")?.to_owned();
    ensure!(secret.starts_with(issued["prefix"].as_str().unwrap_or("?")), "{issued}");
    let listed = api.ok(Method::GET, "/v1/tenants/acme/keys", &ops, None).await?;
    ensure!(listed["data"].as_array().map(Vec::len) == Some(1), "{listed}");
    ensure!(!listed.to_string().contains(&secret), "a listing shows the secret");
    let db = Inspect::open(url).await?;
    let hash = sluice_billing::control::hash_secret(&secret);
    ensure!(
        db.scalar(&format!(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM api_keys WHERE secret_hash = '{hash}'"
        ))
        .await?
            == 1
    );
    let grant = api.ledger.key_grant(&secret).await?.context("a fresh key grants nothing")?;
    ensure!(grant.tenant_id == "acme" && grant.key_id == key_id && grant.scopes == ["chat"]);
    ensure!(grant.quota.limits.rpm == Some(20) && grant.tenant_status == "active", "{grant:?}");
    let mut wrong = secret.clone();
    wrong.pop();
    wrong.push('x');
    ensure!(api.ledger.key_grant(&wrong).await?.is_none(), "a wrong secret with a real prefix");
    ensure!(api.ledger.key_grant("sk-sluice-nope").await?.is_none());
    // A key's own limits, beside the tenant's quota: set, shown, granted, checked.
    let limits_path = format!("/v1/tenants/acme/keys/{key_id}/limits");
    let limited = api
        .ok(Method::PUT, &limits_path, &ops, Some(json!({"rpm": 3, "daily_tokens": 100})))
        .await?;
    ensure!(limited["limits"] == json!({"rpm": 3, "daily_tokens": 100}), "{limited}");
    let grant = api.ledger.key_grant(&secret).await?.context("the limited key grants nothing")?;
    ensure!(grant.key_limits.rpm == Some(3) && grant.key_limits.daily_tokens == Some(100));
    ensure!(grant.quota.limits.rpm == Some(20), "the tenant's quota changed: {grant:?}");
    for (bad, param) in [(json!({"rpm": -1}), "limits.rpm"), (json!({"burst": 1}), "body")] {
        api.err(Method::PUT, &limits_path, Some(&ops), Some(bad), StatusCode::BAD_REQUEST, None)
            .await
            .with_context(|| param.to_owned())?;
    }
    api.err(
        Method::PUT,
        "/v1/tenants/acme/keys/nokey/limits",
        Some(&ops),
        Some(json!({})),
        StatusCode::NOT_FOUND,
        None,
    )
    .await?;
    let revoked =
        api.ok(Method::POST, &format!("/v1/tenants/acme/keys/{key_id}/revoke"), &ops, None).await?;
    ensure!(revoked["revoked_at"].is_string(), "{revoked}");
    ensure!(api.ledger.key_grant(&secret).await?.is_none(), "a revoked key still grants");
    api.err(
        Method::POST,
        "/v1/tenants/globex/keys/nokey/revoke",
        Some(&ops),
        None,
        StatusCode::NOT_FOUND,
        None,
    )
    .await?;
    // Quotas: overrides over the tier.
    let q = api
        .ok(
            Method::PUT,
            "/v1/tenants/acme/quota",
            &ops,
            Some(json!({"rpm": 7, "allowed_models": ["m1"]})),
        )
        .await?;
    ensure!(q["effective"]["rpm"] == 7 && q["effective"]["tpm"] == 20000, "{q}");
    ensure!(q["effective"]["allowed_models"] == json!(["m1"]), "{q}");
    let q = api.ok(Method::GET, "/v1/tenants/acme/quota", &ops, None).await?;
    ensure!(q["overrides"]["rpm"] == 7 && q["overrides"]["tpm"].is_null(), "{q}");
    api.ok(Method::POST, "/v1/tenants/acme/suspend", &ops, None).await?;
    let t = api.ok(Method::GET, "/v1/tenants/acme", &ops, None).await?;
    ensure!(t["status"] == "suspended", "{t}");
    // Every change is in the audit log, with actor, role, before and after; none has the secret.
    let log = api.ok(Method::GET, "/v1/audit-log", &auditor, None).await?;
    let entries = log["data"].as_array().context("no data")?;
    let actions: Vec<&str> = entries.iter().filter_map(|e| e["action"].as_str()).collect();
    ensure!(
        actions
            == [
                "tenant.create",
                "key.issue",
                "key.limits.set",
                "key.revoke",
                "quota.set",
                "tenant.suspend"
            ],
        "{actions:?}"
    );
    for e in entries {
        ensure!(e["actor"] == "ops-tester" && e["role"] == "ops", "{e}");
    }
    ensure!(
        entries[5]["before"]["status"] == "active" && entries[5]["after"]["status"] == "suspended"
    );
    ensure!(entries[4]["after"]["overrides"]["rpm"] == 7);
    ensure!(
        entries[2]["before"]["limits"] == json!({}) && entries[2]["after"]["limits"]["rpm"] == 3
    );
    ensure!(!log.to_string().contains(&secret), "the audit log holds the secret");
    // Keyset pagination of the audit log.
    let page = api.ok(Method::GET, "/v1/audit-log?limit=2", &auditor, None).await?;
    let cursor = page["next_cursor"].as_str().context("no cursor")?;
    let next = api
        .ok(Method::GET, &format!("/v1/audit-log?limit=2&cursor={cursor}"), &auditor, None)
        .await?;
    ensure!(next["data"][0]["action"] == "key.limits.set", "{next}");
    // A failed change writes no audit row (same transaction).
    api.err(
        Method::PUT,
        "/v1/tenants/nobody/quota",
        Some(&ops),
        Some(json!({})),
        StatusCode::NOT_FOUND,
        None,
    )
    .await?;
    ensure!(db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM admin_audit_log").await? == 6);
    db.close().await;
    Ok(())
}

async fn validation(url: &str) -> anyhow::Result<()> {
    let api = start(url, false).await?;
    let ops = token(Role::Ops, None)?;
    let auditor = token(Role::Auditor, None)?;
    let bad = StatusCode::BAD_REQUEST;
    api.err(
        Method::POST,
        "/v1/tenants",
        Some(&ops),
        Some(json!({"id": "Bad Id!"})),
        bad,
        Some("id"),
    )
    .await?;
    api.err(
        Method::POST,
        "/v1/tenants",
        Some(&ops),
        Some(json!({"id": "x", "tier": "gold"})),
        bad,
        Some("tier"),
    )
    .await?;
    api.err(
        Method::POST,
        "/v1/tenants",
        Some(&ops),
        Some(json!({"id": "x", "colour": 1})),
        bad,
        None,
    )
    .await?;
    api.err(Method::POST, "/v1/tenants", Some(&ops), Some(json!({"id": 5})), bad, Some("id"))
        .await?;
    api.ok(Method::POST, "/v1/tenants", &ops, Some(json!({"id": "acme"}))).await?;
    // A tenant's name and tier change by PATCH; its status only by suspend and activate.
    for (body, param) in [
        (json!({"tier": "platinum"}), "tier"),
        (json!({"status": "suspended"}), "status"),
        (json!({}), "body"),
    ] {
        let path = "/v1/tenants/acme";
        api.err(Method::PATCH, path, Some(&ops), Some(body), bad, Some(param)).await?;
    }
    let missing = StatusCode::NOT_FOUND;
    let body = Some(json!({"tier": "enterprise"}));
    api.err(Method::PATCH, "/v1/tenants/nobody", Some(&ops), body.clone(), missing, None).await?;
    let t = api.ok(Method::PATCH, "/v1/tenants/acme", &ops, body).await?;
    ensure!(t["tier"] == "enterprise" && t["status"] == "active", "{t}");
    // Overrides are checked field by field, at creation and by PATCH; none is stored and
    // ignored.
    for (overrides, param) in [
        (json!({"weight": 0}), "overrides.weight"),
        (json!({"weight": 1001}), "overrides.weight"),
        (json!({"weight": "2"}), "overrides.weight"),
        (json!({"weight": 1.5}), "overrides.weight"),
        (json!({"on_limiter_down": "refsue"}), "overrides.on_limiter_down"),
        (json!({"priority": 3}), "overrides.priority"),
        (json!([1]), "overrides"),
    ] {
        let new = json!({"id": "initech", "overrides": overrides});
        api.err(Method::POST, "/v1/tenants", Some(&ops), Some(new), bad, Some(param)).await?;
        let change = Some(json!({"overrides": overrides}));
        api.err(Method::PATCH, "/v1/tenants/acme", Some(&ops), change, bad, Some(param)).await?;
    }
    // A merge patch: a field set, another kept, then removed by null.
    let limiter = json!({"overrides": {"on_limiter_down": "refuse"}});
    api.ok(Method::PATCH, "/v1/tenants/acme", &ops, Some(limiter)).await?;
    let weighted = json!({"overrides": {"weight": 7}});
    let t = api.ok(Method::PATCH, "/v1/tenants/acme", &ops, Some(weighted)).await?;
    ensure!(t["overrides"] == json!({"on_limiter_down": "refuse", "weight": 7}), "{t}");
    let t = api.ok(Method::GET, "/v1/tenants/acme", &ops, None).await?;
    ensure!(t["overrides"]["weight"] == 7 && t["tier"] == "enterprise", "{t}");
    let cleared = json!({"overrides": {"weight": null}});
    let t = api.ok(Method::PATCH, "/v1/tenants/acme", &ops, Some(cleared)).await?;
    ensure!(t["overrides"] == json!({"on_limiter_down": "refuse"}), "{t}");
    api.err(
        Method::PUT,
        "/v1/tenants/acme/quota",
        Some(&ops),
        Some(json!({"rpm": -1})),
        bad,
        Some("rpm"),
    )
    .await?;
    api.err(
        Method::PUT,
        "/v1/tenants/acme/quota",
        Some(&ops),
        Some(json!({"rpm": "many"})),
        bad,
        Some("rpm"),
    )
    .await?;
    api.err(
        Method::PUT,
        "/v1/tenants/acme/quota",
        Some(&ops),
        Some(json!({"priority": 1000})),
        bad,
        Some("priority"),
    )
    .await?;
    api.err(
        Method::POST,
        "/v1/tenants/acme/keys",
        Some(&ops),
        Some(json!({"scopes": ["root"]})),
        bad,
        Some("scopes"),
    )
    .await?;
    api.err(
        Method::POST,
        "/v1/tenants/acme/keys",
        Some(&ops),
        Some(json!({"expires_at": "2001-01-01T00:00:00Z"})),
        bad,
        Some("expires_at"),
    )
    .await?;
    for (q, param) in [
        ("limit=0", "limit"),
        ("limit=abc", "limit"),
        ("cursor=zz", "cursor"),
        ("since=yesterday", "since"),
        ("status=99", "status"),
        ("format=xml", "format"),
        ("tenant_id=acme", "tenant_id"),
        ("tenant=%27%20OR%201%3D1--", "none"),
    ] {
        if param == "none" {
            // Parameterized: an injection attempt is just a tenant with no records.
            let v = api.ok(Method::GET, &format!("/v1/records?{q}"), &auditor, None).await?;
            ensure!(v["records"].as_array().is_some_and(Vec::is_empty), "{v}");
            continue;
        }
        api.err(Method::GET, &format!("/v1/records?{q}"), Some(&auditor), None, bad, Some(param))
            .await?;
    }
    api.err(Method::GET, "/v1/nothing", Some(&ops), None, StatusCode::NOT_FOUND, None).await?;
    Ok(())
}

async fn records_and_exports(url: &str) -> anyhow::Result<()> {
    let api = start(url, false).await?;
    let auditor = token(Role::Auditor, None)?;
    ingest_usage(&api.ledger).await?;
    // Pages of 10 over 25 records: 10 + 10 + 5, in (arrival, id) order, no repeats.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..4 {
        let path = match &cursor {
            Some(c) => format!("/v1/records?limit=10&cursor={c}"),
            None => "/v1/records?limit=10".to_owned(),
        };
        let v = api.ok(Method::GET, &path, &auditor, None).await?;
        for r in v["records"].as_array().context("records")? {
            seen.push(r["request_id"].as_str().context("id")?.to_owned());
        }
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let want: Vec<String> = (0..25).map(|i| format!("req-{i:03}")).collect();
    ensure!(seen == want, "pagination gave {seen:?}");
    // Filters.
    let count = |v: &Value| v["records"].as_array().map_or(0, Vec::len);
    let v = api.ok(Method::GET, "/v1/records?tenant=acme&limit=100", &auditor, None).await?;
    ensure!(count(&v) == 15);
    let v =
        api.ok(Method::GET, "/v1/records?tenant=acme&finish_reason=length", &auditor, None).await?;
    ensure!(count(&v) == 5, "{v}");
    let v = api.ok(Method::GET, "/v1/records?status=429", &auditor, None).await?;
    ensure!(count(&v) == 2);
    let v = api
        .ok(Method::GET, "/v1/records?model_revision=sha256:aaaa&key=key-globex", &auditor, None)
        .await?;
    ensure!(count(&v) == 10);
    let since = (base_time() + TimeDelta::seconds(6)).to_rfc3339();
    let until = (base_time() + TimeDelta::seconds(7)).to_rfc3339();
    let path = format!("/v1/records?since={}&until={}", urlenc(&since), urlenc(&until));
    let v = api.ok(Method::GET, &path, &auditor, None).await?;
    ensure!(count(&v) == 3, "time window: {v}");
    ensure!(
        v["records"][0]["prompt_tokens"] == 100 && v["records"][0]["client_disconnected"] == false
    );
    // CSV: the column names of request_records, one line per record, quoting where needed.
    let (status, csv) =
        api.call(Method::GET, "/v1/records?format=csv&tenant=globex", Some(&auditor), None).await?;
    ensure!(status.is_success(), "{csv}");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().context("no header")?.split(',').collect();
    let names: Vec<&str> = RECORD_COLUMNS.iter().map(|(n, _)| *n).collect();
    ensure!(header == names, "{header:?}");
    let db = Inspect::open(url).await?;
    ensure!(db.columns("request_records").await? == names, "export columns differ from the table");
    db.close().await;
    let rows: Vec<&str> = lines.collect();
    ensure!(rows.len() == 10 && rows.iter().all(|r| r.starts_with("req-0")), "{csv}");
    // JSON Lines.
    let (_, jsonl) = api
        .call(Method::GET, "/v1/records?format=jsonl&tenant=acme&limit=5", Some(&auditor), None)
        .await?;
    let parsed: Vec<Value> = jsonl.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    ensure!(parsed.len() == 5 && parsed.iter().all(|r| r["tenant_id"] == "acme"));
    // Usage aggregates (billing role) from the rollups written with the records.
    let billing = token(Role::Billing, None)?;
    let u = api.ok(Method::GET, "/v1/usage?period=hour&since=2026-11-29", &billing, None).await?;
    // The two 429s are refused: counted apart, nothing billed.
    let t = &u["totals"];
    ensure!(t["requests"] == 23 && t["refused_requests"] == 2, "{u}");
    ensure!(t["cost_micros"] == 23 * 1234, "{u}");
    // The rollups written with the rows add up to them, bucket by bucket.
    let auditor_r =
        api.ok(Method::GET, "/v1/audit/reconcile?since=2026-11-29", &auditor, None).await?;
    ensure!(auditor_r["records"] == 25 && auditor_r["differences"] == json!([]), "{auditor_r}");
    ensure!(auditor_r["buckets"].as_u64().is_some_and(|b| b >= 2), "{auditor_r}");
    // The dashboard's aggregates.
    let path = format!(
        "/v1/dashboard/data?since={}&until={}",
        urlenc("2026-11-29T12:00:00Z"),
        urlenc("2026-12-01T00:00:00Z")
    );
    let d = api.ok(Method::GET, &path, &billing, None).await?;
    ensure!(d["period"] == "hour" && d["top_tenants"][0]["tenant_id"] == "acme", "{d}");
    let acme = d["latency"]
        .as_array()
        .and_then(|l| l.iter().find(|r| r["tenant_id"] == "acme"))
        .context("latency")?;
    // ttft 100..=114: nearest-rank p50 of 15 = 8th smallest = 107.
    ensure!(acme["ttft_ms"]["p50"] == 107.0 && acme["ttft_ms"]["p99"] == 114.0, "{acme}");
    Ok(())
}

fn urlenc(s: &str) -> String {
    s.replace('+', "%2B").replace(':', "%3A")
}

#[tokio::test]
async fn every_role_against_every_endpoint_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    role_matrix(&db.url).await
}

#[tokio::test]
async fn every_role_against_every_endpoint_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    role_matrix(&db.url).await
}

#[tokio::test]
async fn changes_and_their_audit_rows_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    lifecycle_and_audit(&db.url).await
}

#[tokio::test]
async fn changes_and_their_audit_rows_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    lifecycle_and_audit(&db.url).await
}

#[tokio::test]
async fn bad_input_names_the_parameter_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    validation(&db.url).await
}

#[tokio::test]
async fn bad_input_names_the_parameter_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    validation(&db.url).await
}

#[tokio::test]
async fn records_filters_pages_and_exports_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    records_and_exports(&db.url).await
}

#[tokio::test]
async fn records_filters_pages_and_exports_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    records_and_exports(&db.url).await
}

#[tokio::test]
async fn quota_changes_are_announced_to_gateways() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    let api = start(&db.url, true).await?;
    let ops = token(Role::Ops, None)?;
    api.ok(Method::POST, "/v1/tenants", &ops, Some(json!({"id": "acme"}))).await?;
    let client = redis::Client::open(REDIS_URL)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    // The API's own namespace: the announcement is named under it, not the default's.
    let (channel, version) = (api.namespace.control_channel(), api.namespace.control_version_key());
    let before: i64 = redis::AsyncCommands::get(&mut conn, &version).await.unwrap_or(0);
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&channel).await?;
    api.ok(Method::PUT, "/v1/tenants/acme/quota", &ops, Some(json!({"rpm": 3}))).await?;
    let mut messages = pubsub.on_message();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let msg = tokio::time::timeout_at(deadline, futures_next(&mut messages))
            .await
            .context("no announcement within 5 s")?
            .context("pubsub closed")?;
        let payload: String = msg.get_payload()?;
        let v: Value = serde_json::from_str(&payload)?;
        // Only this API announces on its namespace's channel; still, wait for ours.
        if v["tenant_id"] == "acme" && v["kind"] == "quota" {
            ensure!(v["version"].as_i64().is_some_and(|n| n > before), "{v}");
            break;
        }
    }
    let after: i64 = redis::AsyncCommands::get(&mut conn, &version).await?;
    // The counter is this test's own: it leaves nothing behind.
    redis::cmd("DEL").arg(&version).query_async::<()>(&mut conn).await?;
    if after <= before {
        bail!("version counter did not move: {before} -> {after}");
    }
    Ok(())
}

async fn futures_next<S: futures_util::Stream + Unpin>(s: &mut S) -> Option<S::Item> {
    futures_util::StreamExt::next(s).await
}

/// The probes need no token: `/livez` answers while the process does; `/readyz` follows the
/// database (a closed pool stands for one that no longer answers).
#[tokio::test]
async fn readiness_follows_the_database_liveness_does_not() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    let api = start(&db.url, false).await?;
    let (status, text) = api.call(Method::GET, "/readyz", None, None).await?;
    ensure!(status == StatusCode::OK && text.contains("ready"), "{status} {text}");
    api.ledger.close().await;
    let (status, text) = api.call(Method::GET, "/readyz", None, None).await?;
    ensure!(status == StatusCode::SERVICE_UNAVAILABLE, "without its database: {status} {text}");
    ensure!(text.contains("database_"), "{text}");
    let (status, _) = api.call(Method::GET, "/livez", None, None).await?;
    ensure!(status == StatusCode::OK, "liveness does not depend on the database: {status}");
    Ok(())
}

/// `/metrics` (no token, counts only) reports the usage consumer's counters and the group's
/// pending entries; once a drain began, `/readyz` answers 503 and the gauge says so.
#[tokio::test]
async fn metrics_count_ingestion_and_a_draining_replica_is_not_ready() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    let api = start(&db.url, true).await?;
    let (status, text) = api.call(Method::GET, "/metrics", None, None).await?;
    ensure!(status == StatusCode::OK, "{status} {text}");
    ensure!(text.contains("sluice_billing_database_up 1"), "{text}");
    ensure!(text.contains("sluice_billing_draining 0"), "{text}");
    ensure!(!text.contains("sluice_billing_ingest_"), "no consumer, no counters: {text}");

    let (stream, dead, group) = stream_names();
    let client = redis::Client::open(REDIS_URL)?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let mut config = IngestConfig::new("metrics-test");
    (config.stream, config.dead_letter_stream, config.group) =
        (stream.clone(), dead.clone(), group.clone());
    let consumer = UsageConsumer::new(client, api.ledger.clone(), config).await?;
    api.service.set_consumer(consumer.stats(), &stream, &group);
    for i in 0..3 {
        publish_to(&mut redis, &stream, &event(&format!("metrics-{i}"), "t-metrics")).await?;
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(consumer.run(stopped));
    let counters = |text: &str| {
        text.contains("sluice_billing_ingest_inserted_total 3")
            && text.contains("sluice_billing_stream_pending 0")
    };
    wait_until("the metrics to count 3 inserted", Duration::from_secs(20), || async {
        let (_, text) = api.call(Method::GET, "/metrics", None, None).await?;
        Ok(counters(&text))
    })
    .await?;
    let (_, text) = api.call(Method::GET, "/metrics", None, None).await?;
    ensure!(text.contains("# TYPE sluice_billing_ingest_inserted_total counter"), "{text}");
    ensure!(text.contains("sluice_billing_ingest_duplicates_total 0"), "{text}");

    let (status, _) = api.call(Method::GET, "/readyz", None, None).await?;
    ensure!(status == StatusCode::OK, "ready before the drain: {status}");
    api.service.begin_drain();
    let (status, text) = api.call(Method::GET, "/readyz", None, None).await?;
    ensure!(
        status == StatusCode::SERVICE_UNAVAILABLE && text.contains("draining"),
        "{status} {text}"
    );
    let (_, text) = api.call(Method::GET, "/metrics", None, None).await?;
    ensure!(text.contains("sluice_billing_draining 1"), "{text}");
    let (status, _) = api.call(Method::GET, "/livez", None, None).await?;
    ensure!(status == StatusCode::OK, "alive while draining: {status}");
    let _ = stop.send(true);
    run.await??;
    common::delete_keys(&mut redis, &[&stream, &dead]).await?;
    Ok(())
}
