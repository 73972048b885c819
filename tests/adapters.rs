//! Tenant adapters through a real `sluice engine` (issue 50): requests of two tenants on two
//! adapters and a third on the bare base, interleaved into the same batches (streamed and
//! not, with a KV cache small enough to force preemption), each answer the one it gets alone;
//! the adapter in the execution identity; prefix-cache blocks never shared across adapters;
//! unknown and malformed adapters refused.

#[path = "../engine/tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::{Value, json};
use sluice_engine::model::gguf_config;
use sluice_engine::quant::GgmlType;
use sluice_engine::server::adapters::put_in_store;
use sluice_engine::synth::SynthLora;
use sluice_text::gguf::GgufFile;

const PROMPTS: [&str; 3] = [
    "Write a short poem about the sea.",
    "List three uses of copper.",
    "Explain how a bicycle stays upright.",
];

/// Two synthetic adapters of the default model in a fresh store: their `tenant/name@rev`.
fn store_two(store: &Path, work: &Path) -> anyhow::Result<[String; 2]> {
    let base = gguf_config(&GgufFile::open(&common::default_model()?)?)?;
    let mut refs = Vec::new();
    for (seed, tenant) in [(21u64, "acme"), (22, "globex")] {
        let src = work.join(format!("src-{seed}"));
        SynthLora { b_std: 0.06, ..SynthLora::new(seed) }.write_peft(
            &base,
            GgmlType::BF16,
            &src,
        )?;
        let a = put_in_store(&src, &base, store)?;
        refs.push(format!("{tenant}/support@{}", a.revision));
    }
    Ok([refs[0].clone(), refs[1].clone()])
}

/// One chat request's text, streamed or not, with its body's (or last chunk's) `sluice`
/// extension and usage.
async fn ask(
    c: &reqwest::Client,
    url: &str,
    prompt: &str,
    headers: &[(&str, &str)],
    stream: bool,
) -> anyhow::Result<(String, Value, Value)> {
    let mut body = json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    });
    if stream {
        // Only a stream has options (a body's are refused, as OpenAI refuses them).
        body["stream_options"] = json!({"include_usage": true});
    }
    let mut req = c.post(format!("http://{url}/v1/chat/completions")).json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let text = resp.text().await?;
    ensure!(status == 200, "status {status}: {text}");
    if !stream {
        let v: Value = serde_json::from_str(&text)?;
        let out = v["choices"][0]["message"]["content"].as_str().context("content")?.to_string();
        return Ok((out, v["sluice"].clone(), v["usage"].clone()));
    }
    let (mut out, mut ext, mut usage) = (String::new(), Value::Null, Value::Null);
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let data = block.strip_prefix("data: ").with_context(|| format!("bad event {block:?}"))?;
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data)?;
        for ch in v["choices"].as_array().into_iter().flatten() {
            out.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if !ch["finish_reason"].is_null() {
                ext = v["sluice"].clone();
            }
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    Ok((out, ext, usage))
}

async fn metric(c: &reqwest::Client, url: &str, name: &str) -> anyhow::Result<f64> {
    let text = c.get(format!("http://{url}/metrics")).send().await?.text().await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

#[tokio::test]
async fn adapters_mixed_in_batches_answer_as_alone_and_never_share_a_prefix() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("store");
    let [a, b] = store_two(&store, dir.path())?;
    let model = common::default_model()?;
    let listen = format!("127.0.0.1:{}", support::free_port()?);
    let args = [
        "engine",
        "--model",
        model.to_str().context("path")?,
        "--listen",
        &listen,
        "--served-model-name",
        "smollm2-135m-instruct",
        // About 10 blocks of 16 tokens: six requests of ~60 tokens cannot all fit.
        "--kv-cache-mb",
        "4",
        "--threads",
        "1",
        "--adapter-store",
        store.to_str().context("path")?,
    ];
    let (_engine, url) = support::spawn_sluice_logged(&args, &[], &dir.path().join("engine.log"))?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    support::wait_healthy(&c, &format!("http://{url}/health")).await?;

    // (tenant, adapter) of each caller: two tenants on their adapters, a third on the base.
    let callers: [(&str, Option<&str>); 3] =
        [("acme", Some(a.as_str())), ("globex", Some(b.as_str())), ("initech", None)];
    let headers = |i: usize| -> Vec<(&str, &str)> {
        let (tenant, adapter) = callers[i];
        let mut h = vec![("x-sluice-tenant", tenant)];
        h.extend(adapter.map(|a| ("x-sluice-adapter", a)));
        h
    };

    // Each (caller, prompt, streamed) alone, one at a time.
    let mut alone = Vec::new();
    for i in 0..3 {
        for (p, stream) in [(0, false), (1, true)] {
            let (text, ext, _) = ask(&c, &url, PROMPTS[(i + p) % 3], &headers(i), stream).await?;
            // The execution identity names the adapter, exactly as the request did.
            let id = &ext["execution_identity"]["adapter"];
            ensure!(id.as_str() == callers[i].1, "caller {i}: identity adapter {id}");
            alone.push(((i, p, stream), text));
        }
    }
    // The adapters matter: one prompt under each adapter and the base gives three answers.
    let same: Vec<String> = {
        let mut v = Vec::new();
        for i in 0..3 {
            v.push(ask(&c, &url, PROMPTS[0], &headers(i), false).await?.0);
        }
        v
    };
    ensure!(same[0] != same[1] && same[0] != same[2] && same[1] != same[2], "{same:?}");

    // All together, twice over, so they share batches and the small cache forces preemption.
    let preempted = metric(&c, &url, "sluice_engine_num_preemptions_total").await?;
    let mut tasks = Vec::new();
    for _round in 0..2 {
        for ((i, p, stream), _) in &alone {
            let (c, url, h) = (
                c.clone(),
                url.clone(),
                headers(*i).iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>(),
            );
            let (i, p, stream) = (*i, *p, *stream);
            tasks.push(tokio::spawn(async move {
                let h: Vec<(&str, &str)> =
                    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                ask(&c, &url, PROMPTS[(i + p) % 3], &h, stream).await.map(|r| ((i, p, stream), r.0))
            }));
        }
    }
    for t in tasks {
        let (key, text) = t.await??;
        let want = alone.iter().find(|(k, _)| *k == key).map(|(_, t)| t).context("key")?;
        ensure!(&text == want, "{key:?} together: {text:?}\nalone: {want:?}");
    }
    let preempted = metric(&c, &url, "sluice_engine_num_preemptions_total").await? - preempted;
    ensure!(preempted > 0.0, "no request was preempted: the test did not force what it claims");
    // Each adapter was loaded once, however many requests used it, and both stay resident.
    ensure!(metric(&c, &url, "sluice_engine_adapter_loads_total").await? == 2.0, "loads");
    ensure!(metric(&c, &url, "sluice_engine_adapters_resident").await? == 2.0, "resident");
    // The per-tenant series name each caller's adapter (`tenant/name`), `~base` for none.
    for (tenant, adapter) in
        [("acme", "acme/support"), ("globex", "globex/support"), ("initech", "~base")]
    {
        let series = format!(
            "sluice_engine_tenant_generation_tokens_total{{tenant=\"{tenant}\",adapter=\"{adapter}\"}}"
        );
        ensure!(metric(&c, &url, &series).await? > 0.0, "no series {series}");
    }

    // One tenant's long prompt under adapter A, then again under A (cached), under the base
    // and under B: a prefix computed under one adapter serves nobody else.
    let long = PROMPTS.join(" ").repeat(2);
    fn acme(adapter: Option<&str>) -> Vec<(&'static str, &str)> {
        let mut h = vec![("x-sluice-tenant", "acme")];
        h.extend(adapter.map(|x| ("x-sluice-adapter", x)));
        h
    }
    let cached = |u: &Value| u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    ask(&c, &url, &long, &acme(Some(&a)), false).await?;
    let again = ask(&c, &url, &long, &acme(Some(&a)), false).await?.2;
    ensure!(cached(&again) >= 32, "the same adapter's prefix was not reused: {again}");
    for other in [None, Some(b.as_str())] {
        let u = ask(&c, &url, &long, &acme(other), false).await?.2;
        ensure!(cached(&u) == 0, "adapter {other:?} got adapter A's cached prefix: {u}");
    }

    // Refusals: a revision the store lacks is a 404 as an unknown model is; a malformed
    // header a 400 naming it.
    let unknown = format!("acme/support@sha256:{}", "0".repeat(64));
    for (value, status, check) in
        [(unknown.as_str(), 404, "model_not_found"), ("acme/support", 400, "x-sluice-adapter")]
    {
        let resp = c
            .post(format!("http://{url}/v1/chat/completions"))
            .header("x-sluice-tenant", "acme")
            .header("x-sluice-adapter", value)
            .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            .send()
            .await?;
        let code = resp.status().as_u16();
        let v: Value = resp.json().await?;
        ensure!(code == status && v.to_string().contains(check), "{value}: {code} {v}");
    }
    Ok(())
}

/// A chat request through the gateway as `key`: (status, body, execution-identity header),
/// the body's `id` replaced by the request id the ledger keys the row by.
async fn via_gateway(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    model: &str,
) -> anyhow::Result<(u16, Value, String)> {
    let resp = c
        .post(format!("{base}/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4, "temperature": 0}))
        .send()
        .await?;
    let status = resp.status().as_u16();
    let identity = resp
        .headers()
        .get("x-sluice-execution-identity")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let request_id =
        resp.headers().get("x-sluice-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut body: Value = resp.json().await?;
    body["id"] = json!(request_id);
    Ok((status, body, identity))
}

async fn model_ids(c: &reqwest::Client, base: &str, key: &str) -> anyhow::Result<Vec<String>> {
    let v: Value = c.get(format!("{base}/models")).bearer_auth(key).send().await?.json().await?;
    Ok(v["data"]
        .as_array()
        .context("data")?
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect())
}

/// Registration through `sluice admin adapters` against `sluice up`, and the gateway's
/// authorization: the owner's requests run on the adapter (the ledger row names it), another
/// tenant's get a 404 as for a model that does not exist until it is shared, a retired
/// adapter and an unknown pinned revision are 404s, an adapter of another base model is
/// refused at registration naming the mismatch; every refusal is recorded and free.
#[tokio::test]
async fn the_gateway_authorizes_adapters_per_tenant_and_the_ledger_names_them() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let up = support::start_up_with(dir.path(), &["--kv-cache-mb", "128", "--plain-http"])?;
    let env = up.envs()?;
    let base = env.get("OPENAI_BASE_URL").context("OPENAI_BASE_URL")?.clone();
    let ledger = sluice_billing::Ledger::connect(&format!(
        "sqlite://{}",
        up.dir.join("ledger.db").display()
    ))
    .await?;
    let keys = support::tenants_with_keys(&ledger, &["acme", "globex"], None).await?;
    let model = common::default_model()?;
    let config = gguf_config(&GgufFile::open(&model)?)?;
    let src = dir.path().join("support-lora");
    SynthLora { b_std: 0.06, ..SynthLora::new(31) }.write_peft(&config, GgmlType::F32, &src)?;
    let admin = |args: &[&str]| -> anyhow::Result<std::process::Output> {
        Ok(std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .envs(&env)
            .output()?)
    };
    let model_arg = model.to_str().context("path")?;
    let out = admin(&[
        "admin",
        "adapters",
        "register",
        "acme",
        "support",
        "--path",
        src.to_str().context("path")?,
        "--model",
        model_arg,
    ])?;
    ensure!(out.status.success(), "register: {}", String::from_utf8_lossy(&out.stderr));
    let registered: Value = serde_json::from_slice(&out.stdout)?;
    let revision = registered["revision"].as_str().context("revision")?.to_owned();
    let id = format!("acme/support@{revision}");

    // An adapter of another shape is refused before anything is stored or registered.
    let tiny = dir.path().join("tiny-lora");
    let tiny_config = sluice_engine::synth::SynthSpec::tiny().config();
    SynthLora::new(1).write_peft(&tiny_config, GgmlType::F32, &tiny)?;
    let out = admin(&[
        "admin",
        "adapters",
        "register",
        "acme",
        "tiny",
        "--path",
        tiny.to_str().context("path")?,
        "--model",
        model_arg,
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("lora_A must be [8, 576]"), "{err}");

    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    let (acme, globex) = (keys["acme"].as_str(), keys["globex"].as_str());
    let mut ran = Vec::new();
    let mut refused = Vec::new();
    for m in ["acme/support", id.as_str()] {
        let (status, body, identity) = via_gateway(&c, &base, acme, m).await?;
        ensure!(status == 200, "acme {m}: {status} {body}");
        ensure!(identity.contains(&format!("adapter={id}")), "identity header {identity}");
        ran.push(body["id"].as_str().context("id")?.to_owned());
    }
    let (status, body, identity) = via_gateway(&c, &base, acme, "smollm2-135m-instruct").await?;
    ensure!(status == 200 && identity.contains("adapter=none"), "{status} {identity}");
    let bare = body["id"].as_str().context("id")?.to_owned();
    let zeros = format!("acme/support@sha256:{}", "0".repeat(64));
    for (key, m) in [(globex, "acme/support"), (acme, zeros.as_str()), (globex, "acme/nothing")] {
        let (status, body, _) = via_gateway(&c, &base, key, m).await?;
        ensure!(
            status == 404 && body["error"]["code"] == "model_not_found",
            "{m}: {status} {body}"
        );
        refused.push(body["id"].as_str().context("request id of a refusal")?.to_owned());
    }
    ensure!(model_ids(&c, &base, acme).await?.contains(&"acme/support".to_owned()));
    ensure!(!model_ids(&c, &base, globex).await?.contains(&"acme/support".to_owned()));
    // The adapter's own card, by name or pinned, for its tenant; a 404 for anyone else.
    for m in ["acme/support", id.as_str()] {
        let r = c.get(format!("{base}/models/{m}")).bearer_auth(acme).send().await?;
        let (status, card): (u16, Value) = (r.status().as_u16(), r.json().await?);
        ensure!(
            status == 200
                && card["id"] == "acme/support"
                && card["parent"] == "smollm2-135m-instruct"
                && card["sluice"]["adapter"] == id.as_str(),
            "{m}: {status} {card}"
        );
    }
    let r = c.get(format!("{base}/models/acme/support")).bearer_auth(globex).send().await?;
    let (status, v): (u16, Value) = (r.status().as_u16(), r.json().await?);
    ensure!(status == 404 && v["error"]["code"] == "model_not_found", "{status} {v}");

    // Shared with globex: it may use it (once the gateway's cache of the refusal expires).
    let out = admin(&["admin", "adapters", "share", "acme", "support", "--with", "globex"])?;
    ensure!(out.status.success(), "share: {}", String::from_utf8_lossy(&out.stderr));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (status, body, _) = via_gateway(&c, &base, globex, "acme/support").await?;
    ensure!(status == 200, "shared: {status} {body}");
    ran.push(body["id"].as_str().context("id")?.to_owned());
    ensure!(model_ids(&c, &base, globex).await?.contains(&"acme/support".to_owned()));

    // Retired: refused for everyone, as if it never existed.
    let out = admin(&["admin", "adapters", "retire", "acme", "support"])?;
    ensure!(out.status.success(), "retire: {}", String::from_utf8_lossy(&out.stderr));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for key in [acme, globex] {
        let (status, body, _) = via_gateway(&c, &base, key, "acme/support").await?;
        ensure!(status == 404 && body["error"]["code"] == "model_not_found", "{status} {body}");
        refused.push(body["id"].as_str().context("request id of a refusal")?.to_owned());
    }
    ensure!(!model_ids(&c, &base, acme).await?.contains(&"acme/support".to_owned()));

    // The ledger as an auditor reads it, per request id.
    let ids: Vec<&str> = ran.iter().chain([&bare]).chain(&refused).map(String::as_str).collect();
    let rows = support::rows_for(&ledger, &ids, Duration::from_secs(20)).await?;
    for r in &ran {
        let row = &rows[r][0];
        ensure!(
            row["adapter"] == id.as_str() && row["model_id"] == "smollm2-135m-instruct",
            "{row:?}"
        );
        ensure!(row["cost_micros"].as_i64().is_some_and(|c| c > 0), "{row:?}");
    }
    ensure!(rows[&bare][0]["adapter"].is_null(), "{:?}", rows[&bare][0]);
    // Priced by the list in force: the model's rates, plus its adapter surcharge under one
    // (the row carries the sums, so its cost is recomputed from the row alone).
    let prices = &*sluice_policies::prices::PRICES;
    for (id, adapter) in ran.iter().map(|r| (r, true)).chain([(&bare, false)]) {
        let row = &rows[id][0];
        let want = prices.rates_under("smollm2-135m-instruct", "standard", adapter);
        let got = (&row["price_input_micros"], &row["price_output_micros"]);
        ensure!(got.0 == want.input && got.1 == want.output, "{id}: {got:?} want {want:?}");
    }
    let plain = prices.rates("smollm2-135m-instruct", "standard");
    ensure!(
        prices.rates_under("smollm2-135m-instruct", "standard", true).output > plain.output,
        "the shipped list has no adapter surcharge to test"
    );
    // An auditor's filter: one revision exactly, or every revision of the name; the owner's
    // two requests and globex's one under the share, nothing else (not the bare request, not
    // the refusals, which name no adapter).
    for filter in [id.as_str(), "acme/support"] {
        let f = sluice_billing::query::RecordFilter {
            adapter: Some(filter.into()),
            limit: 100,
            ..Default::default()
        };
        let found = ledger.records(&f).await?.records;
        let tenants: Vec<&str> = found.iter().filter_map(|r| r["tenant_id"].as_str()).collect();
        ensure!(
            found.len() == 3 && found.iter().all(|r| r["adapter"] == id.as_str()),
            "{filter}: {found:?}"
        );
        ensure!(tenants.iter().filter(|t| **t == "globex").count() == 1, "{filter}: {tenants:?}");
    }
    let none = sluice_billing::query::RecordFilter {
        adapter: Some("acme/suppor".into()),
        limit: 100,
        ..Default::default()
    };
    ensure!(ledger.records(&none).await?.records.is_empty(), "a name's prefix matched");
    for id in &refused {
        let r = &rows[id][0];
        ensure!(r["http_status"] == 404 && r["cost_micros"] == 0, "{r:?}");
        ensure!(r["finish_reason"] == "rejected", "{r:?}");
        ensure!(r["model_id"].as_str().is_some_and(|m| m.starts_with("acme/")), "{r:?}");
    }
    let log = ledger
        .audit_log(&sluice_billing::query::AuditFilter { limit: 100, ..Default::default() })
        .await?;
    let actions: Vec<&str> = log.iter().map(|e| e.action.as_str()).collect();
    for a in ["adapter.register", "adapter.share", "adapter.retire"] {
        ensure!(actions.contains(&a), "no {a} in the audit log: {actions:?}");
    }
    Ok(())
}
