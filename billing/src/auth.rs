//! Admin API authentication: JWT bearer tokens verified with `jsonwebtoken`.
//!
//! The algorithm is pinned by configuration (HS256 with a shared secret, or RS256 / EdDSA with
//! a public key): a token whose header names any other algorithm, `none` included, is refused
//! before its signature is looked at. `exp` is required; `iss` and `aud` are checked when
//! configured. The claims carry the actor (`sub`), one role and, for `tenant-admin`, the tenant.

use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

pub use crate::principal::{Principal, Role};

/// Smallest accepted HS256 secret (RFC 7518 section 3.2: at least the hash size).
pub const MIN_SECRET_BYTES: usize = 32;

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
    max_lifetime_secs: u64,
}

/// The longest a token may still be valid for when it is presented, unless configured
/// otherwise ([`Verifier::with_max_lifetime`]): a token that never expires is refused.
pub const MAX_TOKEN_LIFETIME_SECS: u64 = 30 * 24 * 3600;

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier").field("algorithms", &self.validation.algorithms).finish()
    }
}

fn validation(alg: Algorithm, issuer: Option<&str>, audience: Option<&str>) -> Validation {
    let mut v = Validation::new(alg);
    v.leeway = 5;
    v.validate_nbf = true;
    let mut required = vec!["exp", "sub"];
    if let Some(iss) = issuer {
        v.set_issuer(&[iss]);
        required.push("iss");
    }
    match audience {
        Some(aud) => {
            v.set_audience(&[aud]);
            required.push("aud");
        }
        None => v.validate_aud = false,
    }
    v.set_required_spec_claims(&required);
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
            max_lifetime_secs: MAX_TOKEN_LIFETIME_SECS,
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
        Ok(Self {
            key,
            validation: validation(alg, issuer, audience),
            max_lifetime_secs: MAX_TOKEN_LIFETIME_SECS,
        })
    }

    /// Refuses tokens whose `exp` is more than `secs` away.
    pub fn with_max_lifetime(mut self, secs: u64) -> Self {
        self.max_lifetime_secs = secs;
        self
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
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if c.exp.saturating_sub(now) > self.max_lifetime_secs + self.validation.leeway {
            return Err(AuthError::Invalid(format!(
                "the token is valid for longer than the {} s this service accepts",
                self.max_lifetime_secs
            )));
        }
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
        // Not valid yet (`nbf` an hour ahead), and valid forever (`exp` = u64::MAX).
        for claims in [
            serde_json::json!({"sub": "a", "role": "ops", "exp": exp + 7200, "nbf": exp + 3600,
                "iss": "sluice", "aud": "admin"}),
            serde_json::json!({"sub": "a", "role": "ops", "exp": u64::MAX, "iss": "sluice",
                "aud": "admin"}),
        ] {
            let t = jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &claims,
                &EncodingKey::from_secret(SECRET),
            )
            .map_err(|e| AuthError::Config(e.to_string()))?;
            assert!(v.verify(&t).is_err(), "{claims}");
        }
        // Beyond the configured lifetime (a day here): refused; within it: accepted.
        let day = Verifier::hs256(SECRET, Some("sluice"), Some("admin"))?.with_max_lifetime(86_400);
        assert!(
            day.verify(&mint_hs256(SECRET, &ops(), 2 * 86_400, Some("sluice"), Some("admin"))?)
                .is_err()
        );
        assert!(
            day.verify(&mint_hs256(SECRET, &ops(), 3600, Some("sluice"), Some("admin"))?).is_ok()
        );
        let unbound = Principal { actor: "t".into(), role: Role::TenantAdmin, tenant: None };
        let t = mint_hs256(SECRET, &unbound, 60, Some("sluice"), Some("admin"))?;
        assert!(v.verify(&t).is_err());
        assert!(Verifier::hs256(b"short", None, None).is_err());
        Ok(())
    }

    // Test-only key pairs (generated with openssl for these tests; never used elsewhere).
    const ED_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIKJ0vn0UySOK4PU98BEW+cEhZOBPS2GKZN/o0Cuvw2WR\n-----END PRIVATE KEY-----\n";
    const ED_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEACOlzD7O33HCHEo3yQsmmz130GnJGbxsR3lHTfTimqyM=\n-----END PUBLIC KEY-----\n";
    const RSA_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----\nMIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQC1FrhyhoMYuf3d\n+t8dWlXJpyB2r3UncjAwgzbdabWldAtmjlPuzFHOTAExcUnKUVbdiBJodVqfELvt\ngSw7FY2JhOc3xGcupQ8jGzQ7XIBow8jsPO14PNQm++jBSBc5BnUI/DRp+cfswFGO\nEiVd7DGFBQGDpirYPrOf3b2ayKV3xx03m0AuLJCEALfgqCDjHlrrHnzyy6FinzO4\nd5bL2+1Z+iN32flrjdc+jMBWg2l7qbR1npZsJ+WT7qeXzuYvc1qpIzn60LkYEpwf\nh7avj5aYAc/s1CeCxPSL+fKTy49hzDm4RnyNCUwAOhYv3LBJTv0XB9SlWam/GCZN\nrP6nMzaXAgMBAAECggEAL5dWhyapumxa9yUw0M6GYDYvdnGbOPAuEPnTB/J5ng92\n1Y+PKGGDGFPqNlu/GFAzI4pYyCIbXFVyBjOd87Mw3NTUTVgtA9m2NjQ2kGk5iA74\nNXm3sRNPcCVhILa4/7AePuvFPJq7+5D5ffxv3JSv2PUdVkNr3CPyYg/M/ipALk9w\nxG7Oc14vO8arYQnFW8Az2P2BEsl1X2gYZtVxg1Z+LGd0WCbU1Y5tGwiR7l5PjlK3\npcFWQjwsK3xDK6R6yR9LHIsgzy3iX3BvPg0fct4wblOw2QP7le8LB7COXjatRv/Z\nw159CLVs8TWVMem1x9AQtFOaYDACt+bLK9iKt+PRsQKBgQDsu8SorySjQ16Jpn8L\nfIi+I70jDPJmFV84ORlD5fWdwfAS6kG/xk2IiTQY0WD4UyWb4fUxh09CIjnYC7IS\niZ4T92kCtO5WMEzeoB5x0WR4CkZjVboZBzy/qfDjtsQb0zlbzkfqvRz9kreeRCzD\nDvyLY3tiSo7NeJoE/w1h50oNhwKBgQDD057XQfZuV4CYKb/BbA+JGMguyD17pcEt\nlLMjAQKrjizwHptedr9EsOgu9r1MMOMxS4mG2SwLwNUqg0gQw76bINe8oWFwIuya\n+F8lo9PWQfyCKznEIxIOzo47vzR68QE3Y3ZAUCwxyplM0Rr8Jn02nvNnDdxwFfxb\nR6CIauJScQKBgEyIK3ypGnwZdH+lrt7ExORLY4LoVZkBAcaIVw2nUy9MGlPTHaxk\n7H3edVQspF/DaZ4qf30ilFH6BJ8+sLPjf5JO4sj4OzDr7n3uX8lF+2f/UmAcv8wF\nlfMUeobzeBTSxXFTj9Zoiu3DN89XlOz+dFCPuby+A8qTWZ+R4P6sqjkTAoGBAIiX\nhrcdEpg6vr7keBWhm2CEgbVoBMLHhmyVyTIEVWl2nU/L+ZG1gIqYXwvLHZUUkJRk\n3QPLXdbA5a9mrRDMiJpKGVFAu+ds5N7fmfZ2RJ+xnUDqh7uQvtrHJxzzrNaIXtHU\ntbn8cic06yNSw+DXtAUycBMU7wrbuw+scYRWEZFxAoGBANAhik+AScSm4WaxtUsg\nkc9TGBR+578Aa5/NPHIkJqK4MgDFwxvQ3J3/u6PhRuk6cQEZUcVL3jiZer1fIMPW\nQcos1fn36wTYJHJrj7OqaWgnmoUeKhOQbXKsfMU9TOy46u3e54ZCggedBNnYiCuZ\nElBJJuCWnaXwTO4FGSajA/gC\n-----END PRIVATE KEY-----\n";
    const RSA_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAtRa4coaDGLn93frfHVpV\nyacgdq91J3IwMIM23Wm1pXQLZo5T7sxRzkwBMXFJylFW3YgSaHVanxC77YEsOxWN\niYTnN8RnLqUPIxs0O1yAaMPI7DzteDzUJvvowUgXOQZ1CPw0afnH7MBRjhIlXewx\nhQUBg6Yq2D6zn929msild8cdN5tALiyQhAC34Kgg4x5a6x588suhYp8zuHeWy9vt\nWfojd9n5a43XPozAVoNpe6m0dZ6WbCflk+6nl87mL3NaqSM5+tC5GBKcH4e2r4+W\nmAHP7NQngsT0i/nyk8uPYcw5uEZ8jQlMADoWL9ywSU79FwfUpVmpvxgmTaz+pzM2\nlwIDAQAB\n-----END PUBLIC KEY-----\n";

    fn signed(alg: Algorithm, key: &EncodingKey) -> Result<String, AuthError> {
        let exp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        jsonwebtoken::encode(
            &Header::new(alg),
            &serde_json::json!({"sub": "kms", "role": "auditor", "exp": exp + 600}),
            key,
        )
        .map_err(|e| AuthError::Config(e.to_string()))
    }

    #[test]
    fn public_key_algorithms_verify_and_refuse_algorithm_confusion() -> Result<(), AuthError> {
        let cfg = |e: jsonwebtoken::errors::Error| AuthError::Config(e.to_string());
        let ed = Verifier::public_key("EdDSA", ED_PUBLIC.as_bytes(), None, None)?;
        let ed_key = EncodingKey::from_ed_pem(ED_PRIVATE.as_bytes()).map_err(cfg)?;
        assert_eq!(ed.verify(&signed(Algorithm::EdDSA, &ed_key)?)?.role, Role::Auditor);
        let rsa = Verifier::public_key("RS256", RSA_PUBLIC.as_bytes(), None, None)?;
        let rsa_key = EncodingKey::from_rsa_pem(RSA_PRIVATE.as_bytes()).map_err(cfg)?;
        assert_eq!(rsa.verify(&signed(Algorithm::RS256, &rsa_key)?)?.actor, "kms");
        // A token "signed" with HS256 using the public key as the HMAC secret is refused.
        for (v, public) in [(&ed, ED_PUBLIC), (&rsa, RSA_PUBLIC)] {
            let forged = signed(Algorithm::HS256, &EncodingKey::from_secret(public.as_bytes()))?;
            assert!(matches!(v.verify(&forged), Err(AuthError::Invalid(_))));
        }
        // Each verifier accepts only its own algorithm.
        assert!(ed.verify(&signed(Algorithm::RS256, &rsa_key)?).is_err());
        assert!(rsa.verify(&signed(Algorithm::EdDSA, &ed_key)?).is_err());
        assert!(Verifier::public_key("ES256", ED_PUBLIC.as_bytes(), None, None).is_err());
        Ok(())
    }
}
