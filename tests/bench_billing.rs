//! `sluice bench billing` end to end against the real Postgres and Redis: it works in a scratch
//! database it drops afterwards, and its JSON accounts for every record. No speed is asserted.

mod support;

use std::process::Command;

use anyhow::{Context, ensure};

const DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const REDIS_URL: &str = "redis://127.0.0.1:6379";

#[test]
fn bench_billing_uses_and_drops_a_scratch_database() -> anyhow::Result<()> {
    let _lock = support::postgres_shared_lock()?;
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "billing", "--database-url", DATABASE_URL, "--redis-url", REDIS_URL])
        .args(["--records", "1000", "--batch", "250", "--rate", "1000", "--seconds", "0.5"])
        .arg("--json")
        .output()?;
    ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let insert = &report["insert"];
    ensure!(insert["inserted"] == 1000 && insert["batches"] == 4, "{report}");
    let ingest = &report["ingest"];
    ensure!(ingest["committed"] == 500 && ingest["inserted"] == 500, "{report}");
    ensure!(ingest["lag"]["samples"] == 500, "{report}");
    let name = report["scratch_database"].as_str().context("no scratch_database")?;
    ensure!(name.starts_with("sluice_bench_"), "{name}");

    let listed = Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-Atc"])
        .arg(format!("SELECT COUNT(*) FROM pg_database WHERE datname = '{name}'"))
        .output()?;
    ensure!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    ensure!(String::from_utf8_lossy(&listed.stdout).trim() == "0", "{name} was not dropped");
    Ok(())
}
