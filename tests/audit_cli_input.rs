//! `sluice audit` with hostile input and a hostile ledger, against a real `sluice billing`
//! process on the embedded SQLite ledger: a `--since` whose last character takes several bytes
//! is refused naming the parameter (never a panic, never a dropped connection), and a CSV export
//! carries no cell a spreadsheet would run as a formula.

mod support;

use std::process::{Command, Output};

use anyhow::{Context, ensure};
use sluice_billing::Ledger;

const SECRET: &str = "audit-input-secret-audit-input-0123";

fn sluice(args: &[&str], url: &str, token: &str) -> anyhow::Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("SLUICE_ADMIN_URL", url)
        .env("SLUICE_ADMIN_TOKEN", token)
        .env("SLUICE_JWT_SECRET", SECRET)
        .output()?)
}

fn ok(args: &[&str], url: &str, token: &str) -> anyhow::Result<String> {
    let out = sluice(args, url, token)?;
    ensure!(out.status.success(), "sluice {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

/// A record whose client-chosen text begins like a formula: the model asked for and the
/// Idempotency-Key.
fn formula_event() -> anyhow::Result<sluice_billing::UsageEvent> {
    Ok(serde_json::from_value(serde_json::json!({
        "request_id": "formula-1", "tenant_id": "acme", "key_id": "key_1",
        "idempotency_key": "@SUM(1+1)", "model_id": "=HYPERLINK(\"http://evil.example\",\"x\")",
        "model_revision": "sha256:rev", "tokenizer_revision": "sha256:tok",
        "chat_template_version": "sha256:tpl", "prompt_tokens": 10, "cached_prompt_tokens": 0,
        "completion_tokens": 5, "finish_reason": "stop", "http_status": 200,
        "client_disconnected": false, "arrival_at": "2026-11-29T08:00:00Z",
        "prompt_sha256": "cd".repeat(32), "prompt_chars": 40, "cost_micros": 7,
        "price_list_version": "test-1", "price_input_micros": 0, "price_cached_input_micros": 0,
        "price_output_micros": 1_400_000,
    }))?)
}

#[test]
fn audit_commands_refuse_a_multibyte_since_and_export_csv_without_formulas() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").to_str().context("utf-8")?);
    let (_billing, addr) = support::spawn_sluice(
        &["billing", "--database-url", &db, "--listen", "127.0.0.1:0"],
        &[("SLUICE_JWT_SECRET", SECRET)],
    )?;
    let url = format!("http://{addr}");
    let auditor = ok(&["admin", "token", "--role", "auditor", "--sub", "input-test"], "", "")?;
    let auditor = auditor.trim();
    let billing = ok(&["admin", "token", "--role", "billing", "--sub", "input-test"], "", "")?;

    // `reconcile` parses --since itself; the others hand it to the API.
    for (args, token) in [
        (vec!["audit", "reconcile", "--since", "1é"], auditor),
        (vec!["audit", "reconcile", "--since", "7日"], auditor),
        (vec!["audit", "records", "--since", "1é"], auditor),
        (vec!["audit", "log", "--since", "24ħ"], auditor),
        (vec!["audit", "usage", "--since", "1🦀"], billing.trim()),
    ] {
        let out = sluice(&args, &url, token)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        // 101 is a Rust panic's exit status.
        ensure!(
            !out.status.success() && out.status.code() != Some(101),
            "sluice {args:?}: {:?} {stderr}",
            out.status
        );
        ensure!(stderr.contains("since") && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }

    let event = formula_event()?;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
        let ledger = Ledger::connect(&db).await?;
        ledger.insert_batch(&[event]).await?;
        ledger.close().await;
        anyhow::Ok(())
    })?;
    let csv = ok(&["audit", "records", "--format", "csv"], &url, auditor)?;
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().context("no header")?.split(',').collect();
    let row = lines.next().context("no row")?;
    ensure!(lines.next().is_none(), "{csv}");
    // The model's cell is quoted (it holds a comma); the key's is not.
    ensure!(row.contains(",\"'=HYPERLINK(\"\"http://evil.example\"\",\"\"x\"\")\","), "{row}");
    let cells: Vec<&str> = row.split(',').collect();
    let at = |name: &str| header.iter().position(|c| *c == name).and_then(|i| cells.get(i));
    ensure!(at("idempotency_key") == Some(&"'@SUM(1+1)"), "{csv}");
    ensure!(at("request_id") == Some(&"formula-1"), "{csv}");
    Ok(())
}
