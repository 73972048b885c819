//! The control plane over the ledger database, its write side: tenants, API keys, quotas, each
//! change with its admin audit-log row, and the key lookup the gateway authenticates by. The
//! read side for auditors and dashboards (records, usage, dashboard aggregates) is
//! [`crate::query`].
//!
//! Every change and its audit-log row are written in one transaction: a change is never
//! recorded without happening, nor happens without being recorded. The same SQL runs on
//! Postgres and SQLite (sqlx numbers the `$n` placeholders for both); [`on_pool!`] expands a
//! body once per backend so each is type-checked against its own driver.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::Row;
use sqlx::types::Json;

use crate::principal::Principal;
use crate::store::Pool;
use crate::{BillingError, Ledger};

/// Runs `$body` with `$pool` bound to the ledger's concrete pool, once per backend.
macro_rules! on_pool {
    ($ledger:expr, $pool:ident => $body:expr) => {
        match $ledger.pool() {
            Pool::Postgres($pool) => $body,
            Pool::Sqlite($pool) => $body,
        }
    };
}
pub(crate) use on_pool;

/// The statement beginning a write transaction. SQLite's takes the write lock up front
/// (`BEGIN IMMEDIATE`): a deferred one that reads first and then writes can fail at once with
/// SQLITE_BUSY when another writer holds the lock, instead of waiting out the busy timeout.
pub(crate) trait BeginWrite {
    const BEGIN: &'static str;
}

impl BeginWrite for sqlx::PgPool {
    const BEGIN: &'static str = "BEGIN";
}

impl BeginWrite for sqlx::SqlitePool {
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
}

pub(crate) fn begin_statement<P: BeginWrite>(_: &P) -> &'static str {
    P::BEGIN
}

/// Begins a write transaction on either pool.
macro_rules! begin_write {
    ($pool:expr) => {
        $pool.begin_with($crate::control::begin_statement($pool))
    };
}
pub(crate) use begin_write;

/// What an admin or audit call can fail with; each maps to one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// A parameter is malformed or out of range (400); `param` names it.
    #[error("{message}")]
    Invalid {
        /// The offending parameter or field.
        param: String,
        /// What is wrong, without echoing secrets.
        message: String,
    },
    /// No credentials, or credentials that do not verify (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The role may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    /// The target does not exist (404).
    #[error("{0}")]
    NotFound(String),
    /// The target exists already or is in a conflicting state (409).
    #[error("{0}")]
    Conflict(String),
    /// The database failed (500, or 503 when retrying may help).
    #[error(transparent)]
    Billing(#[from] BillingError),
}

impl From<sqlx::Error> for AdminError {
    fn from(e: sqlx::Error) -> Self {
        Self::Billing(BillingError::Database(e))
    }
}

impl AdminError {
    /// A 400 naming `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::Invalid { param: param.to_owned(), message: message.into() }
    }
}

/// The rate and volume limits every scope is held to: a tier, a tenant's quota, an API key.
/// `None` is "nothing of this scope's own": in a tenant's overrides the tier's value applies,
/// on a key only its tenant's limit, in a tier or an effective quota no limit at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<i64>,
    /// Tokens (prompt + completion) per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<i64>,
    /// Tokens per UTC day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daily_tokens: Option<i64>,
    /// Tokens per UTC calendar month.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly_tokens: Option<i64>,
    /// Requests in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<i64>,
}

/// Largest limit accepted for any quota number.
const MAX_LIMIT: i64 = 1_000_000_000_000;

/// Checks that every set limit is 0..=MAX_LIMIT, naming the first bad one (`prefix` + name).
fn check_limits(prefix: &str, fields: &[(&str, Option<i64>)]) -> Result<(), AdminError> {
    for &(name, v) in fields {
        if let Some(v) = v
            && !(0..=MAX_LIMIT).contains(&v)
        {
            let param = format!("{prefix}{name}");
            return Err(AdminError::invalid(&param, format!("{param} must be 0..={MAX_LIMIT}")));
        }
    }
    Ok(())
}

impl Limits {
    /// Each limit by its name on the wire.
    fn fields(&self) -> [(&'static str, Option<i64>); 5] {
        [
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("daily_tokens", self.daily_tokens),
            ("monthly_tokens", self.monthly_tokens),
            ("concurrency", self.concurrency),
        ]
    }

    /// The limit named `name` on the wire, to be set.
    fn slot(&mut self, name: &str) -> Option<&mut Option<i64>> {
        match name {
            "rpm" => Some(&mut self.rpm),
            "tpm" => Some(&mut self.tpm),
            "daily_tokens" => Some(&mut self.daily_tokens),
            "monthly_tokens" => Some(&mut self.monthly_tokens),
            "concurrency" => Some(&mut self.concurrency),
            _ => None,
        }
    }

    /// Checks every limit, naming the first bad one as `prefix` + its name.
    pub fn validate(&self, prefix: &str) -> Result<(), AdminError> {
        check_limits(prefix, &self.fields())
    }

    /// Whether no limit is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Whether a day or month limit is set (only then is the ledger's usage needed).
    pub fn has_token_quota(&self) -> bool {
        self.daily_tokens.is_some() || self.monthly_tokens.is_some()
    }

    /// These limits with `base`'s wherever these have none.
    pub fn over(&self, base: &Limits) -> Limits {
        Limits {
            rpm: self.rpm.or(base.rpm),
            tpm: self.tpm.or(base.tpm),
            daily_tokens: self.daily_tokens.or(base.daily_tokens),
            monthly_tokens: self.monthly_tokens.or(base.monthly_tokens),
            concurrency: self.concurrency.or(base.concurrency),
        }
    }
}

/// A tenant's quota: its [`Limits`] and what a request may ask for. In a tenant's quota row
/// `None` means "the tier's value"; in a tier or an effective quota it means "unlimited".
/// Most choices (`n`) one request may ask for: the engines' cap
/// (`sluice_engine::server::ServerConfig`'s default, checked equal by a test) and the ceiling
/// of every tier and every override, so what the gateway admits the engine runs.
pub const MAX_N: i64 = 16;

/// On the wire the limits sit beside the other fields, in one flat object.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct QuotaSettings {
    /// Requests and tokens per window, requests in flight.
    #[serde(flatten)]
    pub limits: Limits,
    /// Longest prompt accepted, in tokens.
    pub max_prompt_tokens: Option<i64>,
    /// Largest `max_tokens` accepted.
    pub max_output_tokens: Option<i64>,
    /// Largest `n` accepted.
    pub max_n: Option<i64>,
    /// Models the tenant may call; empty = every served model.
    pub allowed_models: Vec<String>,
    /// Scheduling priority (higher first), -100..=100.
    pub priority: Option<i64>,
}

/// The fields of a quota on the wire, for the unknown-field error.
const QUOTA_FIELDS: &[&str] = &[
    "rpm",
    "tpm",
    "daily_tokens",
    "monthly_tokens",
    "concurrency",
    "max_prompt_tokens",
    "max_output_tokens",
    "max_n",
    "allowed_models",
    "priority",
];

// By hand rather than `flatten`: each value is read where its key is, so an error names the
// field, unknown fields are refused, and a field given twice is too.
impl<'de> Deserialize<'de> for QuotaSettings {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = QuotaSettings;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a quota object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<QuotaSettings, A::Error> {
                use serde::de::Error;
                let mut q = QuotaSettings::default();
                let mut seen = std::collections::BTreeSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    let Some(&name) = QUOTA_FIELDS.iter().find(|f| **f == key) else {
                        return Err(A::Error::unknown_field(&key, QUOTA_FIELDS));
                    };
                    if !seen.insert(name) {
                        return Err(A::Error::duplicate_field(name));
                    }
                    if let Some(slot) = q.limits.slot(name) {
                        *slot = map.next_value()?;
                        continue;
                    }
                    match name {
                        "max_prompt_tokens" => q.max_prompt_tokens = map.next_value()?,
                        "max_output_tokens" => q.max_output_tokens = map.next_value()?,
                        "max_n" => q.max_n = map.next_value()?,
                        "allowed_models" => q.allowed_models = map.next_value()?,
                        _ => q.priority = map.next_value()?,
                    }
                }
                Ok(q)
            }
        }
        d.deserialize_map(Fields)
    }
}

impl QuotaSettings {
    /// Checks every field, naming the first bad one.
    pub fn validate(&self) -> Result<(), AdminError> {
        self.limits.validate("")?;
        check_limits(
            "",
            &[
                ("max_prompt_tokens", self.max_prompt_tokens),
                ("max_output_tokens", self.max_output_tokens),
                ("max_n", self.max_n),
            ],
        )?;
        if let Some(n) = self.max_n
            && n > MAX_N
        {
            let msg = format!("max_n must be 0..={MAX_N} (the most choices an engine runs)");
            return Err(AdminError::invalid("max_n", msg));
        }
        if let Some(p) = self.priority
            && !(-100..=100).contains(&p)
        {
            return Err(AdminError::invalid("priority", "priority must be -100..=100"));
        }
        if self.allowed_models.len() > 64 {
            return Err(AdminError::invalid("allowed_models", "at most 64 models"));
        }
        if self.allowed_models.iter().any(|m| m.is_empty() || m.len() > 256) {
            return Err(AdminError::invalid(
                "allowed_models",
                "model ids must be 1-256 characters",
            ));
        }
        Ok(())
    }

    /// This override set applied over `tier`.
    pub fn over(&self, tier: &QuotaSettings) -> QuotaSettings {
        QuotaSettings {
            limits: self.limits.over(&tier.limits),
            max_prompt_tokens: self.max_prompt_tokens.or(tier.max_prompt_tokens),
            max_output_tokens: self.max_output_tokens.or(tier.max_output_tokens),
            max_n: self.max_n.or(tier.max_n),
            allowed_models: if self.allowed_models.is_empty() {
                tier.allowed_models.clone()
            } else {
                self.allowed_models.clone()
            },
            priority: self.priority.or(tier.priority),
        }
    }
}

/// The per-tier entries of a policy file, strictly: every entry but `_comment`-style ones must
/// parse as `T`; an error names the tier and the field.
fn tier_entries_strict<T: serde::de::DeserializeOwned>(
    file: &str,
) -> Result<BTreeMap<String, T>, String> {
    let raw: BTreeMap<String, Value> = serde_json::from_str(file).map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for (tier, v) in raw.into_iter().filter(|(k, _)| !k.starts_with('_')) {
        let t = serde_path_to_error::deserialize(v).map_err(|e| {
            let at = e.path().to_string();
            let at = if at == "." { String::new() } else { format!(".{at}") };
            format!("{tier}{at}: {}", e.into_inner())
        })?;
        out.insert(tier, t);
    }
    Ok(out)
}

/// The per-tier entries of policy file `name` in force (see [`sluice_policies`]); none when it
/// cannot be read or an entry does not parse (the services check the files at start,
/// [`check_policies`], and refuse to start then).
fn policy_entries<T: serde::de::DeserializeOwned>(name: &str) -> BTreeMap<String, T> {
    sluice_policies::text(name).and_then(|t| tier_entries_strict(&t)).unwrap_or_else(|e| {
        tracing::error!(error = %e, file = name, "policy file unusable");
        BTreeMap::new()
    })
}

/// Checks the tiers and scheduling policies in force: every entry parses and every tier's
/// limits are valid; an error names the file, the tier and the field.
pub fn check_policies() -> Result<(), String> {
    let at = |name: &str, e: String| format!("{}: {e}", sluice_policies::source(name));
    let tiers: BTreeMap<String, QuotaSettings> =
        tier_entries_strict(&sluice_policies::text("tiers.json")?)
            .map_err(|e| at("tiers.json", e))?;
    for (name, tier) in &tiers {
        tier.validate().map_err(|e| at("tiers.json", format!("{name}: {e}")))?;
    }
    let _: BTreeMap<String, TierScheduling> =
        tier_entries_strict(&sluice_policies::text("scheduling.json")?)
            .map_err(|e| at("scheduling.json", e))?;
    Ok(())
}

/// The quota tiers of the tiers policy in force (`tiers.json`).
pub static TIERS: LazyLock<BTreeMap<String, QuotaSettings>> =
    LazyLock::new(|| policy_entries("tiers.json"));

/// A tier's scheduling policy (`policies/scheduling.json`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierScheduling {
    /// The tier's share of service in the engines' fair order, relative to others waiting.
    pub weight: u32,
    /// The time per output token the tier's requests are kept within, in milliseconds.
    #[serde(default)]
    pub tpot_ms: Option<u32>,
    /// The time to first token the tier's requests are judged by, in milliseconds.
    #[serde(default)]
    pub ttft_ms: Option<u32>,
}

/// The tiers' scheduling policies of the scheduling policy in force (`scheduling.json`).
pub static TIER_SCHEDULING: LazyLock<BTreeMap<String, TierScheduling>> =
    LazyLock::new(|| policy_entries("scheduling.json"));

/// The largest fair-order weight, a tier's or a tenant's own (the smallest is 1): the one the
/// engines accept in the weight header.
pub use sluice_wire::MAX_WEIGHT;

/// The fair-order weight of `tier` (1 for a tier the policy does not name), 1 to 1000.
pub fn tier_weight(tier: &str) -> u32 {
    TIER_SCHEDULING.get(tier).map_or(1, |s| s.weight.clamp(1, MAX_WEIGHT))
}

/// The TPOT target of `tier`, in milliseconds (1 to 60,000), if it has one.
pub fn tier_tpot_ms(tier: &str) -> Option<u32> {
    TIER_SCHEDULING.get(tier).and_then(|s| s.tpot_ms).map(|ms| ms.clamp(1, 60_000))
}

/// The TTFT target of `tier`, in milliseconds (1 to 600,000), if it has one.
pub fn tier_ttft_ms(tier: &str) -> Option<u32> {
    TIER_SCHEDULING.get(tier).and_then(|s| s.ttft_ms).map(|ms| ms.clamp(1, 600_000))
}

/// A tenant as listed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Tenant {
    /// Stable id (`[a-z0-9_-]`, 1-64).
    pub id: String,
    /// Display name.
    pub name: String,
    /// `active` or `suspended`.
    pub status: String,
    /// Quota tier from `policies/tiers.json`.
    pub tier: String,
    /// Per-tenant policy overrides.
    pub overrides: Value,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// An API key as listed: never the secret, only its public prefix.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ApiKey {
    /// Key id.
    pub id: String,
    /// Owning tenant.
    pub tenant_id: String,
    /// The public start of the secret, shown in listings.
    pub prefix: String,
    /// What the key may call.
    pub scopes: Vec<String>,
    /// Issue time.
    pub created_at: DateTime<Utc>,
    /// Expiry, if any.
    pub expires_at: Option<DateTime<Utc>>,
    /// Revocation time, if revoked.
    pub revoked_at: Option<DateTime<Utc>>,
    /// The key's own limits, beside the tenant's quota.
    #[serde(default)]
    pub limits: Limits,
}

/// A tenant's quota: its overrides and the effective limits over its tier.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Quota {
    /// The tenant.
    pub tenant_id: String,
    /// Its tier.
    pub tier: String,
    /// The tier's own values, which the overrides replace.
    #[serde(default)]
    pub tier_settings: QuotaSettings,
    /// The tenant's own settings (`None` = the tier's value).
    pub overrides: QuotaSettings,
    /// What gateways enforce.
    pub effective: QuotaSettings,
    /// Last change, if the tenant has its own row.
    pub updated_at: Option<DateTime<Utc>>,
}

/// One admin audit-log row.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AuditEntry {
    /// Sequence number (keyset cursor).
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who (`sub` of the token).
    pub actor: String,
    /// With which role.
    pub role: String,
    /// What (`tenant.create`, `key.revoke`, ...).
    pub action: String,
    /// On what (`tenant:ID`, `key:ID`).
    pub target: String,
    /// State before, if any.
    pub before: Option<Value>,
    /// State after, if any.
    pub after: Option<Value>,
}

/// Scopes a key may carry.
pub const KEY_SCOPES: &[&str] = &["completions", "chat", "models"];

pub(crate) fn valid_id(param: &str, id: &str) -> Result<(), AdminError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(AdminError::invalid(param, format!("{param} must be 1-64 characters of a-z 0-9 - _")))
    }
}

pub(crate) fn rfc3339(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn random_hex(bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < 2 * bytes {
        out.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    out.truncate(2 * bytes);
    out
}

/// SHA-256 of an API key secret, hex: what the database stores and gateways compare.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::UniqueViolation)
}

macro_rules! tenant_from_row {
    ($row:expr) => {
        Tenant {
            id: $row.try_get("id")?,
            name: $row.try_get("name")?,
            status: $row.try_get("status")?,
            tier: $row.try_get("tier")?,
            overrides: $row.try_get::<Json<Value>, _>("overrides")?.0,
            created_at: $row.try_get("created_at")?,
        }
    };
}

macro_rules! key_from_row {
    ($row:expr) => {
        ApiKey {
            id: $row.try_get("id")?,
            tenant_id: $row.try_get("tenant_id")?,
            prefix: $row.try_get("prefix")?,
            scopes: $row.try_get::<Json<Vec<String>>, _>("scopes")?.0,
            created_at: $row.try_get("created_at")?,
            expires_at: $row.try_get("expires_at")?,
            revoked_at: $row.try_get("revoked_at")?,
            limits: $row.try_get::<Json<Limits>, _>("limits")?.0,
        }
    };
}

macro_rules! quota_from_row {
    ($row:expr) => {
        QuotaSettings {
            limits: Limits {
                rpm: $row.try_get("rpm")?,
                tpm: $row.try_get("tpm")?,
                daily_tokens: $row.try_get("daily_tokens")?,
                monthly_tokens: $row.try_get("monthly_tokens")?,
                concurrency: $row.try_get("concurrency")?,
            },
            max_prompt_tokens: $row.try_get("max_prompt_tokens")?,
            max_output_tokens: $row.try_get("max_output_tokens")?,
            max_n: $row.try_get("max_n")?,
            allowed_models: $row.try_get::<Json<Vec<String>>, _>("allowed_models")?.0,
            priority: Some($row.try_get("priority")?),
        }
    };
}

const TENANT_COLUMNS: &str = "id, name, status, tier, overrides, created_at";
/// Key `key_id` of tenant `tenant_id`, read inside transaction `tx` (404 when it is not that
/// tenant's).
macro_rules! tenant_key {
    ($tx:expr, $tenant:expr, $key:expr) => {{
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1 AND tenant_id = $2"
        ))
        .bind($key)
        .bind($tenant)
        .fetch_optional(&mut *$tx)
        .await?
        .ok_or_else(|| {
            AdminError::NotFound(format!("key {} not found for tenant {}", $key, $tenant))
        })?;
        key_from_row!(row)
    }};
}

const KEY_COLUMNS: &str =
    "id, tenant_id, prefix, scopes, created_at, expires_at, revoked_at, limits";
const QUOTA_COLUMNS: &str = "rpm, tpm, daily_tokens, monthly_tokens, concurrency, \
    max_prompt_tokens, max_output_tokens, max_n, allowed_models, priority, updated_at";

/// Inserts the audit row for a change, inside the change's transaction.
macro_rules! audit {
    ($tx:expr, $who:expr, $action:expr, $target:expr, $before:expr, $after:expr) => {
        sqlx::query(
            "INSERT INTO admin_audit_log (at, actor, role, action, target, before, after) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(Utc::now())
        .bind($who.actor.as_str())
        .bind($who.role.as_str())
        .bind($action)
        .bind($target)
        .bind($before.map(Json))
        .bind($after.map(Json))
        .execute(&mut *$tx)
        .await?
    };
}
pub(crate) use audit;

pub(crate) fn to_value<T: Serialize>(v: &T) -> Option<Value> {
    serde_json::to_value(v).ok()
}

fn valid_name(name: &str) -> Result<(), AdminError> {
    if name.is_empty() || name.chars().count() > 200 {
        return Err(AdminError::invalid("name", "name must be 1-200 characters"));
    }
    Ok(())
}

fn known_tier(tier: &str) -> Result<(), AdminError> {
    if TIERS.contains_key(tier) {
        return Ok(());
    }
    let known: Vec<&str> = TIERS.keys().map(String::as_str).collect();
    Err(AdminError::invalid("tier", format!("unknown tier (one of {})", known.join(", "))))
}

/// `overrides` with a merge `patch` applied: each field of the patch replaces the one of
/// `overrides`, a `null` removes it.
fn merged(overrides: &Value, patch: &Value) -> Value {
    let mut out = overrides.as_object().cloned().unwrap_or_default();
    for (key, value) in patch.as_object().into_iter().flatten() {
        if value.is_null() {
            out.remove(key);
        } else {
            out.insert(key.clone(), value.clone());
        }
    }
    Value::Object(out)
}

/// The per-tenant policy overrides a tenant's `overrides` object may hold, each checked:
/// `on_limiter_down` (`refuse` or `local`: what the gateway does with the tenant's requests
/// while the shared limiter is unreachable) and `weight` (its share of service in the
/// engines' fair order and the gateways' fair admission, 1 to 1000, in place of its tier's
/// `scheduling.json` weight). Anything else is refused by name, never stored and ignored.
pub const TENANT_OVERRIDES: [&str; 2] = ["on_limiter_down", "weight"];

/// Checks a tenant's `overrides` object: an error names the field (`overrides.weight`).
pub fn valid_overrides(overrides: &Value) -> Result<(), AdminError> {
    let Some(fields) = overrides.as_object() else {
        return Err(AdminError::invalid("overrides", "overrides must be a JSON object"));
    };
    for (key, value) in fields {
        let param = format!("overrides.{key}");
        match key.as_str() {
            "on_limiter_down" => {
                if !matches!(value.as_str(), Some("refuse" | "local")) {
                    return Err(AdminError::invalid(&param, "must be \"refuse\" or \"local\""));
                }
            }
            "weight" => {
                if !value.as_u64().is_some_and(|w| (1..=u64::from(MAX_WEIGHT)).contains(&w)) {
                    let message = format!("must be an integer from 1 to {MAX_WEIGHT}");
                    return Err(AdminError::invalid(&param, message));
                }
            }
            _ => {
                let known = TENANT_OVERRIDES.join(", ");
                return Err(AdminError::invalid(
                    &param,
                    format!("unknown override (known: {known})"),
                ));
            }
        }
    }
    Ok(())
}

/// A tenant's fair-order weight: its `overrides.weight`, else its tier's.
pub fn tenant_weight(tier: &str, overrides: &Value) -> u32 {
    let own = overrides["weight"].as_u64().and_then(|w| u32::try_from(w).ok());
    own.map_or_else(|| tier_weight(tier), |w| w.clamp(1, MAX_WEIGHT))
}

/// A change to a tenant: the fields given are set, the others kept.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantChange {
    /// New display name.
    #[serde(default)]
    pub name: Option<String>,
    /// New quota tier.
    #[serde(default)]
    pub tier: Option<String>,
    /// Overrides to merge into the tenant's (a JSON merge patch: a field given replaces the
    /// tenant's, a `null` removes it, the others are kept).
    #[serde(default)]
    pub overrides: Option<Value>,
    /// New status (`active` or `suspended`); only through suspend and activate.
    #[serde(default)]
    pub status: Option<String>,
}

/// A new tenant.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// Stable id.
    pub id: String,
    /// Display name (defaults to the id).
    #[serde(default)]
    pub name: Option<String>,
    /// Tier (defaults to `standard`).
    #[serde(default)]
    pub tier: Option<String>,
    /// Per-tenant policy overrides (a JSON object of [`TENANT_OVERRIDES`]).
    #[serde(default)]
    pub overrides: Option<Value>,
}

impl Ledger {
    /// Creates a tenant (409 if the id exists).
    pub async fn create_tenant(
        &self,
        who: &Principal,
        new: &NewTenant,
    ) -> Result<Tenant, AdminError> {
        valid_id("id", &new.id)?;
        let name = new.name.clone().unwrap_or_else(|| new.id.clone());
        valid_name(&name)?;
        let tier = new.tier.clone().unwrap_or_else(|| "standard".into());
        known_tier(&tier)?;
        let overrides = new.overrides.clone().unwrap_or_else(|| json!({}));
        valid_overrides(&overrides)?;
        let tenant = Tenant {
            id: new.id.clone(),
            name,
            status: "active".into(),
            tier,
            overrides,
            created_at: Utc::now(),
        };
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let res = sqlx::query(
                "INSERT INTO tenants (id, name, status, tier, overrides, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(&tenant.id)
            .bind(&tenant.name)
            .bind(&tenant.status)
            .bind(&tenant.tier)
            .bind(Json(&tenant.overrides))
            .bind(tenant.created_at)
            .execute(&mut *tx)
            .await;
            if let Err(e) = res {
                return Err(if is_unique_violation(&e) {
                    AdminError::Conflict(format!("tenant {} exists already", tenant.id))
                } else {
                    e.into()
                });
            }
            audit!(tx, who, "tenant.create", format!("tenant:{}", tenant.id), None::<Value>, to_value(&tenant));
            tx.commit().await?;
        });
        Ok(tenant)
    }

    /// Every tenant, by id.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, AdminError> {
        on_pool!(self, pool => {
            let rows = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY id"))
                .fetch_all(pool)
                .await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(tenant_from_row!(row));
            }
            Ok(out)
        })
    }

    /// One tenant (404 if unknown).
    pub async fn tenant(&self, id: &str) -> Result<Tenant, AdminError> {
        valid_id("tenant", id)?;
        on_pool!(self, pool => {
            let row = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE id = $1"))
                .bind(id)
                .fetch_optional(pool)
                .await?
                .ok_or_else(|| AdminError::NotFound(format!("tenant {id} not found")))?;
            Ok(tenant_from_row!(row))
        })
    }

    /// Sets a tenant's status to `active` or `suspended`.
    pub async fn set_tenant_status(
        &self,
        who: &Principal,
        id: &str,
        status: &str,
    ) -> Result<Tenant, AdminError> {
        if status != "active" && status != "suspended" {
            return Err(AdminError::invalid("status", "status must be active or suspended"));
        }
        let action = if status == "active" { "tenant.activate" } else { "tenant.suspend" };
        let change = TenantChange { status: Some(status.to_owned()), ..TenantChange::default() };
        self.change_tenant(who, id, &change, action).await
    }

    /// Changes a tenant's name or tier (`PATCH /v1/tenants/{id}`).
    pub async fn update_tenant(
        &self,
        who: &Principal,
        id: &str,
        change: &TenantChange,
    ) -> Result<Tenant, AdminError> {
        if change.status.is_some() {
            return Err(AdminError::invalid(
                "status",
                "status changes through /suspend and /activate",
            ));
        }
        if change.name.is_none() && change.tier.is_none() && change.overrides.is_none() {
            return Err(AdminError::invalid("body", "give a name, a tier or overrides to change"));
        }
        self.change_tenant(who, id, change, "tenant.update").await
    }

    /// One change of a tenant's row and its audit entry, in one transaction.
    async fn change_tenant(
        &self,
        who: &Principal,
        id: &str,
        change: &TenantChange,
        action: &str,
    ) -> Result<Tenant, AdminError> {
        valid_id("tenant", id)?;
        if let Some(name) = &change.name {
            valid_name(name)?;
        }
        if let Some(tier) = &change.tier {
            known_tier(tier)?;
        }
        if let Some(patch) = &change.overrides
            && !patch.is_object()
        {
            return Err(AdminError::invalid("overrides", "overrides must be a JSON object"));
        }
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let row = sqlx::query(&format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE id = $1"))
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or_else(|| AdminError::NotFound(format!("tenant {id} not found")))?;
            let before = tenant_from_row!(row);
            let after = Tenant {
                name: change.name.clone().unwrap_or_else(|| before.name.clone()),
                tier: change.tier.clone().unwrap_or_else(|| before.tier.clone()),
                status: change.status.clone().unwrap_or_else(|| before.status.clone()),
                overrides: match &change.overrides {
                    Some(patch) => merged(&before.overrides, patch),
                    None => before.overrides.clone(),
                },
                ..before.clone()
            };
            // Only a change of them is checked: a suspension never fails on what is stored.
            if change.overrides.is_some() {
                valid_overrides(&after.overrides)?;
            }
            sqlx::query(
                "UPDATE tenants SET name = $1, tier = $2, status = $3, overrides = $4 WHERE id = $5",
            )
                .bind(&after.name)
                .bind(&after.tier)
                .bind(&after.status)
                .bind(Json(&after.overrides))
                .bind(id)
                .execute(&mut *tx)
                .await?;
            audit!(tx, who, action, format!("tenant:{id}"), to_value(&before), to_value(&after));
            tx.commit().await?;
            Ok(after)
        })
    }

    /// Issues a key for an existing tenant. The secret is returned here once and only its
    /// hash is stored.
    pub async fn issue_key(
        &self,
        who: &Principal,
        tenant_id: &str,
        scopes: Option<Vec<String>>,
        expires_at: Option<DateTime<Utc>>,
        limits: Limits,
    ) -> Result<(ApiKey, String), AdminError> {
        valid_id("tenant", tenant_id)?;
        limits.validate("limits.")?;
        let scopes = scopes.unwrap_or_else(|| KEY_SCOPES.iter().map(|s| (*s).to_owned()).collect());
        if scopes.is_empty() || scopes.iter().any(|s| !KEY_SCOPES.contains(&s.as_str())) {
            return Err(AdminError::invalid(
                "scopes",
                format!("scopes must be a non-empty subset of {}", KEY_SCOPES.join(", ")),
            ));
        }
        if expires_at.is_some_and(|t| t <= Utc::now()) {
            return Err(AdminError::invalid("expires_at", "expires_at must be in the future"));
        }
        let prefix = format!("sk-sluice-{}", random_hex(4));
        let secret = format!("{prefix}-{}", random_hex(24));
        let key = ApiKey {
            id: format!("key_{}", random_hex(8)),
            tenant_id: tenant_id.to_owned(),
            prefix,
            scopes,
            created_at: Utc::now(),
            expires_at,
            revoked_at: None,
            limits,
        };
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let exists = sqlx::query("SELECT id FROM tenants WHERE id = $1")
                .bind(tenant_id)
                .fetch_optional(&mut *tx)
                .await?;
            if exists.is_none() {
                return Err(AdminError::NotFound(format!("tenant {tenant_id} not found")));
            }
            sqlx::query(
                "INSERT INTO api_keys (id, tenant_id, prefix, secret_hash, scopes, created_at, \
                 expires_at, limits) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(&key.id)
            .bind(&key.tenant_id)
            .bind(&key.prefix)
            .bind(hash_secret(&secret))
            .bind(Json(&key.scopes))
            .bind(key.created_at)
            .bind(key.expires_at)
            .bind(Json(&key.limits))
            .execute(&mut *tx)
            .await?;
            audit!(tx, who, "key.issue", format!("key:{}", key.id), None::<Value>, to_value(&key));
            tx.commit().await?;
        });
        Ok((key, secret))
    }

    /// A tenant's keys, newest first (404 if the tenant is unknown).
    pub async fn list_keys(&self, tenant_id: &str) -> Result<Vec<ApiKey>, AdminError> {
        self.tenant(tenant_id).await?;
        on_pool!(self, pool => {
            let rows = sqlx::query(&format!(
                "SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant_id = $1 ORDER BY created_at DESC, id"
            ))
            .bind(tenant_id)
            .fetch_all(pool)
            .await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(key_from_row!(row));
            }
            Ok(out)
        })
    }

    /// Revokes one of a tenant's keys (404 if it is not that tenant's; idempotent).
    pub async fn revoke_key(
        &self,
        who: &Principal,
        tenant_id: &str,
        key_id: &str,
    ) -> Result<ApiKey, AdminError> {
        valid_id("tenant", tenant_id)?;
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let before = tenant_key!(tx, tenant_id, key_id);
            if before.revoked_at.is_some() {
                return Ok(before);
            }
            let after = ApiKey { revoked_at: Some(Utc::now()), ..before.clone() };
            sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2")
                .bind(after.revoked_at)
                .bind(key_id)
                .execute(&mut *tx)
                .await?;
            audit!(tx, who, "key.revoke", format!("key:{key_id}"), to_value(&before), to_value(&after));
            tx.commit().await?;
            Ok(after)
        })
    }

    /// Replaces one key's own limits (404 if it is not that tenant's).
    pub async fn set_key_limits(
        &self,
        who: &Principal,
        tenant_id: &str,
        key_id: &str,
        limits: Limits,
    ) -> Result<ApiKey, AdminError> {
        valid_id("tenant", tenant_id)?;
        limits.validate("limits.")?;
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let before = tenant_key!(tx, tenant_id, key_id);
            let after = ApiKey { limits, ..before.clone() };
            sqlx::query("UPDATE api_keys SET limits = $1 WHERE id = $2")
                .bind(Json(&limits))
                .bind(key_id)
                .execute(&mut *tx)
                .await?;
            audit!(tx, who, "key.limits.set", format!("key:{key_id}"), to_value(&before), to_value(&after));
            tx.commit().await?;
            Ok(after)
        })
    }

    /// A tenant's quota: its overrides and the effective limits.
    pub async fn quota(&self, tenant_id: &str) -> Result<Quota, AdminError> {
        let tenant = self.tenant(tenant_id).await?;
        let tier = TIERS.get(&tenant.tier).cloned().unwrap_or_default();
        on_pool!(self, pool => {
            let row = sqlx::query(&format!("SELECT {QUOTA_COLUMNS} FROM quotas WHERE tenant_id = $1"))
                .bind(tenant_id)
                .fetch_optional(pool)
                .await?;
            let (overrides, updated_at) = match row {
                Some(row) => (quota_from_row!(row), Some(row.try_get("updated_at")?)),
                None => (QuotaSettings::default(), None),
            };
            let effective = overrides.over(&tier);
            Ok(Quota {
                tenant_id: tenant.id,
                tier: tenant.tier,
                tier_settings: tier,
                overrides,
                effective,
                updated_at,
            })
        })
    }

    /// Replaces a tenant's quota overrides (fields left out fall back to the tier).
    pub async fn set_quota(
        &self,
        who: &Principal,
        tenant_id: &str,
        settings: &QuotaSettings,
    ) -> Result<Quota, AdminError> {
        settings.validate()?;
        let before = self.quota(tenant_id).await?;
        let tier = TIERS.get(&before.tier).cloned().unwrap_or_default();
        let priority = settings.priority.or(tier.priority).unwrap_or(0);
        let now = Utc::now();
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            sqlx::query(
                "INSERT INTO quotas (tenant_id, rpm, tpm, daily_tokens, monthly_tokens, \
                 concurrency, max_prompt_tokens, max_output_tokens, max_n, allowed_models, \
                 priority, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                 ON CONFLICT (tenant_id) DO UPDATE SET rpm = excluded.rpm, tpm = excluded.tpm, \
                 daily_tokens = excluded.daily_tokens, monthly_tokens = excluded.monthly_tokens, \
                 concurrency = excluded.concurrency, max_prompt_tokens = excluded.max_prompt_tokens, \
                 max_output_tokens = excluded.max_output_tokens, max_n = excluded.max_n, \
                 allowed_models = excluded.allowed_models, priority = excluded.priority, \
                 updated_at = excluded.updated_at",
            )
            .bind(tenant_id)
            .bind(settings.limits.rpm)
            .bind(settings.limits.tpm)
            .bind(settings.limits.daily_tokens)
            .bind(settings.limits.monthly_tokens)
            .bind(settings.limits.concurrency)
            .bind(settings.max_prompt_tokens)
            .bind(settings.max_output_tokens)
            .bind(settings.max_n)
            .bind(Json(&settings.allowed_models))
            .bind(priority)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            let overrides = QuotaSettings { priority: Some(priority), ..settings.clone() };
            let after = Quota {
                tenant_id: tenant_id.to_owned(),
                tier: before.tier.clone(),
                effective: overrides.over(&tier),
                tier_settings: tier,
                overrides,
                updated_at: Some(now),
            };
            audit!(tx, who, "quota.set", format!("tenant:{tenant_id}"), to_value(&before), to_value(&after));
            tx.commit().await?;
            Ok(after)
        })
    }
}

/// What a valid API key grants: who it is and what the gateway must enforce.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct KeyGrant {
    /// The key's id (billed as `key_id`).
    pub key_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// `active` or `suspended`.
    pub tenant_status: String,
    /// The tenant's tier.
    pub tier: String,
    /// What the key may call.
    pub scopes: Vec<String>,
    /// The limits to enforce.
    pub quota: QuotaSettings,
    /// The key's own limits, enforced beside the tenant's.
    #[serde(default)]
    pub key_limits: Limits,
    /// The tenant's per-tenant policy overrides ([`TENANT_OVERRIDES`]).
    pub overrides: Value,
}

impl KeyGrant {
    /// The tenant's fair-order weight ([`tenant_weight`]).
    pub fn weight(&self) -> u32 {
        tenant_weight(&self.tier, &self.overrides)
    }
}

/// Byte strings equal, in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Ledger {
    /// Resolves an API key secret: `None` when it is unknown, wrong, revoked or expired
    /// (callers answer all of these the same way, so a failure never says whether a key
    /// exists). The row is found by the public prefix and the stored hash compared in
    /// constant time.
    pub async fn key_grant(&self, secret: &str) -> Result<Option<KeyGrant>, AdminError> {
        // sk-sluice-XXXXXXXX-<secret part>
        let Some(prefix) = secret.get(..18).filter(|p| p.starts_with("sk-sluice-")) else {
            return Ok(None);
        };
        let row = on_pool!(self, pool => {
            let row = sqlx::query(
                "SELECT k.id, k.tenant_id, k.secret_hash, k.scopes, k.expires_at, k.revoked_at, \
                 k.limits, t.status, t.tier, t.overrides FROM api_keys k JOIN tenants t ON t.id = k.tenant_id \
                 WHERE k.prefix = $1",
            )
            .bind(prefix)
            .fetch_optional(pool)
            .await?;
            match row {
                None => None,
                Some(row) => Some((
                    row.try_get::<String, _>("id")?,
                    row.try_get::<String, _>("tenant_id")?,
                    row.try_get::<String, _>("secret_hash")?,
                    row.try_get::<Json<Vec<String>>, _>("scopes")?.0,
                    row.try_get::<Option<DateTime<Utc>>, _>("expires_at")?,
                    row.try_get::<Option<DateTime<Utc>>, _>("revoked_at")?,
                    row.try_get::<Json<Limits>, _>("limits")?.0,
                    row.try_get::<String, _>("status")?,
                    row.try_get::<String, _>("tier")?,
                    row.try_get::<Json<Value>, _>("overrides")?.0,
                )),
            }
        });
        let Some((
            key_id,
            tenant_id,
            stored,
            scopes,
            expires_at,
            revoked_at,
            key_limits,
            status,
            tier,
            overrides,
        )) = row
        else {
            return Ok(None);
        };
        if !constant_time_eq(hash_secret(secret).as_bytes(), stored.as_bytes())
            || revoked_at.is_some()
            || expires_at.is_some_and(|t| t <= Utc::now())
        {
            return Ok(None);
        }
        let quota = self.quota(&tenant_id).await?.effective;
        Ok(Some(KeyGrant {
            key_id,
            tenant_id,
            tenant_status: status,
            tier,
            scopes,
            quota,
            key_limits,
            overrides,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries of a compiled-in policy file, `_comment`-style keys aside.
    fn named_entries(file: &str) -> usize {
        let raw: BTreeMap<String, Value> =
            serde_json::from_str(sluice_policies::compiled(file).unwrap_or_default())
                .unwrap_or_default();
        raw.keys().filter(|k| !k.starts_with('_')).count()
    }

    #[test]
    fn every_tier_has_a_scheduling_weight_and_the_file_parses_whole() {
        let named = named_entries("scheduling.json");
        assert_eq!(TIER_SCHEDULING.len(), named, "an entry of scheduling.json does not parse");
        for tier in TIERS.keys() {
            assert!(TIER_SCHEDULING.contains_key(tier), "{tier} has no scheduling entry");
        }
        assert_eq!(tier_weight("enterprise"), 4);
        assert_eq!(tier_weight("no-such-tier"), 1);
        assert_eq!(tier_tpot_ms("standard"), Some(100));
        assert_eq!(tier_tpot_ms("no-such-tier"), None);
        // A tenant's own weight goes before its tier's.
        assert_eq!(tenant_weight("standard", &json!({})), 2);
        assert_eq!(tenant_weight("standard", &json!({"weight": 5})), 5);
        assert_eq!(tenant_weight("enterprise", &json!({"on_limiter_down": "local"})), 4);
    }

    #[test]
    fn every_tier_parses_and_stays_within_the_platform_caps() {
        let named = named_entries("tiers.json");
        assert_eq!(TIERS.len(), named, "an entry of tiers.json does not parse");
        for (name, tier) in TIERS.iter() {
            assert_eq!(tier.validate().map_err(|e| e.to_string()), Ok(()), "tier {name}");
            assert!(tier.max_n.is_some_and(|n| (1..=MAX_N).contains(&n)), "tier {name}");
        }
        let over = QuotaSettings { max_n: Some(MAX_N + 1), ..Default::default() };
        assert!(over.validate().is_err_and(|e| e.to_string().contains("max_n")));
    }
}
