//! `sluice bench gateway` end to end: both paths serve every request of every round, the
//! gateway's own time comes back from its header, and the layout is the one asked for. No
//! speed is asserted.

use std::process::Command;

use anyhow::{Context, ensure};
use serde_json::Value;

fn bench(layout: &str, extra: &[&str]) -> anyhow::Result<Vec<Value>> {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "gateway", "--rates", "100", "--seconds", "0.5", "--rounds", "2"])
        .args(["--layout", layout, "--json"])
        .args(extra)
        .output()?;
    ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)?
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("not JSON: {l}")))
        .collect()
}

fn check(lines: &[Value], layout: &str) -> anyhow::Result<()> {
    ensure!(lines.len() == 3, "{lines:?}");
    ensure!(lines[0]["layout"] == layout, "{}", lines[0]);
    for (p, target) in lines[1..].iter().zip(["engine", "gateway"]) {
        ensure!(p["target"] == target, "{p}");
        // 100 requests/s for 0.5 s, twice.
        ensure!(p["ok"] == 100 && p["errors"] == 0 && p["rounds"] == 2, "{p}");
        ensure!(p["round_e2e_p99_ms"].as_array().map(Vec::len) == Some(2), "{p}");
        ensure!(p["e2e_p99_ms"].as_f64().is_some_and(|v| v > 0.0), "{p}");
    }
    // Only responses through the gateway carry its own time.
    ensure!(lines[1]["overhead_p99_ms"].is_null(), "{}", lines[1]);
    let own = lines[2]["overhead_p99_ms"].as_f64().context("no gateway overhead")?;
    let e2e = lines[2]["e2e_p99_ms"].as_f64().unwrap_or(0.0);
    ensure!(own > 0.0 && own < e2e, "gateway's own p99 {own} ms vs e2e {e2e} ms");
    // The gateway's threads are found by name (its CPU is theirs; an isolated layout pins
    // them or fails): they work through the gateway, and no failure goes unnamed.
    let cpu = lines[2]["gateway_cpu_us_per_request"].as_f64().unwrap_or(0.0);
    ensure!(cpu > 0.0, "no CPU of the gateway's threads: {}", lines[2]);
    for p in &lines[1..] {
        ensure!(p["failures"].as_object().is_some_and(|f| f.is_empty()), "{p}");
    }
    Ok(())
}

#[test]
fn bench_gateway_measures_both_paths_in_alternating_rounds() -> anyhow::Result<()> {
    let lines = bench("shared", &[])?;
    check(&lines, "shared")?;
    ensure!(lines[0]["redis"] == false, "{}", lines[0]);
    if std::thread::available_parallelism()?.get() >= 2 {
        check(&bench("isolated", &[])?, "isolated")?;
    }
    // The multi-machine path: Redis limits, usage stream and journal.
    let lines = bench("shared", &["--redis-url", "redis://127.0.0.1:6379"])?;
    check(&lines, "shared")?;
    ensure!(lines[0]["redis"] == true, "{}", lines[0]);
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "gateway", "--rounds", "0"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("--rounds"), "{err}");
    Ok(())
}
