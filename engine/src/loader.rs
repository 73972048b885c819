//! Loading a whole model: weights, tokenizer, chat template and execution identity.

use std::path::{Path, PathBuf};

use crate::defaults::Recommended;
use crate::error::{EngineError, Result};
use crate::fetch::sha256_files;
use crate::identity::{ENGINE_VERSION, ExecutionIdentity};
use crate::model::{LlamaWeights, load_gguf_weights};
use sluice_text::gguf::GgufFile;
use sluice_text::model::ModelText;
use sluice_text::template::ChatTemplate;
use sluice_text::tokenizer::Tokenizer;

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
    /// The sampling its file recommends (GGUF `general.sampling.*`, `generation_config.json`).
    pub recommended: Recommended,
}

/// The id a model is served under by default: its file's stem (a directory's name),
/// lowercased, without the quantization tag a converter appends
/// (`SmolLM2-135M-Instruct.Q4_1.gguf` is `smollm2-135m-instruct`, `gemma-3-270m-q4_k_m.gguf`
/// `gemma-3-270m`), so an engine started on a file and a gateway agree without being told.
pub fn model_id_of(path: &Path) -> String {
    let stem = match path.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("gguf") => path.file_stem(),
        _ => path.file_name(),
    };
    let stem = stem.map(|s| s.to_string_lossy().to_lowercase()).unwrap_or_default();
    let base = match stem.rfind(['.', '-']) {
        Some(i) if is_quant_tag(&stem[i + 1..]) => &stem[..i],
        _ => stem.as_str(),
    };
    if base.is_empty() { "model".into() } else { base.to_owned() }
}

/// `q4_1`, `q4_k_m`, `iq2_xs`, `f16`, `bf16`, `f32`, `q8_0`... (lowercase).
fn is_quant_tag(tag: &str) -> bool {
    if matches!(tag, "f16" | "bf16" | "f32" | "fp16" | "fp32") {
        return true;
    }
    let rest = tag.strip_prefix("iq").or_else(|| tag.strip_prefix('q'));
    rest.is_some_and(|r| {
        r.starts_with(|c: char| c.is_ascii_digit())
            && r.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

impl LoadedModel {
    /// Loads a GGUF file or a Hugging Face safetensors directory.
    pub fn load(path: &Path) -> Result<LoadedModel> {
        let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
        let (weights, ModelText { tokenizer, template }, files, recommended) = if meta.is_dir() {
            let (w, t, files) = load_hf_dir(path)?;
            (w, t, files, Recommended::from_hf_dir(path)?)
        } else {
            let f = GgufFile::open(path)?;
            let text = ModelText::from_gguf(&f)?;
            (load_gguf_weights(&f)?, text, vec![path.to_path_buf()], Recommended::from_gguf(&f))
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
        let model_id = model_id_of(path);
        let identity = ExecutionIdentity {
            model_id,
            model_revision: format!("sha256:{}", sha256_files(&files, &|_| ())?),
            tokenizer_revision: format!("sha256:{}", tokenizer.revision()),
            chat_template_version: template.as_ref().map(|t| format!("sha256:{}", t.version())),
            adapter: None,
            engine_version: ENGINE_VERSION.to_string(),
        };
        Ok(LoadedModel {
            weights,
            tokenizer,
            template,
            identity,
            path: path.to_path_buf(),
            recommended,
        })
    }

    /// Token ids of `text` as a raw completion prompt: BOS when the model adds one, special
    /// tokens in the text parsed as special.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode_prompt(text)?)
    }
}

fn load_hf_dir(dir: &Path) -> Result<(LlamaWeights, ModelText, Vec<PathBuf>)> {
    let (weights, st) = crate::safetensors::load_safetensors_weights(dir)?;
    Ok((weights, ModelText::from_hf_dir(dir)?, st.weight_files().to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_named_after_its_file_without_the_quantization() {
        let id = |p: &str| model_id_of(Path::new(p));
        assert_eq!(id("/m/SmolLM2-135M-Instruct.Q4_1.gguf"), "smollm2-135m-instruct");
        assert_eq!(id("gemma-3-270m-q4_k_m.gguf"), "gemma-3-270m");
        assert_eq!(id("Llama-3.2-1B-Instruct-F16.gguf"), "llama-3.2-1b-instruct");
        assert_eq!(id("tiny-IQ2_XS.gguf"), "tiny");
        assert_eq!(id("/models/Qwen2.5-0.5B"), "qwen2.5-0.5b", "a directory keeps its dots");
        assert_eq!(id("plain.gguf"), "plain");
        assert_eq!(id("quant-q.gguf"), "quant-q", "q alone is no tag");
        assert_eq!(id("/"), "model");
    }
}
