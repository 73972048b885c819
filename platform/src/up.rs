//! `sluice gateway` (the pingora data plane on its own) and `sluice up` (the whole platform in
//! one process: an engine worker, billing on SQLite with its admin API, the gateway over
//! HTTPS, a demo tenant and key).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use sluice_billing::api::{ApiState, router as billing_router};
use sluice_billing::auth::{Principal, Role, Verifier, mint_hs256};
use sluice_billing::control::NewTenant;
use sluice_billing::{Ledger, LedgerOptions};
use sluice_engine::fetch::{DEFAULT_MODEL, fetch, model_dir, resolve_model};
use sluice_engine::loader::LoadedModel;
use sluice_engine::serve::core::EngineConfig;
use sluice_engine::serve::handle::EngineHandle;
use sluice_engine::server::{ServerConfig, router as engine_router};
use sluice_gateway::admission::TokenCounter;
use sluice_gateway::local::RedisDownPolicy;
use sluice_gateway::platform::{IoRuntime, Usage, finish, run_proxy, serve_metrics};
use sluice_gateway::proxy::{Gateway, GatewayConfig};
use sluice_policies::redis_conn::Namespace;
use sluice_text::model::model_id_of;

/// `sluice gateway`.
#[derive(Args, Debug)]
pub struct GatewayArgs {
    /// Address for tenants.
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: String,
    /// TLS certificate chain (PEM).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plain HTTP (only behind something that terminates TLS).
    #[arg(long, conflicts_with = "tls_cert")]
    plain_http: bool,
    /// Engine worker `host:port` (repeat for several).
    #[arg(long = "engine", required = true)]
    engines: Vec<String>,
    /// Ledger with tenants and keys (postgres://... or sqlite://...).
    #[arg(long, env = "SLUICE_DATABASE_URL")]
    database_url: String,
    /// Redis: shared limits across gateway replicas, and the usage stream to billing. Without
    /// it, limits are per process and usage is written to the ledger directly.
    #[arg(long, env = "SLUICE_REDIS_URL")]
    redis_url: Option<String>,
    /// Bearer token the engines require.
    #[arg(long, env = "SLUICE_INTERNAL_TOKEN", hide_env_values = true)]
    internal_token: Option<String>,
    /// A model (GGUF file or Hugging Face directory) whose tokenizer and chat template are
    /// held from the start, served under its file's name until the engines say otherwise
    /// (repeat for several). The models, their ids included, are learned from the engines;
    /// one whose text side is not held here has it fetched from its engine.
    #[arg(long = "model")]
    models: Vec<PathBuf>,
    /// When Redis is unreachable: `local` limits or `refuse` (503).
    #[arg(long, default_value = "local")]
    redis_down: String,
    #[command(flatten)]
    front: FrontDoorArgs,
    /// The deployment's namespace in Redis (1-64 ASCII letters, digits, `-`, `_`, `.`): every
    /// key and stream the gateway uses there is named under it, so deployments sharing one
    /// Redis share nothing (their `sluice billing` names the same one).
    #[arg(long, env = "SLUICE_REDIS_NAMESPACE", value_name = "NAME", default_value = Namespace::DEFAULT)]
    redis_namespace: Namespace,
    /// Usage stream (default: the namespace's; tests isolate themselves with their own).
    #[arg(long, hide = true)]
    usage_stream: Option<String>,
}

/// The models `sluice up` serves: those named (files, directories or catalog names, fetched
/// when missing), else the default model (fetched if missing).
fn model_paths(models: Vec<PathBuf>) -> anyhow::Result<Vec<PathBuf>> {
    if models.is_empty() {
        return Ok(vec![fetch(&DEFAULT_MODEL, &model_dir(), &|s| eprintln!("{s}"))?]);
    }
    let status = |s: &str| eprintln!("{s}");
    models.iter().map(|m| Ok(resolve_model(m, &status)?)).collect()
}

/// Runs `sluice gateway`.
pub fn run_gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let _telemetry = crate::telemetry::init("sluice-gateway")?;
    let redis_down = match args.redis_down.as_str() {
        "local" => RedisDownPolicy::Local,
        "refuse" => RedisDownPolicy::Refuse,
        _ => bail!("--redis-down must be local or refuse"),
    };
    let tls = match (&args.tls_cert, &args.tls_key, args.plain_http) {
        (Some(c), Some(k), _) => Some((c.clone(), k.clone())),
        (None, None, true) => None,
        _ => bail!("give --tls-cert and --tls-key, or --plain-http"),
    };
    let texts = args
        .models
        .iter()
        .map(|p| {
            let text = TokenCounter::open(p).with_context(|| {
                format!("reading the tokenizer and chat template of --model {}", p.display())
            })?;
            Ok((model_id_of(p), text))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let io = IoRuntime::start()?;
    let (ledger, usage) = io.handle.block_on(async {
        let ledger = Ledger::connect_with(&args.database_url, &LedgerOptions::default())
            .await
            .context("connecting to --database-url")?;
        let ns = &args.redis_namespace;
        let stream = args.usage_stream.clone().unwrap_or_else(|| ns.usage_stream());
        let usage =
            Usage::connect(&ledger, &args.database_url, args.redis_url.as_deref(), ns, &stream)
                .await?;
        anyhow::Ok((ledger, usage))
    })?;
    let Usage { limiter, sink, ingest } = usage;
    let token = args.internal_token.clone();
    let cfg =
        args.front.apply(GatewayConfig::platform(&args.engines, args.internal_token, redis_down));
    let gateway =
        Gateway::new(cfg, ledger.clone(), limiter, texts, sink.clone(), io.handle.clone());
    match gateway.models().join(", ") {
        m if m.is_empty() => {
            eprintln!("no engine has said what it serves yet: requests get 404 until one does")
        }
        m => eprintln!("models: {m}"),
    }
    let metrics = serve_metrics(&io, &args.front.metrics_listen, &gateway)?;
    println!("listening on {}://{}", if tls.is_some() { "https" } else { "http" }, args.listen);
    // On stderr: stdout's first line is the listening address, which is all some readers take.
    eprintln!("metrics on http://{metrics}/metrics");
    std::io::stdout().flush()?;
    let tls_ref = tls.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let journal = gateway.journal();
    run_proxy(gateway, &args.listen, tls_ref, args.front.drain(), token)?;
    finish(&io, ingest.as_deref(), &sink, journal.as_deref(), &ledger)?;
    eprintln!("shut down");
    Ok(())
}

/// `sluice up`.
#[derive(Args, Debug)]
pub struct UpArgs {
    /// Where state lives: the ledger, TLS files, secrets and the env files.
    #[arg(long, default_value = ".sluice")]
    dir: PathBuf,
    /// The gateway's address (HTTPS).
    #[arg(long, default_value = "127.0.0.1:8443")]
    listen: String,
    /// The billing admin API and dashboard.
    #[arg(long, default_value = "127.0.0.1:8090")]
    admin_listen: String,
    /// Serve the gateway over plain HTTP instead of HTTPS.
    #[arg(long)]
    plain_http: bool,
    /// A model to serve: a GGUF file, Hugging Face directory or catalog name (`sluice model
    /// list`; fetched when missing). Repeat to serve several, an engine each, every one under
    /// the id its file gives it (default: the default model, fetched if missing).
    #[arg(long = "model")]
    models: Vec<PathBuf>,
    /// Where the engine's forward pass runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: sluice_engine::backend::Device,
    /// KV cache memory, MiB [default on the CPU: 512; on a GPU the cache takes what
    /// --gpu-memory-utilization leaves].
    #[arg(long, conflicts_with = "gpu_memory_utilization")]
    kv_cache_mb: Option<usize>,
    /// On a GPU: the share of the device's memory the engine may take in all [default: 0.9
    /// unless --kv-cache-mb].
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// The order in which waiting requests are admitted: `fair` (each tenant its weighted
    /// share of service, priorities first) or `fcfs` (arrival order).
    #[arg(long, default_value = "fair")]
    scheduling: sluice_engine::serve::core::Scheduling,
    #[command(flatten)]
    front: FrontDoorArgs,
}

/// How the gateway's front door behaves: `sluice gateway` and `sluice up` alike.
#[derive(Args, Debug)]
pub struct FrontDoorArgs {
    /// On SIGINT or SIGTERM: how long running requests may go on before they are cancelled
    /// (a stream billed for the tokens it sent; a whole answer, which sent none, recorded
    /// with what it generated and charged nothing), in seconds.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Where `/metrics` is served (never on the tenants' port: it shows every tenant).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_listen: String,
    /// Seconds a kept-alive client connection may sit idle between requests.
    #[arg(long, default_value_t = 30)]
    idle_timeout: u64,
    /// Seconds a request head may take to arrive, in all (then 408); a new connection that
    /// sends nothing for this long is closed.
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Seconds a request body may take to arrive, in all (then 408).
    #[arg(long, default_value_t = 30)]
    body_timeout: u64,
    /// Requests one client address may have in flight at once (then 429).
    #[arg(long, default_value_t = 512)]
    max_per_client: u32,
    /// A load balancer's address or network (CIDR; repeat or separate with commas) whose
    /// `X-Forwarded-For` names the client: requests from it count against the address it
    /// forwarded for (the rightmost one that is not itself trusted), not against the proxy.
    #[arg(long = "trusted-proxy", value_delimiter = ',', value_parser = parse_net)]
    trusted_proxies: Vec<ipnet::IpNet>,
    /// While the engines are backlogged: `fair` admits each tenant up to its weighted share
    /// of their places and past it only as far as its tier's TTFT target allows (the rest get
    /// 429 at once); `fcfs` lets every request queue at the engines. `sluice up --scheduling
    /// fcfs` implies `fcfs`.
    #[arg(long, default_value = "fair", value_parser = ["fair", "fcfs"])]
    admission: String,
}

impl FrontDoorArgs {
    /// `cfg` with these timeouts, limits and the admission policy.
    fn apply(&self, cfg: GatewayConfig) -> GatewayConfig {
        GatewayConfig {
            idle_timeout: Duration::from_secs(self.idle_timeout),
            header_timeout: Duration::from_secs(self.header_timeout),
            body_timeout: Duration::from_secs(self.body_timeout),
            max_per_client: self.max_per_client,
            trusted_proxies: self.trusted_proxies.clone(),
            fair_admission: self.admission == "fair",
            ..cfg
        }
    }

    fn drain(&self) -> Duration {
        Duration::from_secs(self.drain_timeout)
    }
}

/// A `--trusted-proxy` value: a network (`10.0.0.0/8`) or one address.
fn parse_net(s: &str) -> Result<ipnet::IpNet, String> {
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("{s:?} is not an IP address or network (CIDR)"))
}

fn write_private(path: &Path, content: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(content.as_bytes())?;
    Ok(())
}

/// The state directory holds the ledger, keys and tokens: 0700, and the ledger 0600 before
/// SQLite opens it (SQLite gives its -wal and -shm files the database file's mode).
fn private_state_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let private = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("making {} private", p.display()))
    };
    private(dir, 0o700)?;
    let ledger = dir.join("ledger.db");
    if !ledger.exists() {
        write_private(&ledger, "")?;
    }
    for name in ["ledger.db", "ledger.db-wal", "ledger.db-shm", "tls/ca.pem", "tls/cert.pem"] {
        let p = dir.join(name);
        if p.exists() {
            private(&p, 0o600)?;
        }
    }
    if dir.join("tls").exists() {
        private(&dir.join("tls"), 0o700)?;
    }
    Ok(())
}

/// A local CA and a certificate for localhost signed by it (created once).
fn tls_files(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    let (ca_path, cert_path, key_path) =
        (dir.join("tls/ca.pem"), dir.join("tls/cert.pem"), dir.join("tls/key.pem"));
    if ca_path.exists() && cert_path.exists() && key_path.exists() {
        return Ok((ca_path, cert_path, key_path));
    }
    std::fs::create_dir_all(dir.join("tls"))?;
    private_state_dir(dir)?;
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "Sluice local CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let key = rcgen::KeyPair::generate()?;
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    params.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &ca, &ca_key)?;
    write_private(&ca_path, &ca.pem())?;
    write_private(&cert_path, &cert.pem())?;
    write_private(&key_path, &key.serialize_pem())?;
    Ok((ca_path, cert_path, key_path))
}

/// One line of an env file: `export KEY=value`, which `source` in bash or zsh exports to the
/// programs it starts, and which dotenv-style readers (python-dotenv, `sluice`'s tests) accept.
/// Values are single-quoted when they hold anything a shell would expand or split.
fn env_line(key: &str, value: &str) -> String {
    format!("export {key}={}", quote_value(value))
}

fn quote_value(v: &str) -> String {
    let plain =
        !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:@%+=,".contains(&b));
    if plain { v.to_owned() } else { format!("'{}'", v.replace('\'', "'\\''")) }
}

fn shell_quote(p: &Path) -> String {
    quote_value(&p.display().to_string())
}

/// The value of `key` in an env file written by [`env_line`] (or an older `KEY=value` one).
fn env_value(file: &str, key: &str) -> Option<String> {
    file.lines().find_map(|l| {
        let l = l.trim();
        let v = l.strip_prefix("export ").unwrap_or(l).strip_prefix(key)?.strip_prefix('=')?;
        Some(match v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
            Some(q) => q.replace("'\\''", "'"),
            None => v.to_owned(),
        })
    })
}

fn random_secret() -> String {
    format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// Each model's id with the gateway's token counter for it.
type ModelTexts = Vec<(String, TokenCounter)>;

/// Loads every model `sluice up` serves, with the gateway's token counter for each; two files
/// under one model id are refused.
fn load_models(paths: Vec<PathBuf>) -> anyhow::Result<(Vec<Arc<LoadedModel>>, ModelTexts)> {
    let mut models: Vec<Arc<LoadedModel>> = Vec::new();
    let mut texts = Vec::new();
    for path in model_paths(paths)? {
        let model = LoadedModel::load(&path)
            .with_context(|| format!("loading the model {}", path.display()))?;
        if let Some(same) = models.iter().find(|m| m.identity.model_id == model.identity.model_id) {
            bail!(
                "--model {} and --model {} are both named {}: serve one",
                same.path.display(),
                path.display(),
                model.identity.model_id
            );
        }
        texts.push((model.identity.model_id.clone(), TokenCounter::open(&path)?));
        models.push(Arc::new(model));
    }
    Ok((models, texts))
}

/// The JWT secret kept in `dir` (made on the first start).
fn jwt_secret(dir: &Path) -> anyhow::Result<String> {
    let secret_path = dir.join("jwt-secret");
    Ok(match std::fs::read_to_string(&secret_path) {
        Ok(s) if s.trim().len() >= 32 => s.trim().to_owned(),
        _ => {
            let s = random_secret();
            write_private(&secret_path, &s)?;
            s
        }
    })
}

/// Starts an engine for each model: the routers of their HTTP servers, not yet listening.
fn start_engines(
    args: &UpArgs,
    models: &[Arc<LoadedModel>],
    dir: &Path,
    internal_token: &str,
) -> anyhow::Result<Vec<axum::Router>> {
    let (kv_cache_bytes, gpu_memory_utilization) = sluice_engine::backend::kv_cache_size(
        args.device,
        args.kv_cache_mb,
        args.gpu_memory_utilization,
    )?;
    // Several models on one GPU share what the engines may take of it.
    let gpu_memory_utilization = gpu_memory_utilization.map(|u| u / models.len() as f64);
    let mut engine_apps = Vec::new();
    for model in models {
        let handle = EngineHandle::start(
            Arc::clone(model),
            EngineConfig {
                kv_cache_bytes,
                gpu_memory_utilization,
                device: args.device,
                scheduling: args.scheduling,
                ..EngineConfig::default()
            },
        )
        .with_context(|| {
            format!("starting the engine of {} on {}", model.identity.model_id, args.device)
        })?;
        engine_apps.push(engine_router(
            handle,
            ServerConfig {
                internal_token: Some(internal_token.to_owned()),
                // `sluice admin adapters register` writes here (admin.env names it).
                adapter_store: Some(dir.join("adapters")),
                ..ServerConfig::default()
            },
        ));
    }
    Ok(engine_apps)
}

/// The demo tenant's key: the one `demo.env` holds while the ledger knows it, else a new
/// one (the tenant created when missing); `true` when it was issued now.
async fn demo_key(ledger: &Ledger, existing: Option<String>) -> anyhow::Result<(String, bool)> {
    let system = Principal { actor: "sluice-up".into(), role: Role::Ops, tenant: None };
    if let Some(k) = existing
        && ledger.key_grant(&k).await?.is_some()
    {
        return Ok((k, false));
    }
    if ledger.tenant("demo").await.is_err() {
        let new = NewTenant {
            id: "demo".into(),
            name: Some("Demo tenant".into()),
            tier: Some("standard".into()),
            overrides: None,
        };
        ledger.create_tenant(&system, &new).await?;
    }
    let (_, secret) = ledger.issue_key(&system, "demo", None, None, Default::default()).await?;
    Ok((secret, true))
}

/// Writes `admin.env`: the admin API's address, a day's tokens for ops, the auditor and
/// billing, and the adapter store. Its path.
fn write_admin_env(dir: &Path, admin_listen: &str, jwt_secret: &str) -> anyhow::Result<PathBuf> {
    let ops = Principal { actor: "sluice-up-ops".into(), role: Role::Ops, tenant: None };
    let auditor =
        Principal { actor: "sluice-up-auditor".into(), role: Role::Auditor, tenant: None };
    let billing =
        Principal { actor: "sluice-up-billing".into(), role: Role::Billing, tenant: None };
    let day = 24 * 3600;
    let admin_env = [
        env_line("SLUICE_ADMIN_URL", &format!("http://{}", admin_listen)),
        env_line("SLUICE_ADMIN_TOKEN", &mint_hs256(jwt_secret.as_bytes(), &ops, day, None, None)?),
        env_line(
            "SLUICE_AUDITOR_TOKEN",
            &mint_hs256(jwt_secret.as_bytes(), &auditor, day, None, None)?,
        ),
        env_line(
            "SLUICE_BILLING_TOKEN",
            &mint_hs256(jwt_secret.as_bytes(), &billing, day, None, None)?,
        ),
        env_line("SLUICE_ADAPTER_STORE", &dir.join("adapters").display().to_string()),
    ];
    let admin_path = dir.join("admin.env");
    write_private(&admin_path, &(admin_env.join("\n") + "\n"))?;
    Ok(admin_path)
}

/// What `sluice up` prints once it is ready.
fn print_banner(
    args: &UpArgs,
    scheme: &str,
    served: &[String],
    metrics_url: &str,
    fresh_key: Option<&str>,
    demo_env: &Path,
    admin_path: &Path,
) -> anyhow::Result<()> {
    println!("sluice is up");
    let plural = if served.len() == 1 { "model" } else { "models" };
    println!("  gateway    {scheme}://{}/v1  ({plural} {})", args.listen, served.join(", "));
    println!(
        "  admin API  http://{}  (console: /console, dashboard: /dashboard)",
        args.admin_listen
    );
    println!("  metrics    {metrics_url}");
    if let Some(key) = fresh_key {
        println!("  demo key   {key}  (shown once)");
    }
    println!("  env files  {} and {}", demo_env.display(), admin_path.display());
    println!("  SDK        source {} && python3 your_openai_app.py", shell_quote(demo_env));
    println!("  admin      source {} && sluice admin tenants list", shell_quote(admin_path));
    println!("ready");
    std::io::stdout().flush()?;
    Ok(())
}

/// Runs `sluice up`.
pub fn run_up(args: UpArgs) -> anyhow::Result<()> {
    let _telemetry = crate::telemetry::init("sluice")?;
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = std::fs::canonicalize(&args.dir)?;
    private_state_dir(&dir)?;
    let (models, texts) = load_models(args.models.clone())?;
    let jwt_secret = jwt_secret(&dir)?;
    let internal_token = random_secret();
    let io = IoRuntime::start()?;
    let engine_apps = start_engines(&args, &models, &dir, &internal_token)?;
    let db_url = format!("sqlite://{}", dir.join("ledger.db").display());
    let (engine_addrs, ledger, usage) = io.handle.block_on(async {
        let mut engine_addrs = Vec::new();
        for app in engine_apps {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            engine_addrs.push(listener.local_addr()?.to_string());
            tokio::spawn(async move {
                let _ = axum::serve(sluice_engine::server::no_delay(listener), app).await;
            });
        }
        let ledger = Ledger::connect(&db_url).await.context("opening the ledger")?;
        let admin = tokio::net::TcpListener::bind(&args.admin_listen)
            .await
            .with_context(|| format!("binding {}", args.admin_listen))?;
        let state = Arc::new(ApiState {
            ledger: ledger.clone(),
            verifier: Verifier::hs256(jwt_secret.as_bytes(), None, None)?,
            redis: None,
            service: Default::default(),
        });
        tokio::spawn(async move {
            let _ = axum::serve(admin, billing_router(state)).await;
        });
        anyhow::Ok((engine_addrs, ledger, Usage::local(&db_url).await?))
    })?;
    // The demo tenant and key: created once; the key is shown only when issued.
    let demo_env = dir.join("demo.env");
    let scheme = if args.plain_http { "http" } else { "https" };
    let mut lines = vec![env_line("OPENAI_BASE_URL", &format!("{scheme}://{}/v1", args.listen))];
    let tls = if args.plain_http { None } else { Some(tls_files(&dir)?) };
    if let Some((ca, _, _)) = &tls {
        lines.push(env_line("SSL_CERT_FILE", &ca.display().to_string()));
    }
    let existing_key =
        std::fs::read_to_string(&demo_env).ok().and_then(|s| env_value(&s, "OPENAI_API_KEY"));
    let (key, fresh) = io.handle.block_on(demo_key(&ledger, existing_key))?;
    lines.push(env_line("OPENAI_API_KEY", &key));
    write_private(&demo_env, &(lines.join("\n") + "\n"))?;
    let admin_path = write_admin_env(&dir, &args.admin_listen, &jwt_secret)?;
    let mut cfg = args.front.apply(GatewayConfig::platform(
        &engine_addrs,
        Some(internal_token.clone()),
        RedisDownPolicy::Local,
    ));
    // First come, first served all the way: the gateway does not share places out either.
    cfg.fair_admission &= args.scheduling == sluice_engine::serve::core::Scheduling::Fair;
    let gateway = Gateway::new(
        cfg,
        ledger.clone(),
        usage.limiter,
        texts,
        usage.sink.clone(),
        io.handle.clone(),
    );
    for model in &models {
        gateway.seed_identity(model.identity.clone());
    }
    let served = gateway.models();
    if served.len() < models.len() {
        bail!(
            "the engines did not say what they serve within {:?}",
            sluice_gateway::proxy::FIRST_POLL
        );
    }
    for model in served.iter().filter(|m| !sluice_policies::prices::PRICES.priced(m)) {
        eprintln!(
            "warning: {model} has no price in {}: its requests get 503 model_not_priced until \
             the price list names it (--policies DIR with a prices.json that does)",
            sluice_policies::source("prices.json")
        );
    }
    let metrics = serve_metrics(&io, &args.front.metrics_listen, &gateway)?;
    let metrics_url = format!("http://{metrics}/metrics");
    let mut admin_env = std::fs::read_to_string(&admin_path)?;
    admin_env.push_str(&(env_line("SLUICE_METRICS_URL", &metrics_url) + "\n"));
    write_private(&admin_path, &admin_env)?;
    print_banner(
        &args,
        scheme,
        &served,
        &metrics_url,
        fresh.then_some(key.as_str()),
        &demo_env,
        &admin_path,
    )?;
    let tls_ref = tls.as_ref().map(|(_, c, k)| (c.as_path(), k.as_path()));
    let journal = gateway.journal();
    run_proxy(gateway, &args.listen, tls_ref, args.front.drain(), Some(internal_token))?;
    finish(&io, usage.ingest.as_deref(), &usage.sink, journal.as_deref(), &ledger)?;
    eprintln!("shut down");
    Ok(())
}
