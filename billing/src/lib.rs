//! Sluice billing: the ledger schema and store, and durable idempotent usage ingestion.
//!
//! Gateways publish one [`UsageEvent`] per admitted request to a Redis Stream
//! ([`ingest::publish`]); [`ingest::UsageConsumer`] moves them into the [`Ledger`] and
//! acknowledges them only after the database commit. Delivery is at-least-once; inserts are
//! idempotent on request id and per-tenant idempotency key, so the ledger counts each request
//! exactly once.
//!
//! The service's server (the admin, audit and usage HTTP API with the console, JWT
//! authentication, retention and the ledger benchmark) is the default feature `server`; a
//! gateway links the ledger and the usage stream without it (the price list and the Redis
//! connection are `sluice-policies`', re-exported here).

pub mod adapters;
#[cfg(feature = "server")]
pub mod api;
#[cfg(feature = "server")]
pub mod auth;
#[cfg(feature = "server")]
pub mod bench;
pub mod control;
mod error;
pub mod event;
pub mod ingest;
pub mod local;
pub mod principal;
pub mod query;
#[cfg(feature = "server")]
pub mod retention;
pub mod store;

pub use error::BillingError;
pub use event::{FinishReason, UsageEvent};
/// The price list and the Redis connection, shared with the gateway through `sluice-policies`.
pub use sluice_policies::{prices, redis_conn};
pub use store::{Backend, Ledger, LedgerOptions};
