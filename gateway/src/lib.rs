//! Sluice gateway: the pingora data plane ([`proxy`]) and the modules its phases call:
//! admission by tokens with per-tenant quotas and rate limits shared by every replica through
//! Redis ([`limits`]), the local fallback when Redis is unreachable ([`local`]), the observer
//! of the engine's event stream that times what the client receives ([`observe`]), and the
//! usage-event sink ([`sink`]), and `Idempotency-Key` claims with response replay
//! ([`idempotency`]).

pub mod drain;
pub mod idempotency;
pub mod limits;
pub mod local;
pub mod metrics;
pub mod observe;
pub mod proxy;
pub mod sink;
pub mod workers;
