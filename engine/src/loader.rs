//! Loading a whole model: weights, tokenizer, chat template and execution identity.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};
use crate::fetch::sha256_files;
use crate::gguf::GgufFile;
use crate::identity::{ENGINE_VERSION, ExecutionIdentity};
use crate::model::{LlamaWeights, load_gguf_weights};
use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;

/// Everything needed to serve one model.
#[derive(Debug)]
pub struct LoadedModel {
    /// Weights in compute layout.
    pub weights: LlamaWeights,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// What requests run under.
    pub identity: ExecutionIdentity,
    /// Where it was loaded from.
    pub path: PathBuf,
}

impl LoadedModel {
    /// Loads a GGUF file or a Hugging Face safetensors directory.
    pub fn load(path: &Path) -> Result<LoadedModel> {
        let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
        let (weights, tokenizer, template, files) = if meta.is_dir() {
            load_hf_dir(path)?
        } else {
            let f = GgufFile::open(path)?;
            let weights = load_gguf_weights(&f)?;
            let tokenizer = Tokenizer::from_gguf(&f)?;
            let template = ChatTemplate::from_gguf(&f)?;
            (weights, tokenizer, template, vec![path.to_path_buf()])
        };
        if tokenizer.vocab_size() > weights.config.vocab_size {
            return Err(EngineError::format(
                path,
                format!(
                    "tokenizer has {} tokens but the embedding only {} rows",
                    tokenizer.vocab_size(),
                    weights.config.vocab_size
                ),
            ));
        }
        let model_id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let identity = ExecutionIdentity {
            model_id,
            model_revision: format!("sha256:{}", sha256_files(&files, &|_| ())?),
            tokenizer_revision: format!("sha256:{}", tokenizer.revision()),
            chat_template_version: template.as_ref().map(|t| format!("sha256:{}", t.version())),
            adapter: None,
            engine_version: ENGINE_VERSION.to_string(),
        };
        Ok(LoadedModel { weights, tokenizer, template, identity, path: path.to_path_buf() })
    }

    /// Token ids of `text` as a raw completion prompt: BOS when the model adds one, special
    /// tokens in the text parsed as special.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode_prompt(text)
    }
}

type Parts = (LlamaWeights, Tokenizer, Option<ChatTemplate>, Vec<PathBuf>);

fn load_hf_dir(dir: &Path) -> Result<Parts> {
    let (weights, st) = crate::safetensors::load_safetensors_weights(dir)?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg: Option<serde_json::Value> = match std::fs::read_to_string(&cfg_path) {
        Ok(s) => Some(
            serde_json::from_str(&s)
                .map_err(|e| EngineError::format(&cfg_path, format!("invalid JSON: {e}")))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(EngineError::io(&cfg_path, e)),
    };
    let tokenizer = Tokenizer::from_hf_file(&dir.join("tokenizer.json"), cfg.as_ref())?;
    let template = match cfg.as_ref().and_then(|c| chat_template_text(c.get("chat_template")?)) {
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
    Ok((weights, tokenizer, template, st.weight_files().to_vec()))
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
