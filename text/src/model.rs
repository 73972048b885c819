//! A model's text side: its tokenizer and chat template, from a GGUF file's metadata or a
//! Hugging Face directory's `tokenizer.json` and `tokenizer_config.json`. The gateway counts
//! tokens with this and the engine encodes with it, so both read the same files the same way.
//! A [bundle](ModelText::bundle) carries the text side alone (no weights) from an engine to a
//! gateway, which learns the models it routes to from the engines that serve them.

use std::path::{Path, PathBuf};

use crate::error::{Result, TextError};
use crate::gguf::{GgufFile, GgufWriter, MetaValue};
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

/// Metadata keys of a bundle made from a Hugging Face directory: its files' text.
const HF_FILES: [(&str, &str); 2] = [
    ("sluice.hf.tokenizer.json", "tokenizer.json"),
    ("sluice.hf.tokenizer_config.json", "tokenizer_config.json"),
];

impl ModelText {
    /// The text side of the model at `path` as one GGUF file without tensors: a GGUF model's
    /// `tokenizer.*` metadata, or a Hugging Face directory's tokenizer files as strings.
    /// [`from_bundle`](Self::from_bundle) reads it back to the same tokenizer revision and
    /// template version.
    pub fn bundle(path: &Path) -> Result<Vec<u8>> {
        let mut w = GgufWriter::new();
        if std::fs::metadata(path).map_err(|e| TextError::io(path, e))?.is_dir() {
            for (key, name) in HF_FILES {
                let file = path.join(name);
                match std::fs::read_to_string(&file) {
                    Ok(text) => {
                        w.meta(key, MetaValue::String(text));
                    }
                    Err(e)
                        if e.kind() == std::io::ErrorKind::NotFound && name != "tokenizer.json" => {
                    }
                    Err(e) => return Err(TextError::io(&file, e)),
                }
            }
        } else {
            let f = GgufFile::open(path)?;
            for (key, value) in f.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
                w.meta(key, value.clone());
            }
        }
        Ok(w.to_bytes())
    }

    /// The text side a [`bundle`](Self::bundle) carries.
    pub fn from_bundle(bytes: &[u8]) -> Result<ModelText> {
        let scratch = Scratch::new()?;
        let gguf = scratch.0.join("text.gguf");
        std::fs::write(&gguf, bytes).map_err(|e| TextError::io(&gguf, e))?;
        let f = GgufFile::open(&gguf)?;
        if f.get(HF_FILES[0].0).is_none() {
            return ModelText::from_gguf(&f);
        }
        for (key, name) in HF_FILES {
            if let Some(v) = f.get(key) {
                let text = v.as_str().ok_or_else(|| {
                    TextError::format(&gguf, format!("metadata {key} is not a string"))
                })?;
                let file = scratch.0.join(name);
                std::fs::write(&file, text).map_err(|e| TextError::io(&file, e))?;
            }
        }
        ModelText::from_hf_dir(&scratch.0)
    }
}

/// A private directory under the system's temporary one, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("sluice-text-{}-{n}", std::process::id()));
        // Left over from a process of the same pid that died: not ours to trust.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(|e| TextError::io(&dir, e))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{SynthVocabulary, write_vocab_gguf};

    fn same(a: &ModelText, b: &ModelText) -> bool {
        a.tokenizer.revision() == b.tokenizer.revision()
            && a.template.as_ref().map(|t| t.version()) == b.template.as_ref().map(|t| t.version())
    }

    #[test]
    fn a_bundle_carries_the_text_side_of_either_format()
    -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let gguf = dir.path().join("m.gguf");
        write_vocab_gguf(512, &gguf)?;
        let hf = dir.path().join("hf");
        std::fs::create_dir(&hf)?;
        let v = SynthVocabulary::new(512);
        std::fs::write(hf.join("tokenizer.json"), v.tokenizer_json().to_string())?;
        std::fs::write(hf.join("tokenizer_config.json"), v.tokenizer_config_json(256).to_string())?;
        for path in [&gguf, &hf] {
            let direct = ModelText::open(path)?;
            let bundle = ModelText::bundle(path)?;
            let carried = ModelText::from_bundle(&bundle)?;
            assert!(direct.template.is_some(), "{}", path.display());
            assert!(same(&direct, &carried), "{}", path.display());
            let (a, b) = (
                direct.tokenizer.encode_prompt("Hello, world")?,
                carried.tokenizer.encode_prompt("Hello, world")?,
            );
            assert!(!a.is_empty() && a == b, "{}", path.display());
        }
        // Without tokenizer.json there is nothing to carry; a bundle that is not GGUF is refused.
        std::fs::remove_file(hf.join("tokenizer.json"))?;
        assert!(ModelText::bundle(&hf).is_err());
        assert!(ModelText::from_bundle(b"not a gguf file").is_err());
        Ok(())
    }

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
