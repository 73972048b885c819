//! The web console (`GET /console`) driven by real clicks in headless Chromium, with
//! Playwright for Python pointed at the system Chromium, against a real `sluice billing` on
//! SQLite and on Postgres, with a gateway and an engine on the same database so a key issued
//! in the browser is used for real requests. `tests/browser/console_flow.py` holds the steps:
//! ops creates tenants, issues and revokes keys, sets a quota and reads the audit log; an
//! auditor filters records and downloads CSV and JSON Lines equal to `sluice audit records`;
//! a tenant-admin cannot see another tenant; a billing token is refused the ops pages with a
//! message; an adapter registered through the API (its two revisions checked and put in the
//! engine's store here, as `sluice admin adapters register` does) is listed for ops and its
//! tenant's admin, unseen by another tenant's until shared in the console, runs requests,
//! is found by the records explorer's `adapter` filter and is retired in the console.
//! Screenshots of each view are written under the target's test directory and their paths
//! printed.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, ensure};
use serde_json::{Value, json};
use sluice_engine::fetch::sha256_files;
use sluice_engine::model::gguf_config;
use sluice_engine::quant::GgmlType;
use sluice_engine::server::adapters::put_in_store;
use sluice_engine::synth::SynthLora;
use sluice_text::gguf::GgufFile;
use support::{Proc, ScratchDatabase, random_hex, spawn_engine, spawn_sluice, wait_healthy};

const INTERNAL_TOKEN: &str = "console-test-internal-token";
const MODEL_ID: &str = "smollm2-135m-instruct";

fn chromium() -> anyhow::Result<String> {
    ["chromium", "chromium-browser"]
        .iter()
        .find_map(|name| {
            let out =
                Command::new("sh").args(["-c", &format!("command -v {name}")]).output().ok()?;
            let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            (out.status.success() && !path.is_empty()).then_some(path)
        })
        .context("headless Chromium is needed (scripts/deps installs it)")
}

/// Two revisions of one synthetic adapter of `model`, checked against it and put in `store`
/// as `sluice admin adapters register` does: the registration bodies (less the name) the
/// browser steps send to the API, oldest first.
fn stored_adapter_revisions(model: &Path, store: &Path, work: &Path) -> anyhow::Result<Value> {
    let base = gguf_config(&GgufFile::open(model)?)?;
    let base_revision = format!("sha256:{}", sha256_files(&[model.to_path_buf()], &|_| ())?);
    let mut bodies = Vec::new();
    for seed in [41u64, 42] {
        let src = work.join(format!("lora-{seed}"));
        SynthLora::new(seed).write_peft(&base, GgmlType::F32, &src)?;
        let a = put_in_store(&src, &base, store)?;
        let targets: Vec<&str> = a.targets().iter().map(|t| t.peft_name()).collect();
        bodies.push(json!({
            "revision": a.revision,
            "base_model": MODEL_ID,
            "base_revision": base_revision,
            "rank": a.rank,
            "targets": targets,
            "bytes": a.memory_bytes(),
        }));
    }
    ensure!(bodies[0]["revision"] != bodies[1]["revision"], "two seeds gave one revision");
    Ok(Value::Array(bodies))
}

/// Billing, an engine and a gateway on `database_url`, then the browser steps.
async fn console_flow(database_url: &str, backend: &str) -> anyhow::Result<()> {
    // Playwright for Python; the system Chromium is used, so no browser is downloaded.
    support::ensure_python_package("playwright.sync_api", "playwright==1.65.2")?;
    let chromium = chromium()?;
    let secret = random_hex(32)?;
    let jwt = [("SLUICE_JWT_SECRET", secret.as_str())];
    let (_billing, billing) = spawn_sluice(
        &["billing", "--database-url", database_url, "--listen", "127.0.0.1:0"],
        &jwt,
    )?;
    let model = common::default_model()?;
    let work = tempfile::tempdir()?;
    let store = work.path().join("adapters");
    let adapters = stored_adapter_revisions(&model, &store, work.path())?;
    let store = store.to_str().context("utf-8 store path")?;
    let model = model.to_str().context("utf-8 model path")?;
    let (_engine, engine) =
        spawn_engine(model, INTERNAL_TOKEN, "64", &[("SLUICE_ADAPTER_STORE", store)], None)?;
    let listen = format!("127.0.0.1:{}", support::free_port()?);
    let (_gateway, gateway): (Proc, String) = spawn_sluice(
        &["gateway", "--plain-http", "--listen", &listen, "--engine", &engine]
            .into_iter()
            .chain(["--database-url", database_url, "--internal-token", INTERNAL_TOKEN])
            .chain(["--model", model])
            .collect::<Vec<_>>(),
        &[],
    )?;
    let c = reqwest::Client::new();
    for url in [&billing, &engine, &gateway] {
        wait_healthy(&c, &format!("http://{url}/health")).await?;
    }
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("console-{backend}"));
    let _ = std::fs::remove_dir_all(&shots);
    std::fs::create_dir_all(&shots)?;
    let out = tokio::task::block_in_place(|| {
        Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/console_flow.py"))
            .env("CONSOLE_URL", format!("http://{billing}"))
            .env("GATEWAY_URL", format!("http://{gateway}"))
            .env("SLUICE_BIN", env!("CARGO_BIN_EXE_sluice"))
            .env("SLUICE_JWT_SECRET", &secret)
            .env("CHROMIUM", &chromium)
            .env("SHOTS", &shots)
            .env("TAG", random_hex(3)?)
            .env("MODEL_ID", MODEL_ID)
            .env("ADAPTER_REVISIONS", adapters.to_string())
            .output()
            .context("running python3")
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    ensure!(
        out.status.success(),
        "the console flow on {backend} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(stdout.contains("console flow passed"), "{stdout}");
    // Each view was photographed.
    for view in ["ops-tenants", "ops-quota", "ops-audit-log", "auditor-records", "tenant-admin"]
        .into_iter()
        .chain(["billing-denied-ops", "billing-dashboard", "ops-tenants-dark"])
        .chain(["ops-adapters", "tenant-admin-shared-adapter", "auditor-records-adapter"])
        .chain(["ops-adapters-retired"])
    {
        let png = shots.join(format!("{view}.png"));
        let len = std::fs::metadata(&png).with_context(|| png.display().to_string())?.len();
        ensure!(len > 1000, "{} is {len} bytes", png.display());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_serves_ops_auditors_tenant_admins_and_billing_on_sqlite() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").display());
    console_flow(&db, "sqlite").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_serves_ops_auditors_tenant_admins_and_billing_on_postgres()
-> anyhow::Result<()> {
    let db = tokio::task::block_in_place(|| ScratchDatabase::create("console"))?;
    console_flow(&db.url, "postgres").await
}
