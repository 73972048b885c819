//! Every call the gateway makes to an engine worker, except the proxied request itself (which
//! pingora forwards in [`crate::proxy`]): health, models, text side and load for
//! [`crate::workers`], a request's outcome for billing ([`crate::proxy`], [`crate::journal`]),
//! and aborts ([`crate::proxy`], [`crate::drain`]). Each route is `sluice_wire::route`'s and
//! each answer is read as a type (the wire's, and the one field of `/health` read here), so
//! nothing reads an engine's JSON by key; the internal token goes on every `/v1` route.

use std::time::Duration;

use serde::Deserialize;
use sluice_wire::{EngineLoad, ModelCard, Outcome, route};

/// How long a poll (health, models, load) may take: a worker slower than this is unhealthy.
const POLL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long fetching a text side (tokenizer and template, a few MB) may take.
const TEXT_TIMEOUT: Duration = Duration::from_secs(30);

/// How much longer than the wait it asked for an outcome may take to arrive.
const OUTCOME_SLACK: Duration = Duration::from_secs(5);

/// An engine's [`route::MODELS`] answer, each card read on its own.
#[derive(Deserialize)]
struct Listed {
    data: Vec<serde_json::Value>,
}

/// What the gateway reads of an engine's [`route::HEALTH`] answer.
#[derive(Deserialize)]
struct Health {
    /// The model the engine serves.
    model: Option<String>,
}

/// The bearer token the engines' `/v1` routes require: `Debug` never shows it.
#[derive(Clone)]
pub struct InternalToken(String);

impl InternalToken {
    /// `token`, when there is one.
    pub fn new(token: Option<String>) -> Option<Self> {
        token.map(InternalToken)
    }
}

impl std::fmt::Debug for InternalToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The gateway's client of its engines: one HTTP client (pooled connections) and the
/// internal token.
#[derive(Clone, Debug)]
pub struct EngineClient {
    http: reqwest::Client,
    token: Option<InternalToken>,
}

impl EngineClient {
    /// A client sending `token` (when some) to the engines' `/v1` routes.
    pub fn new(http: reqwest::Client, token: Option<String>) -> Self {
        Self::with_token(http, InternalToken::new(token))
    }

    /// A client sending `token` (when some) to the engines' `/v1` routes.
    pub fn with_token(http: reqwest::Client, token: Option<InternalToken>) -> Self {
        Self { http, token }
    }

    /// A request to `worker`'s `path`, with the internal token.
    fn request(
        &self,
        method: reqwest::Method,
        worker: &str,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let req = self.http.request(method, format!("http://{worker}{path}"));
        match &self.token {
            Some(InternalToken(t)) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The body of a GET of `path` at `worker`, read by `read`, when it answers with success
    /// within `timeout`; an error names the route.
    async fn get<T, F>(
        &self,
        worker: &str,
        path: &str,
        timeout: Duration,
        read: impl FnOnce(reqwest::Response) -> F,
    ) -> Result<T, String>
    where
        F: std::future::Future<Output = reqwest::Result<T>>,
    {
        let req = self.request(reqwest::Method::GET, worker, path).timeout(timeout);
        match req.send().await.and_then(reqwest::Response::error_for_status) {
            Ok(r) => read(r).await.map_err(|e| format!("{path}: {e}")),
            Err(e) => Err(format!("{path}: {e}")),
        }
    }

    /// `None` when `worker` is not healthy ([`route::HEALTH`] does not answer with success
    /// within [`POLL_TIMEOUT`]); else `Some` of the model it names (`None` when it names none).
    /// Sent without the token: the probe is outside `/v1`.
    pub async fn health(&self, worker: &str) -> Option<Option<String>> {
        let req = self.http.get(format!("http://{worker}{}", route::HEALTH)).timeout(POLL_TIMEOUT);
        match req.send().await {
            Ok(r) if r.status().is_success() => {
                Some(r.json::<Health>().await.ok().and_then(|h| h.model))
            }
            _ => None,
        }
    }

    /// The cards of the models `worker` serves ([`route::MODELS`]). A card that is not the
    /// wire's [`ModelCard`] is left out with a warning naming it; the others still count.
    pub async fn models(&self, worker: &str) -> Result<Vec<ModelCard>, String> {
        let list: Listed = self.get(worker, route::MODELS, POLL_TIMEOUT, |r| r.json()).await?;
        let cards = list.data.iter().filter_map(|card| match ModelCard::deserialize(card) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(worker, card = %card["id"], error = %e,
                    "an engine's model card is not what the wire says; left out");
                None
            }
        });
        Ok(cards.collect())
    }

    /// `worker`'s text side ([`route::TEXT`]): the bundle a
    /// [`crate::admission::TokenCounter`] is read from.
    pub async fn text(&self, worker: &str) -> Result<bytes::Bytes, String> {
        self.get(worker, route::TEXT, TEXT_TIMEOUT, |r| r.bytes()).await
    }

    /// What `worker` is doing now ([`route::LOAD`]).
    pub async fn load(&self, worker: &str) -> Result<EngineLoad, String> {
        self.get(worker, route::LOAD, POLL_TIMEOUT, |r| r.json()).await
    }

    /// `worker`'s outcome of request `id`, waiting up to `wait` for it to end there; `None`
    /// when the worker has no record of it.
    pub async fn outcome(
        &self,
        worker: &str,
        id: &str,
        wait: Duration,
    ) -> Result<Option<Outcome>, String> {
        let path = format!("{}?wait_ms={}", route::outcome(id), wait.as_millis());
        let req = self.request(reqwest::Method::GET, worker, &path).timeout(wait + OUTCOME_SLACK);
        let err = |e: reqwest::Error| format!("{}: {e}", route::outcome(id));
        let resp = req.send().await.map_err(err)?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        resp.error_for_status().map_err(err)?.json().await.map(Some).map_err(err)
    }

    /// Asks `worker` to stop request `id` ([`route::abort`]), waiting at most `timeout`.
    pub async fn abort(&self, worker: &str, id: &str, timeout: Duration) -> Result<(), String> {
        let req = self.request(reqwest::Method::POST, worker, &route::abort(id)).timeout(timeout);
        req.send().await.map(drop).map_err(|e| format!("{}: {e}", route::abort(id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_internal_token_never_shows_in_debug() {
        let client = EngineClient::new(reqwest::Client::new(), Some("s3cret-token".into()));
        let shown = format!("{client:?}");
        assert!(!shown.contains("s3cret") && shown.contains("<redacted>"), "{shown}");
        let workers = crate::workers::Workers::new(&["a:1".into()], Some("s3cret-token".into()));
        let shown = format!("{workers:?}");
        assert!(!shown.contains("s3cret") && shown.contains("<redacted>"), "{shown}");
    }
}
