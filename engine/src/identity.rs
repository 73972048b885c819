//! The execution identity every request runs under (never a bare model alias).

use serde::{Deserialize, Serialize};

/// Version of this engine build.
pub const ENGINE_VERSION: &str = concat!("sluice-engine/", env!("CARGO_PKG_VERSION"));

/// Immutable description of what computed a response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionIdentity {
    /// The model's id from its file ([`sluice_text::model::model_id_of`]).
    pub model_id: String,
    /// `sha256:` of the weight file(s).
    pub model_revision: String,
    /// `sha256:` of the tokenizer's canonical serialization.
    pub tokenizer_revision: String,
    /// `sha256:` of the chat template text, when the model has one.
    pub chat_template_version: Option<String>,
    /// Adapter `id@revision`, when one is applied.
    pub adapter: Option<String>,
    /// Engine build.
    pub engine_version: String,
}

impl ExecutionIdentity {
    /// A compact one-line form for headers: `model@rev;tok=..;tmpl=..;engine=..`.
    pub fn header_value(&self) -> String {
        let short = |s: &str| s.trim_start_matches("sha256:").chars().take(16).collect::<String>();
        format!(
            "{}@{};tok={};tmpl={};adapter={};engine={}",
            self.model_id,
            short(&self.model_revision),
            short(&self.tokenizer_revision),
            self.chat_template_version.as_deref().map_or_else(|| "none".into(), short),
            self.adapter.as_deref().unwrap_or("none"),
            self.engine_version
        )
    }
}
