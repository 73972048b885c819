//! OpenTelemetry: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the gateway and the engine export
//! their request spans over OTLP/HTTP, in the client's trace, the engine's span a child of the
//! gateway's. The receiver here is a plain HTTP endpoint that keeps what it is sent.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use sluice_billing::Ledger;
use sluice_billing::auth::{Principal, Role};
use sluice_billing::control::NewTenant;
use support::{free_port, spawn_sluice, wait_healthy};

/// Every span received: (service name, span object).
fn spans(bodies: &[Value]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for b in bodies {
        for rs in b["resourceSpans"].as_array().into_iter().flatten() {
            let service = rs["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .and_then(|a| a["value"]["stringValue"].as_str())
                .unwrap_or("")
                .to_owned();
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                for s in ss["spans"].as_array().into_iter().flatten() {
                    out.push((service.clone(), s.clone()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_gateway_and_engine() -> anyhow::Result<()> {
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let sink = Arc::clone(&received);
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = Arc::clone(&sink);
            async move {
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    sink.lock().unwrap_or_else(|e| e.into_inner()).push(v);
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let otlp = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let model = common::default_model()?;
    let model = model.to_str().context("utf-8")?;
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let ledger = Ledger::connect(&db).await?;
    let ops = Principal { actor: "test".into(), role: Role::Ops, tenant: None };
    let new = NewTenant { id: "traced".into(), name: None, tier: None, overrides: None };
    ledger.create_tenant(&ops, &new).await?;
    let (_, key) = ledger.issue_key(&ops, "traced", None, None, Default::default()).await?;
    ledger.close().await;

    let engine_listen = format!("127.0.0.1:{}", free_port()?);
    let (mut engine, engine_addr) = spawn_sluice(
        &["engine", "--model", model, "--listen", &engine_listen, "--internal-token", "t0ken"]
            .into_iter()
            .chain(["--served-model-name", "smollm2-135m-instruct", "--kv-cache-mb", "32"])
            .collect::<Vec<_>>(),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str())],
    )?;
    let gw_listen = format!("127.0.0.1:{}", free_port()?);
    let (mut gateway, gw_addr) = spawn_sluice(
        &["gateway", "--plain-http", "--listen", &gw_listen, "--engine", &engine_addr]
            .into_iter()
            .chain(["--database-url", &db, "--internal-token", "t0ken", "--model", model])
            .collect::<Vec<_>>(),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str())],
    )?;
    let c = reqwest::Client::new();
    wait_healthy(&c, &format!("http://{gw_addr}/health")).await?;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = c
        .post(format!("http://{gw_addr}/v1/completions"))
        .bearer_auth(&key)
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .json(&json!({"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}))
        .send()
        .await?;
    ensure!(r.status() == 200, "{}", r.text().await?);
    gateway.stop()?;
    engine.stop()?;

    let deadline = Instant::now() + Duration::from_secs(10);
    let (gw_span, engine_span) = loop {
        let all = spans(&received.lock().unwrap_or_else(|e| e.into_inner()));
        let find = |svc: &str, name: &str| {
            all.iter()
                .find(|(s, sp)| s == svc && sp["name"] == name && sp["traceId"] == trace_id)
                .map(|(_, sp)| sp.clone())
        };
        if let (Some(g), Some(e)) =
            (find("sluice-gateway", "gateway.request"), find("sluice-engine", "engine.request"))
        {
            break (g, e);
        }
        if Instant::now() > deadline {
            bail!("spans missing from the export: {all:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        gw_span["parentSpanId"] == "00f067aa0ba902b7",
        "gateway span not under the client's: {gw_span}"
    );
    let all: Vec<String> = spans(&received.lock().unwrap_or_else(|e| e.into_inner()))
        .iter()
        .map(|(s, sp)| format!("{s} {} {} parent {}", sp["name"], sp["spanId"], sp["parentSpanId"]))
        .collect();
    ensure!(
        engine_span["parentSpanId"] == gw_span["spanId"],
        "engine span not under the gateway's: {}",
        all.join(" | ")
    );
    Ok(())
}
