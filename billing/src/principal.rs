//! Who acts on the control plane: a role and, for a tenant's admin, its tenant. The ledger's
//! control operations take a [`Principal`] and record it in the audit log; how one is proven
//! (JWT bearer tokens) is `auth`'s, part of the billing service's server (feature `server`).

use serde::{Deserialize, Serialize};

/// What a token holder may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Tenants, keys and quotas.
    Ops,
    /// Usage, rollups, costs and the dashboard.
    Billing,
    /// Read-only request records and the admin audit log.
    Auditor,
    /// One tenant's own keys and usage.
    TenantAdmin,
}

impl Role {
    /// The name used in tokens, the audit log and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ops => "ops",
            Self::Billing => "billing",
            Self::Auditor => "auditor",
            Self::TenantAdmin => "tenant-admin",
        }
    }

    /// Parses a role name.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Ops, Self::Billing, Self::Auditor, Self::TenantAdmin]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// The verified identity behind a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Who acts (`sub`), recorded in the audit log.
    pub actor: String,
    /// The one role the token grants.
    pub role: Role,
    /// The tenant a `tenant-admin` token is bound to.
    pub tenant: Option<String>,
}
