//! Sluice gateway: the modules the data plane's phases call. Today: admission by tokens with
//! per-tenant quotas and rate limits shared by every replica through Redis ([`limits`]), the
//! local fallback when Redis is unreachable ([`local`]), and the observer of the engine's
//! event stream that times what the client receives ([`observe`]).

pub mod limits;
pub mod local;
pub mod observe;
