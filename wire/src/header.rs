//! The trusted internal headers: set by the gateway on each request it forwards to an engine
//! (after authenticating the tenant), and the ones an engine answers with. An engine started
//! with an internal token accepts them from the token's holder only.

/// The tenant whose prefix-cache scope and fair-order share the request uses.
pub const TENANT: &str = "x-sluice-tenant";
/// The request id, chosen by the gateway (an engine generates one when it is absent).
pub const REQUEST_ID: &str = "x-sluice-request-id";
/// Scheduling priority (an i32, larger first).
pub const PRIORITY: &str = "x-sluice-priority";
/// The tenant's weight in the fair order (1 to [`crate::MAX_WEIGHT`]).
pub const WEIGHT: &str = "x-sluice-weight";
/// The time per output token to keep the request within, in milliseconds (1 to 60,000).
pub const TPOT_MS: &str = "x-sluice-tpot-ms";
/// The tenant's adapter, `TENANT/NAME@sha256:HEX`.
pub const ADAPTER: &str = "x-sluice-adapter";
/// The execution identity, compact form (an engine's answer).
pub const EXECUTION_IDENTITY: &str = "x-sluice-execution-identity";
/// The model revision, the content hash of the weights (an engine's answer).
pub const MODEL_REVISION: &str = "x-sluice-model-revision";
/// The gateway's own time on the request, milliseconds (the gateway's answer to a client).
pub const GATEWAY_OVERHEAD_MS: &str = "x-sluice-gateway-overhead-ms";
/// W3C trace context, passed on from the client or started by the gateway.
pub const TRACEPARENT: &str = "traceparent";
