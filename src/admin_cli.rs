//! `sluice billing` (the billing service: admin/audit API, dashboard, usage ingestion) and
//! the `sluice admin` / `sluice audit` clients over its HTTP API.

use std::io::Write;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use sluice_billing::api::{ApiState, ServiceStatus, router};
use sluice_billing::auth::{Principal, Role, Verifier, mint_hs256};
use sluice_billing::ingest::{IngestConfig, UsageConsumer};
use sluice_billing::redis_conn::RedisTarget;
use sluice_billing::{Ledger, LedgerOptions};

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
    /// Usage stream to consume (tests isolate themselves with their own).
    #[arg(long, hide = true, default_value = sluice_billing::ingest::USAGE_STREAM)]
    usage_stream: String,
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
            redis = Some(client.connect().await.context("connecting to --redis-url")?);
            let mut config = IngestConfig::new(&args.consumer);
            // The dead-letter stream shares the usage stream's hash tag (same cluster slot).
            config.dead_letter_stream = format!("{}:dead", args.usage_stream);
            config.stream = args.usage_stream.clone();
            config.group = args.consumer_group.clone();
            if let Some(idle) = args.claim_min_idle {
                let idle = std::time::Duration::from_secs(idle);
                config.claim_min_idle = idle;
                config.claim_interval = config.claim_interval.min(idle);
            }
            let consumer = UsageConsumer::new(client, ledger.clone(), config)
                .await
                .context("joining the usage stream's consumer group")?;
            service.set_consumer(consumer.stats(), &args.usage_stream, &args.consumer_group);
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

pub(crate) struct Client {
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
    use reqwest::Method;
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
            AdminCommand::Tenants(TenantCommand::Create { id, name, tier }) => {
                let body = json!({"id": id, "name": name, "tier": tier});
                c.json(Method::POST, "/v1/tenants", &[], Some(body)).await?
            }
            AdminCommand::Tenants(TenantCommand::List) => {
                let v = c.json(Method::GET, "/v1/tenants", &[], None).await?;
                for t in v["data"].as_array().into_iter().flatten() {
                    println!(
                        "{}\t{}\t{}\t{}",
                        t["id"].as_str().unwrap_or(""),
                        t["status"].as_str().unwrap_or(""),
                        t["tier"].as_str().unwrap_or(""),
                        t["name"].as_str().unwrap_or("")
                    );
                }
                return Ok(());
            }
            AdminCommand::Tenants(TenantCommand::Suspend { id }) => {
                c.json(Method::POST, &format!("/v1/tenants/{id}/suspend"), &[], None).await?
            }
            AdminCommand::Tenants(TenantCommand::Activate { id }) => {
                c.json(Method::POST, &format!("/v1/tenants/{id}/activate"), &[], None).await?
            }
            AdminCommand::Keys(KeyCommand::Issue { tenant, scopes, expires_at }) => {
                let mut body = json!({});
                if !scopes.is_empty() {
                    body["scopes"] = json!(scopes);
                }
                if let Some(e) = expires_at {
                    body["expires_at"] = json!(e);
                }
                c.json(Method::POST, &format!("/v1/tenants/{tenant}/keys"), &[], Some(body)).await?
            }
            AdminCommand::Keys(KeyCommand::List { tenant }) => {
                c.json(Method::GET, &format!("/v1/tenants/{tenant}/keys"), &[], None).await?
            }
            AdminCommand::Keys(KeyCommand::Revoke { tenant, key }) => {
                let path = format!("/v1/tenants/{tenant}/keys/{key}/revoke");
                c.json(Method::POST, &path, &[], None).await?
            }
            AdminCommand::Keys(KeyCommand::Limits { tenant, key, limits }) => {
                let body = limits.json();
                let path = format!("/v1/tenants/{tenant}/keys/{key}/limits");
                c.json(Method::PUT, &path, &[], Some(body)).await?
            }
            AdminCommand::Quotas(QuotaCommand::Get { tenant }) => {
                c.json(Method::GET, &format!("/v1/tenants/{tenant}/quota"), &[], None).await?
            }
            AdminCommand::Quotas(QuotaCommand::Set {
                tenant,
                limits,
                max_prompt_tokens,
                max_output_tokens,
                max_n,
                allowed_models,
                priority,
            }) => {
                let mut body = limits.json();
                body["max_prompt_tokens"] = json!(max_prompt_tokens);
                body["max_output_tokens"] = json!(max_output_tokens);
                body["max_n"] = json!(max_n);
                body["allowed_models"] = json!(allowed_models);
                body["priority"] = json!(priority);
                c.json(Method::PUT, &format!("/v1/tenants/{tenant}/quota"), &[], Some(body)).await?
            }
        };
        print_json(&v)
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
                opt(&mut base, "status", status.map(|s| s.to_string()));
                opt(&mut base, "since", since);
                opt(&mut base, "until", until);
                base.push(("format", format.clone()));
                let mut left = limit;
                let mut cursor: Option<String> = None;
                let mut header_done = false;
                let mut out = std::io::stdout().lock();
                while left > 0 {
                    let mut q = base.clone();
                    q.push(("limit", left.min(1000).to_string()));
                    opt(&mut q, "cursor", cursor.take());
                    let resp = c.send(Method::GET, "/v1/records", &q, None).await?;
                    let next = resp
                        .headers()
                        .get("x-next-cursor")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    let text = resp.text().await.context("reading records")?;
                    let mut lines = text.lines();
                    if format == "csv" {
                        let header = lines.next().unwrap_or_default();
                        if !header_done {
                            writeln!(out, "{header}")?;
                            header_done = true;
                        }
                    }
                    let mut n = 0u64;
                    for line in lines {
                        writeln!(out, "{line}")?;
                        n += 1;
                    }
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
                    let entries = v["data"].as_array().cloned().unwrap_or_default();
                    for e in &entries {
                        println!("{e}");
                    }
                    left = left.saturating_sub(entries.len() as u64);
                    match v["next_cursor"].as_str() {
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
                print_json(&c.json(Method::GET, "/v1/usage", &q, None).await?)
            }
        }
    })
}
