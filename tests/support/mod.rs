//! Helpers shared by the tests that run `sluice` processes (engine, gateway, billing).

#![expect(dead_code, reason = "each test binary uses a different subset of the helpers")]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

/// A child process, killed when dropped (also when a test fails half-way).
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// SIGTERM, then waits for a clean exit (which flushes what the process buffers).
    pub fn stop(&mut self) -> anyhow::Result<()> {
        signal_and_wait(&mut self.0, "TERM", Duration::from_secs(20)).map(|_| ())
    }
}

/// Sends `signal` (`INT`, `TERM`) to `child` and waits up to `within` for it to exit.
pub fn signal_and_wait(
    child: &mut Child,
    signal: &str,
    within: Duration,
) -> anyhow::Result<std::process::ExitStatus> {
    let sent =
        Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status()?;
    ensure!(sent.success(), "kill -{signal} failed");
    wait_exit(child, within, signal)
}

/// Waits up to `within` for `child` to exit (after `why`, for the message).
pub fn wait_exit(
    child: &mut Child,
    within: Duration,
    why: &str,
) -> anyhow::Result<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        ensure!(Instant::now() < deadline, "did not exit within {within:?} of SIG{why}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `sluice engine` on `model` on a free port, behind `token`, serving the default model id with
/// a KV cache of `kv_mb` MiB; its logs go to `log` when given.
pub fn spawn_engine(
    model: &str,
    token: &str,
    kv_mb: &str,
    envs: &[(&str, &str)],
    log: Option<&Path>,
) -> anyhow::Result<(Proc, String)> {
    let listen = format!("127.0.0.1:{}", free_port()?);
    let args = ["engine", "--model", model, "--listen", &listen, "--internal-token", token]
        .into_iter()
        .chain(["--served-model-name", "smollm2-135m-instruct", "--kv-cache-mb", kv_mb])
        .collect::<Vec<_>>();
    match log {
        Some(l) => spawn_sluice_logged(&args, envs, l),
        None => spawn_sluice(&args, envs),
    }
}

/// A port that was free a moment ago.
///
/// Taken below the kernel's ephemeral range: a port from `:0` is one of that range, which the
/// process's own outbound connections (to Redis, the ledger, an engine, made before it binds
/// its listener) draw from too, so one of them could hold it by then (a gateway's `/health`
/// once never answered that way, its bind having failed).
pub fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    const LOW: u16 = 10_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral > LOW + 1_000 {
        let span = u64::from(ephemeral - LOW);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // Apart for every call, in this process and beside other test processes.
        let mut x = (u64::from(nanos) ^ (u64::from(std::process::id()) << 32))
            ^ CALLS.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            | 1;
        for _ in 0..64 {
            // xorshift64: only a spread of tries, not randomness anyone relies on.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let port = LOW + u16::try_from(x % span).unwrap_or(0);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `sluice ARGS` with extra environment variables and returns it with the address of
/// its first `listening on SCHEME://ADDR` line.
/// A gateway's `/metrics` listener goes on a free port unless the test names one.
pub fn spawn_sluice(args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<(Proc, String)> {
    spawn_sluice_to(args, envs, Stdio::null())
}

/// [`spawn_sluice`] with its stderr (the logs) written to `log`.
pub fn spawn_sluice_logged(
    args: &[&str],
    envs: &[(&str, &str)],
    log: &Path,
) -> anyhow::Result<(Proc, String)> {
    spawn_sluice_to(args, envs, Stdio::from(std::fs::File::create(log)?))
}

fn spawn_sluice_to(
    args: &[&str],
    envs: &[(&str, &str)],
    stderr: Stdio,
) -> anyhow::Result<(Proc, String)> {
    let mut args = args.to_vec();
    if args.first() == Some(&"gateway") && !args.contains(&"--metrics-listen") {
        args.extend(["--metrics-listen", "127.0.0.1:0"]);
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()?;
    let out = child.stdout.take().context("stdout")?;
    let proc = Proc(child);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("listening on ").and_then(|l| l.split("://").nth(1));
    let Some(addr) = addr else { bail!("no listening line from sluice {args:?}: {line:?}") };
    Ok((proc, addr.to_owned()))
}

/// Polls `url` until it answers 2xx.
pub async fn wait_healthy(c: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if c.get(url).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} never became healthy");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `redis-server` of the test's own on a free port (stopping it disturbs nothing else).
pub async fn private_redis(dir: &std::path::Path) -> anyhow::Result<(Proc, String)> {
    let port = free_port()?;
    let proc = redis_server(dir, port, false)?;
    Ok((proc, format!("redis://127.0.0.1:{port}")))
}

/// `redis-server` on `port` with its files in `dir`, once it accepts connections; with
/// `persistent`, an append-only file fsynced on every write, so a restart on the same `dir`
/// keeps its streams (as a production Redis holding the usage stream must).
pub fn redis_server(dir: &Path, port: u16, persistent: bool) -> anyhow::Result<Proc> {
    let aof: &[&str] = if persistent {
        &["--appendonly", "yes", "--appendfsync", "always"]
    } else {
        &["--appendonly", "no"]
    };
    let proc = Proc(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(aof)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server is needed for this test")?,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(proc)
}

/// A running `sluice up`, killed when dropped.
pub struct Up {
    pub child: Child,
    /// Its state directory (`--dir`).
    pub dir: PathBuf,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Up {
    /// demo.env and admin.env together.
    pub fn envs(&self) -> anyhow::Result<HashMap<String, String>> {
        let mut e = env_file(&self.dir.join("demo.env"))?;
        e.extend(env_file(&self.dir.join("admin.env"))?);
        Ok(e)
    }
}

/// Starts `sluice up --dir DIR` on free ports and waits for its `ready` line.
pub fn start_up(dir: &Path) -> anyhow::Result<Up> {
    start_up_with(dir, &["--kv-cache-mb", "128"])
}

/// [`start_up`] with other arguments (which must include `--kv-cache-mb`).
pub fn start_up_with(dir: &Path, extra: &[&str]) -> anyhow::Result<Up> {
    let (gw, admin) = (free_port()?, free_port()?);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["up", "--dir", dir.to_str().context("utf-8")?, "--metrics-listen", "127.0.0.1:0"])
        .args(extra)
        .args([
            "--listen",
            &format!("127.0.0.1:{gw}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut up = Up { child, dir: dir.to_owned() };
    let mut lines = BufReader::new(stdout).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match lines.next() {
            Some(Ok(l)) if l == "ready" => break,
            Some(Ok(_)) => {}
            _ => bail!("sluice up exited before it was ready: {:?}", up.child.try_wait()),
        }
        ensure!(Instant::now() < deadline, "sluice up not ready in 120 s");
    }
    std::thread::spawn(move || for _ in lines {});
    // `ready` comes as pingora starts; its listener follows within moments.
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", gw)).is_err() {
        ensure!(Instant::now() < deadline, "the gateway did not listen within 20 s of ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(up)
}

/// An env file as `sluice up` writes it (`export KEY=value`, values single-quoted where a
/// shell would split them), read as a dotenv reader would.
pub fn env_file(path: &Path) -> anyhow::Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut out = HashMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix("export ") else {
            bail!("{}: {line:?} is not an `export KEY=value` line", path.display());
        };
        let (k, v) = rest.split_once('=').context("no `=`")?;
        let v = match v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
            Some(q) => q.replace("'\\''", "'"),
            None => v.to_owned(),
        };
        out.insert(k.to_owned(), v);
    }
    Ok(out)
}

/// Installs the official OpenAI Python SDK when it is missing.
pub fn ensure_sdk() -> anyhow::Result<()> {
    ensure_python_package("openai", "openai")
}

/// Installs `requirement` with pip when Python cannot import `module`.
pub fn ensure_python_package(module: &str, requirement: &str) -> anyhow::Result<()> {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .stderr(Stdio::null())
        .status()?
        .success();
    if !ok {
        let out = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(["--root-user-action=ignore", requirement])
            .output()?;
        ensure!(
            out.status.success(),
            "pip install {requirement}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Shared with the billing crate's tests: held shared here, exclusively by its outage test.
const POSTGRES_LOCK: &str = "/tmp/sluice-billing-postgres-tests.lock";

/// A scratch Postgres database, dropped (forcibly) with this value.
pub struct ScratchDatabase {
    /// Its `postgres://` URL.
    pub url: String,
    name: String,
    _lock: std::fs::File,
}

/// The Postgres lock held shared, so the billing crate's outage test waits for this test.
pub fn postgres_shared_lock() -> anyhow::Result<std::fs::File> {
    let lock =
        std::fs::File::options().create(true).truncate(false).write(true).open(POSTGRES_LOCK)?;
    lock.lock_shared()?;
    Ok(lock)
}

impl ScratchDatabase {
    /// A new database named `sluice_{purpose}_{random}`.
    pub fn create(purpose: &str) -> anyhow::Result<Self> {
        let lock = postgres_shared_lock()?;
        let name = format!("sluice_{purpose}_{}", random_hex(8)?);
        psql(&format!("CREATE DATABASE {name}"))?;
        Ok(Self { url: format!("postgres://postgres@127.0.0.1:5432/{name}"), name, _lock: lock })
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        if psql(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).is_err() {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

fn psql(sql: &str) -> anyhow::Result<()> {
    let out = Command::new("psql")
        .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-c", sql])
        .output()
        .context("running psql")?;
    ensure!(out.status.success(), "psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// `bytes` random bytes as hex.
pub fn random_hex(bytes: usize) -> anyhow::Result<String> {
    use std::io::Read;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// One cluster-mode `redis-server`, once it accepts connections. A node also binds the port
/// 10000 above its own (the cluster bus): both are probed, and a node that exits at once (a
/// port taken meanwhile) is started again on other ports.
fn cluster_node(dir: &Path, node_timeout_ms: u64) -> anyhow::Result<(Proc, u16)> {
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port()?;
        if port > 55535 || std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_err() {
            continue;
        }
        let node_dir = dir.join(format!("node-{port}"));
        std::fs::create_dir_all(&node_dir)?;
        let mut proc = Proc(
            Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
                .arg("--dir")
                .arg(&node_dir)
                .stdout(Stdio::null())
                .spawn()
                .context("redis-server is needed for this test")?,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok((proc, port));
            }
            if let Some(status) = proc.0.try_wait()? {
                last = format!("redis-server on {port} exited: {status}");
                break;
            }
            ensure!(Instant::now() < deadline, "redis-server {port} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    bail!("no cluster node started in 5 tries: {last}")
}

/// A local Redis Cluster: `primaries` primaries with one replica each (redis-server in cluster
/// mode, joined by `redis-cli --cluster create`), a node timeout of `node_timeout_ms` (how soon
/// a replica takes over a primary that stopped answering). Returns the nodes (process, port)
/// and the comma-separated URL list Sluice takes as `--redis-url`, once the cluster is `ok`.
pub fn redis_cluster(
    dir: &Path,
    primaries: usize,
    node_timeout_ms: u64,
) -> anyhow::Result<(Vec<(Proc, u16)>, String)> {
    let mut nodes = Vec::new();
    for _ in 0..primaries * 2 {
        nodes.push(cluster_node(dir, node_timeout_ms)?);
    }
    let addrs: Vec<String> = nodes.iter().map(|(_, p)| format!("127.0.0.1:{p}")).collect();
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .output()
        .context("redis-cli is needed for this test")?;
    ensure!(
        out.status.success(),
        "redis-cli --cluster create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Every node agrees the cluster is ok (slots assigned, gossip settled).
    let deadline = Instant::now() + Duration::from_secs(30);
    for (_, port) in &nodes {
        loop {
            let info = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "cluster", "info"])
                .output()?;
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                break;
            }
            ensure!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let url = addrs.iter().map(|a| format!("redis://{a}")).collect::<Vec<_>>().join(",");
    Ok((nodes, url))
}

/// One try of one request, as `sluice bench serve --requests-log` wrote it.
#[derive(Debug, Clone)]
pub struct Try {
    pub url: String,
    pub stream: bool,
    pub key: String,
    pub status: Option<u16>,
    pub request_id: Option<String>,
    pub error_code: Option<String>,
    pub ok: bool,
    pub usage_tokens: Option<u64>,
    pub streamed_tokens: u64,
}

/// The requests of a `--requests-log`, each as its tries in order.
pub fn read_tries(path: &Path) -> anyhow::Result<Vec<Vec<Try>>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let key = v["idempotency_key"].as_str().context("no idempotency key")?.to_owned();
        let stream = v["stream"].as_bool().unwrap_or(false);
        let tries = v["tries"].as_array().context("no tries")?;
        out.push(
            tries
                .iter()
                .map(|t| Try {
                    url: t["url"].as_str().unwrap_or_default().to_owned(),
                    stream,
                    key: key.clone(),
                    status: t["status"].as_u64().map(|s| s as u16),
                    request_id: t["request_id"].as_str().map(str::to_owned),
                    error_code: t["error_code"].as_str().map(str::to_owned),
                    ok: t["ok"].as_bool().unwrap_or(false),
                    usage_tokens: t["usage_tokens"].as_u64(),
                    streamed_tokens: t["streamed_tokens"].as_u64().unwrap_or(0),
                })
                .collect(),
        );
    }
    Ok(out)
}

/// A ledger row as the records API gives it.
pub type Row = serde_json::Map<String, serde_json::Value>;

/// The ledger's rows grouped by request id, once each of `ids` has at least one; an error
/// naming those still without one after `within` (ingestion runs behind the answers).
pub async fn rows_for(
    ledger: &sluice_billing::Ledger,
    ids: &[&str],
    within: Duration,
) -> anyhow::Result<HashMap<String, Vec<Row>>> {
    let filter = sluice_billing::query::RecordFilter { limit: 10_000, ..Default::default() };
    let deadline = Instant::now() + within;
    loop {
        let mut rows: HashMap<String, Vec<Row>> = HashMap::new();
        for r in ledger.records(&filter).await?.records {
            rows.entry(r["request_id"].as_str().unwrap_or_default().to_owned())
                .or_default()
                .push(r);
        }
        let missing: Vec<&&str> = ids.iter().filter(|id| !rows.contains_key(**id)).collect();
        if missing.is_empty() {
            return Ok(rows);
        }
        ensure!(
            Instant::now() < deadline,
            "{} request ids without a row after {within:?}: {missing:?}",
            missing.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Creates `tenants` in `ledger`, each with one API key (the secrets, by tenant); the tenant
/// named `capped`, if any, is held to 2 requests a minute.
pub async fn tenants_with_keys<'a>(
    ledger: &sluice_billing::Ledger,
    tenants: &[&'a str],
    capped: Option<&str>,
) -> anyhow::Result<HashMap<&'a str, String>> {
    use sluice_billing::auth::{Principal, Role};
    use sluice_billing::control::{Limits, NewTenant, QuotaSettings};
    let ops = Principal { actor: "test-setup".into(), role: Role::Ops, tenant: None };
    let mut keys = HashMap::new();
    for id in tenants {
        let new = NewTenant { id: (*id).into(), name: None, tier: None, overrides: None };
        ledger.create_tenant(&ops, &new).await?;
        keys.insert(*id, ledger.issue_key(&ops, id, None, None, Default::default()).await?.1);
    }
    if let Some(id) = capped {
        let limits = Limits { rpm: Some(2), ..Default::default() };
        ledger.set_quota(&ops, id, &QuotaSettings { limits, ..Default::default() }).await?;
    }
    Ok(keys)
}

/// `sluice audit reconcile --since 1h` over `engines` against the billing service at
/// `admin_url`, as an auditor (a token minted with `jwt_secret`); its report, or an error
/// with it when anything differs.
pub fn reconcile(
    jwt_secret: &str,
    admin_url: &str,
    engines: &[&str],
    internal_token: &str,
) -> anyhow::Result<String> {
    let auditor = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["admin", "token", "--role", "auditor", "--sub", "test-auditor"])
        .env("SLUICE_JWT_SECRET", jwt_secret)
        .output()?;
    let auditor = String::from_utf8(auditor.stdout)?.trim().to_owned();
    let mut reconcile = Command::new(env!("CARGO_BIN_EXE_sluice"));
    reconcile.args(["audit", "reconcile", "--since", "1h"]);
    for e in engines {
        reconcile.args(["--engine", e]);
    }
    let out = reconcile
        .env("SLUICE_ADMIN_URL", admin_url)
        .env("SLUICE_ADMIN_TOKEN", &auditor)
        .env("SLUICE_INTERNAL_TOKEN", internal_token)
        .output()?;
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "reconcile:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    Ok(report)
}

/// One Redis command on `url`.
pub async fn redis_cmd(url: &str, args: &[&str]) -> anyhow::Result<redis::Value> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    Ok(cmd.query_async(&mut conn).await?)
}
