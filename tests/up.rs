//! `sluice up` end to end: the whole platform in one process, driven by the official OpenAI
//! Python SDK over HTTPS (trusting the generated CA through demo.env), administered with
//! `sluice admin`, and checked against the ledger it wrote: every admitted or refused request
//! billed exactly once with the tokens the client received.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::Value;
use sluice_billing::Ledger;
use sluice_billing::query::RecordFilter;
use support::{Up, ensure_sdk, env_file, signal_and_wait, start_up};

/// What a test does with a running `sluice up`.
trait UpExt {
    fn sdk(&self, phase: &str) -> anyhow::Result<Vec<Value>>;
    fn admin(&self, args: &[&str]) -> anyhow::Result<String>;
}

impl UpExt for Up {
    /// One phase of the SDK script; its JSON lines.
    fn sdk(&self, phase: &str) -> anyhow::Result<Vec<Value>> {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/test_gateway_sdk.py");
        let out = Command::new("python3").arg(&script).arg(phase).envs(self.envs()?).output()?;
        ensure!(
            out.status.success(),
            "SDK phase {phase} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)?.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
    }

    fn admin(&self, args: &[&str]) -> anyhow::Result<String> {
        let out =
            Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).envs(self.envs()?).output()?;
        ensure!(out.status.success(), "sluice {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8(out.stdout)?)
    }
}

/// Key grants are cached for 2 s: changes are visible after that.
fn wait_for_cache() {
    std::thread::sleep(Duration::from_millis(2_500));
}

#[test]
fn sluice_up_serves_bills_and_administers_through_the_gateway() -> anyhow::Result<()> {
    ensure_sdk()?;
    let tmp = tempfile::tempdir()?;
    let up = start_up(tmp.path())?;
    let demo = env_file(&up.dir.join("demo.env"))?;
    ensure!(demo["OPENAI_BASE_URL"].starts_with("https://127.0.0.1:"), "{demo:?}");
    ensure!(
        Path::new(&demo["SSL_CERT_FILE"]).exists()
            && demo["OPENAI_API_KEY"].starts_with("sk-sluice-")
    );

    let mut seen = up.sdk("basic")?;
    up.admin(&["admin", "quotas", "set", "demo", "--rpm", "3", "--max-prompt-tokens", "50"])?;
    wait_for_cache();
    seen.extend(up.sdk("limits")?);
    up.admin(&["admin", "quotas", "set", "demo"])?;
    wait_for_cache();
    seen.extend(up.sdk("idempotency")?);
    seen.extend(up.sdk("ttft")?);
    // `sluice bench serve` through the gateway over HTTPS (SSL_CERT_FILE from demo.env).
    let envs = up.envs()?;
    let result = up.dir.join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "serve", "--base-url", &envs["OPENAI_BASE_URL"], "--num-prompts", "4"])
        .args(["--request-rate", "8", "--input-len", "8", "--output-len", "3", "--save-result"])
        .arg(&result)
        .arg("--report")
        .arg(up.dir.join("bench.md"))
        .envs(&envs)
        .output()?;
    ensure!(out.status.success(), "bench serve: {}", String::from_utf8_lossy(&out.stderr));
    let bench: Value = serde_json::from_str(&std::fs::read_to_string(&result)?)?;
    ensure!(bench["completed"] == 4 && bench["failed"] == 0, "{bench}");
    // With admin.env's SLUICE_ADMIN_URL and auditor token, the gateway's own TTFT of the same
    // requests (by request id) stands beside the client's, which starts earlier (at the
    // scheduled send) and ends later (after the network).
    let g = &bench["gateway_ttft"];
    ensure!(g["matched"] == 4, "{g}");
    let bench_minus_gateway = g["client_minus_gateway_ms"]["median"].as_f64().unwrap_or(-1.0);
    ensure!(bench_minus_gateway >= 0.0, "{g}");
    let md = std::fs::read_to_string(up.dir.join("bench.md"))?;
    ensure!(md.contains("TTFT: client vs the gateway's record"), "{md}");
    seen.extend(up.sdk("disconnect")?);
    seen.extend(up.sdk("metrics")?);
    up.admin(&["admin", "quotas", "set", "demo", "--allowed-model", "some-other-model"])?;
    wait_for_cache();
    seen.extend(up.sdk("forbidden_model")?);
    up.admin(&["admin", "quotas", "set", "demo"])?;
    up.admin(&["admin", "tenants", "suspend", "demo"])?;
    wait_for_cache();
    seen.extend(up.sdk("suspended")?);
    up.admin(&["admin", "tenants", "activate", "demo"])?;
    let keys: Value = serde_json::from_str(&up.admin(&["admin", "keys", "list", "demo"])?)?;
    for k in keys["data"].as_array().context("keys")? {
        up.admin(&["admin", "keys", "revoke", "demo", k["id"].as_str().context("id")?])?;
    }
    wait_for_cache();
    seen.extend(up.sdk("revoked")?);

    // Ctrl-C: everything billed reaches the ledger, then the process exits cleanly.
    let mut up = up;
    let status = signal_and_wait(&mut up.child, "INT", Duration::from_secs(30))?;
    ensure!(status.success(), "sluice up exited with {status}");

    let db = format!("sqlite://{}", up.dir.join("ledger.db").display());
    let records =
        tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
            let ledger = Ledger::connect(&db).await?;
            let page = ledger.records(&RecordFilter { limit: 1000, ..Default::default() }).await?;
            ledger.close().await;
            anyhow::Ok(page.records)
        })?;
    let by_id: HashMap<&str, &serde_json::Map<String, Value>> =
        records.iter().filter_map(|r| Some((r["request_id"].as_str()?, r))).collect();
    ensure!(by_id.len() == records.len(), "a request id billed twice");
    let mut idempotent = 0;
    let mut sdk_minus_gateway = Vec::new();
    for s in &seen {
        let kind = s["kind"].as_str().unwrap_or("");
        let Some(id) = s["request_id"].as_str() else {
            // 401s are not tied to a tenant and are not billed; /metrics is not a request.
            ensure!(s["status"] == 401 || kind == "metrics", "{s}");
            continue;
        };
        if kind.starts_with("idempotent") {
            idempotent += 1;
        }
        let r = by_id.get(id).with_context(|| format!("{kind} {id} was not billed"))?;
        ensure!(r["http_status"] == s["status"], "{kind}: {r:?}");
        ensure!(
            r["tenant_id"] == "demo"
                && r["model_revision"].as_str().is_some_and(|m| m.starts_with("sha256:"))
                || s["status"] != 200,
            "{r:?}"
        );
        match s["status"].as_u64() {
            // The engine may have generated a token or two the client never read: billed by
            // the engine's count, never less than the client got.
            Some(200) if kind == "disconnect" => ensure!(
                r["completion_tokens"].as_u64() >= s["tokens"].as_u64(),
                "{kind}: billed {} received {}",
                r["completion_tokens"],
                s["tokens"]
            ),
            Some(200) => ensure!(
                r["completion_tokens"] == s["tokens"],
                "{kind}: billed {} received {}",
                r["completion_tokens"],
                s["tokens"]
            ),
            _ => ensure!(
                r["finish_reason"] == "rejected"
                    && r["completion_tokens"] == 0
                    && r["cost_micros"] == 0,
                "{kind}: a refused request, charged or with tokens: {r:?}"
            ),
        }
        if let Some(sdk) = s["sdk_ttft_ms"].as_f64() {
            // The same request timed by the SDK and recorded by the gateway: the client's
            // clock starts before the gateway's and stops after it.
            let gw = r["ttft_ms"].as_f64().context("no gateway TTFT")?;
            ensure!(sdk >= gw, "SDK TTFT {sdk} ms below the gateway's {gw} ms");
            sdk_minus_gateway.push(sdk - gw);
        }
        if kind == "disconnect" {
            ensure!(
                r["finish_reason"] == "client_disconnected" && r["client_disconnected"] == true,
                "{r:?}"
            );
        }
        if kind.ends_with("stream") {
            ensure!(r["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "streamed without TTFT: {r:?}");
        } else if s["status"] == 200 && kind != "disconnect" {
            ensure!(r["ttft_ms"].is_null(), "non-streamed request with a TTFT: {r:?}");
        }
    }
    sdk_minus_gateway.sort_by(f64::total_cmp);
    ensure!(sdk_minus_gateway.len() == 5, "{sdk_minus_gateway:?}");
    eprintln!(
        "TTFT, OpenAI SDK minus the gateway's record, same requests: median {:.2} ms, max {:.2} ms \
         (bench serve's client minus gateway: median {:.2} ms)",
        sdk_minus_gateway[2], sdk_minus_gateway[4], bench_minus_gateway
    );
    // Each idempotent pair (a request and its replayed retry) is one record.
    ensure!(idempotent == 2, "{idempotent} idempotent requests billed, expected 2");
    let idempotent_records =
        records.iter().filter(|r| r["idempotency_key"].as_str().is_some()).count();
    ensure!(idempotent_records == 2, "{idempotent_records} records with an idempotency key");
    let kinds: Vec<&str> = seen.iter().filter_map(|s| s["kind"].as_str()).collect();
    for k in [
        "chat",
        "chat_stream",
        "tools",
        "tools_stream",
        "completion_stream",
        "bad_key",
        "rate_limited",
        "prompt_too_long",
        "disconnect",
        "model_not_allowed",
        "suspended",
        "revoked",
        "idempotency_mismatch",
    ] {
        ensure!(kinds.contains(&k), "phase result {k} missing: {kinds:?}");
    }
    Ok(())
}

/// A request to the platform's gateway with the demo key: status and JSON body.
async fn call(
    c: &reqwest::Client,
    envs: &HashMap<String, String>,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<(u16, Value)> {
    let url = format!("{}{path}", envs["OPENAI_BASE_URL"]);
    let mut req = c.request(method, url).bearer_auth(&envs["OPENAI_API_KEY"]);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    Ok((status, resp.json().await?))
}

#[tokio::test]
async fn sluice_up_serves_several_models_each_by_its_name() -> anyhow::Result<()> {
    use reqwest::Method;
    ensure_sdk()?;
    let tmp = tempfile::tempdir()?;
    // The default model and Gemma 3 270M, named by their catalog names, an engine each; each
    // is served under its file's name.
    for name in ["smollm2-135m", "gemma3-270m"] {
        let path =
            Command::new(env!("CARGO_BIN_EXE_sluice")).args(["model", "path", name]).output()?;
        let path = String::from_utf8(path.stdout)?.trim().to_owned();
        ensure!(Path::new(&path).exists(), "{name} is not fetched: {path:?}");
    }
    let state = tmp.path().join("state");
    let args = [
        "--plain-http",
        "--kv-cache-mb",
        "64",
        "--model",
        "smollm2-135m",
        "--model",
        "gemma3-270m",
    ];
    let up = support::start_up_with(&state, &args)?;
    let envs = up.envs()?;
    // Pooled connections are dropped before the gateway's 30 s idle timeout would close them
    // under a request (the SDK scripts below keep this client idle for about that long).
    let c = reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(10)).build()?;

    let (status, list) = call(&c, &envs, Method::GET, "/models", None).await?;
    let ids: Vec<&str> =
        list["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    ensure!(status == 200 && ids == ["gemma-3-270m", "smollm2-135m-instruct"], "{list}");
    for m in list["data"].as_array().into_iter().flatten() {
        ensure!(m["sluice"]["engines"] == 1 && m["max_model_len"].as_u64() > Some(0), "{m}");
    }
    // Each model answers from its own engine; `default` is the policy's alias of SmolLM2.
    let mut revisions = HashMap::new();
    for (asked, id) in [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("gemma-3-270m", "gemma-3-270m"),
        ("default", "smollm2-135m-instruct"),
    ] {
        let body = serde_json::json!({"model": asked, "prompt": "Hello", "max_tokens": 3, "temperature": 0});
        let (status, v) = call(&c, &envs, Method::POST, "/completions", Some(body)).await?;
        ensure!(status == 200 && v["model"] == id, "{asked}: {v}");
        let identity = &v["sluice"]["execution_identity"];
        ensure!(identity["model_id"] == id, "{asked}: {v}");
        let rev = identity["model_revision"].as_str().context("revision")?.to_owned();
        ensure!(*revisions.entry(id).or_insert_with(|| rev.clone()) == rev, "{asked}: {v}");
        let (status, card) =
            call(&c, &envs, Method::GET, &format!("/models/{asked}"), None).await?;
        ensure!(
            status == 200 && card["id"] == id && card["sluice"]["model_revision"] == rev.as_str(),
            "{card}"
        );
    }
    ensure!(
        revisions.len() == 2 && revisions["gemma-3-270m"] != revisions["smollm2-135m-instruct"]
    );
    // The official SDK: both listed, Gemma completes (streamed and not) and refuses chat.
    let sdk = up.sdk("two_models")?;
    let kinds: Vec<&str> = sdk.iter().filter_map(|r| r["kind"].as_str()).collect();
    ensure!(kinds == ["gemma_completion", "gemma_completion_stream", "gemma_chat"], "{kinds:?}");
    // Structured outputs (20 pydantic schemas through `parse`) and a tool-calling round trip
    // over the gateway, as a tenant of their own (the ledger checks below count demo's rows).
    up.admin(&["admin", "tenants", "create", "sdk", "--tier", "standard"])?;
    let issued: Value = serde_json::from_str(&up.admin(&["admin", "keys", "issue", "sdk"])?)?;
    let key = issued["secret"].as_str().with_context(|| format!("no secret in {issued}"))?;
    for script in ["tests/sdk/test_structured.py", "tests/sdk/test_tools.py"] {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(script);
        let out = Command::new("python3")
            .arg(&path)
            .envs(&envs)
            .env("OPENAI_API_KEY", key)
            .env("SLUICE_SDK_MODEL", "smollm2-135m-instruct")
            .output()?;
        ensure!(
            out.status.success(),
            "{script} through the gateway:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{script}: {}", String::from_utf8_lossy(&out.stdout).trim());
    }
    let unknown = serde_json::json!({"model": "gpt-4o", "prompt": "Hello", "max_tokens": 1});
    let (status, v) = call(&c, &envs, Method::POST, "/completions", Some(unknown)).await?;
    ensure!(status == 404 && v["error"]["code"] == "model_not_found", "{v}");

    // A tenant allowed one model sees only it, and gets 403 on the other (the SDK phase).
    up.admin(&["admin", "quotas", "set", "demo", "--allowed-model", "gemma-3-270m"])?;
    wait_for_cache();
    let only = up.sdk("only_gemma")?;
    ensure!(only.len() == 1 && only[0]["kind"] == "model_not_allowed", "{only:?}");
    let body = serde_json::json!({"model": "default", "prompt": "Hello", "max_tokens": 1});
    let (status, v) = call(&c, &envs, Method::POST, "/completions", Some(body)).await?;
    ensure!(status == 403 && v["error"]["code"] == "model_not_allowed", "{v}");

    // Every row names the model the request ran on (or asked for), at that model's revision
    // and prices.
    let mut up = up;
    let status = signal_and_wait(&mut up.child, "INT", Duration::from_secs(30))?;
    ensure!(status.success(), "sluice up exited with {status}");
    let db = format!("sqlite://{}", up.dir.join("ledger.db").display());
    let ledger = Ledger::connect(&db).await?;
    let demo = RecordFilter { tenant: Some("demo".into()), limit: 100, ..Default::default() };
    let rows = ledger.records(&demo).await?.records;
    ledger.close().await;
    let count = |model: &str, status: u64| {
        rows.iter().filter(|r| r["model_id"] == model && r["http_status"] == status).count()
    };
    // SmolLM2: two completions. Gemma: one, the SDK's two, and the allowed tenant's one.
    ensure!(
        count("smollm2-135m-instruct", 200) == 2 && count("gemma-3-270m", 200) == 4,
        "{rows:?}"
    );
    ensure!(count("gemma-3-270m", 400) == 1, "the refused chat is recorded once: {rows:?}");
    ensure!(count("gpt-4o", 404) == 1 && count("default", 403) == 1, "{rows:?}");
    ensure!(count("smollm2-135m-instruct", 403) == 1, "the SDK's forbidden request: {rows:?}");
    for r in rows.iter().filter(|r| r["http_status"] == 200) {
        let model = r["model_id"].as_str().unwrap_or_default();
        ensure!(r["model_revision"] == revisions[model].as_str(), "{r:?}");
    }
    Ok(())
}
