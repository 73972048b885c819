//! The models behind a gateway, learned from the engines that serve them: each engine's
//! `/v1/models` card names the model, its context length and its execution identity, and the
//! text side (tokenizer and chat template) comes with the identity's revisions, from a file
//! the gateway was given or else from the engine (`/v1/internal/text`). Nothing is kept in
//! step by hand: an engine started on a file names the model, and the gateway routes by that
//! name ([`crate::workers`]). Aliases (`default` -> a model id) come from
//! `policies/models.json`.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, Mutex, RwLock};

use serde_json::{Value, json};
use sluice_wire::{ExecutionIdentity, ModelCard};

use crate::admission::TokenCounter;

/// One model the gateway routes to.
#[derive(Debug)]
pub struct ModelEntry {
    /// The id clients name (after an alias is resolved).
    pub id: String,
    /// Counts prompt tokens as its engines will.
    pub tokens: Arc<TokenCounter>,
    /// Its context length, from the engine's card (`max_model_len`).
    pub context_length: u64,
    /// The execution identity its engine reported (none before an engine has).
    pub identity: Option<ExecutionIdentity>,
}

impl ModelEntry {
    /// Its card in `/v1/models`, with the engines serving it now.
    pub fn card(&self, engines: usize) -> Value {
        let id = self.identity.as_ref();
        json!({
            "id": self.id,
            "object": "model",
            "created": 0,
            "owned_by": "sluice",
            "max_model_len": self.context_length,
            "sluice": {
                "model_revision": id.map(|i| &i.model_revision),
                "tokenizer_revision": id.map(|i| &i.tokenizer_revision),
                "chat_template_version": id.and_then(|i| i.chat_template_version.as_ref()),
                "engines": engines,
            },
        })
    }
}

/// The aliases the models policy in force names (`models.json`, see [`sluice_policies`]).
static ALIASES: LazyLock<BTreeMap<String, String>> = LazyLock::new(|| {
    sluice_policies::text("models.json").and_then(|t| aliases(&t)).unwrap_or_else(|e| {
        tracing::error!(error = %e, "models.json is invalid; no aliases");
        BTreeMap::new()
    })
});

/// Checks the models policy in force: an error names the file and the alias at fault.
pub fn check_policy() -> Result<(), String> {
    let text = sluice_policies::text("models.json")?;
    aliases(&text)
        .map(|_| ())
        .map_err(|e| format!("{}: {e}", sluice_policies::source("models.json")))
}

/// The `aliases` object of a models policy: alias -> model id (an alias naming itself, or
/// empty, is refused).
pub fn aliases(text: &str) -> Result<BTreeMap<String, String>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let mut out = BTreeMap::new();
    let Some(map) = v.get("aliases") else { return Ok(out) };
    let map = map.as_object().ok_or("aliases must be an object")?;
    for (alias, target) in map {
        let target = target.as_str().ok_or_else(|| format!("alias {alias:?}: not a string"))?;
        if alias.is_empty() || target.is_empty() || alias == target {
            return Err(format!("alias {alias:?} -> {target:?}: empty or naming itself"));
        }
        out.insert(alias.clone(), target.to_owned());
    }
    Ok(out)
}

/// The gateway's models and the text sides it holds.
#[derive(Debug)]
pub struct Catalog {
    models: RwLock<BTreeMap<String, Arc<ModelEntry>>>,
    /// Text sides by revision: loaded from files at start, or fetched from engines.
    texts: Mutex<Vec<Arc<TokenCounter>>>,
    aliases: BTreeMap<String, String>,
}

impl Catalog {
    /// A catalog holding the text sides of the models the gateway was given, each under the
    /// id its file gives it until an engine describes it, and the shipped aliases.
    pub fn new(texts: Vec<(String, TokenCounter)>) -> Self {
        Self::with_aliases(texts, ALIASES.clone())
    }

    /// With these aliases.
    pub fn with_aliases(
        texts: Vec<(String, TokenCounter)>,
        aliases: BTreeMap<String, String>,
    ) -> Self {
        let catalog = Self { models: RwLock::default(), texts: Mutex::default(), aliases };
        for (id, text) in texts {
            let tokens = catalog.add_text(text);
            let entry = ModelEntry { id: id.clone(), tokens, context_length: 0, identity: None };
            catalog.models.write().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::new(entry));
        }
        catalog
    }

    /// The text side with this tokenizer revision and chat template version, if held.
    pub fn text(&self, tokenizer: &str, template: Option<&str>) -> Option<Arc<TokenCounter>> {
        let texts = self.texts.lock().unwrap_or_else(|e| e.into_inner());
        texts
            .iter()
            .find(|t| t.revision() == tokenizer && t.template_version() == template)
            .cloned()
    }

    /// Holds a text side fetched from an engine.
    pub fn add_text(&self, text: TokenCounter) -> Arc<TokenCounter> {
        let text = Arc::new(text);
        let mut texts = self.texts.lock().unwrap_or_else(|e| e.into_inner());
        texts.push(Arc::clone(&text));
        text
    }

    /// Records the model an engine's card describes, counted with `tokens`.
    pub fn learn(&self, card: &ModelCard, tokens: Arc<TokenCounter>) -> Option<String> {
        if card.id.is_empty() {
            return None;
        }
        let id = card.id.clone();
        let identity = &card.sluice.execution_identity;
        let entry = ModelEntry {
            id: id.clone(),
            tokens,
            context_length: card.max_model_len,
            identity: Some(identity.clone()),
        };
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = models.get(&id).and_then(|old| old.identity.as_ref())
            && old.model_revision != identity.model_revision
        {
            tracing::warn!(
                model = %id,
                was = %old.model_revision,
                now = %identity.model_revision,
                "engines serve one model id at two revisions"
            );
        }
        models.insert(id.clone(), Arc::new(entry));
        Some(id)
    }

    /// The model id `name` stands for: an alias's target, else itself.
    pub fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.aliases.get(name).map_or(name, String::as_str)
    }

    /// The model `name` (an id or an alias) names, when some engine has served it.
    pub fn resolve(&self, name: &str) -> Option<Arc<ModelEntry>> {
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        models.get(self.canonical(name)).cloned()
    }

    /// Every model learned, by id.
    pub fn entries(&self) -> Vec<Arc<ModelEntry>> {
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        models.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_aliases_parse_and_bad_ones_are_refused() {
        let shipped = aliases(sluice_policies::compiled("models.json").unwrap_or_default());
        assert_eq!(
            shipped.as_ref().ok().and_then(|a| a.get("default")).map(String::as_str),
            Some("smollm2-135m-instruct")
        );
        assert!(aliases(r#"{"aliases": {"a": "a"}}"#).is_err());
        assert!(aliases(r#"{"aliases": {"a": 3}}"#).is_err());
        assert!(aliases(r#"{"aliases": []}"#).is_err());
        assert_eq!(aliases("{}").map(|a| a.len()), Ok(0));
    }
}
