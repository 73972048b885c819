//! The billing API against hostile input, over real HTTP against real Postgres and SQLite:
//! every query parameter of every GET route (and the path segments of the tenant routes)
//! fuzzed with generated strings (multi-byte characters, huge and negative numbers, empty
//! values, broken `%` sequences, NUL) answers 200 or a 4xx in the OpenAI error shape naming
//! the parameter, never a dropped connection or a 5xx; CSV exports carry no spreadsheet
//! formula; the dashboard gets the console's security headers.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, ensure};
use common::{Inspect, PgDatabase, SqliteFile, event};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::api::{ApiState, ServiceStatus, router};
use sluice_billing::auth::{Principal, Role, Verifier, mint_hs256};

const SECRET: &[u8] = b"input-test-secret-input-test-secret!";

struct Api {
    base: String,
    http: reqwest::Client,
    ledger: Ledger,
    _server: tokio::task::JoinHandle<()>,
}

async fn start(url: &str) -> anyhow::Result<Api> {
    let ledger = Ledger::connect(url).await?;
    let app = router(Arc::new(ApiState {
        ledger: ledger.clone(),
        verifier: Verifier::hs256(SECRET, None, None)?,
        redis: None,
        service: Arc::new(ServiceStatus::default()),
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    // No redirects followed: `/` answers its own redirect, which is checked as such.
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
    Ok(Api { base: format!("http://{addr}"), http, ledger, _server: server })
}

fn token(role: Role) -> anyhow::Result<String> {
    let tenant = (role == Role::TenantAdmin).then(|| "acme".to_owned());
    let who = Principal { actor: format!("{}-fuzzer", role.as_str()), role, tenant };
    Ok(mint_hs256(SECRET, &who, 600, None, None)?)
}

/// A deterministic generator (xorshift64*): the same strings on every run, so a failure
/// names a value that reproduces it.
struct Strings(u64);

impl Strings {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[(self.next() % from.len() as u64) as usize]
    }

    /// A string of 0 to 11 pieces: digits, units, signs, date and time punctuation, multi-byte
    /// characters, NUL and other controls, and whole numbers far beyond any range.
    fn value(&mut self) -> String {
        const PIECES: &[&str] = &[
            "0",
            "1",
            "7",
            "24",
            "99",
            "2026",
            "-",
            "+",
            ".",
            ":",
            "T",
            "Z",
            "s",
            "m",
            "h",
            "d",
            "y",
            "mo",
            "e",
            "é",
            "ħ",
            "日",
            "🦀",
            "\u{0}",
            "\n",
            "\t",
            " ",
            "%",
            "'",
            "\"",
            ",",
            "=",
            "@",
            "\u{feff}",
            "\u{202e}",
            "-12-31",
            "18446744073709551616",
            "9223372036854775807",
            "-9223372036854775809",
            "100000",
            "csv",
            "jsonl",
            "hour",
            "day",
        ];
        let n = self.next() % 12;
        (0..n).map(|_| self.pick(PIECES)).collect()
    }
}

/// Every byte but ASCII letters and digits as `%XX`: the server receives exactly `s`.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() { char::from(b).to_string() } else { format!("%{b:02X}") }
        })
        .collect()
}

/// Written into the query string as they are: broken `%` sequences, raw multi-byte characters
/// (the client encodes those), a value that brings a second parameter.
const RAW: &[&str] = &[
    "",
    "1é",
    "é",
    "24ħ",
    "7日",
    "🦀",
    "1🦀",
    "-1",
    "-1d",
    "0",
    "1",
    "+5",
    "4294967296",
    "18446744073709551616",
    "99999999999999999999999999d",
    "-9223372036854775808",
    "1e309",
    "NaN",
    "%",
    "%%",
    "%zz",
    "%C3",
    "%C3%A9",
    "%00",
    "a%00b",
    "%FF%FE",
    "%2B1d",
    "%0A",
    "%0D%0A",
    "0000-01-01",
    "0001-01-01",
    "9999-12-31",
    "+275760-09-13",
    "-262143-01-01",
    "+262143-12-31",
    "2026-11-29T10:00:00+23:59",
    "9999-12-31T23:59:59-23:59",
    "0001-01-01T00:00:00+23:59",
    "100000d",
    "100001d",
    "csv",
    "jsonl",
    "json",
    "hour",
    "day",
    "=1+1",
    "'",
    "\"",
    "<script>",
    "a&b=c",
    " ",
    "null",
    "[]",
    "{}",
];

/// What one answer must be: 2xx (pages, and JSON on the API unless CSV or JSON Lines was
/// asked for), or on the API a 4xx in the OpenAI error shape, a 400 naming `param`.
async fn check(
    api: &Api,
    path_and_query: &str,
    token: Option<&str>,
    param: Option<&str>,
) -> anyhow::Result<()> {
    let url = format!("{}{path_and_query}", api.base);
    let mut req = api.http.get(&url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.with_context(|| format!("GET {path_and_query}: no answer"))?;
    let status = resp.status();
    let content_type =
        resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let text = resp.text().await.with_context(|| format!("GET {path_and_query}: cut off"))?;
    let what = format!("GET {path_and_query}: {status} {content_type} {text:.300}");
    ensure!(status.is_success() || status.is_client_error() || status.is_redirection(), "{what}");
    if !path_and_query.starts_with("/v1/") {
        ensure!(!status.is_client_error(), "a page refused a query: {what}");
        return Ok(());
    }
    ensure!(!status.is_redirection(), "{what}");
    if status.is_success() {
        if content_type.starts_with("application/json") {
            serde_json::from_str::<Value>(&text).with_context(|| what.clone())?;
        } else {
            let export = content_type.starts_with("text/csv")
                || content_type.starts_with("application/x-ndjson");
            ensure!(path_and_query.starts_with("/v1/records?") && export, "{what}");
        }
        return Ok(());
    }
    ensure!(content_type.starts_with("application/json"), "{what}");
    let v: Value = serde_json::from_str(&text).with_context(|| what.clone())?;
    let e = &v["error"];
    ensure!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}");
    ensure!(e["type"].is_string() && e["code"].as_str() == Some(status.as_str()), "{what}");
    if status == StatusCode::BAD_REQUEST
        && let Some(p) = param
    {
        ensure!(e["param"] == p, "the error should name {p}: {what}");
    }
    Ok(())
}

/// The GET routes, the role that may call each (none for the pages) and the query parameters
/// each knows.
fn get_routes() -> Vec<(&'static str, Option<Role>, Vec<&'static str>)> {
    let records = sluice_billing::api::RECORDS_QUERY.to_vec();
    let audit_log = vec!["since", "until", "actor", "target", "limit", "cursor"];
    vec![
        ("/v1/records", Some(Role::Auditor), records),
        ("/v1/audit-log", Some(Role::Auditor), audit_log),
        ("/v1/audit/reconcile", Some(Role::Auditor), vec!["since"]),
        ("/v1/usage", Some(Role::Billing), vec!["tenant", "model", "period", "since", "until"]),
        ("/v1/usage", Some(Role::TenantAdmin), vec!["tenant", "since"]),
        ("/v1/dashboard/data", Some(Role::Billing), vec!["since", "until"]),
        ("/v1/whoami", Some(Role::Ops), vec![]),
        ("/v1/tiers", Some(Role::Ops), vec![]),
        ("/v1/tenants", Some(Role::Ops), vec![]),
        ("/v1/tenants/acme", Some(Role::Ops), vec![]),
        ("/v1/tenants/acme/keys", Some(Role::Ops), vec![]),
        ("/v1/tenants/acme/quota", Some(Role::Ops), vec![]),
        ("/health", None, vec![]),
        ("/livez", None, vec![]),
        ("/readyz", None, vec![]),
        ("/metrics", None, vec![]),
        ("/", None, vec![]),
        ("/console", None, vec![]),
        ("/console.js", None, vec![]),
        ("/ui.css", None, vec![]),
        ("/dashboard", None, vec![]),
    ]
}

async fn fuzz(url: &str) -> anyhow::Result<()> {
    let api = start(url).await?;
    let ops = token(Role::Ops)?;
    let (status, text) = {
        let resp = api
            .http
            .post(format!("{}/v1/tenants", api.base))
            .bearer_auth(&ops)
            .json(&json!({"id": "acme"}))
            .send()
            .await?;
        (resp.status(), resp.text().await?)
    };
    ensure!(status == StatusCode::CREATED, "{status} {text}");
    let events: Vec<_> = (0..30)
        .map(|i| event(&format!("fuzz-{i:02}"), if i % 2 == 0 { "acme" } else { "globex" }))
        .collect();
    api.ledger.insert_batch(&events).await?;

    let mut strings = Strings(0x5eed_f00d_cafe_d00d);
    let generated: Vec<String> = (0..40).map(|_| encode(&strings.value())).collect();
    let mut answered = 0usize;
    for (path, role, known) in get_routes() {
        let token = role.map(token).transpose()?;
        // Every parameter it knows, one it does not, and on the pages the dashboard's own.
        let mut names = known.clone();
        names.push("bogus");
        if role.is_none() {
            names.extend(["since", "until", "window"]);
        }
        for name in names {
            let values = RAW
                .iter()
                .map(|v| ((*v).to_owned(), v.contains('&')))
                .chain(generated.iter().map(|v| (v.clone(), false)));
            for (value, brings_another) in values {
                let param = (!brings_another).then_some(name);
                check(&api, &format!("{path}?{name}={value}"), token.as_deref(), param).await?;
                answered += 1;
            }
        }
    }
    // Windows made of two extremes.
    let auditor = token(Role::Auditor)?;
    let billing = token(Role::Billing)?;
    let edges = ["0001-01-01", "9999-12-31", "100000d", "0s", "9999-12-31T23:59:59Z"];
    for since in edges {
        for until in edges {
            for (path, t) in [
                ("/v1/records", &auditor),
                ("/v1/audit-log", &auditor),
                ("/v1/usage", &billing),
                ("/v1/dashboard/data", &billing),
            ] {
                let q = format!("{path}?since={}&until={}", encode(since), encode(until));
                check(&api, &q, Some(t), None).await?;
                answered += 1;
            }
        }
    }
    // The tenant routes' path segments.
    for segment in RAW.iter().copied().filter(|s| !s.contains(['/', '?', '#'])) {
        for route in ["/v1/tenants/{}", "/v1/tenants/{}/keys", "/v1/tenants/{}/quota"] {
            for seg in [segment.to_owned(), encode(segment)] {
                check(&api, &route.replace("{}", &seg), Some(&ops), None).await?;
                answered += 1;
            }
        }
    }
    // A change refuses a query parameter it does not know, and makes no change.
    let resp = api
        .http
        .post(format!("{}/v1/tenants?dry_run=1", api.base))
        .bearer_auth(&ops)
        .json(&json!({"id": "made-anyway"}))
        .send()
        .await?;
    let (status, text) = (resp.status(), resp.text().await?);
    ensure!(status == StatusCode::BAD_REQUEST && text.contains("\"dry_run\""), "{status} {text}");
    let resp = api.http.get(format!("{}/v1/tenants/made-anyway", api.base)).bearer_auth(&ops);
    let status = resp.send().await?.status();
    ensure!(status == StatusCode::NOT_FOUND, "a refused request created a tenant: {status}");
    // Still serving after all of it.
    check(&api, "/v1/records?limit=1", Some(&auditor), None).await?;
    println!("{answered} fuzzed requests answered");
    Ok(())
}

#[tokio::test]
async fn every_get_route_answers_fuzzed_parameters_with_200_or_a_json_4xx_postgres()
-> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    fuzz(&db.url).await
}

#[tokio::test]
async fn every_get_route_answers_fuzzed_parameters_with_200_or_a_json_4xx_sqlite()
-> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    fuzz(&db.url).await
}

/// CSV text as rows of cells (RFC 4180: quoted cells may hold commas, quotes and newlines).
fn parse_csv(text: &str) -> anyhow::Result<Vec<Vec<String>>> {
    let (mut rows, mut row, mut cell) = (Vec::new(), Vec::new(), String::new());
    let mut chars = text.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                cell.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => cell.push(c),
            (false, '"') if cell.is_empty() => quoted = true,
            (false, ',') => row.push(std::mem::take(&mut cell)),
            (false, '\n') => {
                row.push(std::mem::take(&mut cell));
                rows.push(std::mem::take(&mut row));
            }
            (false, c) => cell.push(c),
        }
    }
    ensure!(!quoted && cell.is_empty() && row.is_empty(), "the CSV does not end a row");
    Ok(rows)
}

async fn csv_without_formulas(url: &str) -> anyhow::Result<()> {
    let api = start(url).await?;
    let auditor = token(Role::Auditor)?;
    // What a client controls lands in these cells: the model asked for, the Idempotency-Key.
    let crafted = [
        ("model_id", "=HYPERLINK(\"http://evil.example\",\"open\")"),
        ("idempotency_key", "+cmd|' /C calc'!A0"),
        ("key_id", "-2+3"),
        ("error_type", "@SUM(1+1)"),
        ("adapter", "\t=1+1"),
        ("engine_worker", "\r=1+1"),
        ("trace_id", "=1,\"2\"\n3"),
    ];
    let mut e = event("csv-formula", "acme");
    e.model_id = crafted[0].1.to_owned();
    e.idempotency_key = Some(crafted[1].1.to_owned());
    e.key_id = crafted[2].1.to_owned();
    e.error_type = Some(crafted[3].1.to_owned());
    e.adapter = Some(crafted[4].1.to_owned());
    e.engine_worker = Some(crafted[5].1.to_owned());
    e.trace_id = Some(crafted[6].1.to_owned());
    api.ledger.insert_batch(&[e, event("csv-plain", "acme")]).await?;
    // Numbers below zero only reach a row behind the ledger's back; they stay numbers.
    let db = Inspect::open(url).await?;
    let negative = "UPDATE request_records SET ttft_ms = -5.5, e2e_ms = -1000.25 \
                    WHERE request_id = 'csv-plain' RETURNING CAST(1 AS BIGINT)";
    ensure!(db.scalar(negative).await? == 1);
    db.close().await;

    let get = |format: &str| {
        let url = format!("{}/v1/records?tenant=acme&format={format}", api.base);
        let req = api.http.get(url).bearer_auth(&auditor);
        async move {
            let resp = req.send().await?;
            ensure!(resp.status().is_success(), "{}", resp.status());
            anyhow::Ok(resp.text().await?)
        }
    };
    let json: Value = serde_json::from_str(&get("json").await?)?;
    let records = json["records"].as_array().context("records")?;
    let csv = parse_csv(&get("csv").await?)?;
    let (header, rows) = csv.split_first().context("no header")?;
    ensure!(rows.len() == records.len() && rows.len() == 2, "{csv:?}");
    let mut seen = BTreeMap::new();
    for (row, record) in rows.iter().zip(records) {
        for (name, cell) in header.iter().zip(row) {
            let want = match &record[name.as_str()] {
                Value::Null => String::new(),
                Value::String(s) if s.starts_with(['=', '+', '-', '@', '\t', '\r']) => {
                    format!("'{s}")
                }
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            ensure!(*cell == want, "{name}: cell {cell:?}, expected {want:?}");
            if let Some(first) = cell.chars().next()
                && "=+-@\t\r".contains(first)
            {
                // Only a number may begin so, and then it is one.
                ensure!(cell.parse::<f64>().is_ok(), "{name}: {cell:?} would run as a formula");
            }
            let id = record["request_id"].as_str().context("request_id")?;
            seen.insert((id.to_owned(), name.clone()), cell.clone());
        }
    }
    for (column, value) in crafted {
        let cell = seen.get(&("csv-formula".to_owned(), column.to_owned()));
        ensure!(cell.map(String::as_str) == Some(&format!("'{value}")), "{column}: {cell:?}");
    }
    for (column, value) in
        [("ttft_ms", "-5.5"), ("e2e_ms", "-1000.25"), ("model_id", "smollm2-135m-instruct")]
    {
        let cell = seen.get(&("csv-plain".to_owned(), column.to_owned()));
        ensure!(cell.map(String::as_str) == Some(value), "{column}: {cell:?}");
    }
    Ok(())
}

#[tokio::test]
async fn csv_exports_carry_no_formula_and_keep_negative_numbers_postgres() -> anyhow::Result<()> {
    let db = PgDatabase::create().await?;
    csv_without_formulas(&db.url).await
}

#[tokio::test]
async fn csv_exports_carry_no_formula_and_keep_negative_numbers_sqlite() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    csv_without_formulas(&db.url).await
}

/// A content security policy as directive name -> sources.
fn directives(policy: &str) -> BTreeMap<String, String> {
    policy
        .split(';')
        .filter_map(|d| {
            let d = d.trim();
            let (name, sources) = d.split_once(' ').unwrap_or((d, ""));
            (!name.is_empty()).then(|| (name.to_owned(), sources.to_owned()))
        })
        .collect()
}

/// `/dashboard` reads the same token as `/console`: it gets the same headers, its policy
/// differing only in admitting its one inline script by a nonce drawn for each answer.
#[tokio::test]
async fn the_dashboard_gets_the_consoles_security_headers() -> anyhow::Result<()> {
    let db = SqliteFile::create()?;
    let api = start(&db.url).await?;
    let page = |path: &str| {
        let req = api.http.get(format!("{}{path}", api.base));
        async move {
            let resp = req.send().await?;
            ensure!(resp.status() == StatusCode::OK, "{}", resp.status());
            let headers = resp.headers().clone();
            anyhow::Ok((headers, resp.text().await?))
        }
    };
    let (console, _) = page("/console").await?;
    let header = |h: &reqwest::header::HeaderMap, name: &str| {
        h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
    };
    let mut nonces = Vec::new();
    for _ in 0..2 {
        let (dashboard, html) = page("/dashboard").await?;
        for name in ["x-frame-options", "referrer-policy", "cache-control"] {
            let (got, want) = (header(&dashboard, name), header(&console, name));
            ensure!(want.is_some() && got == want, "{name}: dashboard {got:?}, console {want:?}");
        }
        ensure!(header(&dashboard, "x-frame-options").as_deref() == Some("DENY"));
        ensure!(header(&dashboard, "referrer-policy").as_deref() == Some("no-referrer"));
        let policy = header(&dashboard, "content-security-policy").context("no policy")?;
        let (mut ours, mut theirs) = (
            directives(&policy),
            directives(&header(&console, "content-security-policy").context("console policy")?),
        );
        let script = ours.remove("script-src").context("no script-src")?;
        ensure!(theirs.remove("script-src").as_deref() == Some("'self'"));
        ensure!(ours == theirs, "dashboard {ours:?}, console {theirs:?}");
        ensure!(ours.get("frame-ancestors").map(String::as_str) == Some("'none'"), "{policy}");
        ensure!(ours.get("default-src").map(String::as_str) == Some("'none'"), "{policy}");
        let nonce = script
            .strip_prefix("'nonce-")
            .and_then(|n| n.strip_suffix('\''))
            .with_context(|| format!("script-src {script}"))?
            .to_owned();
        ensure!(nonce.len() >= 22, "a short nonce: {nonce}");
        // The page's one script carries it, so the policy admits exactly that script.
        ensure!(html.matches("<script").count() == 1, "more than one script");
        ensure!(html.contains(&format!("<script nonce=\"{nonce}\">")), "the script lacks it");
        nonces.push(nonce);
    }
    ensure!(nonces[0] != nonces[1], "the nonce is not drawn per answer: {nonces:?}");
    Ok(())
}
