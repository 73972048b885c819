//! Admin API authentication: JWT bearer tokens verified with `jsonwebtoken`.
//!
//! The algorithm is pinned by configuration (HS256 with a shared secret, or RS256 / EdDSA with
//! a public key): a token whose header names any other algorithm, `none` included, is refused
//! before its signature is looked at. `exp` is required; `iss` and `aud` are checked when
//! configured. The claims carry the actor (`sub`), one role and, for `tenant-admin`, the tenant.

use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

/// Smallest accepted HS256 secret (RFC 7518 section 3.2: at least the hash size).
pub const MIN_SECRET_BYTES: usize = 32;

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

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    iat: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    iss: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    aud: Option<String>,
}

/// Why a token was refused. Messages never quote the token.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("missing bearer token (Authorization: Bearer <JWT>)")]
    Missing,
    /// Signature, algorithm, expiry, issuer, audience or claims are wrong.
    #[error("invalid token: {0}")]
    Invalid(String),
    /// The configuration cannot verify anything.
    #[error("invalid JWT configuration: {0}")]
    Config(String),
}

/// Verifies admin tokens with one pinned algorithm and key.
pub struct Verifier {
    key: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier").field("algorithms", &self.validation.algorithms).finish()
    }
}

fn validation(alg: Algorithm, issuer: Option<&str>, audience: Option<&str>) -> Validation {
    let mut v = Validation::new(alg);
    v.set_required_spec_claims(&["exp", "sub"]);
    v.leeway = 5;
    if let Some(iss) = issuer {
        v.set_issuer(&[iss]);
        v.set_required_spec_claims(&["exp", "sub", "iss"]);
    }
    match audience {
        Some(aud) => v.set_audience(&[aud]),
        None => v.validate_aud = false,
    }
    v
}

impl Verifier {
    /// HS256 with a shared secret of at least [`MIN_SECRET_BYTES`] bytes.
    pub fn hs256(
        secret: &[u8],
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Result<Self, AuthError> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(AuthError::Config(format!(
                "the HS256 secret must be at least {MIN_SECRET_BYTES} bytes"
            )));
        }
        Ok(Self {
            key: DecodingKey::from_secret(secret),
            validation: validation(Algorithm::HS256, issuer, audience),
        })
    }

    /// RS256 or EdDSA with a PEM public key.
    pub fn public_key(
        alg: &str,
        pem: &[u8],
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Result<Self, AuthError> {
        let (alg, key) = match alg {
            "RS256" => (Algorithm::RS256, DecodingKey::from_rsa_pem(pem)),
            "EdDSA" => (Algorithm::EdDSA, DecodingKey::from_ed_pem(pem)),
            other => {
                return Err(AuthError::Config(format!(
                    "unsupported public-key algorithm {other:?} (RS256 or EdDSA)"
                )));
            }
        };
        let key = key.map_err(|e| AuthError::Config(format!("cannot read the public key: {e}")))?;
        Ok(Self { key, validation: validation(alg, issuer, audience) })
    }

    /// Verifies a bearer token and returns who it speaks for.
    pub fn verify(&self, token: &str) -> Result<Principal, AuthError> {
        // Checked explicitly (decode would refuse it too): the pinned algorithm is the only
        // one accepted, whatever the header says.
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| AuthError::Invalid(e.to_string()))?;
        if !self.validation.algorithms.contains(&header.alg) {
            return Err(AuthError::Invalid(format!("algorithm {:?} is not accepted", header.alg)));
        }
        let data = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation)
            .map_err(|e| AuthError::Invalid(e.to_string()))?;
        let c = data.claims;
        if c.sub.is_empty() || c.sub.len() > 256 {
            return Err(AuthError::Invalid("sub must be 1-256 characters".into()));
        }
        if c.role == Role::TenantAdmin && c.tenant.as_deref().is_none_or(str::is_empty) {
            return Err(AuthError::Invalid("a tenant-admin token must name its tenant".into()));
        }
        Ok(Principal { actor: c.sub, role: c.role, tenant: c.tenant })
    }
}

/// Mints an HS256 token (for `sluice admin token` and tests).
pub fn mint_hs256(
    secret: &[u8],
    who: &Principal,
    ttl_secs: u64,
    issuer: Option<&str>,
    audience: Option<&str>,
) -> Result<String, AuthError> {
    if secret.len() < MIN_SECRET_BYTES {
        return Err(AuthError::Config(format!(
            "the HS256 secret must be at least {MIN_SECRET_BYTES} bytes"
        )));
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let claims = Claims {
        sub: who.actor.clone(),
        role: who.role,
        tenant: who.tenant.clone(),
        exp: now + ttl_secs,
        iat: Some(now),
        iss: issuer.map(str::to_owned),
        aud: audience.map(str::to_owned),
    };
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret))
        .map_err(|e| AuthError::Config(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn ops() -> Principal {
        Principal { actor: "alice".into(), role: Role::Ops, tenant: None }
    }

    fn b64(s: &str) -> String {
        use std::fmt::Write;
        // base64url without padding, small and local to the test.
        const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let b = s.as_bytes();
        let mut out = String::new();
        for c in b.chunks(3) {
            let n = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for i in 0..=c.len() {
                let _ = write!(out, "{}", T[(n >> (18 - 6 * i) & 63) as usize] as char);
            }
        }
        out
    }

    #[test]
    fn a_minted_token_verifies_and_carries_its_claims() -> Result<(), AuthError> {
        let v = Verifier::hs256(SECRET, None, None)?;
        let t = mint_hs256(SECRET, &ops(), 60, None, None)?;
        assert_eq!(v.verify(&t)?, ops());
        Ok(())
    }

    #[test]
    fn other_algorithms_none_and_bad_signatures_are_refused() -> Result<(), AuthError> {
        let v = Verifier::hs256(SECRET, None, None)?;
        let exp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let claims = format!(r#"{{"sub":"mallory","role":"ops","exp":{}}}"#, exp + 600);
        let none = format!("{}.{}.", b64(r#"{"alg":"none","typ":"JWT"}"#), b64(&claims));
        assert!(matches!(v.verify(&none), Err(AuthError::Invalid(_))));
        let hs384 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS384),
            &serde_json::json!({"sub": "mallory", "role": "ops", "exp": exp + 600}),
            &EncodingKey::from_secret(SECRET),
        )
        .map_err(|e| AuthError::Config(e.to_string()))?;
        assert!(matches!(v.verify(&hs384), Err(AuthError::Invalid(m)) if m.contains("HS384")));
        let other = mint_hs256(b"another-secret-another-secret-xx", &ops(), 60, None, None)?;
        assert!(v.verify(&other).is_err());
        Ok(())
    }

    #[test]
    fn expiry_issuer_audience_and_tenant_binding_are_enforced() -> Result<(), AuthError> {
        let v = Verifier::hs256(SECRET, Some("sluice"), Some("admin"))?;
        let good = mint_hs256(SECRET, &ops(), 60, Some("sluice"), Some("admin"))?;
        assert!(v.verify(&good).is_ok());
        for (iss, aud) in [
            (None, Some("admin")),
            (Some("evil"), Some("admin")),
            (Some("sluice"), None),
            (Some("sluice"), Some("x")),
        ] {
            let t = mint_hs256(SECRET, &ops(), 60, iss, aud)?;
            assert!(v.verify(&t).is_err(), "{iss:?} {aud:?}");
        }
        let exp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let expired = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "a", "role": "ops", "exp": exp - 600, "iss": "sluice", "aud": "admin"}),
            &EncodingKey::from_secret(SECRET),
        )
        .map_err(|e| AuthError::Config(e.to_string()))?;
        assert!(v.verify(&expired).is_err());
        let no_exp = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "a", "role": "ops", "iss": "sluice", "aud": "admin"}),
            &EncodingKey::from_secret(SECRET),
        )
        .map_err(|e| AuthError::Config(e.to_string()))?;
        assert!(v.verify(&no_exp).is_err());
        let unbound = Principal { actor: "t".into(), role: Role::TenantAdmin, tenant: None };
        let t = mint_hs256(SECRET, &unbound, 60, Some("sluice"), Some("admin"))?;
        assert!(v.verify(&t).is_err());
        assert!(Verifier::hs256(b"short", None, None).is_err());
        Ok(())
    }
}
