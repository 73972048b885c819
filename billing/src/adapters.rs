//! Tenants' LoRA adapters as ledger objects (issue 50): registered revisions, sharing,
//! retirement, and the resolution the gateway authorizes a request's `model` by.
//!
//! The adapter's files are checked against its base model and put in the engines' store by
//! whoever has them (`sluice admin adapters register` does both, with the engine's loader);
//! the ledger keeps what the platform decides by: which tenant owns `name`, its revisions
//! (the SHA-256 of each one's canonical form), the base model and revision each was checked
//! against, who else may use it, and whether it is retired. Every change and its audit-log row
//! are one transaction.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::Row;
use sqlx::types::Json;

use crate::control::{
    AdminError, audit, begin_write, is_unique_violation, on_pool, to_value, valid_id,
};
use crate::principal::Principal;
use crate::store::{Ledger, Pool};

/// The projections an adapter may update, as PEFT names them.
pub const TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
/// The largest rank the engines accept.
pub const MAX_RANK: i64 = 512;

/// One registered revision of a tenant's adapter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Adapter {
    /// Owning tenant.
    pub tenant_id: String,
    /// Its name within the tenant.
    pub name: String,
    /// `sha256:` of the adapter's canonical form.
    pub revision: String,
    /// The model id it was checked against (the engines' served id).
    pub base_model: String,
    /// That model's revision (`sha256:` of its weights).
    pub base_revision: String,
    /// Rank.
    pub rank: i64,
    /// The projections it updates.
    pub targets: Vec<String>,
    /// Bytes it takes resident in an engine.
    pub bytes: i64,
    /// Other tenants that may use it.
    pub shared_with: Vec<String>,
    /// `active` or `retired`.
    pub status: String,
    /// When it was registered.
    pub created_at: DateTime<Utc>,
    /// When it was retired.
    pub retired_at: Option<DateTime<Utc>>,
}

impl Adapter {
    /// `tenant/name@revision`: what a request runs under, in the execution identity and the
    /// ledger's `adapter` column.
    pub fn id(&self) -> String {
        format!("{}/{}@{}", self.tenant_id, self.name, self.revision)
    }
}

/// A revision to register (its files already checked and stored).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NewAdapter {
    /// Its name within the tenant.
    pub name: String,
    /// `sha256:` of its canonical form.
    pub revision: String,
    /// The model id it was checked against.
    pub base_model: String,
    /// That model's revision.
    pub base_revision: String,
    /// Rank.
    pub rank: i64,
    /// The projections it updates.
    pub targets: Vec<String>,
    /// Bytes resident.
    pub bytes: i64,
    /// Other tenants that may use the name (every revision of it); the name's sharing as it
    /// stands when absent.
    #[serde(default)]
    pub shared_with: Option<Vec<String>>,
}

const COLUMNS: &str = "tenant_id, name, revision, base_model, base_revision, rank, targets, \
    bytes, shared_with, status, created_at, retired_at";

macro_rules! adapter_from_row {
    ($row:expr) => {
        Adapter {
            tenant_id: $row.try_get("tenant_id")?,
            name: $row.try_get("name")?,
            revision: $row.try_get("revision")?,
            base_model: $row.try_get("base_model")?,
            base_revision: $row.try_get("base_revision")?,
            rank: $row.try_get("rank")?,
            targets: $row.try_get::<Json<Vec<String>>, _>("targets")?.0,
            bytes: $row.try_get("bytes")?,
            shared_with: $row.try_get::<Json<Vec<String>>, _>("shared_with")?.0,
            status: $row.try_get("status")?,
            created_at: $row.try_get("created_at")?,
            retired_at: $row.try_get("retired_at")?,
        }
    };
}

/// A 404 naming the first of `tenants` the ledger does not have (`what` says where it was
/// named), inside transaction `tx`.
macro_rules! require_tenants {
    ($tx:expr, $tenants:expr, $what:expr) => {
        for t in $tenants {
            let found = sqlx::query("SELECT id FROM tenants WHERE id = $1")
                .bind(t)
                .fetch_optional(&mut *$tx)
                .await?;
            if found.is_none() {
                return Err(AdminError::NotFound(format!("tenant {t}{} not found", $what)));
            }
        }
    };
}

fn valid_revision(param: &str, r: &str) -> Result<(), AdminError> {
    let hex = r.strip_prefix("sha256:").unwrap_or("");
    if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        Ok(())
    } else {
        Err(AdminError::invalid(
            param,
            format!("{param} must be sha256: and 64 lowercase hex digits"),
        ))
    }
}

fn valid_text(param: &str, s: &str) -> Result<(), AdminError> {
    if s.is_empty() || s.len() > 200 || s.chars().any(char::is_control) {
        return Err(AdminError::invalid(
            param,
            format!("{param} must be 1-200 printable characters"),
        ));
    }
    Ok(())
}

impl NewAdapter {
    fn validate(&self, tenant_id: &str) -> Result<(), AdminError> {
        valid_id("name", &self.name)?;
        valid_revision("revision", &self.revision)?;
        valid_text("base_model", &self.base_model)?;
        valid_revision("base_revision", &self.base_revision)?;
        if !(1..=MAX_RANK).contains(&self.rank) {
            return Err(AdminError::invalid("rank", format!("rank must be 1-{MAX_RANK}")));
        }
        if self.targets.is_empty() || self.targets.iter().any(|t| !TARGETS.contains(&t.as_str())) {
            return Err(AdminError::invalid(
                "targets",
                format!("targets must be a non-empty subset of {}", TARGETS.join(", ")),
            ));
        }
        if self.bytes < 0 {
            return Err(AdminError::invalid("bytes", "bytes must not be negative"));
        }
        check_sharing(tenant_id, self.shared_with.as_deref().unwrap_or_default())
    }
}

fn check_sharing(tenant_id: &str, with: &[String]) -> Result<(), AdminError> {
    for (i, t) in with.iter().enumerate() {
        valid_id(&format!("shared_with[{i}]"), t)?;
        if t == tenant_id {
            return Err(AdminError::invalid(
                &format!("shared_with[{i}]"),
                "an adapter is its own tenant's already; share it with others",
            ));
        }
    }
    Ok(())
}

/// A `tenant/name` or `tenant/name@revision` a request names as its `model`, or `None` when
/// the text is no adapter reference (a plain model id has no `/`... or is the name of a
/// model that has one: callers look models up first).
pub fn parse_reference(model: &str) -> Option<(&str, &str, Option<&str>)> {
    let (path, revision) = match model.split_once('@') {
        Some((p, r)) => (p, Some(r)),
        None => (model, None),
    };
    let (tenant, name) = path.split_once('/')?;
    if tenant.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    Some((tenant, name, revision))
}

impl Ledger {
    /// Registers a revision of `tenant_id`'s adapter `new.name` (404 for an unknown tenant or
    /// a tenant to share with that does not exist, 409 when the revision is registered
    /// already, 400 when the name's earlier revisions are of another base model).
    pub async fn register_adapter(
        &self,
        who: &Principal,
        tenant_id: &str,
        new: &NewAdapter,
    ) -> Result<Adapter, AdminError> {
        valid_id("tenant", tenant_id)?;
        new.validate(tenant_id)?;
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            require_tenants!(tx, [tenant_id], "");
            require_tenants!(tx, new.shared_with.iter().flatten(), " (in shared_with)");
            let earlier = sqlx::query(&format!(
                "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 AND name = $2 \
                 ORDER BY created_at DESC LIMIT 1"
            ))
            .bind(tenant_id)
            .bind(&new.name)
            .fetch_optional(&mut *tx)
            .await?;
            let earlier = match earlier {
                Some(row) => Some(adapter_from_row!(row)),
                None => None,
            };
            if let Some(e) = &earlier
                && e.base_model != new.base_model
            {
                return Err(AdminError::invalid(
                    "base_model",
                    format!(
                        "{tenant_id}/{} is an adapter of {}; a revision for {} needs another name",
                        new.name, e.base_model, new.base_model
                    ),
                ));
            }
            let shared_with = match (&new.shared_with, &earlier) {
                (Some(s), _) => s.clone(),
                (None, Some(e)) => e.shared_with.clone(),
                (None, None) => Vec::new(),
            };
            let adapter = Adapter {
                tenant_id: tenant_id.to_owned(),
                name: new.name.clone(),
                revision: new.revision.clone(),
                base_model: new.base_model.clone(),
                base_revision: new.base_revision.clone(),
                rank: new.rank,
                targets: new.targets.clone(),
                bytes: new.bytes,
                shared_with: shared_with.clone(),
                status: "active".into(),
                created_at: Utc::now(),
                retired_at: None,
            };
            let res = sqlx::query(
                "INSERT INTO adapters (tenant_id, name, revision, base_model, base_revision, \
                 rank, targets, bytes, shared_with, status, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            )
            .bind(&adapter.tenant_id)
            .bind(&adapter.name)
            .bind(&adapter.revision)
            .bind(&adapter.base_model)
            .bind(&adapter.base_revision)
            .bind(adapter.rank)
            .bind(Json(&adapter.targets))
            .bind(adapter.bytes)
            .bind(Json(&adapter.shared_with))
            .bind(&adapter.status)
            .bind(adapter.created_at)
            .execute(&mut *tx)
            .await;
            if let Err(e) = res {
                return Err(if is_unique_violation(&e) {
                    AdminError::Conflict(format!("{} is registered already", adapter.id()))
                } else {
                    e.into()
                });
            }
            // One sharing for every revision of the name.
            sqlx::query("UPDATE adapters SET shared_with = $1 WHERE tenant_id = $2 AND name = $3")
                .bind(Json(&shared_with))
                .bind(tenant_id)
                .bind(&new.name)
                .execute(&mut *tx)
                .await?;
            audit!(tx, who, "adapter.register", format!("adapter:{}", adapter.id()), None::<Value>, to_value(&adapter));
            tx.commit().await?;
            Ok(adapter)
        })
    }

    /// The adapters `tenant_id` may use: its own revisions, and the revisions of those other
    /// tenants share with it; retired ones too (their status says so), newest first.
    pub async fn list_adapters(&self, tenant_id: &str) -> Result<Vec<Adapter>, AdminError> {
        valid_id("tenant", tenant_id)?;
        let all: Vec<Adapter> = on_pool!(self, pool => {
            let rows = sqlx::query(&format!(
                "SELECT {COLUMNS} FROM adapters ORDER BY tenant_id, name, created_at DESC"
            ))
            .fetch_all(pool)
            .await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(adapter_from_row!(row));
            }
            out
        });
        Ok(all
            .into_iter()
            .filter(|a| a.tenant_id == tenant_id || a.shared_with.iter().any(|t| t == tenant_id))
            .collect())
    }

    /// Retires `tenant_id`'s adapter `name`: one revision, or every active one (404 when there
    /// is none). Requests already running go on; new ones naming it are refused, and the name
    /// alone resolves to the newest revision still active.
    pub async fn retire_adapter(
        &self,
        who: &Principal,
        tenant_id: &str,
        name: &str,
        revision: Option<&str>,
    ) -> Result<Vec<Adapter>, AdminError> {
        valid_id("tenant", tenant_id)?;
        valid_id("name", name)?;
        if let Some(r) = revision {
            valid_revision("revision", r)?;
        }
        let now = Utc::now();
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            let rows = sqlx::query(&format!(
                "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 AND name = $2 \
                 AND status = 'active' ORDER BY created_at DESC"
            ))
            .bind(tenant_id)
            .bind(name)
            .fetch_all(&mut *tx)
            .await?;
            let mut retired = Vec::new();
            for row in &rows {
                let before = adapter_from_row!(row);
                if revision.is_some_and(|r| r != before.revision) {
                    continue;
                }
                sqlx::query(
                    "UPDATE adapters SET status = 'retired', retired_at = $1 \
                     WHERE tenant_id = $2 AND name = $3 AND revision = $4",
                )
                .bind(now)
                .bind(tenant_id)
                .bind(name)
                .bind(&before.revision)
                .execute(&mut *tx)
                .await?;
                let after =
                    Adapter { status: "retired".into(), retired_at: Some(now), ..before.clone() };
                audit!(tx, who, "adapter.retire", format!("adapter:{}", before.id()), to_value(&before), to_value(&after));
                retired.push(after);
            }
            if retired.is_empty() {
                let what = revision.map_or_else(|| name.to_owned(), |r| format!("{name}@{r}"));
                return Err(AdminError::NotFound(format!("no active adapter {tenant_id}/{what}")));
            }
            tx.commit().await?;
            Ok(retired)
        })
    }

    /// Sets which other tenants may use `tenant_id`'s adapter `name` (every revision).
    pub async fn share_adapter(
        &self,
        who: &Principal,
        tenant_id: &str,
        name: &str,
        shared_with: &[String],
    ) -> Result<Vec<String>, AdminError> {
        valid_id("tenant", tenant_id)?;
        valid_id("name", name)?;
        check_sharing(tenant_id, shared_with)?;
        on_pool!(self, pool => {
            let mut tx = begin_write!(pool).await?;
            require_tenants!(tx, shared_with, " (in shared_with)");
            let row = sqlx::query(&format!(
                "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 AND name = $2 \
                 ORDER BY created_at DESC LIMIT 1"
            ))
            .bind(tenant_id)
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no adapter {tenant_id}/{name}")))?;
            let before = adapter_from_row!(row).shared_with;
            sqlx::query("UPDATE adapters SET shared_with = $1 WHERE tenant_id = $2 AND name = $3")
                .bind(Json(shared_with))
                .bind(tenant_id)
                .bind(name)
                .execute(&mut *tx)
                .await?;
            audit!(
                tx,
                who,
                "adapter.share",
                format!("adapter:{tenant_id}/{name}"),
                Some(serde_json::json!({"shared_with": before})),
                Some(serde_json::json!({"shared_with": shared_with}))
            );
            tx.commit().await?;
            Ok(shared_with.to_vec())
        })
    }

    /// The revision a request of `caller` naming `owner/name` (the newest active revision) or
    /// `owner/name@revision` (that one, if active) runs, when `caller` may use it: `None`
    /// otherwise, whatever the reason (unknown, retired, another tenant's and not shared), so
    /// a refusal says nothing about other tenants' names.
    pub async fn resolve_adapter(
        &self,
        caller: &str,
        owner: &str,
        name: &str,
        revision: Option<&str>,
    ) -> Result<Option<Adapter>, AdminError> {
        if valid_id("tenant", owner).is_err() || valid_id("name", name).is_err() {
            return Ok(None);
        }
        let rows: Vec<Adapter> = on_pool!(self, pool => {
            let rows = sqlx::query(&format!(
                "SELECT {COLUMNS} FROM adapters WHERE tenant_id = $1 AND name = $2 \
                 AND status = 'active' ORDER BY created_at DESC"
            ))
            .bind(owner)
            .bind(name)
            .fetch_all(pool)
            .await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(adapter_from_row!(row));
            }
            out
        });
        Ok(rows
            .into_iter()
            .filter(|a| a.tenant_id == caller || a.shared_with.iter().any(|t| t == caller))
            .find(|a| revision.is_none_or(|r| r == a.revision)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_name_a_tenant_a_name_and_maybe_a_revision() {
        assert_eq!(parse_reference("acme/support"), Some(("acme", "support", None)));
        assert_eq!(
            parse_reference("acme/support@sha256:ab"),
            Some(("acme", "support", Some("sha256:ab")))
        );
        assert_eq!(parse_reference("smollm2-135m-instruct"), None);
        assert_eq!(parse_reference("a/b/c"), None);
        assert_eq!(parse_reference("/x"), None);
    }
}
