//! The billing dashboard page (`GET /dashboard`) in headless Chromium against a real `sluice
//! billing` process. Usage goes through the real pipeline (Redis stream -> billing consumer ->
//! Postgres); the test reads what the page rendered from Chromium's `--dump-dom`.
//!
//! The server's consumer ingests the shared default stream, so other processes' events may land
//! in this test's scratch database too. Assertions are therefore about this test's own tenants
//! (unique ids), and the page's totals are compared with the data API's own answer.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use sluice_billing::UsageEvent;
use support::{ScratchDatabase, random_hex};

mod support;

const REDIS_URL: &str = "redis://127.0.0.1:6379";
/// A running `sluice billing`; killed when dropped, also when a test fails.
struct Server {
    child: Child,
    url: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(database_url: &str, secret: &str, stream: &str) -> anyhow::Result<Server> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["billing", "--database-url", database_url, "--redis-url", REDIS_URL])
            .args(["--usage-stream", stream, "--consumer-group", "billing-dashboard-test"])
            .args(["--listen", "127.0.0.1:0"])
            .env("SLUICE_JWT_SECRET", secret)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting sluice billing")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let stderr = collect(child.stderr.take().context("no stderr")?);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server { child, url: String::new(), stderr };
        // The line comes once migrations ran and the port is bound.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).map_err(|_| {
                anyhow::anyhow!("sluice billing printed no listening line: {}", server.log())
            })?;
            if let Some(url) = line.strip_prefix("listening on ") {
                server.url = url.trim().to_owned();
                break;
            }
        }
        ensure!(server.url.starts_with("http://127.0.0.1:"), "listening on {}", server.url);
        Ok(server)
    }

    fn log(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// Reads a pipe to its end on a thread of its own, so the child never blocks on a full pipe.
fn collect(mut pipe: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&text);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            if let Ok(mut s) = sink.lock() {
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
    });
    text
}

/// `sluice admin token`: a JWT signed with `secret`.
fn mint(secret: &str, role: &str) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["admin", "token", "--role", role, "--sub", "dash-test", "--ttl", "600"])
        .env("SLUICE_JWT_SECRET", secret)
        .output()?;
    ensure!(out.status.success(), "sluice admin token: {}", String::from_utf8_lossy(&out.stderr));
    let token = String::from_utf8(out.stdout)?.trim().to_owned();
    ensure!(token.split('.').count() == 3, "not a JWT: {token:?}");
    Ok(token)
}

/// RFC 3339 in UTC with milliseconds (days to civil date: H. Hinnant's algorithm). The root
/// crate does not depend on chrono, and this is all the test needs of it.
fn rfc3339_ms(unix_ms: i64) -> String {
    let (secs, ms) = (unix_ms.div_euclid(1000), unix_ms.rem_euclid(1000));
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (sod / 3600, sod % 3600 / 60, sod % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

/// Whole seconds, as the page forwards them unchanged.
fn rfc3339_s(unix_s: i64) -> String {
    rfc3339_ms(unix_s * 1000).replace(".000Z", "Z")
}

// ---------- the usage this test ingests ----------

/// One event's varying fields: tenant, model, finish reason, tokens, cost, TTFT, TPOT.
struct Spec {
    tenant: usize,
    model: &'static str,
    finish: &'static str,
    prompt: u32,
    cached: u32,
    completion: u32,
    cost: u64,
    ttft: Option<f64>,
    tpot: Option<f64>,
}

const MODEL_A: &str = "smollm2-135m-instruct";
const MODEL_B: &str = "llama-3.2-1b-instruct";

/// Latencies avoid values a display rounding could tie on (see `ms`).
fn specs() -> Vec<Spec> {
    let s = |tenant, model, finish, prompt, cached, completion, cost, ttft, tpot| Spec {
        tenant,
        model,
        finish,
        prompt,
        cached,
        completion,
        cost,
        ttft,
        tpot,
    };
    vec![
        // Tenant 0: busy, both models, mostly `stop`.
        s(0, MODEL_A, "stop", 120, 20, 40, 1_234, Some(101.0), Some(12.5)),
        s(0, MODEL_A, "stop", 300, 0, 80, 5_678, Some(87.5), Some(14.0)),
        s(0, MODEL_A, "length", 50, 50, 256, 9_001, Some(142.0), Some(11.5)),
        s(0, MODEL_B, "stop", 800, 400, 120, 45_000, Some(230.0), Some(35.5)),
        s(0, MODEL_B, "stop", 640, 0, 64, 38_500, Some(199.0), Some(31.0)),
        s(0, MODEL_A, "error", 90, 0, 3, 0, Some(95.0), Some(8.25)),
        s(0, MODEL_A, "stop", 210, 100, 70, 2_222, Some(120.0), Some(13.0)),
        s(0, MODEL_B, "client_disconnected", 400, 200, 10, 12_345, Some(310.0), Some(40.5)),
        s(0, MODEL_A, "stop", 75, 0, 1, 777, Some(64.0), None),
        s(0, MODEL_A, "stop", 180, 60, 90, 3_333, Some(110.5), Some(12.0)),
        // Tenant 1: smaller, `length` and `timeout` appear.
        s(1, MODEL_B, "stop", 1_000, 500, 300, 99_999, Some(450.0), Some(42.0)),
        s(1, MODEL_B, "length", 1_200, 0, 512, 150_000, Some(520.0), Some(44.5)),
        s(1, MODEL_A, "stop", 60, 0, 30, 600, Some(55.0), Some(9.75)),
        // A 504 the client got: refused, so the gateway priced it at 0.
        s(1, MODEL_B, "timeout", 700, 350, 20, 0, Some(900.0), Some(66.0)),
        s(1, MODEL_A, "stop", 45, 45, 15, 321, Some(48.5), Some(10.5)),
        s(1, MODEL_B, "stop", 900, 100, 200, 80_001, Some(480.0), Some(43.0)),
        // Tenant 2: only rejections at admission: no tokens out, no latency samples.
        s(2, MODEL_A, "rejected", 0, 0, 0, 0, None, None),
        s(2, MODEL_B, "rejected", 0, 0, 0, 0, None, None),
        s(2, MODEL_A, "rejected", 0, 0, 0, 0, None, None),
    ]
}

fn usage_event(
    spec: &Spec,
    tenant: &str,
    request_id: &str,
    arrival_ms: i64,
) -> anyhow::Result<UsageEvent> {
    let rejected = spec.finish == "rejected";
    let (http_status, error_type) = match spec.finish {
        "rejected" => (429, Some("rate_limited")),
        "error" => (500, Some("engine_failure")),
        "timeout" => (504, Some("timeout")),
        _ => (200, None),
    };
    let engine = |v: &'static str| (!rejected).then_some(v);
    let first = spec.ttft.map(|t| arrival_ms + t as i64);
    let last = first.map(|f| f + 40 * i64::from(spec.completion));
    let event = json!({
        "request_id": request_id,
        "idempotency_key": null,
        "tenant_id": tenant,
        "key_id": format!("key-{tenant}"),
        "model_id": spec.model,
        "model_revision": "sha256:aaaa",
        "tokenizer_revision": "sha256:bbbb",
        "chat_template_version": "sha256:cccc",
        "adapter": null,
        "engine_version": engine("0.1.0"),
        "engine_worker": engine("worker-0"),
        "prompt_tokens": spec.prompt,
        "cached_prompt_tokens": spec.cached,
        "completion_tokens": spec.completion,
        "finish_reason": spec.finish,
        "http_status": http_status,
        "error_type": error_type,
        "client_disconnected": spec.finish == "client_disconnected",
        "arrival_at": rfc3339_ms(arrival_ms),
        "first_token_at": first.map(rfc3339_ms),
        "last_token_at": last.map(rfc3339_ms),
        "ttft_ms": spec.ttft,
        "tpot_ms": spec.tpot,
        "itl_max_ms": spec.tpot.map(|t| t * 2.0),
        "itl_p99_ms": spec.tpot.map(|t| t * 1.5),
        "e2e_ms": last.map(|l| (l - arrival_ms) as f64),
        "engine_queue_ms": (!rejected).then_some(2.0),
        "engine_prefill_ms": spec.ttft.map(|t| t / 2.0),
        "engine_decode_ms": spec.tpot.map(|t| t * f64::from(spec.completion)),
        "trace_id": null,
        "prompt_sha256": "cd".repeat(32),
        "prompt_chars": spec.prompt * 4,
        "cost_micros": spec.cost,
        "price_list_version": "test-1",
        "price_input_micros": 0,
        "price_cached_input_micros": 0,
        "price_output_micros": 0,
    });
    let event: UsageEvent = serde_json::from_value(event)?;
    event.validate()?;
    Ok(event)
}

/// What one tenant's rows must show.
#[derive(Debug, Default)]
struct Expected {
    /// Billed requests (the token and cost sums are theirs).
    requests: u64,
    /// Refused requests (an error status: counted apart, nothing billed).
    refused: u64,
    /// Every record.
    records: u64,
    prompt: u64,
    cached: u64,
    completion: u64,
    cost: u64,
    finish: BTreeMap<String, u64>,
    /// Records that ended normally within the tier's targets.
    good: u64,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    /// Records the engine timed, those good by its figures, and its figures.
    engine_records: u64,
    engine_good: u64,
    engine_ttft: Vec<f64>,
    engine_tpot: Vec<f64>,
    engine_queue: Vec<f64>,
    /// The misses by why, under the API's names.
    misses: BTreeMap<String, u64>,
}

/// Nearest rank: the value at index `ceil(p/100 * n) - 1` of the sorted sample.
fn percentile(sorted: &[f64], p: u64) -> Option<f64> {
    let n = sorted.len() as u64;
    let rank = (p * n).div_ceil(100).max(1);
    sorted.get(usize::try_from(rank).ok()? - 1).copied()
}

// ---------- what the page shows, formatted as the page formats it ----------

fn int(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn usd_fixed(micros: u64, decimals: u32) -> String {
    let unit = 10u64.pow(6 - decimals);
    let q = micros / unit + u64::from(2 * (micros % unit) >= unit);
    let scale = 10u64.pow(decimals);
    let frac = if decimals == 0 {
        String::new()
    } else {
        format!(".{:0w$}", q % scale, w = decimals as usize)
    };
    format!("${}{frac}", int(q / scale))
}

fn usd(micros: u64) -> String {
    if micros >= 1_000_000 {
        return usd_fixed(micros, 2);
    }
    let s = usd_fixed(micros, 6);
    let (whole, frac) = s.split_once('.').unwrap_or((&s, "00"));
    let kept = frac.trim_end_matches('0');
    format!("{whole}.{kept:0<2}")
}

fn usd_decimals(max_micros: u64) -> u32 {
    match max_micros {
        100_000_000.. => 2,
        1_000_000.. => 4,
        _ => 6,
    }
}

/// Milliseconds as the page shows them; samples are chosen so no rounding tie occurs.
fn ms(v: Option<f64>) -> String {
    match v {
        None => "–".to_owned(),
        Some(v) if v < 10.0 => format!("{v:.2}"),
        Some(v) if v < 100.0 => format!("{v:.1}"),
        Some(v) => int(v.round() as u64),
    }
}

// ---------- reading the dumped DOM ----------

/// From the tag containing `marker` to the first `end` after it.
fn section<'a>(dom: &'a str, marker: &str, end: &str) -> anyhow::Result<&'a str> {
    let at = dom.find(marker).with_context(|| format!("{marker} not in the page"))?;
    let start = dom[..at].rfind('<').unwrap_or(at);
    let len = dom[at..].find(end).with_context(|| format!("no {end} after {marker}"))?;
    Ok(&dom[start..at + len + end.len()])
}

/// The opening tag at the start of `fragment`.
fn opening_tag(fragment: &str) -> &str {
    fragment.find('>').map_or(fragment, |i| &fragment[..=i])
}

fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = tag.find(&key)? + key.len();
    tag[at..].find('"').map(|end| &tag[at..at + end])
}

/// Text content: tags removed, the entities Chromium writes in text decoded.
fn text(fragment: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in fragment.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&lt;", "<").replace("&gt;", ">").replace("&nbsp;", "\u{a0}").replace("&amp;", "&")
}

/// A table cell by its `data-col`: (`data-value`, text).
fn cell(row: &str, col: &str) -> anyhow::Result<(String, String)> {
    let td = section(row, &format!("data-col=\"{col}\""), "</td>")?;
    let value = attribute(opening_tag(td), "data-value").context("cell without data-value")?;
    Ok((value.to_owned(), text(td)))
}

fn tile(dom: &str, id: &str) -> anyhow::Result<(String, String)> {
    let tile = section(dom, &format!("data-testid=\"{id}\""), "</div></div>")?;
    let value = attribute(opening_tag(tile), "data-value").context("tile without data-value")?;
    Ok((value.to_owned(), text(section(tile, "class=\"tile-value\"", "</div>")?)))
}

fn body_state(dom: &str) -> Option<&str> {
    attribute(opening_tag(&dom[dom.find("<body")?..]), "data-state")
}

fn is_hidden(dom: &str, testid: &str) -> anyhow::Result<bool> {
    let at = dom.find(&format!("data-testid=\"{testid}\"")).context(testid.to_owned())?;
    let start = dom[..at].rfind('<').unwrap_or(at);
    Ok(opening_tag(&dom[start..]).contains(" hidden"))
}

// ---------- Chromium ----------

fn chromium_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!("this test needs headless Chromium: apt-get install -y chromium")
}

/// Loads `url` in a fresh headless Chromium profile and returns the DOM once the page's own
/// work is done (virtual time lets the fetch and rendering finish without a wall-clock wait).
fn dump_dom(browser: &Path, url: &str) -> anyhow::Result<String> {
    let profile = tempfile::tempdir()?;
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--window-size=1400,1800", "--virtual-time-budget=15000", "--dump-dom", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", browser.display()))?;
    let stderr = collect(child.stderr.take().context("no stderr")?);
    let mut stdout = child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut dom = String::new();
        let read = stdout.read_to_string(&mut dom).map(|_| dom);
        let _ = tx.send(read);
    });
    let dom = match rx.recv_timeout(Duration::from_secs(90)) {
        Ok(dom) => dom?,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "chromium did not finish in 90 s: {}",
                stderr.lock().map(|s| s.clone()).unwrap_or_default()
            );
        }
    };
    let status = child.wait()?;
    ensure!(
        status.success() && dom.contains("<body"),
        "chromium exited with {status}: {}",
        stderr.lock().map(|s| s.clone()).unwrap_or_default()
    );
    Ok(dom)
}

// ---------- the data API ----------

async fn get_json(c: &reqwest::Client, url: &str, token: &str) -> anyhow::Result<(u16, Value)> {
    let resp = c.get(url).bearer_auth(token).send().await?;
    let status = resp.status().as_u16();
    let body = resp.text().await?;
    let value =
        serde_json::from_str(&body).with_context(|| format!("{status}: not JSON: {body:?}"))?;
    Ok((status, value))
}

fn row_of<'a>(rows: &'a Value, tenant: &str) -> Option<&'a Value> {
    rows.as_array()?.iter().find(|r| r["tenant_id"] == tenant)
}

fn uint(v: &Value) -> anyhow::Result<u64> {
    v.as_u64().with_context(|| format!("{v} is not an unsigned integer"))
}

/// The page's tiles: sums over `series`.
fn series_totals(data: &Value) -> anyhow::Result<[u64; 5]> {
    let mut t = [0u64; 5];
    for row in data["series"].as_array().context("series")? {
        let fields = [
            "requests",
            "prompt_tokens",
            "completion_tokens",
            "cached_prompt_tokens",
            "cost_micros",
        ];
        for (sum, field) in t.iter_mut().zip(fields) {
            *sum += uint(&row[field])?;
        }
    }
    Ok(t)
}

fn escape_text(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_usage_ingested_through_the_pipeline() -> anyhow::Result<()> {
    // Checked against `date -u -d @SECONDS`.
    ensure!(rfc3339_ms(1_796_033_730_123) == "2026-11-30T10:15:30.123Z", "date formatting");
    ensure!(rfc3339_s(1_709_164_800) == "2024-02-29T00:00:00Z", "leap day formatting");
    let browser = chromium_binary()?;
    let db = tokio::task::block_in_place(|| ScratchDatabase::create("dashboard"))?;
    let secret = random_hex(32)?;
    // A stream of its own: no other process's events land in this test's database.
    let stream = format!("{{dashboard-test-{}}}:usage", random_hex(6)?);
    let server = Server::start(&db.url, &secret, &stream)?;
    let billing = mint(&secret, "billing")?;
    let auditor = mint(&secret, "auditor")?;
    let forged = mint(&random_hex(32)?, "billing")?;

    // Publish to the stream gateways use; the server's consumer moves it into Postgres.
    let tag = random_hex(4)?;
    let tenants: Vec<String> = ["a", "b", "c"].iter().map(|s| format!("dash-{tag}-{s}")).collect();
    let now_ms = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis())?;
    let mut expected: Vec<Expected> = tenants.iter().map(|_| Expected::default()).collect();
    // Two of the tenants exist, with tiers whose targets judge their attainment; the third
    // exists only in the usage rows and is judged by nothing.
    let tiers = [Some("enterprise"), Some("standard"), None];
    let ops = mint(&secret, "ops")?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    for (tenant, tier) in tenants.iter().zip(tiers) {
        let Some(tier) = tier else { continue };
        let r = c
            .post(format!("{}/v1/tenants", server.url))
            .bearer_auth(&ops)
            .json(&json!({"id": tenant, "tier": tier}))
            .send()
            .await?;
        ensure!(r.status().is_success(), "creating {tenant}: {}", r.text().await?);
    }
    let redis = redis::Client::open(REDIS_URL)?;
    let mut conn = redis.get_multiplexed_async_connection().await?;
    for (i, spec) in specs().iter().enumerate() {
        // Spread over the last two days, so the 7-day window has several day buckets.
        let arrival = now_ms - 60_000 - i64::try_from(i)? * 9_000_000;
        let event = usage_event(spec, &tenants[spec.tenant], &format!("dash-{tag}-{i}"), arrival)?;
        let _id = sluice_billing::ingest::publish_to(&mut conn, &stream, &event).await?;
        let e = &mut expected[spec.tenant];
        e.records += 1;
        if sluice_policies::prices::is_refused(event.http_status) {
            e.refused += 1;
        } else {
            e.requests += 1;
            e.prompt += u64::from(spec.prompt);
            e.cached += u64::from(spec.cached);
            e.completion += u64::from(spec.completion);
            e.cost += spec.cost;
        }
        *e.finish.entry(spec.finish.to_owned()).or_default() += 1;
        // The engine's own timing, as `usage_event` writes it: a 2 ms queue, half the TTFT
        // in prefill, the TPOT times the tokens in decode (over the tokens after the first).
        let reached = spec.finish != "rejected";
        let engine_ttft = spec.ttft.filter(|_| reached).map(|t| 2.0 + t / 2.0);
        let engine_tpot = (reached && spec.completion > 1)
            .then(|| spec.tpot.map(|t| t * f64::from(spec.completion)))
            .flatten()
            .map(|d| d / f64::from(spec.completion - 1));
        // Good: ended normally within the tier's targets (a missing figure is not judged).
        if let Some(tier) = tiers[spec.tenant] {
            let ttft_target = sluice_billing::control::tier_ttft_ms(tier).map(f64::from);
            let tpot_target = sluice_billing::control::tier_tpot_ms(tier).map(f64::from);
            let within = |v: Option<f64>, t: Option<f64>| v.zip(t).is_none_or(|(v, t)| v <= t);
            let normal = ["stop", "length", "tool_calls", "content_filter"].contains(&spec.finish);
            let good = normal && within(spec.ttft, ttft_target) && within(spec.tpot, tpot_target);
            e.good += u64::from(good);
            if engine_ttft.is_some() {
                let by_engine =
                    normal && within(engine_ttft, ttft_target) && within(engine_tpot, tpot_target);
                e.engine_good += u64::from(by_engine);
            }
            // Why a miss missed: refused, failed, then the largest part of its TTFT (the 2 ms
            // queue never is: prefill is half of it), then its TPOT.
            let why = if good {
                None
            } else if !reached {
                Some("refused")
            } else if !normal {
                Some("failed")
            } else if !within(spec.ttft, ttft_target) {
                Some("prefill")
            } else {
                Some("tpot")
            };
            if let Some(why) = why {
                *e.misses.entry(why.to_owned()).or_default() += 1;
            }
        }
        e.ttft.extend(spec.ttft);
        e.tpot.extend(spec.tpot);
        if engine_ttft.is_some() {
            e.engine_records += 1;
            e.engine_queue.push(2.0);
        }
        e.engine_ttft.extend(engine_ttft);
        e.engine_tpot.extend(engine_tpot);
    }
    for e in &mut expected {
        for v in [&mut e.ttft, &mut e.tpot, &mut e.engine_ttft, &mut e.engine_tpot] {
            v.sort_by(f64::total_cmp);
        }
    }

    let since = rfc3339_s(now_ms / 1000 - 7 * 86_400);
    let until = rfc3339_s(now_ms / 1000 + 1);
    let window = format!("since={since}&until={until}");
    let data_url = format!("{}/v1/dashboard/data?{window}", server.url);

    // Wait until the consumer committed all of them (polling bounds the rate, it is no sync).
    let deadline = Instant::now() + Duration::from_secs(60);
    let data = loop {
        let (status, data) = get_json(&c, &data_url, &billing).await?;
        ensure!(status == 200, "{status}: {data}\n{}", server.log());
        let ingested = tenants.iter().zip(&expected).all(|(t, e)| {
            row_of(&data["top_tenants"], t)
                .is_some_and(|r| r["requests"] == e.requests && r["refused_requests"] == e.refused)
        });
        if ingested {
            break data;
        }
        ensure!(Instant::now() < deadline, "events not ingested in 60 s: {data}\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _deleted: usize =
        redis::AsyncCommands::del(&mut conn, &[stream.clone(), format!("{stream}:dead")]).await?;

    // The API's answer for this test's tenants.
    for ((tenant, e), tier) in tenants.iter().zip(&expected).zip(tiers) {
        let top = row_of(&data["top_tenants"], tenant).context("top_tenants row")?;
        let got = [
            "requests",
            "prompt_tokens",
            "cached_prompt_tokens",
            "completion_tokens",
            "cost_micros",
        ]
        .map(|k| uint(&top[k]).unwrap_or(u64::MAX));
        ensure!(got == [e.requests, e.prompt, e.cached, e.completion, e.cost], "{tenant}: {top}");
        let latency = row_of(&data["latency"], tenant).context("latency row")?;
        ensure!(latency["requests"] == e.records, "{tenant}: {latency}");
        let attainment = latency["attainment"].as_f64();
        let want = tier.map(|_| e.good as f64 / e.records as f64);
        ensure!(attainment == want, "{tenant}: attainment {attainment:?} != {want:?}: {latency}");
        let samples = [
            ("ttft_ms", &e.ttft),
            ("tpot_ms", &e.tpot),
            ("engine_ttft_ms", &e.engine_ttft),
            ("engine_tpot_ms", &e.engine_tpot),
            ("engine_queue_ms", &e.engine_queue),
        ];
        for (metric, samples) in samples {
            for p in [50, 90, 99] {
                let want = percentile(samples, p);
                let got = latency[metric][format!("p{p}")].as_f64();
                ensure!(got == want, "{tenant} {metric} p{p}: {got:?} != {want:?}: {latency}");
            }
        }
        // The engine's side: its attainment over the requests it timed, and why each miss
        // missed.
        ensure!(latency["engine_requests"] == e.engine_records, "{tenant}: {latency}");
        let got = latency["engine_attainment"].as_f64();
        let want = tier
            .filter(|_| e.engine_records > 0)
            .map(|_| e.engine_good as f64 / e.engine_records as f64);
        ensure!(got == want, "{tenant}: engine attainment {got:?} != {want:?}: {latency}");
        if tier.is_some() {
            let names = ["refused", "failed", "engine_queue", "prefill", "outside_engine", "tpot"];
            for name in names {
                let want = e.misses.get(name).copied().unwrap_or(0);
                let got = uint(&latency["misses"][name])?;
                ensure!(got == want, "{tenant}: misses {name} {got} != {want}: {latency}");
            }
            let counted: u64 = e.misses.values().sum();
            ensure!(counted == e.records - e.good, "{tenant}: {counted} misses counted");
        } else {
            ensure!(latency["misses"].is_null(), "{tenant}: misses without a tier: {latency}");
        }
        let mut finish = BTreeMap::new();
        for r in data["finish_reasons"].as_array().context("finish_reasons")? {
            if r["tenant_id"] == tenant.as_str() {
                finish.insert(
                    r["finish_reason"].as_str().unwrap_or_default().to_owned(),
                    uint(&r["requests"])?,
                );
            }
        }
        ensure!(finish == e.finish, "{tenant}: finish reasons {finish:?} != {:?}", e.finish);
    }

    // The page, in a browser, with the token in the fragment as an operator's link carries it.
    let page = format!("{}/dashboard?{window}", server.url);
    let dom =
        tokio::task::block_in_place(|| dump_dom(&browser, &format!("{page}#token={billing}")))?;
    let (_, after) = get_json(&c, &data_url, &billing).await?;
    ensure!(body_state(&dom) == Some("ready"), "page state {:?}:\n{dom}", body_state(&dom));
    ensure!(is_hidden(&dom, "error")? && is_hidden(&dom, "empty")?, "error or empty shown:\n{dom}");

    // Totals: sums over the API's series (which other processes' events may join between the
    // two reads; then the page's value lies between them).
    let (low, high) = (series_totals(&data)?, series_totals(&after)?);
    let tiles = [
        "total-requests",
        "total-prompt-tokens",
        "total-completion-tokens",
        "total-cached-tokens",
        "total-cost",
    ];
    for (i, id) in tiles.iter().enumerate() {
        let (raw, shown) = tile(&dom, id)?;
        let value: u64 = raw.parse().with_context(|| format!("{id} data-value {raw:?}"))?;
        ensure!(
            low[i] <= value && value <= high[i],
            "{id}: {value} not in {}..={}",
            low[i],
            high[i]
        );
        let want = if *id == "total-cost" { usd(value) } else { int(value) };
        ensure!(shown == want, "{id} shows {shown:?}, expected {want:?}");
    }

    // Top tenants: this test's rows, in the API's order, with its numbers.
    let table = section(&dom, "data-testid=\"top-tenants\"", "</table>")?;
    let mut order = tenants.clone();
    let mut api_order = tenants.clone();
    let top_rows = data["top_tenants"].as_array().context("top_tenants")?;
    order.sort_by_key(|t| table.find(&format!("<tr data-tenant=\"{t}\"")));
    api_order.sort_by_key(|t| top_rows.iter().position(|r| r["tenant_id"] == t.as_str()));
    ensure!(order == api_order, "top-tenants order {order:?}, API order {api_order:?}");
    let max_costs = [&data, &after].map(|d| {
        d["top_tenants"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["cost_micros"].as_u64())
            .max()
            .unwrap_or(0)
    });
    for (tenant, e) in tenants.iter().zip(&expected) {
        let row = section(table, &format!("<tr data-tenant=\"{tenant}\""), "</tr>")?;
        for (col, want) in [
            ("requests", e.requests),
            ("prompt-tokens", e.prompt),
            ("cached-tokens", e.cached),
            ("completion-tokens", e.completion),
            ("total-tokens", e.prompt + e.completion),
        ] {
            let (raw, shown) = cell(row, col)?;
            ensure!(
                raw == want.to_string() && shown == int(want),
                "{tenant} {col}: {raw} / {shown:?}"
            );
        }
        let (raw, shown) = cell(row, "cost")?;
        ensure!(raw == e.cost.to_string(), "{tenant} cost data-value {raw}");
        let formats = max_costs.map(|m| usd_fixed(e.cost, usd_decimals(m)));
        ensure!(
            formats.contains(&shown),
            "{tenant} cost shows {shown:?}, expected one of {formats:?}"
        );
    }

    // Latency: nearest-rank percentiles of the samples sent; a dash where there are none.
    let table = section(&dom, "data-testid=\"latency-table\"", "</table>")?;
    for ((tenant, e), tier) in tenants.iter().zip(&expected).zip(tiers) {
        let row = section(table, &format!("<tr data-tenant=\"{tenant}\""), "</tr>")?;
        let (raw, shown) = cell(row, "requests")?;
        ensure!(raw == e.records.to_string() && shown == int(e.records), "{tenant} requests");
        // Attainment as a percentage of the tier's good requests; a dash without a tier.
        let (raw, shown) = cell(row, "attainment")?;
        let want = tier.map(|_| e.good as f64 / e.records as f64);
        let want_raw = want.map(|v| v.to_string()).unwrap_or_default();
        let want_shown = want.map_or("-".to_owned(), |v| format!("{:.1}%", 100.0 * v));
        ensure!(raw == want_raw && shown == want_shown, "{tenant} attainment {raw:?} {shown:?}");
        // The engine's side beside it.
        let (raw, shown) = cell(row, "engine-attainment")?;
        let want = tier
            .filter(|_| e.engine_records > 0)
            .map(|_| e.engine_good as f64 / e.engine_records as f64);
        let want_raw = want.map(|v| v.to_string()).unwrap_or_default();
        let want_shown = want.map_or("-".to_owned(), |v| format!("{:.1}%", 100.0 * v));
        ensure!(
            raw == want_raw && shown == want_shown,
            "{tenant} engine attainment {raw:?} {shown:?}"
        );
        let (_, shown) = cell(row, "engine-ttft-p99")?;
        ensure!(shown == ms(percentile(&e.engine_ttft, 99)), "{tenant} engine TTFT p99 {shown:?}");
        let (_, shown) = cell(row, "misses")?;
        let named = [
            ("refused", "refused"),
            ("failed", "failed"),
            ("prefill", "prefill"),
            ("tpot", "TPOT"),
        ];
        let parts: Vec<String> = named
            .iter()
            .filter_map(|(k, n)| {
                e.misses.get(*k).filter(|c| **c > 0).map(|c| format!("{n} {}", int(*c)))
            })
            .collect();
        let want_shown = match (tier, parts.is_empty()) {
            (None, _) => "-".to_owned(),
            (Some(_), true) => "none".to_owned(),
            (Some(_), false) => parts.join(", "),
        };
        ensure!(shown == want_shown, "{tenant} misses shows {shown:?}, want {want_shown:?}");
        for (metric, samples) in [("ttft", &e.ttft), ("tpot", &e.tpot)] {
            for p in [50, 90, 99] {
                let want = percentile(samples, p);
                let (raw, shown) = cell(row, &format!("{metric}-p{p}"))?;
                let want_raw = want.map(|v| v.to_string()).unwrap_or_default();
                ensure!(
                    raw == want_raw,
                    "{tenant} {metric} p{p}: data-value {raw:?}, want {want_raw:?}"
                );
                ensure!(
                    shown == ms(want),
                    "{tenant} {metric} p{p}: shows {shown:?}, want {:?}",
                    ms(want)
                );
            }
        }
    }

    // Charts: SVG drawn, this test's tenants and finish reasons named.
    let finish = section(&dom, "data-testid=\"chart-finish\"", "</svg>")?;
    for (tenant, e) in tenants.iter().zip(&expected) {
        ensure!(
            finish.contains(&format!("<g data-tenant=\"{tenant}\"")),
            "finish chart lacks {tenant}"
        );
        for reason in e.finish.keys() {
            ensure!(
                finish.contains(&format!("data-key=\"{reason}\"")),
                "finish legend lacks {reason}"
            );
        }
    }
    for chart in ["chart-tokens", "chart-cost"] {
        let svg = section(&dom, &format!("data-testid=\"{chart}\""), "</svg>")?;
        ensure!(svg.contains("<rect"), "{chart} draws no bars");
    }
    let tokens = section(&dom, "data-testid=\"chart-tokens\"", "</svg>")?;
    ensure!(
        tokens.contains(&format!("data-key=\"{}\"", tenants[0])),
        "tokens legend lacks {}",
        tenants[0]
    );
    let cost = section(&dom, "data-testid=\"chart-cost\"", "</svg>")?;
    for model in [MODEL_A, MODEL_B] {
        ensure!(cost.contains(&format!("data-key=\"{model}\"")), "cost legend lacks {model}");
    }

    // A valid token without the billing role: 403, the server's message on the page.
    let (status, refused) = get_json(&c, &data_url, &auditor).await?;
    ensure!(status == 403, "auditor token: {status} {refused}");
    let dom =
        tokio::task::block_in_place(|| dump_dom(&browser, &format!("{page}#token={auditor}")))?;
    check_error_page(&dom, "403", &refused)?;

    // A token signed with another secret: 401.
    let (status, refused) = get_json(&c, &data_url, &forged).await?;
    ensure!(status == 401, "forged token: {status} {refused}");
    let dom =
        tokio::task::block_in_place(|| dump_dom(&browser, &format!("{page}#token={forged}")))?;
    check_error_page(&dom, "401", &refused)?;

    // No token at all: the sign-in form, no request made.
    let dom = tokio::task::block_in_place(|| dump_dom(&browser, &page))?;
    ensure!(body_state(&dom) == Some("login"), "state {:?} without a token", body_state(&dom));
    ensure!(
        !is_hidden(&dom, "login")? && is_hidden(&dom, "error")?,
        "sign-in form not shown:\n{dom}"
    );
    Ok(())
}

fn check_error_page(dom: &str, status: &str, body: &Value) -> anyhow::Result<()> {
    ensure!(body_state(dom) == Some("error"), "state {:?} for {status}:\n{dom}", body_state(dom));
    ensure!(!is_hidden(dom, "error")?, "error element hidden for {status}");
    let shown = section(dom, "data-testid=\"error\"", "</div>")?;
    let message = body["error"]["message"].as_str().context("error.message")?;
    ensure!(shown.contains(status), "error for {status} does not say so: {shown}");
    ensure!(
        shown.contains(&escape_text(message)),
        "error lacks the server's message {message:?}: {shown}"
    );
    ensure!(
        !dom.contains("data-testid=\"total-requests\" data-value"),
        "{status}: totals rendered"
    );
    Ok(())
}
