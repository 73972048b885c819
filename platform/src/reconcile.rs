//! `sluice audit reconcile`: the ledger checked as an auditor would. The billing service
//! recomputes the hour rollups from the rows; every row's cost is recomputed from its token
//! counts and the price-list rates it carries; with `--engine`, each engine's own record of the
//! requests it ran (`GET /v1/internal/outcomes`, kept in memory since it started) is matched to
//! the ledger by request id: every request the engine ran has exactly its row, with the prompt
//! and generated tokens the engine counted, and every row billed to that engine since it
//! started is one the engine knows.
//!
//! It fails closed: an answer it does not understand (a field missing or of another type, a
//! body that is not what was asked for) is an error, never read as "nothing to compare".

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::{Context, bail};
use chrono::{DateTime, TimeDelta, Utc};
use serde::Deserialize;
use serde_json::Value;

use sluice_billing::query::RollupReconciliation;
use sluice_policies::prices::Rates;
use sluice_wire::Outcomes;

use crate::admin::Client;

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

/// The columns of a ledger row the checks read. Every one is required (`engine_worker` too,
/// though it may be null): a record without one is an error, not a zero.
#[derive(Debug, Deserialize)]
struct LedgerRow {
    request_id: String,
    tenant_id: String,
    model_id: String,
    #[serde(deserialize_with = "Option::deserialize")]
    engine_worker: Option<String>,
    arrival_at: DateTime<Utc>,
    http_status: u16,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
    completion_tokens: u64,
    cost_micros: u64,
    price_list_version: String,
    price_input_micros: u64,
    price_cached_input_micros: u64,
    price_output_micros: u64,
}

/// `/v1/audit/reconcile`'s answer, every field required.
fn read_rollups(v: Value) -> anyhow::Result<RollupReconciliation> {
    serde_json::from_value(v)
        .context("the billing service's rollup reconciliation is not one this tool understands")
}

/// One JSON Lines page of `/v1/records`: every line a record with the columns the checks read.
fn read_records(content_type: Option<&str>, text: &str) -> anyhow::Result<Vec<LedgerRow>> {
    if !content_type.is_some_and(|t| t.starts_with("application/x-ndjson")) {
        bail!(
            "the billing service answered the records query with {}, not JSON Lines",
            content_type.unwrap_or("no content type")
        );
    }
    text.lines()
        .filter(|l| !l.is_empty())
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| {
                format!("record {} of a page is not one this tool understands", i + 1)
            })
        })
        .collect()
}

/// An engine's outcomes, every field required, and when it started.
fn read_outcomes(engine: &str, v: Value) -> anyhow::Result<(Outcomes, DateTime<Utc>)> {
    let outcomes: Outcomes = serde_json::from_value(v).with_context(|| {
        format!("the engine {engine}'s outcomes are not ones this tool understands")
    })?;
    // To the millisecond: a row from within its first second may belong to the process
    // before it on the same address (a restart).
    let started = i64::try_from(outcomes.started_ms)
        .ok()
        .and_then(DateTime::from_timestamp_millis)
        .with_context(|| format!("the engine {engine}'s start time is out of range"))?;
    Ok((outcomes, started))
}

/// Every record since `since` (pages followed), by request id.
async fn ledger_rows(
    c: &Client,
    since: DateTime<Utc>,
) -> anyhow::Result<HashMap<String, LedgerRow>> {
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
        let header =
            |name| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (next, content_type) = (header("x-next-cursor"), header("content-type"));
        let text = resp.text().await.context("reading records")?;
        let page = read_records(content_type.as_deref(), &text)?;
        let n = page.len();
        for r in page {
            rows.insert(r.request_id.clone(), r);
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
    let r = read_rollups(r)?;
    println!(
        "rollups: {} records in {} hour buckets since {}: {} differ",
        r.records,
        r.buckets,
        r.since.to_rfc3339(),
        r.differences.len()
    );
    for d in &r.differences {
        println!(
            "  DIFF rollup {} {} {}: rows {} rollup {}",
            d.bucket_start.to_rfc3339(),
            d.tenant_id,
            d.model_id,
            serde_json::to_string(&d.rows)?,
            serde_json::to_string(&d.rollup)?
        );
    }
    differences += r.differences.len();
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
fn costs(rows: &HashMap<String, LedgerRow>) -> usize {
    let mut versions: BTreeMap<&str, u64> = BTreeMap::new();
    let mut differ = Vec::new();
    for (id, r) in rows {
        *versions.entry(r.price_list_version.as_str()).or_default() += 1;
        let rates = Rates {
            input: r.price_input_micros,
            cached_input: r.price_cached_input_micros,
            output: r.price_output_micros,
        };
        let expected = rates.charge(
            r.http_status,
            r.prompt_tokens,
            r.cached_prompt_tokens,
            r.completion_tokens,
        );
        if r.cost_micros != expected {
            differ.push((id, r.cost_micros, expected));
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
        println!("  DIFF cost {id}: stored {stored}, recomputed {expected}");
    }
    differ.len()
}

async fn against_engines(
    rows: &HashMap<String, LedgerRow>,
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
            .get(format!("http://{engine}{}", sluice_wire::route::OUTCOMES))
            .query(&[("since", since.timestamp().max(0).to_string())]);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.with_context(|| format!("cannot reach the engine {engine}"))?;
        if !resp.status().is_success() {
            bail!("the engine {engine} answered {} (is --internal-token right?)", resp.status());
        }
        let v: Value = resp.json().await.context("the engine sent invalid JSON")?;
        let (Outcomes { model, data: outcomes, .. }, started) = read_outcomes(engine, v)?;
        let (mut running, mut matched) = (0, 0);
        let mut known = HashSet::new();
        for o in &outcomes {
            let id = o.request_id.as_str();
            known.insert(id.to_owned());
            if !o.finished() {
                running += 1;
                continue;
            }
            let (prompt, completion) = (o.prompt_tokens, o.completion_tokens);
            let Some(row) = rows.get(id) else {
                diff(format!(
                    "{engine} ran {id} ({prompt} prompt + {completion} generated tokens); the \
                     ledger has no row"
                ));
                continue;
            };
            matched += 1;
            let t = totals.entry((row.tenant_id.clone(), row.model_id.clone())).or_default();
            t.requests += 1;
            t.ledger_prompt += row.prompt_tokens;
            t.ledger_completion += row.completion_tokens;
            t.engine_prompt += prompt;
            t.engine_completion += completion;
            if row.completion_tokens != completion || row.prompt_tokens != prompt {
                diff(format!(
                    "{id}: the ledger has {} prompt + {} completion tokens, {engine} counted \
                     {prompt} + {completion}",
                    row.prompt_tokens, row.completion_tokens
                ));
            }
        }
        // Rows billed to this engine since it started (and since `since`) that it never ran.
        let from = since.max(started);
        for (id, row) in rows {
            if row.engine_worker.as_deref() == Some(engine.as_str())
                && row.arrival_at >= from
                && row.completion_tokens > 0
                && !known.contains(id)
            {
                diff(format!(
                    "{id}: billed {} completion tokens on {engine}, which has no record of it",
                    row.completion_tokens
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rollups() -> Value {
        json!({"since": "2026-11-29T00:00:00Z", "records": 25, "buckets": 2, "differences": []})
    }

    fn record() -> Value {
        json!({
            "request_id": "r1", "tenant_id": "acme", "model_id": "m", "engine_worker": null,
            "arrival_at": "2026-11-29T08:00:00Z", "http_status": 200, "prompt_tokens": 10,
            "cached_prompt_tokens": 0, "completion_tokens": 5, "cost_micros": 7,
            "price_list_version": "test-1", "price_input_micros": 0,
            "price_cached_input_micros": 0, "price_output_micros": 1_400_000,
        })
    }

    /// An answer missing what the check compares, or holding it as another type, is an
    /// error: never "no difference".
    #[test]
    fn a_rollup_report_it_does_not_understand_is_an_error() {
        let ok = read_rollups(rollups()).map(|r| (r.records, r.buckets, r.differences.len()));
        assert_eq!(ok.ok(), Some((25, 2, 0)));
        let mut cases = vec![json!({}), json!([]), json!(null), json!({"data": []})];
        for field in ["differences", "records", "buckets", "since"] {
            let mut v = rollups();
            v.as_object_mut().map(|m| m.remove(field));
            cases.push(v);
        }
        for (field, wrong) in [
            ("differences", json!(null)),
            ("differences", json!({})),
            ("differences", json!([{"tenant_id": "acme"}])),
            ("records", json!("25")),
            ("buckets", json!(-1)),
        ] {
            let mut v = rollups();
            v[field] = wrong;
            cases.push(v);
        }
        for v in cases {
            let err = read_rollups(v.clone()).map(|r| r.differences.len());
            assert!(err.is_err(), "{v} was read as {err:?}");
        }
    }

    #[test]
    fn a_records_page_it_does_not_understand_is_an_error() {
        let jsonl = format!("{}\n{}\n", record(), record());
        let rows = read_records(Some("application/x-ndjson"), &jsonl).map(|r| r.len());
        assert_eq!(rows.ok(), Some(2));
        for field in ["cost_micros", "price_output_micros", "engine_worker", "http_status"] {
            let mut r = record();
            r.as_object_mut().map(|m| m.remove(field));
            assert!(read_records(Some("application/x-ndjson"), &r.to_string()).is_err(), "{field}");
        }
        let mut r = record();
        r["completion_tokens"] = json!("5");
        assert!(read_records(Some("application/x-ndjson"), &r.to_string()).is_err());
        assert!(read_records(Some("application/x-ndjson"), "<html>").is_err());
        assert!(read_records(Some("text/html"), "").is_err(), "a page that is not JSON Lines");
        assert!(read_records(None, &jsonl).is_err());
    }

    #[test]
    fn engine_outcomes_it_does_not_understand_are_an_error() {
        let outcome = json!({"request_id": "r1", "tenant": "t", "state": "finished",
            "choices": 1, "ended": 1, "prompt_tokens": 10, "cached_tokens": 0,
            "completion_tokens": 5, "finish_reason": "stop", "created": 1, "ended_ms": 1600});
        let good = json!({"model": "m", "started": 1, "started_ms": 1500, "data": [outcome]});
        let read = read_outcomes("e:1", good.clone()).map(|(o, at)| (o.data.len(), at));
        assert_eq!(read.ok(), Some((1, DateTime::UNIX_EPOCH + TimeDelta::milliseconds(1500))));
        let mut cases = Vec::new();
        for field in ["data", "model"] {
            let mut v = good.clone();
            v.as_object_mut().map(|m| m.remove(field));
            cases.push(v);
        }
        let mut no_start = good.clone();
        no_start.as_object_mut().map(|m| (m.remove("started"), m.remove("started_ms")));
        cases.push(no_start);
        for field in ["request_id", "state", "prompt_tokens", "completion_tokens"] {
            let mut v = good.clone();
            v["data"][0].as_object_mut().map(|m| m.remove(field));
            cases.push(v);
        }
        let mut wrong = good.clone();
        wrong["data"] = json!({"r1": outcome});
        cases.push(wrong);
        for v in cases {
            let read = read_outcomes("e:1", v.clone()).map(|(o, _)| o.data.len());
            assert!(read.is_err(), "{v} was read as {read:?}");
        }
    }

    /// The CLI parses `--since` with the API's parser: a multi-byte last character is refused
    /// naming the parameter (it once cut the string inside the character).
    #[test]
    fn since_with_a_multibyte_last_character_is_refused() {
        for since in ["1é", "é", "7日", "1🦀"] {
            let err = sluice_billing::api::parse_time("since", since).map_err(|e| e.to_string());
            assert!(err.as_ref().is_err_and(|e| e.contains("since")), "{since:?}: {err:?}");
        }
    }
}
