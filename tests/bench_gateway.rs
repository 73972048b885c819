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

/// The added e2e p99 of a pair's median round, ms, as the bench judges it.
fn added_p99_median(d: &Value, g: &Value) -> Option<f64> {
    let rounds = |p: &Value| -> Option<Vec<f64>> {
        p["round_e2e_p99_ms"].as_array()?.iter().map(Value::as_f64).collect()
    };
    let mut added: Vec<f64> = rounds(g)?.iter().zip(rounds(d)?).map(|(a, b)| a - b).collect();
    added.sort_by(f64::total_cmp);
    added.get(added.len() / 2).copied()
}

#[test]
fn bench_gateway_search_reports_rates_its_own_points_bear_out() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "gateway", "--search", "--rates", "100", "--search-steps", "1"])
        .args(["--seconds", "0.3", "--rounds", "1", "--layout", "shared", "--json"])
        .output()?;
    ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = String::from_utf8(out.stdout)?
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("not JSON: {l}")))
        .collect::<anyhow::Result<_>>()?;
    let search = &lines.last().context("no output")?["search"];
    ensure!(search["criterion"].as_str().is_some_and(|c| c.contains("1 ms")), "{search}");
    let pairs: Vec<&[Value]> = lines[1..lines.len() - 1].chunks(2).collect();
    ensure!(!pairs.is_empty() && pairs.iter().all(|p| p.len() == 2), "{lines:?}");
    // Each rate tried, held or not, as its own figures say.
    let mut verdicts = Vec::new();
    for pair in &pairs {
        let (d, g) = (&pair[0], &pair[1]);
        ensure!(d["target"] == "engine" && g["target"] == "gateway", "{d} {g}");
        let rate = g["offered_rps"].as_f64().context("no rate")?;
        let added = added_p99_median(d, g).context("no rounds")?;
        let served = |p: &Value| p["ok"].as_u64().is_some_and(|n| n > 0) && p["errors"] == 0;
        let held = served(d) && served(g) && added < 1.0;
        verdicts.push((rate, held));
    }
    // From the rate asked for, doubling while rates hold (halving while they fail), up to 8
    // rates; once the verdict turns, at most one bisection (`--search-steps 1`).
    let first = verdicts[0].1;
    let out =
        verdicts.iter().position(|(_, held)| *held != first).map_or(verdicts.len(), |i| i + 1);
    let step: f64 = if first { 2.0 } else { 0.5 };
    for (i, (rate, _)) in verdicts[..out].iter().enumerate() {
        ensure!(*rate == 100.0 * step.powi(i32::try_from(i)?), "{verdicts:?}");
    }
    ensure!(verdicts.len() - out <= 1, "{verdicts:?}");
    let held_rps = search["held_rps"].as_f64();
    let failed_rps = search["failed_rps"].as_f64();
    if let Some(h) = held_rps {
        ensure!(verdicts.contains(&(h, true)), "held {h}: {verdicts:?}");
    }
    if held_rps.is_none() || failed_rps.is_none() {
        ensure!(verdicts.len() == 8 && verdicts.iter().all(|v| v.1 == first), "{verdicts:?}");
    }
    if let Some(f) = failed_rps {
        ensure!(verdicts.contains(&(f, false)), "failed {f}: {verdicts:?}");
        ensure!(held_rps.is_none_or(|h| h < f), "{search}");
    }
    // No rate above the one reported held held, and none below the one reported failed
    // failed (the search's answer is the boundary of what it measured).
    for (rate, held) in &verdicts {
        if let (Some(h), true) = (held_rps, *held) {
            ensure!(*rate <= h, "{rate} held above {h}: {verdicts:?}");
        }
        if let (Some(f), false) = (failed_rps, *held) {
            ensure!(*rate >= f, "{rate} failed below {f}: {verdicts:?}");
        }
    }
    Ok(())
}
