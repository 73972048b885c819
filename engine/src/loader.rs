//! Loading a whole model: weights, tokenizer, chat template and execution identity.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::defaults::Recommended;
use crate::error::{EngineError, Result};
use crate::fetch::sha256_files;
use crate::identity::{ENGINE_VERSION, ExecutionIdentity};
use crate::model::{LlamaWeights, load_gguf_weights};
use crate::structured::Spelling;
use sluice_text::gguf::GgufFile;
use sluice_text::model::{ModelText, model_id_of};
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
    /// The vocabulary's byte strings for constrained decoding, made at its first use.
    spelling: OnceLock<Spelling>,
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
            spelling: OnceLock::new(),
        })
    }

    /// How many tokens spell a byte string in this model's vocabulary (special tokens left
    /// out), for constrained decoding.
    pub fn spelling(&self) -> &Spelling {
        self.spelling.get_or_init(|| {
            let tok = &self.tokenizer;
            let ids = 0..tok.vocab_size() as u32;
            Spelling::new(ids.filter(|&t| !tok.is_special(t)).filter_map(|t| tok.token_bytes(t)))
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
