//! `sluice admin` and `sluice audit` against a real `sluice billing` process on the embedded
//! SQLite ledger: the commands, their output shapes and their errors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

use anyhow::{Context, ensure};
use serde_json::{Value, json};
use sluice_billing::{Ledger, UsageEvent};

mod support;

const SECRET: &str = "cli-test-secret-cli-test-secret-0123";

struct Billing {
    child: Child,
    url: String,
}

impl Drop for Billing {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(database_url: &str) -> anyhow::Result<Billing> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["billing", "--database-url", database_url, "--listen", "127.0.0.1:0"])
        .env("SLUICE_JWT_SECRET", SECRET)
        .env_remove("SLUICE_REDIS_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let url = line.trim().strip_prefix("listening on ").context("no listening line")?.to_owned();
    Ok(Billing { child, url })
}

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

/// Runs a command that must fail and returns its stderr.
fn fails(args: &[&str], url: &str, token: &str) -> anyhow::Result<String> {
    let out = sluice(args, url, token)?;
    ensure!(!out.status.success(), "sluice {args:?} should fail");
    Ok(String::from_utf8(out.stderr)?)
}

fn mint(role: &str) -> anyhow::Result<String> {
    Ok(ok(&["admin", "token", "--role", role, "--sub", "cli-test"], "", "")?.trim().to_owned())
}

fn usage_event(i: usize) -> anyhow::Result<UsageEvent> {
    let arrival = format!("2026-11-29T08:00:{i:02}Z");
    Ok(serde_json::from_value(json!({
        "request_id": format!("cli-{i}"), "tenant_id": if i < 4 { "acme" } else { "globex" },
        "key_id": "key_1", "model_id": "smollm2", "model_revision": "sha256:rev",
        "tokenizer_revision": "sha256:tok", "chat_template_version": "sha256:tpl",
        "prompt_tokens": 10 + i, "cached_prompt_tokens": 0, "completion_tokens": 5,
        "finish_reason": if i == 2 { "length" } else { "stop" }, "http_status": 200,
        "client_disconnected": false, "arrival_at": arrival,
        "prompt_sha256": "cd".repeat(32), "prompt_chars": 40, "cost_micros": 7,
        "price_list_version": "test-1", "price_input_micros": 0, "price_cached_input_micros": 0,
        "price_output_micros": 1_400_000,
    }))?)
}

#[test]
fn admin_and_audit_commands_over_the_billing_api() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").to_str().context("utf-8")?);
    let billing = start(&db)?;
    let url = billing.url.as_str();
    let ops = mint("ops")?;
    let auditor = mint("auditor")?;

    let t: Value = serde_json::from_str(&ok(
        &["admin", "tenants", "create", "acme", "--tier", "free"],
        url,
        &ops,
    )?)?;
    ensure!(t["id"] == "acme" && t["status"] == "active", "{t}");
    let list = ok(&["admin", "tenants", "list"], url, &ops)?;
    ensure!(list.lines().any(|l| l == "acme\tactive\tfree\tacme"), "{list}");
    // A fair-order weight of its own, then its tier's again; out of range is refused here.
    let weighted: Value = serde_json::from_str(&ok(
        &["admin", "tenants", "update", "acme", "--weight", "6"],
        url,
        &ops,
    )?)?;
    ensure!(weighted["overrides"]["weight"] == 6 && weighted["tier"] == "free", "{weighted}");
    let back: Value = serde_json::from_str(&ok(
        &["admin", "tenants", "update", "acme", "--weight", "tier"],
        url,
        &ops,
    )?)?;
    ensure!(back["overrides"] == serde_json::json!({}), "{back}");
    let err = fails(&["admin", "tenants", "update", "acme", "--weight", "0"], url, &ops)?;
    ensure!(err.contains("--weight") && err.contains("1 to 1000"), "{err}");
    let key: Value = serde_json::from_str(&ok(
        &["admin", "keys", "issue", "acme", "--scope", "chat"],
        url,
        &ops,
    )?)?;
    let secret = key["secret"].as_str().context("secret")?;
    let keys = ok(&["admin", "keys", "list", "acme"], url, &ops)?;
    ensure!(keys.contains(key["prefix"].as_str().context("prefix")?) && !keys.contains(secret));
    let key_id = key["id"].as_str().context("key id")?;
    let limited: Value = serde_json::from_str(&ok(
        &["admin", "keys", "limits", "acme", key_id, "--rpm", "2", "--concurrency", "1"],
        url,
        &ops,
    )?)?;
    ensure!(limited["limits"] == serde_json::json!({"rpm": 2, "concurrency": 1}), "{limited}");
    let q: Value = serde_json::from_str(&ok(
        &[
            "admin",
            "quotas",
            "set",
            "acme",
            "--rpm",
            "5",
            "--priority",
            "-3",
            "--allowed-model",
            "smollm2",
        ],
        url,
        &ops,
    )?)?;
    ensure!(q["effective"]["rpm"] == 5 && q["effective"]["priority"] == -3, "{q}");
    ensure!(q["effective"]["tpm"] == 20000, "tier default: {q}");
    let suspended: Value =
        serde_json::from_str(&ok(&["admin", "tenants", "suspend", "acme"], url, &ops)?)?;
    ensure!(suspended["status"] == "suspended");

    // Records arrive through the ledger (the same insert the usage consumer makes).
    let events: Vec<UsageEvent> = (0..6).map(usage_event).collect::<anyhow::Result<_>>()?;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
        let ledger = Ledger::connect(&db).await?;
        ledger.insert_batch(&events).await?;
        ledger.close().await;
        anyhow::Ok(())
    })?;
    let jsonl = ok(
        &["audit", "records", "--tenant", "acme", "--since", "2026-11-29", "--limit", "3"],
        url,
        &auditor,
    )?;
    let rows: Vec<Value> = jsonl.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    ensure!(rows.len() == 3, "{jsonl}");
    for (i, r) in rows.iter().enumerate() {
        ensure!(r["request_id"] == format!("cli-{i}") && r["tenant_id"] == "acme", "{r}");
        for col in ["prompt_tokens", "completion_tokens", "finish_reason", "model_revision"] {
            ensure!(!r[col].is_null(), "{col} missing: {r}");
        }
    }
    let csv =
        ok(&["audit", "records", "--format", "csv", "--finish-reason", "length"], url, &auditor)?;
    let mut lines = csv.lines();
    let header = lines.next().context("no header")?;
    ensure!(
        header.starts_with("request_id,idempotency_key,tenant_id,key_id,model_id,model_revision"),
        "{header}"
    );
    let cols: Vec<&str> = header.split(',').collect();
    let row: Vec<&str> = lines.next().context("no row")?.split(',').collect();
    let at = |name: &str| cols.iter().position(|c| *c == name).and_then(|i| row.get(i).copied());
    ensure!(at("request_id") == Some("cli-2") && at("prompt_tokens") == Some("12"), "{csv}");
    ensure!(lines.next().is_none(), "{csv}");
    let log = ok(&["audit", "log"], url, &auditor)?;
    let actions: Vec<String> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).map(|v| v["action"].as_str().unwrap_or("").to_owned())
        })
        .collect::<Result<_, _>>()?;
    ensure!(
        actions
            == [
                "tenant.create",
                "tenant.update",
                "tenant.update",
                "key.issue",
                "key.limits.set",
                "quota.set",
                "tenant.suspend"
            ],
        "{actions:?}"
    );

    // Clear errors.
    let err = fails(&["admin", "tenants", "create", "x"], url, &auditor)?;
    ensure!(err.contains("403") && err.contains("role auditor may not"), "{err}");
    let err = fails(&["audit", "records", "--since", "yesterday"], url, &auditor)?;
    ensure!(err.contains("400") && err.contains("parameter since"), "{err}");
    let err = fails(&["admin", "tenants", "list"], url, "forged.token.value")?;
    ensure!(err.contains("401"), "{err}");
    let err = fails(&["admin", "tenants", "list"], "http://127.0.0.1:9", &ops)?;
    ensure!(err.contains("cannot reach the billing service"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["audit", "records"])
        .env_remove("SLUICE_ADMIN_URL")
        .env("SLUICE_ADMIN_TOKEN", &auditor)
        .output()?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("SLUICE_ADMIN_URL")
    );
    let err = fails(&["admin", "token", "--role", "root", "--sub", "x"], url, &ops)?;
    ensure!(err.contains("--role"), "{err}");
    // The token never appears in what the commands print on failure.
    ensure!(!err.contains(&ops));
    Ok(())
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

/// `sluice audit` with hostile input and a hostile ledger: a `--since` whose last character
/// takes several bytes is refused naming the parameter (never a panic, never a dropped
/// connection), and a CSV export carries no cell a spreadsheet would run as a formula.
#[test]
fn audit_commands_refuse_a_multibyte_since_and_export_csv_without_formulas() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").to_str().context("utf-8")?);
    let billing_proc = start(&db)?;
    let url = billing_proc.url.clone();
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

/// The keys of tenant `tenant`, as `sluice admin keys list` gives them (`None` while the
/// tenant does not exist).
fn keys_of(tenant: &str, url: &str, ops: &str) -> anyhow::Result<Option<Vec<Value>>> {
    let out = sluice(&["admin", "keys", "list", tenant], url, ops)?;
    if !out.status.success() {
        return Ok(None);
    }
    let listed: Value = serde_json::from_slice(&out.stdout)?;
    Ok(Some(listed["data"].as_array().context("keys listing")?.clone()))
}

/// `sluice bench isolation --scenario` creates its tenants and issues them keys through the
/// admin API; interrupted mid-run (Ctrl-C), it revokes those keys before it exits, so a run
/// cut short leaves no live key behind.
#[test]
fn an_interrupted_isolation_run_revokes_the_keys_it_issued() -> anyhow::Result<()> {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir()?;
    let db = format!("sqlite://{}", dir.path().join("ledger.db").to_str().context("utf-8")?);
    let billing = start(&db)?;
    let url = billing.url.as_str();
    let ops = mint("ops")?;
    // A gateway that takes connections and never answers: the run's requests stay in flight
    // until it is interrupted.
    let hold = std::net::TcpListener::bind("127.0.0.1:0")?;
    let gateway = format!("http://{}", hold.local_addr()?);
    std::thread::spawn(move || {
        let held: Vec<_> = hold.incoming().map_while(Result::ok).collect();
        drop(held);
    });
    let log = std::fs::File::create(dir.path().join("bench.log"))?;
    let mut run = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "isolation", "--base-url", &gateway, "--model", "smollm2-135m-instruct"])
        .args(["--scenario", "decode-flood", "--duration", "60", "--admin-url", url])
        .env("SLUICE_ADMIN_TOKEN", &ops)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let tenants = ["iso-quiet", "iso-decode-flood"];
    let deadline = Instant::now() + Duration::from_secs(60);
    let issued = loop {
        let mut all = Vec::new();
        for t in tenants {
            all.extend(keys_of(t, url, &ops)?.unwrap_or_default());
        }
        if all.len() == tenants.len() {
            break all;
        }
        if Instant::now() > deadline || run.try_wait()?.is_some() {
            let _ = run.kill();
            let log = std::fs::read_to_string(dir.path().join("bench.log")).unwrap_or_default();
            anyhow::bail!("the run issued {} keys, not one per tenant:\n{log}", all.len());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    ensure!(issued.iter().all(|k| k["revoked_at"].is_null()), "live while it runs: {issued:?}");
    // Its requests are in flight when it is interrupted.
    std::thread::sleep(Duration::from_secs(2));
    ensure!(run.try_wait()?.is_none(), "the run ended before the interrupt");
    let status = support::signal_and_wait(&mut run, "INT", Duration::from_secs(30));
    if status.is_err() {
        let _ = run.kill();
    }
    let status = status?;
    let log = std::fs::read_to_string(dir.path().join("bench.log")).unwrap_or_default();
    ensure!(status.code() == Some(130), "exit {status}:\n{log}");
    ensure!(log.contains("revoking the keys this run issued"), "{log}");
    for t in tenants {
        let keys = keys_of(t, url, &ops)?.context("the tenant is gone")?;
        ensure!(
            !keys.is_empty() && keys.iter().all(|k| !k["revoked_at"].is_null()),
            "{t}'s keys after the interrupt: {keys:?}"
        );
    }
    Ok(())
}
