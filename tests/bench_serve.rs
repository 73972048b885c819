//! `sluice bench serve` against a real `sluice engine`: every request completes, the JSON
//! result carries vLLM's field names and the per-request arrays, and the per-request numbers
//! are consistent with each other and with the workload asked for; a multi-tenant mix of
//! workloads with warm-up, per-tenant and per-length breakdowns and a Markdown report; whole
//! (non-streamed) responses; a closed loop timed from each send.

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
        let (addr, out_path, plots) = (addr.clone(), out_path.clone(), dir.path().join("plots"));
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
                .arg("--plots")
                .arg(&plots)
                .output()
        }
    })
    .await??;
    ensure!(out.status.success(), "bench serve failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out_path)?)?;
    ensure!(v["completed"] == 6 && v["failed"] == 0, "{v}");
    let cdf = std::fs::read_to_string(dir.path().join("plots/latency_cdf.svg"))?;
    ensure!(cdf.starts_with("<svg") && cdf.matches("<polyline").count() == 3, "{cdf}");
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
    for (k, d) in [("median_ttft_ms_ci95", "median_ttft_ms"), ("p99_e2el_ms_ci95", "p99_e2el_ms")] {
        let ci: Vec<f64> =
            v[k].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
        let x = v[d].as_f64().context("estimate")?;
        ensure!(ci.len() == 2 && ci[0] <= x && x <= ci[1], "{k} {ci:?} around {x}");
    }

    // A closed loop of one stream, timed from each send (--from-send): the requests follow
    // one another, so their latencies add up to no more than the run, and each first token
    // comes after its own send, not after the queue of the ones before it.
    let closed = dir.path().join("closed.json");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &format!("http://{addr}"), "--num-prompts", "4"])
        .args(["--request-rate", "inf", "--max-concurrency", "1", "--from-send"])
        .args(["--input-len", "12", "--output-len", "5", "--save-detailed", "--save-result"])
        .arg(&closed)
        .output()?;
    ensure!(out.status.success(), "closed loop: {}", String::from_utf8_lossy(&out.stderr));
    let c: Value = serde_json::from_str(&std::fs::read_to_string(&closed)?)?;
    ensure!(c["completed"] == 4 && c["from_send"] == true, "{c}");
    let e2els: Vec<f64> =
        c["e2els"].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    let duration = c["duration"].as_f64().context("duration")?;
    ensure!(e2els.len() == 4 && e2els.iter().sum::<f64>() <= duration, "{e2els:?} in {duration}");

    // A multi-tenant mix: a noisy tenant with shared prefixes beside a quiet one holding
    // multi-turn chats, after two warm-up requests left out of every figure; the report
    // carries the experiment's identity.
    let mix = dir.path().join("mix.json");
    std::fs::write(
        &mix,
        r#"[{"name": "noisy", "request_rate": 20, "num_prompts": 8, "workload": "shared-prefix",
             "input_len": "uniform:4:12", "output_len": "3"},
            {"name": "quiet", "request_rate": 4, "num_prompts": 4, "workload": "multi-turn",
             "input_len": 6, "output_len": "2"}]"#,
    )?;
    let (result, report) = (dir.path().join("mix-result.json"), dir.path().join("report.md"));
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &format!("http://{addr}"), "--endpoint", "chat"])
        .args(["--mix", mix.to_str().context("utf-8")?, "--warmup", "2", "--prefixes", "2"])
        .args(["--prefix-len", "16", "--sessions", "2", "--turns", "2", "--output-len", "3"])
        .args(["--input-len", "5", "--save-result", result.to_str().context("utf-8")?])
        .args(["--report", report.to_str().context("utf-8")?])
        .output()?;
    ensure!(out.status.success(), "mix failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&result)?)?;
    ensure!(v["completed"] == 12 && v["failed"] == 0, "{v}");
    ensure!(v["tenants"]["noisy"]["completed"] == 8, "{}", v["tenants"]);
    ensure!(v["tenants"]["quiet"]["completed"] == 4, "{}", v["tenants"]);
    // Warm-up excluded: the engine generated exactly the window's 8 x 3 + 4 x 2 tokens.
    ensure!(v["server_metrics"]["sluice_engine_generation_tokens_total"] == 32.0, "{v}");
    let buckets = v["length_buckets"].as_array().context("no length buckets")?;
    let bucketed: u64 = buckets.iter().filter_map(|b| b["completed"].as_u64()).sum();
    ensure!(bucketed == 12 && buckets[0]["bucket"] == "1-64", "{buckets:?}");
    let md = std::fs::read_to_string(&report)?;
    for needle in ["## Experiment identity", "model revision", "sha256:", "| noisy |", "warm-up"] {
        ensure!(md.contains(needle), "the report lacks {needle:?}:\n{md}");
    }

    // Whole responses: no TTFT to observe (absent, not E2E), throughput still counted.
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &format!("http://{addr}"), "--num-prompts", "3"])
        .args(["--request-rate", "10", "--input-len", "normal:8:2", "--output-len", "4"])
        .args(["--no-stream", "--save-result", result.to_str().context("utf-8")?])
        .output()?;
    ensure!(out.status.success(), "no-stream failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&result)?)?;
    ensure!(v["completed"] == 3 && v["ttft_samples"] == 0 && v["e2el_samples"] == 3, "{v}");
    ensure!(v["output_throughput"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    // Capacity search: doubling from 4 req/s to a ceiling of 16, then bisection; the
    // capacity is a rate every tested rate up to which met the target.
    let sweep = dir.path().join("sweep");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "sweep", "--base-url", &format!("http://{addr}")])
        .args(["--goodput", "ttft:3000,tpot:1000", "--input-len", "8", "--output-len", "3"])
        .args(["--duration", "1", "--start-rate", "4", "--max-rate", "16", "--repeats", "1"])
        .args(["--bisect", "1", "--out", sweep.to_str().context("utf-8")?])
        .output()?;
    ensure!(out.status.success(), "sweep failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(sweep.join("sweep.json"))?)?;
    let points = v["points"].as_array().context("no points")?;
    let rates: Vec<f64> = points.iter().filter_map(|p| p["rate"].as_f64()).collect();
    ensure!(rates.len() >= 3 && rates.windows(2).all(|w| w[0] < w[1]), "{rates:?}");
    ensure!(rates[0] == 4.0 && rates.iter().all(|r| *r <= 16.0), "{rates:?}");
    let cap = v["capacity_rps"].as_f64().context("no capacity")?;
    for p in points {
        let (rate, att) = (p["rate"].as_f64().unwrap_or(0.0), p["slo_attainment"].as_f64());
        if rate <= cap {
            ensure!(att.is_some_and(|a| a >= 0.9), "{p} is below the capacity {cap} yet missed");
        }
    }
    for f in ["throughput.svg", "latency.svg", "attainment.svg", "goodput.svg"] {
        let svg = std::fs::read_to_string(sweep.join(f))?;
        ensure!(svg.starts_with("<svg") && svg.contains("<polyline"), "{f}: {svg}");
    }
    ensure!(std::fs::read_to_string(sweep.join("sweep.md"))?.contains("**Capacity:"));
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "sweep", "--base-url", &format!("http://{addr}")])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("--goodput"), "{err}");
    // Bad input names the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &format!("http://{addr}")])
        .args(["--input-len", "uniform:9:3"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("--input-len"), "{err}");
    Ok(())
}
