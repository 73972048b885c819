//! `sluice bench serve` against a real `sluice engine`: every request completes, the JSON
//! result carries vLLM's field names and the per-request arrays, and the per-request numbers
//! are consistent with each other and with the workload asked for.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::process::Command;

use anyhow::{Context, ensure};
use serde_json::Value;
use support::{free_port, spawn_sluice, wait_healthy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_measures_an_engine() -> anyhow::Result<()> {
    let model = common::default_model()?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (_engine, addr) = spawn_sluice(
        &[
            "engine",
            "--model",
            model.to_str().context("utf-8")?,
            "--listen",
            &listen,
            "--kv-cache-mb",
            "64",
        ],
        &[],
    )?;
    wait_healthy(&reqwest::Client::new(), &format!("http://{addr}/health")).await?;
    let dir = tempfile::tempdir()?;
    let out_path = dir.path().join("result.json");
    let out = tokio::task::spawn_blocking({
        let (addr, out_path) = (addr.clone(), out_path.clone());
        move || {
            Command::new(env!("CARGO_BIN_EXE_sluice"))
                .args([
                    "bench",
                    "serve",
                    "--base-url",
                    &format!("http://{addr}"),
                    "--num-prompts",
                    "6",
                ])
                .args([
                    "--request-rate",
                    "5",
                    "--input-len",
                    "12",
                    "--output-len",
                    "5",
                    "--seed",
                    "3",
                ])
                .args([
                    "--goodput",
                    "ttft:60000,tpot:60000,e2el:60000",
                    "--save-detailed",
                    "--save-result",
                ])
                .arg(&out_path)
                .output()
        }
    })
    .await??;
    ensure!(out.status.success(), "bench serve failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out_path)?)?;
    ensure!(v["completed"] == 6 && v["failed"] == 0, "{v}");
    for k in [
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "request_goodput",
        "slo_attainment",
    ] {
        ensure!(v[k].as_f64().is_some_and(|x| x >= 0.0), "{k} missing: {v}");
    }
    ensure!(v["slo_attainment"] == 1.0, "generous thresholds: every request is good");
    // The server's own counters over the run agree with what the client received.
    let m = &v["server_metrics"];
    ensure!(m["sluice_engine_generation_tokens_total"] == 30.0, "{m}");
    ensure!(m["sluice_engine_prompt_tokens_total"] == 72.0, "{m}");
    ensure!(m["sluice_engine_num_requests_running"] == 0.0, "{m}");
    let arr = |k: &str| v[k].as_array().cloned().unwrap_or_default();
    ensure!(arr("output_lens").iter().all(|x| x == 5), "{:?}", arr("output_lens"));
    ensure!(arr("input_lens").iter().all(|x| x == 12), "{:?}", arr("input_lens"));
    let sched: Vec<f64> = arr("scheduled_send_times").iter().filter_map(Value::as_f64).collect();
    ensure!(sched.len() == 6 && sched[0] == 0.0 && sched.windows(2).all(|w| w[1] >= w[0]));
    for (i, (t, e)) in arr("ttfts").iter().zip(arr("e2els")).enumerate() {
        let (t, e) = (t.as_f64().context("ttft")?, e.as_f64().context("e2el")?);
        ensure!(0.0 < t && t <= e, "request {i}: ttft {t} e2el {e}");
        // 5 tokens, one per event from our engine: 4 gaps.
        ensure!(arr("itls")[i].as_array().map(Vec::len) == Some(4), "{:?}", arr("itls")[i]);
    }
    Ok(())
}
