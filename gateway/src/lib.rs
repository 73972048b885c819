//! Sluice gateway: the pingora data plane ([`proxy`]) and the modules its phases call: the
//! request checks and every refusal as data ([`admission`]), the models learned from the
//! engines and routed to by name ([`catalog`], [`workers`]), every call to an engine beside
//! the proxied request ([`engine_client`]), admission by tokens with per-tenant quotas and
//! rate limits shared by every replica through Redis ([`limits`]), the local fallback when
//! Redis is unreachable ([`local`]), the observer of the engine's event stream that times what
//! the client receives ([`observe`]), how an admitted request ended, as data ([`conclude`]),
//! the usage-event sink ([`sink`]), `Idempotency-Key` claims with response replay
//! ([`idempotency`]), the guard on request heads under pingora's parser ([`door`]), and fair
//! admission by each tenant's share of the engines ([`fair`]), judged with the other replicas
//! through Redis ([`fair_peers`]).

pub mod admission;
pub mod catalog;
pub mod conclude;
pub mod door;
pub mod drain;
pub mod engine_client;
pub mod fair;
pub mod fair_peers;
pub mod idempotency;
pub mod journal;
pub mod limits;
pub mod local;
pub mod metrics;
pub mod observe;
pub mod platform;
pub mod proxy;
pub mod sink;
pub mod workers;
