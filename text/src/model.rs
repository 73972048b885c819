//! A model's text side: its tokenizer and chat template, from a GGUF file's metadata or a
//! Hugging Face directory's `tokenizer.json` and `tokenizer_config.json`. The gateway counts
//! tokens with this and the engine encodes with it, so both read the same files the same way.

use std::path::Path;

use crate::error::{Result, TextError};
use crate::gguf::GgufFile;
use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;

/// The tokenizer and chat template of one model.
#[derive(Debug)]
pub struct ModelText {
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
}

impl ModelText {
    /// Reads a GGUF file's metadata (its tensors are mapped, never read) or a Hugging Face
    /// directory.
    pub fn open(path: &Path) -> Result<ModelText> {
        let meta = std::fs::metadata(path).map_err(|e| TextError::io(path, e))?;
        if meta.is_dir() {
            ModelText::from_hf_dir(path)
        } else {
            ModelText::from_gguf(&GgufFile::open(path)?)
        }
    }

    /// The text side of an opened GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelText> {
        Ok(ModelText {
            tokenizer: Tokenizer::from_gguf(file)?,
            template: ChatTemplate::from_gguf(file)?,
        })
    }

    /// The text side of a Hugging Face directory: `tokenizer.json`, and `tokenizer_config.json`
    /// when present for its special tokens and chat template.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelText> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<serde_json::Value> = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => Some(
                serde_json::from_str(&s)
                    .map_err(|e| TextError::format(&cfg_path, format!("invalid JSON: {e}")))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(TextError::io(&cfg_path, e)),
        };
        let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json"), cfg.as_ref())?;
        let template = match cfg.as_ref().and_then(|c| chat_template_text(c.get("chat_template")?))
        {
            Some(src) => {
                let tok_text = |key: &str| {
                    cfg.as_ref()
                        .and_then(|c| c.get(key))
                        .and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()))
                        .unwrap_or("")
                        .to_string()
                };
                Some(ChatTemplate::new(&src, &tok_text("bos_token"), &tok_text("eos_token"))?)
            }
            None => None,
        };
        Ok(ModelText { tokenizer, template })
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which "default" is used.
fn chat_template_text(v: &serde_json::Value) -> Option<String> {
    if let Some(s) = v.as_str() {
        return Some(s.to_string());
    }
    v.as_array()?
        .iter()
        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
        .and_then(|t| t.get("template")?.as_str().map(str::to_string))
}
