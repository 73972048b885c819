//! The engines' routes: the OpenAI-compatible ones the gateway forwards to and the internal
//! ones it (and `sluice audit reconcile`) calls. Paths with a parameter come as a pattern
//! (axum's `{id}` syntax, for the engine's router) and a function that fills it in (for
//! callers).

/// Text completions (OpenAI).
pub const COMPLETIONS: &str = "/v1/completions";
/// Chat completions (OpenAI).
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
/// The models served (OpenAI), each card carrying Sluice's execution identity.
pub const MODELS: &str = "/v1/models";
/// One model's card.
pub const MODEL: &str = "/v1/models/{id}";
/// What the engine did for one request (`?wait_ms=` waits for its end).
pub const OUTCOME: &str = "/v1/internal/requests/{id}";
/// Aborts one request.
pub const ABORT: &str = "/v1/internal/requests/{id}/abort";
/// Every outcome kept since the engine started, for reconciliation.
pub const OUTCOMES: &str = "/v1/internal/outcomes";
/// The text side (tokenizer and chat template) as one bundle.
pub const TEXT: &str = "/v1/internal/text";
/// The engine's load, an [`crate::EngineLoad`].
pub const LOAD: &str = "/v1/internal/load";
/// Health and engine statistics.
pub const HEALTH: &str = "/health";
/// Liveness.
pub const LIVEZ: &str = "/livez";
/// Readiness.
pub const READYZ: &str = "/readyz";
/// Prometheus exposition.
pub const METRICS: &str = "/metrics";

/// [`OUTCOME`] for request `id`.
pub fn outcome(id: &str) -> String {
    OUTCOME.replace("{id}", id)
}

/// [`ABORT`] for request `id`.
pub fn abort(id: &str) -> String {
    ABORT.replace("{id}", id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_routes_match_their_patterns() {
        assert_eq!(outcome("r-1"), "/v1/internal/requests/r-1");
        assert_eq!(abort("r-1"), "/v1/internal/requests/r-1/abort");
    }
}
