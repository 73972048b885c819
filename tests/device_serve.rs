//! `scripts/device-serve`, the one script a GPU session runs for issue 23's serving figures,
//! run here end to end on the CPU with the small synthetic model (tiny layers, a 32,000-token
//! vocabulary) and small counts: the model
//! written by `sluice model synth`, `sluice bench forward`, `sluice engine`, `sluice bench
//! serve` at two concurrencies, the shared-prefix run (its tenant header is what lets the
//! prompts share the prefix cache), the chunked-prefill isolation run and the summary. So the
//! device's few minutes are not spent finding a mistake in the script.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, ensure};
use serde_json::Value;

#[test]
fn the_device_serving_script_runs_on_the_cpu() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir()?;
    let run = Command::new("bash")
        .arg(root.join("scripts/device-serve"))
        .current_dir(root)
        .env("SLUICE", env!("CARGO_BIN_EXE_sluice"))
        .env("DEVICE", "cpu")
        .env("SHAPE", "small")
        .env("CONCURRENCY", "1 4")
        .env("IN", "48")
        .env("OUT_TOKENS", "8")
        .env("PREFIX", "32")
        .env("PREFIXES", "1")
        .env("PREFIX_STREAMS", "1")
        .env("LONG_IN", "200")
        .env("STEPS", "4")
        .env("MAX_BATCHED", "64")
        .env("OUT", out.path())
        .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let log = |name: &str| std::fs::read_to_string(out.path().join(name)).unwrap_or_default();
    ensure!(
        run.status.success(),
        "scripts/device-serve failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- \
         engine.log\n{}",
        run.status,
        log("engine.log")
    );
    let summary: Value = serde_json::from_str(&log("summary.json"))
        .with_context(|| format!("summary.json:\n{stdout}"))?;
    let points = summary["points"].as_array().context("points")?;
    ensure!(points.len() == 2, "{summary}");
    for (p, streams) in points.iter().zip([1, 4]) {
        let f = |k: &str| p[k].as_f64().with_context(|| format!("{k} in {p}"));
        ensure!(p["concurrency"] == streams && p["failed"] == 0, "{p}");
        ensure!(p["completed"].as_u64().is_some_and(|n| n >= 4), "{p}");
        ensure!(f("output_tok_s")? > 0.0 && f("forward_tok_s")? > 0.0, "{p}");
        let ratio = f("output_tok_s")? / f("forward_tok_s")?;
        ensure!((f("ratio_to_forward")? - ratio).abs() < 1e-9 * ratio, "{p}");
        // The same work through the forward pass alone includes the prompts' prefill: less
        // output a second than decode steps alone.
        ensure!(f("forward_workload_tok_s")? < f("forward_tok_s")?, "{p}");
        ensure!(f("ratio_to_workload")? > f("ratio_to_forward")?, "{p}");
        ensure!(f("tpot_ms_p50")? > 0.0 && f("tpot_ms_p99")? >= f("tpot_ms_p50")?, "{p}");
        // The engine's own counters came back through bench serve: a share of idle time
        // between passes, with passes and gaps of some length.
        let idle = f("device_idle_share")?;
        ensure!((0.0..1.0).contains(&idle), "{p}");
        ensure!(f("device_pass_ms")? > 0.0 && f("device_gap_ms")? > 0.0, "{p}");
    }
    // One tenant's prompts, one after another, over one prefix: after the first, the prefix
    // (two whole blocks of 16) is found in the cache.
    let shared = &summary["shared_prefix"];
    ensure!(shared["failed"] == 0, "{shared}");
    let hits = shared["prefix_hit_tokens"].as_f64().context("hits")?;
    let queried = shared["prefix_queried_tokens"].as_f64().context("queries")?;
    ensure!(hits >= 3.0 * 32.0 && hits < queried, "{shared}");
    let tenants = summary["chunked_prefill"]["tenants"].as_array().context("tenants")?;
    let names: Vec<&str> = tenants.iter().filter_map(|t| t["name"].as_str()).collect();
    ensure!(names == ["decoders", "long-prompts"], "{names:?}");
    ensure!(tenants[0]["mixed_over_alone"]["tpot_p99"].as_f64().is_some(), "{}", tenants[0]);
    // The engine's default order (on the CPU: tokens streamed before the next pass) against
    // the other (streamed while it runs), both answering every request.
    let overlap = summary["overlap"]["points"].as_array().context("overlap")?;
    let modes: Vec<&str> = overlap.iter().filter_map(|p| p["overlap"].as_str()).collect();
    ensure!(modes == ["off", "on"], "{modes:?}");
    for p in overlap {
        ensure!(p["failed"] == 0 && p["completed"].as_u64().is_some_and(|n| n >= 4), "{p}");
        ensure!(p["device_idle_share"].as_f64().is_some_and(|s| (0.0..1.0).contains(&s)), "{p}");
    }
    let md = log("summary.md");
    ensure!(
        md.contains("| 4 |") && md.contains("prefix cache") && md.contains("output overlap on"),
        "{md}"
    );
    Ok(())
}
