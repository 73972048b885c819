//! `sluice audit reconcile`: the ledger checked as an auditor would. The billing service
//! recomputes the hour rollups from the rows; every row's cost is recomputed from its token
//! counts and the price-list rates it carries; with `--engine`, each engine's own record of the
//! requests it ran (`GET /v1/internal/outcomes`, kept in memory since it started) is matched to
//! the ledger by request id: every request the engine ran has exactly its row, with the prompt
//! and generated tokens the engine counted, and every row billed to that engine since it
//! started is one the engine knows.

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::{Context, bail};
use chrono::{DateTime, TimeDelta, Utc};
use serde_json::Value;

use sluice_billing::prices::Rates;

use crate::admin_cli::Client;

/// Rows are read from this much before `since`: an engine registers a request a moment after
/// the gateway stamped its arrival.
const EARLY: TimeDelta = TimeDelta::seconds(60);

/// Tokens per (tenant, model): the ledger's and the engines'.
#[derive(Default)]
struct Totals {
    requests: u64,
    ledger_prompt: u64,
    ledger_completion: u64,
    engine_prompt: u64,
    engine_completion: u64,
}

fn uint(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Every record since `since` (pages followed), by request id.
async fn ledger_rows(c: &Client, since: DateTime<Utc>) -> anyhow::Result<HashMap<String, Value>> {
    let mut rows = HashMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut q = vec![
            ("since", since.to_rfc3339()),
            ("format", "jsonl".to_owned()),
            ("limit", "1000".to_owned()),
        ];
        if let Some(cur) = cursor.take() {
            q.push(("cursor", cur));
        }
        let resp = c.send(reqwest::Method::GET, "/v1/records", &q, None).await?;
        let next =
            resp.headers().get("x-next-cursor").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let text = resp.text().await.context("reading records")?;
        let mut n = 0;
        for line in text.lines().filter(|l| !l.is_empty()) {
            let r: Value = serde_json::from_str(line).context("a record is not JSON")?;
            let id = r["request_id"].as_str().context("a record without request_id")?.to_owned();
            rows.insert(id, r);
            n += 1;
        }
        match next {
            Some(cur) if n > 0 => cursor = Some(cur),
            _ => return Ok(rows),
        }
    }
}

/// Runs the reconciliation; an error when anything differs.
pub async fn run(
    c: &Client,
    since: &str,
    engines: &[String],
    token: Option<&str>,
) -> anyhow::Result<()> {
    let since_at =
        sluice_billing::api::parse_time("since", since).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut differences = 0usize;
    let r = c
        .json(
            reqwest::Method::GET,
            "/v1/audit/reconcile",
            &[("since", since_at.to_rfc3339())],
            None,
        )
        .await?;
    let diffs = r["differences"].as_array().cloned().unwrap_or_default();
    println!(
        "rollups: {} records in {} hour buckets since {}: {} differ",
        uint(&r["records"]),
        uint(&r["buckets"]),
        r["since"].as_str().unwrap_or("?"),
        diffs.len()
    );
    for d in &diffs {
        println!(
            "  DIFF rollup {} {} {}: rows {} rollup {}",
            d["bucket_start"].as_str().unwrap_or("?"),
            d["tenant_id"].as_str().unwrap_or("?"),
            d["model_id"].as_str().unwrap_or("?"),
            d["rows"],
            d["rollup"]
        );
    }
    differences += diffs.len();
    let rows = ledger_rows(c, since_at - EARLY).await?;
    differences += costs(&rows);
    if !engines.is_empty() {
        differences += against_engines(&rows, since_at, engines, token).await?;
    }
    if differences > 0 {
        bail!("{differences} differences");
    }
    println!("reconciled: no difference");
    Ok(())
}

/// Recomputes every row's cost from its own token counts and the rates it carries (nothing
/// for a refused request); the number that differ from the stored cost.
fn costs(rows: &HashMap<String, Value>) -> usize {
    let mut versions: BTreeMap<&str, u64> = BTreeMap::new();
    let mut differ = Vec::new();
    for (id, r) in rows {
        *versions.entry(r["price_list_version"].as_str().unwrap_or("?")).or_default() += 1;
        let rates = Rates {
            input: uint(&r["price_input_micros"]),
            cached_input: uint(&r["price_cached_input_micros"]),
            output: uint(&r["price_output_micros"]),
        };
        let status = u16::try_from(uint(&r["http_status"])).unwrap_or(u16::MAX);
        let (prompt, cached) = (uint(&r["prompt_tokens"]), uint(&r["cached_prompt_tokens"]));
        let expected = rates.charge(status, prompt, cached, uint(&r["completion_tokens"]));
        let stored = r["cost_micros"].as_u64();
        if stored != Some(expected) {
            differ.push((id, stored, expected));
        }
    }
    let lists: Vec<String> = versions.iter().map(|(v, n)| format!("{v} ({n})")).collect();
    println!(
        "costs: {} records recomputed from their rates, price lists {}: {} differ",
        rows.len(),
        if lists.is_empty() { "none".to_owned() } else { lists.join(", ") },
        differ.len()
    );
    differ.sort();
    for (id, stored, expected) in &differ {
        let stored = stored.map_or("none".to_owned(), |s| s.to_string());
        println!("  DIFF cost {id}: stored {stored}, recomputed {expected}");
    }
    differ.len()
}

async fn against_engines(
    rows: &HashMap<String, Value>,
    since: DateTime<Utc>,
    engines: &[String],
    token: Option<&str>,
) -> anyhow::Result<usize> {
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .context("building the HTTP client")?;
    let mut totals: BTreeMap<(String, String), Totals> = BTreeMap::new();
    let mut differences = 0;
    let mut diff = |line: String| {
        println!("  DIFF {line}");
        differences += 1;
    };
    for engine in engines {
        let mut req = http
            .get(format!("http://{engine}/v1/internal/outcomes"))
            .query(&[("since", since.timestamp().max(0).to_string())]);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.with_context(|| format!("cannot reach the engine {engine}"))?;
        if !resp.status().is_success() {
            bail!("the engine {engine} answered {} (is --internal-token right?)", resp.status());
        }
        let v: Value = resp.json().await.context("the engine sent invalid JSON")?;
        let model = v["model"].as_str().unwrap_or("?").to_owned();
        // To the millisecond where the engine says it: a row from within its first second may
        // belong to the process before it on the same address (a restart).
        let started = match v["started_ms"].as_i64() {
            Some(ms) => DateTime::from_timestamp_millis(ms),
            None => DateTime::from_timestamp(v["started"].as_i64().unwrap_or(0), 0),
        }
        .unwrap_or(DateTime::UNIX_EPOCH);
        let outcomes = v["data"].as_array().cloned().unwrap_or_default();
        let (mut running, mut matched) = (0, 0);
        let mut known = HashSet::new();
        for o in &outcomes {
            let id = o["request_id"].as_str().unwrap_or_default();
            known.insert(id.to_owned());
            if o["state"] != "finished" {
                running += 1;
                continue;
            }
            let (prompt, completion) = (uint(&o["prompt_tokens"]), uint(&o["completion_tokens"]));
            let Some(row) = rows.get(id) else {
                diff(format!(
                    "{engine} ran {id} ({prompt} prompt + {completion} generated tokens); the \
                     ledger has no row"
                ));
                continue;
            };
            matched += 1;
            let tenant = row["tenant_id"].as_str().unwrap_or("?").to_owned();
            let t = totals.entry((tenant, row["model_id"].as_str().unwrap_or(&model).to_owned()));
            let t = t.or_default();
            t.requests += 1;
            t.ledger_prompt += uint(&row["prompt_tokens"]);
            t.ledger_completion += uint(&row["completion_tokens"]);
            t.engine_prompt += prompt;
            t.engine_completion += completion;
            if uint(&row["completion_tokens"]) != completion
                || uint(&row["prompt_tokens"]) != prompt
            {
                diff(format!(
                    "{id}: the ledger has {} prompt + {} completion tokens, {engine} counted \
                     {prompt} + {completion}",
                    row["prompt_tokens"], row["completion_tokens"]
                ));
            }
        }
        // Rows billed to this engine since it started (and since `since`) that it never ran.
        let from = since.max(started);
        for (id, row) in rows {
            let arrival = row["arrival_at"]
                .as_str()
                .and_then(|a| DateTime::parse_from_rfc3339(a).ok())
                .map(|a| a.with_timezone(&Utc));
            if row["engine_worker"].as_str() == Some(engine.as_str())
                && arrival.is_some_and(|a| a >= from)
                && uint(&row["completion_tokens"]) > 0
                && !known.contains(id)
            {
                diff(format!(
                    "{id}: billed {} completion tokens on {engine}, which has no record of it",
                    row["completion_tokens"]
                ));
            }
        }
        println!(
            "engine {engine} ({model}, up since {started}): {} requests, {matched} matched to \
             rows, {running} still running",
            outcomes.len()
        );
    }
    println!(
        "{:<24} {:<28} {:>8} {:>14} {:>14} {:>14} {:>14}",
        "tenant",
        "model",
        "requests",
        "ledger prompt",
        "engine prompt",
        "ledger output",
        "engine output"
    );
    for ((tenant, model), t) in &totals {
        let mark =
            if t.ledger_prompt != t.engine_prompt || t.ledger_completion != t.engine_completion {
                "  DIFF"
            } else {
                ""
            };
        println!(
            "{tenant:<24} {model:<28} {:>8} {:>14} {:>14} {:>14} {:>14}{mark}",
            t.requests, t.ledger_prompt, t.engine_prompt, t.ledger_completion, t.engine_completion
        );
    }
    Ok(differences)
}
