//! Sluice billing: the ledger schema and store, and durable idempotent usage ingestion.
//!
//! Gateways publish one [`UsageEvent`] per admitted request to a Redis Stream
//! ([`ingest::publish`]); [`ingest::UsageConsumer`] moves them into the [`Ledger`] and
//! acknowledges them only after the database commit. Delivery is at-least-once; inserts are
//! idempotent on request id and per-tenant idempotency key, so the ledger counts each request
//! exactly once.

pub mod adapters;
pub mod api;
pub mod auth;
pub mod bench;
pub mod control;
mod error;
pub mod event;
pub mod ingest;
pub mod local;
pub mod prices;
pub mod query;
pub mod redis_conn;
pub mod retention;
pub mod store;

pub use error::BillingError;
pub use event::{FinishReason, UsageEvent};
pub use store::{Backend, Ledger, LedgerOptions};
