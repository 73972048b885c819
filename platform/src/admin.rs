//! `sluice billing` (the billing service: admin/audit API, dashboard, usage ingestion) and
//! the `sluice admin` / `sluice audit` clients over its HTTP API.

use std::io::Write;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use sluice_billing::api::{ApiState, ServiceStatus, router};
use sluice_billing::auth::{Principal, Role, Verifier, mint_hs256};
use sluice_billing::control::MAX_WEIGHT;
use sluice_billing::ingest::{IngestConfig, UsageConsumer};
use sluice_billing::{Ledger, LedgerOptions};
use sluice_policies::redis_conn::{Namespace, RedisTarget};

/// JWT settings shared by the service and `sluice admin token`.
#[derive(Args, Debug)]
pub struct JwtArgs {
    /// HS256 shared secret (at least 32 bytes); read from the environment only.
    #[arg(
        long = "jwt-secret-from-env",
        hide = true,
        env = "SLUICE_JWT_SECRET",
        hide_env_values = true
    )]
    secret: Option<String>,
    /// PEM public key verifying RS256 or EdDSA tokens, instead of a shared secret.
    #[arg(long)]
    jwt_public_key: Option<std::path::PathBuf>,
    /// Algorithm of --jwt-public-key: RS256 or EdDSA.
    #[arg(long, default_value = "RS256")]
    jwt_alg: String,
    /// Required `iss` claim.
    #[arg(long, env = "SLUICE_JWT_ISSUER")]
    jwt_issuer: Option<String>,
    /// Required `aud` claim.
    #[arg(long, env = "SLUICE_JWT_AUDIENCE")]
    jwt_audience: Option<String>,
}

impl JwtArgs {
    fn verifier(&self) -> anyhow::Result<Verifier> {
        let (iss, aud) = (self.jwt_issuer.as_deref(), self.jwt_audience.as_deref());
        Ok(match (&self.jwt_public_key, &self.secret) {
            (Some(path), _) => {
                let pem = std::fs::read(path)
                    .with_context(|| format!("reading --jwt-public-key {}", path.display()))?;
                Verifier::public_key(&self.jwt_alg, &pem, iss, aud)?
            }
            (None, Some(secret)) => {
                Verifier::hs256(secret.as_bytes(), iss, aud).context("SLUICE_JWT_SECRET")?
            }
            (None, None) => bail!(
                "no JWT key: set SLUICE_JWT_SECRET (HS256, 32+ bytes) or pass --jwt-public-key"
            ),
        })
    }
}

/// `sluice billing`.
#[derive(Args, Debug)]
#[command(subcommand_negates_reqs = true)]
pub struct BillingArgs {
    #[command(subcommand)]
    command: Option<BillingCommand>,
    /// postgres://... (production) or sqlite://PATH (embedded).
    #[arg(long, env = "SLUICE_DATABASE_URL", required = true)]
    database_url: Option<String>,
    /// Address for the admin, audit and dashboard API.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
    /// Redis: consume usage events from the stream and announce control-plane changes.
    #[arg(long, env = "SLUICE_REDIS_URL")]
    redis_url: Option<String>,
    /// This replica's consumer name in the usage stream's group.
    #[arg(long, default_value = "billing-1")]
    consumer: String,
    /// The deployment's namespace in Redis (1-64 ASCII letters, digits, `-`, `_`, `.`): the
    /// usage stream consumed and the control channel are named under it (the deployment's
    /// gateways name the same one).
    #[arg(long, env = "SLUICE_REDIS_NAMESPACE", value_name = "NAME", default_value = Namespace::DEFAULT)]
    redis_namespace: Namespace,
    /// Usage stream to consume (default: the namespace's; tests isolate themselves with their
    /// own).
    #[arg(long, hide = true)]
    usage_stream: Option<String>,
    /// Consumer group on the usage stream.
    #[arg(long, hide = true, default_value = sluice_billing::ingest::CONSUMER_GROUP)]
    consumer_group: String,
    /// Pending usage entries another consumer left unacknowledged this long are taken over
    /// (default 60 s): a replica that died for good is drained by the others.
    #[arg(long, value_name = "SECONDS")]
    claim_min_idle: Option<u64>,
    /// On SIGTERM or SIGINT, how long the consumer's batch in hand and the API's requests in
    /// hand have to finish, in seconds (readiness answers 503 from the signal on).
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    #[command(flatten)]
    jwt: JwtArgs,
}

#[derive(Subcommand, Debug)]
enum BillingCommand {
    /// Archive and drop the request-record months before the kept window (Postgres ledger):
    /// each month's partition is detached, copied into DIR/request_records_YYYY_MM.sqlite (a
    /// SQLite ledger, queryable with sqlite3 or `sluice billing --database-url sqlite://FILE`),
    /// verified against it, then dropped.
    Retention(RetentionArgs),
}

#[derive(Args, Debug)]
struct RetentionArgs {
    /// postgres://... ledger.
    #[arg(long, env = "SLUICE_DATABASE_URL")]
    database_url: String,
    /// Months kept, the current one included: 13mo, 2y.
    #[arg(long, value_parser = sluice_billing::retention::parse_keep)]
    keep: u32,
    /// Where the archive files are written (created if missing).
    #[arg(long)]
    archive_dir: std::path::PathBuf,
    /// Report what would be archived; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn run_retention(args: RetentionArgs) -> anyhow::Result<()> {
    use sluice_billing::retention::RetentionOptions;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(async {
        let ledger = Ledger::connect(&args.database_url).await.context("--database-url")?;
        let options = RetentionOptions {
            keep_months: args.keep,
            archive_dir: args.archive_dir.clone(),
            dry_run: args.dry_run,
            now: chrono::Utc::now(),
        };
        let report = ledger.apply_retention(&options).await;
        ledger.close().await;
        anyhow::Ok(report?)
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "keep {} months: records before {} leave the ledger{}",
        report.keep_months,
        report.cutoff.format("%Y-%m-%d"),
        if args.dry_run { " (dry run: nothing changed)" } else { "" }
    );
    println!("past-month rows in the default partition: {}", report.moved_from_default);
    println!(
        "{:<24} {:>10} {:>14} {:>14} {:>16}  {:<16} archive",
        "partition", "rows", "prompt", "completion", "cost_micros", "action"
    );
    for m in &report.months {
        println!(
            "{:<24} {:>10} {:>14} {:>14} {:>16}  {:<16} {}",
            m.partition,
            m.sums.rows,
            m.sums.prompt_tokens,
            m.sums.completion_tokens,
            m.sums.cost_micros,
            m.action,
            m.archive.as_deref().unwrap_or("-")
        );
    }
    println!("kept: {}", report.kept.join(", "));
    Ok(())
}

/// Runs the billing service until Ctrl-C or SIGTERM (or `sluice billing retention`).
pub fn run_billing(args: BillingArgs) -> anyhow::Result<()> {
    if let Some(BillingCommand::Retention(retention)) = args.command {
        return run_retention(retention);
    }
    let database_url = args.database_url.context("--database-url is required")?;
    let verifier = args.jwt.verifier()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let ledger = Ledger::connect_with(&database_url, &LedgerOptions::default())
            .await
            .context("connecting to --database-url")?;
        // The months ahead keep existing while the service runs (connect created them).
        let partitions = {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(std::time::Duration::from_secs(3600));
                every.tick().await;
                loop {
                    every.tick().await;
                    let now = chrono::Utc::now();
                    let ahead = now + sluice_billing::store::PARTITIONS_AHEAD;
                    if let Err(e) = ledger.create_record_partitions(now, ahead).await {
                        tracing::warn!(error = %e, "creating the months ahead's partitions failed");
                    }
                }
            })
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let service = Arc::new(ServiceStatus::default());
        let mut consumer_task = None;
        let mut redis = None;
        if let Some(url) = &args.redis_url {
            let client = RedisTarget::open(url).context("--redis-url")?;
            let conn = client.connect().await.context("connecting to --redis-url")?;
            redis = Some((conn, args.redis_namespace.clone()));
            let stream =
                args.usage_stream.clone().unwrap_or_else(|| args.redis_namespace.usage_stream());
            let mut config = IngestConfig::new(&args.consumer);
            // The dead-letter stream shares the usage stream's hash tag (same cluster slot).
            config.dead_letter_stream = format!("{stream}:dead");
            config.stream = stream.clone();
            config.group = args.consumer_group.clone();
            if let Some(idle) = args.claim_min_idle {
                let idle = std::time::Duration::from_secs(idle);
                config.claim_min_idle = idle;
                config.claim_interval = config.claim_interval.min(idle);
            }
            let consumer = UsageConsumer::new(client, ledger.clone(), config)
                .await
                .context("joining the usage stream's consumer group")?;
            service.set_consumer(consumer.stats(), &stream, &args.consumer_group);
            consumer_task = Some(tokio::spawn(consumer.run(stop_rx)));
        }
        let state = Arc::new(ApiState {
            ledger: ledger.clone(),
            verifier,
            redis,
            service: service.clone(),
        });
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        println!("listening on http://{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let (http_stop_tx, http_stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(
            axum::serve(listener, router(state))
                .with_graceful_shutdown(async {
                    let _ = http_stop_rx.await;
                })
                .into_future(),
        );
        tokio::select! {
            () = crate::shutdown_signal() => {}
            served = &mut server => {
                served.context("serving")?.context("serving")?;
                anyhow::bail!("the billing API stopped serving");
            }
        }
        // Drain: readiness fails at once; the consumer finishes the batch in hand (commit,
        // then ack) and the API the requests in hand, within --drain-timeout together.
        // Whatever is still unacknowledged after that stays pending in the stream for the
        // next start or another replica: nothing is lost, only delayed.
        service.begin_drain();
        let drain_timeout = std::time::Duration::from_secs(args.drain_timeout);
        let deadline = tokio::time::Instant::now() + drain_timeout;
        eprintln!("shutting down: draining (up to {drain_timeout:?})");
        let _ = stop_tx.send(true);
        partitions.abort();
        if let Some(mut task) = consumer_task {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(done) => done.context("usage consumer")?.context("usage consumer")?,
                Err(_) => {
                    tracing::warn!(
                        "the usage consumer did not finish its batch within the drain timeout; \
                         it stays pending in the stream"
                    );
                    task.abort();
                }
            }
        }
        let _ = http_stop_tx.send(());
        match tokio::time::timeout_at(deadline, &mut server).await {
            Ok(served) => served.context("serving")?.context("serving")?,
            Err(_) => {
                tracing::warn!("API requests still open at the drain timeout; stopping anyway");
                server.abort();
            }
        }
        // Bounded too: a connection still held by an aborted write must not hold the exit.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), ledger.close()).await;
        eprintln!("shut down");
        anyhow::Ok(())
    })
}

/// Where the admin and audit clients find the billing service.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// Billing service base URL.
    #[arg(long, env = "SLUICE_ADMIN_URL", global = true)]
    admin_url: Option<String>,
    /// Bearer JWT.
    #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true, global = true)]
    admin_token: Option<String>,
}

/// `sluice admin`.
#[derive(Subcommand, Debug)]
pub enum AdminCommand {
    /// Tenants.
    #[command(subcommand)]
    Tenants(TenantCommand),
    /// API keys.
    #[command(subcommand)]
    Keys(KeyCommand),
    /// Per-tenant quotas.
    #[command(subcommand)]
    Quotas(QuotaCommand),
    /// Tenants' LoRA adapters on a shared base model.
    #[command(subcommand)]
    Adapters(AdapterCommand),
    /// Mint an HS256 admin token with SLUICE_JWT_SECRET and print it.
    Token {
        /// ops, billing, auditor or tenant-admin.
        #[arg(long)]
        role: String,
        /// The actor recorded in the audit log.
        #[arg(long)]
        sub: String,
        /// Tenant of a tenant-admin token.
        #[arg(long)]
        tenant: Option<String>,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
        #[command(flatten)]
        jwt: JwtArgs,
    },
    /// Mint a short-lived token and print a link that signs the console in with it (the
    /// token rides in the link's fragment, which browsers never send; the page removes it).
    Console {
        /// ops, billing, auditor or tenant-admin.
        #[arg(long)]
        role: String,
        /// The actor recorded in the audit log.
        #[arg(long, default_value = "console")]
        sub: String,
        /// Tenant of a tenant-admin token.
        #[arg(long)]
        tenant: Option<String>,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 900)]
        ttl: u64,
        #[command(flatten)]
        jwt: JwtArgs,
    },
}

/// `sluice admin adapters`.
#[derive(Subcommand, Debug)]
pub enum AdapterCommand {
    /// Check an adapter (a PEFT directory or a GGUF LoRA) against its base model, put it in
    /// the engines' store under its revision, and register that revision for the tenant.
    Register {
        /// Tenant id.
        tenant: String,
        /// The adapter's name within the tenant (requests name `TENANT/NAME`).
        name: String,
        /// The adapter: a PEFT directory (adapter_config.json, adapter_model.safetensors) or
        /// a GGUF LoRA file.
        #[arg(long)]
        path: std::path::PathBuf,
        /// The base model's file or directory (or catalog name) the engines serve.
        #[arg(long)]
        model: std::path::PathBuf,
        /// The id the engines serve the base model under (default: the file's model id).
        #[arg(long)]
        served_model_name: Option<String>,
        /// The engines' adapter store (their --adapter-store).
        #[arg(long, env = "SLUICE_ADAPTER_STORE")]
        store: std::path::PathBuf,
        /// Other tenants that may use it (repeatable).
        #[arg(long = "share-with")]
        share_with: Vec<String>,
    },
    /// List a tenant's adapters and those shared with it.
    List {
        /// Tenant id.
        tenant: String,
    },
    /// Retire an adapter: one revision, or every active one. Running requests finish; new
    /// ones naming it are refused, and the name alone rolls back to the newest revision left.
    Retire {
        /// Tenant id.
        tenant: String,
        /// Adapter name.
        name: String,
        /// Only this revision (sha256:...).
        #[arg(long)]
        revision: Option<String>,
    },
    /// Set the other tenants that may use an adapter (none: only its own tenant).
    Share {
        /// Tenant id.
        tenant: String,
        /// Adapter name.
        name: String,
        /// Tenants (repeatable).
        #[arg(long = "with")]
        with: Vec<String>,
    },
}

/// Checks the adapter at `path` against the base model at `model`, puts it in `store`, and
/// returns the registration body.
fn stored_adapter(
    name: &str,
    path: &std::path::Path,
    model: &std::path::Path,
    served: Option<&str>,
    store: &std::path::Path,
) -> anyhow::Result<Value> {
    let model = sluice_engine::fetch::resolve_model(model, &|s| eprintln!("{s}"))?;
    let base = sluice_engine::loader::LoadedModel::load(&model)
        .with_context(|| format!("loading the base model {}", model.display()))?;
    let adapter = sluice_engine::server::adapters::put_in_store(path, &base.weights.config, store)
        .with_context(|| format!("checking {} against {}", path.display(), model.display()))?;
    let targets: Vec<&str> = adapter.targets().iter().map(|t| t.peft_name()).collect();
    Ok(json!({
        "name": name,
        "revision": adapter.revision,
        "base_model": served.unwrap_or(&base.identity.model_id),
        "base_revision": base.identity.model_revision,
        "rank": adapter.rank,
        "targets": targets,
        "bytes": adapter.memory_bytes(),
    }))
}

/// `sluice admin tenants`.
#[derive(Subcommand, Debug)]
pub enum TenantCommand {
    /// Create a tenant.
    Create {
        /// Tenant id (a-z 0-9 - _).
        id: String,
        /// Display name.
        #[arg(long)]
        name: Option<String>,
        /// Quota tier (policies/tiers.json).
        #[arg(long)]
        tier: Option<String>,
        /// The tenant's own fair-order weight (1 to 1000), in place of its tier's
        /// (policies/scheduling.json).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_WEIGHT)))]
        weight: Option<u32>,
    },
    /// Change a tenant's name, tier or fair-order weight (the others are kept).
    Update {
        /// Tenant id.
        id: String,
        /// New display name.
        #[arg(long)]
        name: Option<String>,
        /// New quota tier (policies/tiers.json).
        #[arg(long)]
        tier: Option<String>,
        /// The tenant's own fair-order weight (1 to 1000), or `tier` for its tier's again.
        #[arg(long, value_name = "N|tier", value_parser = parse_weight)]
        weight: Option<Weight>,
    },
    /// List tenants.
    List,
    /// Suspend a tenant.
    Suspend {
        /// Tenant id.
        id: String,
    },
    /// Reactivate a suspended tenant.
    Activate {
        /// Tenant id.
        id: String,
    },
}

/// A tenant's fair-order weight as `tenants update --weight` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    /// Its own, 1 to 1000.
    Own(u32),
    /// Its tier's (the override removed).
    Tier,
}

fn parse_weight(s: &str) -> Result<Weight, String> {
    if s == "tier" {
        return Ok(Weight::Tier);
    }
    match s.parse::<u32>() {
        Ok(w) if (1..=MAX_WEIGHT).contains(&w) => Ok(Weight::Own(w)),
        _ => Err(format!("{s:?} is neither a weight from 1 to {MAX_WEIGHT} nor `tier`")),
    }
}

/// `sluice admin keys`.
#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Issue a key; its secret is printed once and never stored.
    Issue {
        /// Tenant id.
        tenant: String,
        /// Scopes (completions, chat, models); default all.
        #[arg(long = "scope")]
        scopes: Vec<String>,
        /// Expiry (RFC 3339).
        #[arg(long)]
        expires_at: Option<String>,
    },
    /// List a tenant's keys (prefixes only).
    List {
        /// Tenant id.
        tenant: String,
    },
    /// Revoke a key.
    Revoke {
        /// Tenant id.
        tenant: String,
        /// Key id.
        key: String,
    },
    /// Replace a key's own limits, enforced beside its tenant's quota (limits left out: only
    /// the tenant's applies).
    Limits {
        /// Tenant id.
        tenant: String,
        /// Key id.
        key: String,
        #[command(flatten)]
        limits: RateLimitArgs,
    },
}

/// The rate and token limits a tenant's quota and a key's limits share.
#[derive(clap::Args, Debug)]
pub struct RateLimitArgs {
    #[arg(long)]
    rpm: Option<i64>,
    #[arg(long)]
    tpm: Option<i64>,
    #[arg(long)]
    daily_tokens: Option<i64>,
    #[arg(long)]
    monthly_tokens: Option<i64>,
    #[arg(long)]
    concurrency: Option<i64>,
}

impl RateLimitArgs {
    fn json(&self) -> serde_json::Value {
        json!({
            "rpm": self.rpm, "tpm": self.tpm, "daily_tokens": self.daily_tokens,
            "monthly_tokens": self.monthly_tokens, "concurrency": self.concurrency,
        })
    }
}

/// `sluice admin quotas`.
#[derive(Subcommand, Debug)]
pub enum QuotaCommand {
    /// Show a tenant's quota overrides and effective limits.
    Get {
        /// Tenant id.
        tenant: String,
    },
    /// Replace a tenant's quota overrides (limits left out fall back to the tier).
    Set {
        /// Tenant id.
        tenant: String,
        #[command(flatten)]
        limits: RateLimitArgs,
        #[arg(long)]
        max_prompt_tokens: Option<i64>,
        #[arg(long)]
        max_output_tokens: Option<i64>,
        #[arg(long)]
        max_n: Option<i64>,
        /// A model the tenant may call (repeat; none = every model).
        #[arg(long = "allowed-model")]
        allowed_models: Vec<String>,
        #[arg(long, allow_hyphen_values = true)]
        priority: Option<i64>,
    },
}

/// `sluice audit`.
#[derive(Subcommand, Debug)]
pub enum AuditCommand {
    /// Request records, one per line.
    Records {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        key: Option<String>,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        model_revision: Option<String>,
        #[arg(long)]
        finish_reason: Option<String>,
        /// A tenant adapter: `TENANT/NAME@REVISION`, or `TENANT/NAME` for every revision.
        #[arg(long)]
        adapter: Option<String>,
        /// HTTP status.
        #[arg(long)]
        status: Option<u16>,
        /// From (RFC 3339, YYYY-MM-DD, or an age like 24h).
        #[arg(long)]
        since: Option<String>,
        /// Until (same forms).
        #[arg(long)]
        until: Option<String>,
        /// Most records printed (pages are followed).
        #[arg(long, default_value_t = 100)]
        limit: u64,
        /// jsonl or csv.
        #[arg(long, default_value = "jsonl")]
        format: String,
    },
    /// The admin audit log, one entry per line.
    Log {
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        actor: Option<String>,
        #[arg(long)]
        target: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u64,
    },
    /// Checks the ledger: the hour rollups against the rows they count, and with `--engine`,
    /// every request an engine ran against its row (tokens by request id, totals per tenant
    /// and model). Prints each difference; exits non-zero when there is any.
    Reconcile {
        /// From (RFC 3339, YYYY-MM-DD, or an age like 24h).
        #[arg(long, default_value = "24h")]
        since: String,
        /// An engine worker `host:port` as the gateway names it (repeat for several).
        #[arg(long = "engine")]
        engines: Vec<String>,
        /// Bearer token the engines require.
        #[arg(long, env = "SLUICE_INTERNAL_TOKEN", hide_env_values = true)]
        internal_token: Option<String>,
    },
    /// Aggregate usage per bucket, tenant and model.
    Usage {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        model: Option<String>,
        /// hour or day.
        #[arg(long, default_value = "day")]
        period: String,
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        until: Option<String>,
    },
}

pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    fn new(args: &ClientArgs) -> anyhow::Result<Self> {
        let base = args
            .admin_url
            .clone()
            .context("set SLUICE_ADMIN_URL to the billing service (e.g. http://127.0.0.1:8090)")?;
        let token = args
            .admin_token
            .clone()
            .context("set SLUICE_ADMIN_TOKEN to an admin JWT (see `sluice admin token`)")?;
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(60))
            .build()
            .context("building the HTTP client")?;
        Ok(Self { base: base.trim_end_matches('/').to_owned(), token, http })
    }

    pub(crate) async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
    ) -> anyhow::Result<reqwest::Response> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method, &url).bearer_auth(&self.token).query(query);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the billing service at {}", self.base))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let msg = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| {
                let e = v.get("error")?;
                let m = e.get("message")?.as_str()?.to_owned();
                Some(match e.get("param").and_then(Value::as_str) {
                    Some(p) => format!("{m} (parameter {p})"),
                    None => m,
                })
            })
            .unwrap_or(text);
        bail!("{} {}: {msg}", status.as_u16(), status.canonical_reason().unwrap_or(""))
    }

    pub(crate) async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let resp = self.send(method, path, query, body).await?;
        resp.json().await.context("the billing service sent invalid JSON")
    }
}

fn print_json(v: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn opt(query: &mut Vec<(&'static str, String)>, name: &'static str, v: Option<String>) {
    if let Some(v) = v {
        query.push((name, v));
    }
}

fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(f: F) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(f)
}

/// An HS256 admin token for `role`, signed with SLUICE_JWT_SECRET.
fn mint(
    role: &str,
    sub: &str,
    tenant: &Option<String>,
    ttl: u64,
    jwt: &JwtArgs,
) -> anyhow::Result<String> {
    let role = Role::parse(role).context("--role must be ops, billing, auditor or tenant-admin")?;
    if role == Role::TenantAdmin && tenant.is_none() {
        bail!("--tenant is needed for a tenant-admin token");
    }
    let secret = jwt.secret.as_deref().context("set SLUICE_JWT_SECRET to mint a token")?;
    let who = Principal { actor: sub.to_owned(), role, tenant: tenant.clone() };
    Ok(mint_hs256(
        secret.as_bytes(),
        &who,
        ttl,
        jwt.jwt_issuer.as_deref(),
        jwt.jwt_audience.as_deref(),
    )?)
}

/// Runs `sluice admin ...`.
pub fn run_admin(cmd: AdminCommand, client: &ClientArgs) -> anyhow::Result<()> {
    match &cmd {
        AdminCommand::Token { role, sub, tenant, ttl, jwt } => {
            println!("{}", mint(role, sub, tenant, *ttl, jwt)?);
            return Ok(());
        }
        AdminCommand::Console { role, sub, tenant, ttl, jwt } => {
            let base = client.admin_url.as_deref().context(
                "set SLUICE_ADMIN_URL to the billing service (e.g. http://127.0.0.1:8090)",
            )?;
            let token = mint(role, sub, tenant, *ttl, jwt)?;
            println!("{}/console#token={token}", base.trim_end_matches('/'));
            return Ok(());
        }
        _ => {}
    }
    let c = Client::new(client)?;
    block_on(async move {
        let v = match cmd {
            AdminCommand::Token { .. } | AdminCommand::Console { .. } => return Ok(()),
            AdminCommand::Tenants(cmd) => match tenant_command(&c, cmd).await? {
                Some(v) => v,
                None => return Ok(()),
            },
            AdminCommand::Keys(cmd) => key_command(&c, cmd).await?,
            AdminCommand::Adapters(cmd) => adapter_command(&c, cmd).await?,
            AdminCommand::Quotas(cmd) => quota_command(&c, cmd).await?,
        };
        print_json(&v)
    })
}

/// `sluice admin tenants ...`: the admin API's answer to print, `None` when it printed itself.
async fn tenant_command(c: &Client, cmd: TenantCommand) -> anyhow::Result<Option<Value>> {
    use reqwest::Method;
    Ok(Some(match cmd {
        TenantCommand::Create { id, name, tier, weight } => {
            let mut body = json!({"id": id, "name": name, "tier": tier});
            if let Some(w) = weight {
                body["overrides"] = json!({"weight": w});
            }
            c.json(Method::POST, "/v1/tenants", &[], Some(body)).await?
        }
        TenantCommand::Update { id, name, tier, weight } => {
            let mut body = json!({});
            if let Some(n) = name {
                body["name"] = json!(n);
            }
            if let Some(t) = tier {
                body["tier"] = json!(t);
            }
            if let Some(w) = weight {
                let w = match w {
                    Weight::Own(w) => json!(w),
                    Weight::Tier => Value::Null,
                };
                body["overrides"] = json!({"weight": w});
            }
            c.json(Method::PATCH, &format!("/v1/tenants/{id}"), &[], Some(body)).await?
        }
        TenantCommand::List => {
            let v = c.json(Method::GET, "/v1/tenants", &[], None).await?;
            for line in tenant_lines(&v)? {
                println!("{line}");
            }
            return Ok(None);
        }
        TenantCommand::Suspend { id } => {
            c.json(Method::POST, &format!("/v1/tenants/{id}/suspend"), &[], None).await?
        }
        TenantCommand::Activate { id } => {
            c.json(Method::POST, &format!("/v1/tenants/{id}/activate"), &[], None).await?
        }
    }))
}

/// `sluice admin keys ...`: the admin API's answer.
async fn key_command(c: &Client, cmd: KeyCommand) -> anyhow::Result<Value> {
    use reqwest::Method;
    Ok(match cmd {
        KeyCommand::Issue { tenant, scopes, expires_at } => {
            let mut body = json!({});
            if !scopes.is_empty() {
                body["scopes"] = json!(scopes);
            }
            if let Some(e) = expires_at {
                body["expires_at"] = json!(e);
            }
            c.json(Method::POST, &format!("/v1/tenants/{tenant}/keys"), &[], Some(body)).await?
        }
        KeyCommand::List { tenant } => {
            c.json(Method::GET, &format!("/v1/tenants/{tenant}/keys"), &[], None).await?
        }
        KeyCommand::Revoke { tenant, key } => {
            let path = format!("/v1/tenants/{tenant}/keys/{key}/revoke");
            c.json(Method::POST, &path, &[], None).await?
        }
        KeyCommand::Limits { tenant, key, limits } => {
            let body = limits.json();
            let path = format!("/v1/tenants/{tenant}/keys/{key}/limits");
            c.json(Method::PUT, &path, &[], Some(body)).await?
        }
    })
}

/// `sluice admin adapters ...`: the admin API's answer.
async fn adapter_command(c: &Client, cmd: AdapterCommand) -> anyhow::Result<Value> {
    use reqwest::Method;
    Ok(match cmd {
        AdapterCommand::Register {
            tenant,
            name,
            path,
            model,
            served_model_name,
            store,
            share_with,
        } => {
            let mut body = tokio::task::spawn_blocking(move || {
                stored_adapter(&name, &path, &model, served_model_name.as_deref(), &store)
            })
            .await??;
            if !share_with.is_empty() {
                body["shared_with"] = json!(share_with);
            }
            c.json(Method::POST, &format!("/v1/tenants/{tenant}/adapters"), &[], Some(body)).await?
        }
        AdapterCommand::List { tenant } => {
            c.json(Method::GET, &format!("/v1/tenants/{tenant}/adapters"), &[], None).await?
        }
        AdapterCommand::Retire { tenant, name, revision } => {
            let path = format!("/v1/tenants/{tenant}/adapters/{name}/retire");
            let body = revision.map(|r| json!({"revision": r}));
            c.json(Method::POST, &path, &[], body).await?
        }
        AdapterCommand::Share { tenant, name, with } => {
            let path = format!("/v1/tenants/{tenant}/adapters/{name}/sharing");
            c.json(Method::PUT, &path, &[], Some(json!({"shared_with": with}))).await?
        }
    })
}

/// `sluice admin quotas ...`: the admin API's answer.
async fn quota_command(c: &Client, cmd: QuotaCommand) -> anyhow::Result<Value> {
    use reqwest::Method;
    Ok(match cmd {
        QuotaCommand::Get { tenant } => {
            c.json(Method::GET, &format!("/v1/tenants/{tenant}/quota"), &[], None).await?
        }
        QuotaCommand::Set {
            tenant,
            limits,
            max_prompt_tokens,
            max_output_tokens,
            max_n,
            allowed_models,
            priority,
        } => {
            let mut body = limits.json();
            body["max_prompt_tokens"] = json!(max_prompt_tokens);
            body["max_output_tokens"] = json!(max_output_tokens);
            body["max_n"] = json!(max_n);
            body["allowed_models"] = json!(allowed_models);
            body["priority"] = json!(priority);
            c.json(Method::PUT, &format!("/v1/tenants/{tenant}/quota"), &[], Some(body)).await?
        }
    })
}

/// Runs `sluice audit ...`.
pub fn run_audit(cmd: AuditCommand, client: &ClientArgs) -> anyhow::Result<()> {
    use reqwest::Method;
    let c = Client::new(client)?;
    block_on(async move {
        match cmd {
            AuditCommand::Records {
                tenant,
                key,
                model,
                model_revision,
                finish_reason,
                adapter,
                status,
                since,
                until,
                limit,
                format,
            } => {
                if format != "jsonl" && format != "csv" {
                    bail!("--format must be jsonl or csv");
                }
                let mut base = Vec::new();
                opt(&mut base, "tenant", tenant);
                opt(&mut base, "key", key);
                opt(&mut base, "model", model);
                opt(&mut base, "model_revision", model_revision);
                opt(&mut base, "finish_reason", finish_reason);
                opt(&mut base, "adapter", adapter);
                opt(&mut base, "status", status.map(|s| s.to_string()));
                opt(&mut base, "since", since);
                opt(&mut base, "until", until);
                base.push(("format", format.clone()));
                let mut left = limit;
                let mut cursor: Option<String> = None;
                let mut first_header: Option<String> = None;
                let mut out = std::io::stdout().lock();
                while left > 0 {
                    let mut q = base.clone();
                    q.push(("limit", left.min(1000).to_string()));
                    opt(&mut q, "cursor", cursor.take());
                    let resp = c.send(Method::GET, "/v1/records", &q, None).await?;
                    let header = |name| {
                        resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
                    };
                    let (next, content_type) = (header("x-next-cursor"), header("content-type"));
                    let text = resp.text().await.context("reading records")?;
                    let page = RecordsPage::read(&format, content_type.as_deref(), &text)?;
                    if let Some(h) = page.header {
                        match &first_header {
                            None => {
                                writeln!(out, "{h}")?;
                                first_header = Some(h.to_owned());
                            }
                            Some(first) if first != h => {
                                bail!("the billing service changed the CSV columns between pages")
                            }
                            Some(_) => {}
                        }
                    }
                    for record in &page.records {
                        writeln!(out, "{record}")?;
                    }
                    let n = page.records.len() as u64;
                    left = left.saturating_sub(n);
                    match next {
                        Some(c) if n > 0 => cursor = Some(c),
                        _ => break,
                    }
                }
                Ok(())
            }
            AuditCommand::Log { since, actor, target, limit } => {
                let mut base = Vec::new();
                opt(&mut base, "since", since);
                opt(&mut base, "actor", actor);
                opt(&mut base, "target", target);
                let mut left = limit;
                let mut cursor: Option<String> = None;
                while left > 0 {
                    let mut q = base.clone();
                    q.push(("limit", left.min(1000).to_string()));
                    opt(&mut q, "cursor", cursor.take());
                    let v = c.json(Method::GET, "/v1/audit-log", &q, None).await?;
                    let (entries, next) = audit_log_page(&v)?;
                    for e in entries {
                        println!("{e}");
                    }
                    left = left.saturating_sub(entries.len() as u64);
                    match next {
                        Some(c) if !entries.is_empty() => cursor = Some(c.to_owned()),
                        _ => break,
                    }
                }
                Ok(())
            }
            AuditCommand::Reconcile { since, engines, internal_token } => {
                crate::reconcile::run(&c, &since, &engines, internal_token.as_deref()).await
            }
            AuditCommand::Usage { tenant, model, period, since, until } => {
                let mut q = vec![("period", period)];
                opt(&mut q, "tenant", tenant);
                opt(&mut q, "model", model);
                opt(&mut q, "since", since);
                opt(&mut q, "until", until);
                let v = c.json(Method::GET, "/v1/usage", &q, None).await?;
                check_usage(&v)?;
                print_json(&v)
            }
        }
    })
}

// What the clients read from the billing API is read strictly: an answer they do not
// understand is an error naming what is missing, never an empty list printed as "nothing".

/// `GET /v1/tenants` as lines of id, status, tier and name (tab-separated).
fn tenant_lines(v: &Value) -> anyhow::Result<Vec<String>> {
    let tenants = v
        .get("data")
        .and_then(Value::as_array)
        .context("the billing service's tenant list has no `data` array")?;
    tenants
        .iter()
        .map(|t| {
            let text = |field: &str| {
                t.get(field)
                    .and_then(Value::as_str)
                    .with_context(|| format!("a tenant without a `{field}` string: {t}"))
            };
            let name = match t.get("name") {
                Some(Value::String(n)) => n.as_str(),
                Some(Value::Null) => "",
                _ => bail!("a tenant without a `name` (a string or null): {t}"),
            };
            Ok(format!("{}\t{}\t{}\t{name}", text("id")?, text("status")?, text("tier")?))
        })
        .collect()
}

/// A page of `GET /v1/audit-log`: its entries and the next page's cursor (null on the last).
fn audit_log_page(v: &Value) -> anyhow::Result<(&[Value], Option<&str>)> {
    let entries = v
        .get("data")
        .and_then(Value::as_array)
        .context("the billing service's audit log page has no `data` array")?;
    if let Some(e) = entries.iter().find(|e| !e.is_object()) {
        bail!("an audit log entry is not an object: {e}");
    }
    let next = match v.get("next_cursor") {
        Some(Value::String(c)) => Some(c.as_str()),
        Some(Value::Null) => None,
        _ => bail!("the billing service's audit log page has no `next_cursor` (a string or null)"),
    };
    Ok((entries, next))
}

/// `GET /v1/usage`: its rows and totals must be there to be printed.
fn check_usage(v: &Value) -> anyhow::Result<()> {
    if !v.get("data").is_some_and(Value::is_array) {
        bail!("the billing service's usage has no `data` array");
    }
    if !v.get("totals").is_some_and(Value::is_object) {
        bail!("the billing service's usage has no `totals` object");
    }
    Ok(())
}

/// A page of `GET /v1/records` in the format asked for.
#[derive(Debug)]
struct RecordsPage<'a> {
    /// The CSV header line (`None` for JSON Lines).
    header: Option<&'a str>,
    /// Each record's text as printed: a JSON line, or a CSV record (which a quoted cell may
    /// carry over several lines).
    records: Vec<&'a str>,
}

impl<'a> RecordsPage<'a> {
    fn read(format: &str, content_type: Option<&str>, text: &'a str) -> anyhow::Result<Self> {
        let want = if format == "csv" { "text/csv" } else { "application/x-ndjson" };
        if !content_type.is_some_and(|t| t.starts_with(want)) {
            bail!(
                "the billing service answered the records query with {}, not {want}",
                content_type.unwrap_or("no content type")
            );
        }
        if format != "csv" {
            let records: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
            for (i, line) in records.iter().enumerate() {
                let r: Value = serde_json::from_str(line)
                    .with_context(|| format!("record {} of a page is not JSON", i + 1))?;
                if !r.get("request_id").is_some_and(Value::is_string) {
                    bail!("record {} of a page has no `request_id`", i + 1);
                }
            }
            return Ok(Self { header: None, records });
        }
        let mut rows = csv_records(text)?.into_iter();
        let (header, columns) = rows.next().context("a CSV page without its header line")?;
        if !header.starts_with("request_id,") {
            bail!("a CSV page whose header is not the records' columns: {header:?}");
        }
        let mut records = Vec::new();
        for (i, (record, fields)) in rows.enumerate() {
            if fields != columns {
                bail!("CSV record {} of a page has {fields} cells for {columns} columns", i + 1);
            }
            records.push(record);
        }
        Ok(Self { header: Some(header), records })
    }
}

/// CSV text cut into records (at line ends outside quoted cells), each with its cell count.
fn csv_records(text: &str) -> anyhow::Result<Vec<(&str, usize)>> {
    let mut out = Vec::new();
    let (mut start, mut cells, mut quoted) = (0, 1, false);
    for (i, c) in text.char_indices() {
        match c {
            // An escaped quote (`""`) flips twice.
            '"' => quoted = !quoted,
            ',' if !quoted => cells += 1,
            '\n' if !quoted => {
                out.push((&text[start..i], cells));
                (start, cells) = (i + 1, 1);
            }
            _ => {}
        }
    }
    if quoted {
        bail!("a CSV page ends inside a quoted cell");
    }
    if start < text.len() {
        out.push((&text[start..], cells));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audit_log_page_without_its_fields_is_an_error() {
        let v = json!({"data": [{"id": 1}], "next_cursor": "1"});
        assert_eq!(audit_log_page(&v).ok().map(|(e, n)| (e.len(), n)), Some((1, Some("1"))));
        let last = json!({"data": [], "next_cursor": null});
        assert_eq!(audit_log_page(&last).ok().map(|(e, n)| (e.len(), n)), Some((0, None)));
        for bad in [
            json!({}),
            json!({"next_cursor": null}),
            json!({"data": null, "next_cursor": null}),
            json!({"data": {}, "next_cursor": null}),
            json!({"data": []}),
            json!({"data": [], "next_cursor": 5}),
            json!({"data": [1], "next_cursor": null}),
            json!([]),
        ] {
            assert!(audit_log_page(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn usage_and_tenants_without_their_fields_are_an_error() {
        assert!(check_usage(&json!({"period": "day", "data": [], "totals": {}})).is_ok());
        for bad in [
            json!({}),
            json!({"data": []}),
            json!({"totals": {}}),
            json!({"data": {}, "totals": {}}),
        ] {
            assert!(check_usage(&bad).is_err(), "{bad}");
        }
        let tenants = json!({"data": [
            {"id": "acme", "status": "active", "tier": "free", "name": "Acme"},
            {"id": "globex", "status": "suspended", "tier": "standard", "name": null},
        ]});
        let lines = tenant_lines(&tenants).ok();
        let want = ["acme\tactive\tfree\tAcme", "globex\tsuspended\tstandard\t"];
        assert_eq!(lines.as_deref(), Some(&want.map(str::to_owned)[..]));
        for bad in [
            json!({}),
            json!({"data": null}),
            json!({"data": [{"id": "acme", "status": "active", "tier": "free"}]}),
            json!({"data": [{"id": "acme", "tier": "free", "name": null}]}),
            json!({"data": [{"id": 1, "status": "active", "tier": "free", "name": null}]}),
        ] {
            assert!(tenant_lines(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_records_page_is_read_by_its_format_and_refused_when_it_is_not_one() {
        let csv = "request_id,model_id,ttft_ms\nr1,\"'=1,\"\"2\"\"\n3\",-5.5\nr2,m,\n";
        let page = RecordsPage::read("csv", Some("text/csv; charset=utf-8"), csv);
        let page = page.ok().map(|p| (p.header, p.records));
        let records = vec!["r1,\"'=1,\"\"2\"\"\n3\",-5.5", "r2,m,"];
        assert_eq!(page, Some((Some("request_id,model_id,ttft_ms"), records)));
        let jsonl = "{\"request_id\":\"r1\"}\n{\"request_id\":\"r2\"}\n";
        let page = RecordsPage::read("jsonl", Some("application/x-ndjson"), jsonl);
        assert_eq!(page.ok().map(|p| p.records.len()), Some(2));
        for (format, content_type, text) in [
            ("csv", Some("text/html"), "request_id\n"),
            ("csv", None, "request_id\n"),
            ("csv", Some("text/csv"), ""),
            ("csv", Some("text/csv"), "<html></html>\n"),
            ("csv", Some("text/csv"), "request_id,model_id\nr1\n"),
            ("csv", Some("text/csv"), "request_id,model_id\nr1,\"open\n"),
            ("jsonl", Some("text/csv"), jsonl),
            ("jsonl", Some("application/x-ndjson"), "not json\n"),
            ("jsonl", Some("application/x-ndjson"), "{\"id\":1}\n"),
            ("jsonl", Some("application/x-ndjson"), "[]\n"),
        ] {
            let page = RecordsPage::read(format, content_type, text);
            assert!(page.is_err(), "{format} {content_type:?} {text:?} was read as {page:?}");
        }
    }
}
