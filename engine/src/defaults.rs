//! What a request's sampling parameters are when it leaves them out: the model file's own
//! recommendations (GGUF `general.sampling.*`, a Hugging Face `generation_config.json`), as
//! vLLM takes them, else the served model's entry in `policies/sampling.json`, else OpenAI's
//! defaults (temperature 1, top-p 1, no top-k or min-p cut).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_text::gguf::GgufFile;

use crate::error::{EngineError, Result};

/// Where a default from the policy file is said to come from.
const POLICY_SOURCE: &str = "policies/sampling.json";

/// Sampling values recommended for a model, each one or none.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recommended {
    /// Temperature, 0 to 2.
    pub temperature: Option<f32>,
    /// Nucleus cut, in (0, 1].
    pub top_p: Option<f32>,
    /// Top-k cut (0: none).
    pub top_k: Option<usize>,
    /// Min-p cut, in [0, 1].
    pub min_p: Option<f32>,
}

impl Recommended {
    /// The recommendations a GGUF file carries (`general.sampling.temp`, `.top_p`,
    /// `.top_k`, `.min_p`); values out of range are left out.
    pub fn from_gguf(f: &GgufFile) -> Recommended {
        let num = |k: &str| f.get(&format!("general.sampling.{k}")).and_then(|v| v.as_f64());
        Recommended {
            temperature: num("temp").map(|x| x as f32),
            top_p: num("top_p").map(|x| x as f32),
            top_k: num("top_k").filter(|k| *k >= 0.0).map(|k| k as usize),
            min_p: num("min_p").map(|x| x as f32),
        }
        .in_range()
    }

    /// The recommendations of a Hugging Face directory's `generation_config.json` (none
    /// when it has none; `do_sample: false` means greedy).
    pub fn from_hf_dir(dir: &Path) -> Result<Recommended> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Recommended::default()),
            Err(e) => return Err(EngineError::io(&path, e)),
        };
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::format(&path, format!("not JSON: {e}")))?;
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let greedy = v.get("do_sample").and_then(Value::as_bool) == Some(false);
        Ok(Recommended {
            temperature: if greedy { Some(0.0) } else { num("temperature").map(|x| x as f32) },
            top_p: num("top_p").map(|x| x as f32),
            top_k: num("top_k").filter(|k| *k >= 0.0).map(|k| k as usize),
            min_p: num("min_p").map(|x| x as f32),
        }
        .in_range())
    }

    fn in_range(self) -> Recommended {
        Recommended {
            temperature: self.temperature.filter(|t| (0.0..=2.0).contains(t)),
            top_p: self.top_p.filter(|p| *p > 0.0 && *p <= 1.0),
            top_k: self.top_k,
            min_p: self.min_p.filter(|p| (0.0..=1.0).contains(p)),
        }
    }
}

/// The policy file's entries by served model id, or an error naming the entry at fault.
pub fn policy(text: &str) -> std::result::Result<BTreeMap<String, Recommended>, String> {
    let v: BTreeMap<String, Value> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for (model, entry) in v.into_iter().filter(|(k, _)| !k.starts_with('_')) {
        let r: Recommended = serde_json::from_value(entry).map_err(|e| format!("{model}: {e}"))?;
        if r.clone().in_range() != r {
            return Err(format!("{model}: a value is out of range"));
        }
        out.insert(model, r);
    }
    Ok(out)
}

/// Checks the sampling policy in force (`sampling.json`, see [`sluice_policies`]): an error
/// names the file and the model entry at fault.
pub fn check_policy() -> std::result::Result<(), String> {
    let text = sluice_policies::text("sampling.json")?;
    policy(&text)
        .map(|_| ())
        .map_err(|e| format!("{}: {e}", sluice_policies::source("sampling.json")))
}

/// The defaults a served model's requests get, and where each came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingDefaults {
    /// Temperature.
    pub temperature: f32,
    /// Nucleus cut.
    pub top_p: f32,
    /// Top-k cut (0: none).
    pub top_k: usize,
    /// Min-p cut.
    pub min_p: f32,
    /// Per parameter: `model file`, `policies/sampling.json` or `openai`.
    pub from: BTreeMap<&'static str, &'static str>,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults::resolve(&Recommended::default(), None)
    }
}

impl SamplingDefaults {
    /// Per parameter, the model file's value, else the policy's, else OpenAI's.
    pub fn resolve(file: &Recommended, policy: Option<&Recommended>) -> SamplingDefaults {
        let mut from = BTreeMap::new();
        let mut pick = |name: &'static str, f: Option<f32>, p: Option<f32>, openai: f32| {
            let (v, src) = match (f, p) {
                (Some(v), _) => (v, "model file"),
                (None, Some(v)) => (v, POLICY_SOURCE),
                (None, None) => (openai, "openai"),
            };
            from.insert(name, src);
            v
        };
        let p = policy.cloned().unwrap_or_default();
        let temperature = pick("temperature", file.temperature, p.temperature, 1.0);
        let top_p = pick("top_p", file.top_p, p.top_p, 1.0);
        let top_k = pick("top_k", file.top_k.map(|k| k as f32), p.top_k.map(|k| k as f32), 0.0);
        let min_p = pick("min_p", file.min_p, p.min_p, 0.0);
        SamplingDefaults { temperature, top_p, top_k: top_k as usize, min_p, from }
    }

    /// The defaults of a model served as `served`, from its file's recommendations and the
    /// shipped policy file.
    pub fn for_model(file: &Recommended, served: &str) -> SamplingDefaults {
        let shipped = sluice_policies::text("sampling.json")
            .and_then(|text| policy(&text))
            .unwrap_or_else(|e| {
                tracing::error!("{POLICY_SOURCE} does not parse: {e}");
                BTreeMap::new()
            });
        SamplingDefaults::resolve(file, shipped.get(served))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_policy_parses_and_names_the_default_model() -> std::result::Result<(), String> {
        let p = policy(sluice_policies::compiled("sampling.json").unwrap_or_default())?;
        let smol = p.get("smollm2-135m-instruct").cloned().unwrap_or_default();
        assert_eq!((smol.temperature, smol.top_p), (Some(0.2), Some(0.9)));
        assert_eq!(
            policy(r#"{"m": {"temperature": 3}}"#).err(),
            Some("m: a value is out of range".into())
        );
        assert!(
            policy(r#"{"m": {"temp": 0.5}}"#)
                .err()
                .is_some_and(|e| e.starts_with("m: unknown field"))
        );
        Ok(())
    }

    #[test]
    fn the_file_goes_before_the_policy_and_the_policy_before_openai() {
        let file = Recommended { top_k: Some(40), ..Default::default() };
        let policy = Recommended { temperature: Some(0.2), top_k: Some(10), ..Default::default() };
        let d = SamplingDefaults::resolve(&file, Some(&policy));
        assert_eq!((d.temperature, d.top_p, d.top_k, d.min_p), (0.2, 1.0, 40, 0.0));
        let from: Vec<_> = d.from.into_iter().collect();
        assert_eq!(
            from,
            vec![
                ("min_p", "openai"),
                ("temperature", POLICY_SOURCE),
                ("top_k", "model file"),
                ("top_p", "openai")
            ]
        );
        let plain = SamplingDefaults::for_model(&Recommended::default(), "not-in-the-policy");
        assert_eq!((plain.temperature, plain.top_p), (1.0, 1.0));
        let smol = SamplingDefaults::for_model(&Recommended::default(), "smollm2-135m-instruct");
        assert_eq!((smol.temperature, smol.top_p), (0.2, 0.9));
    }

    #[test]
    fn generation_config_json_is_read_and_do_sample_false_is_greedy() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::io(Path::new("tmp"), e))?;
        assert_eq!(Recommended::from_hf_dir(dir.path())?, Recommended::default());
        let path = dir.path().join("generation_config.json");
        let write = |text: &str| std::fs::write(&path, text).map_err(|e| EngineError::io(&path, e));
        write(r#"{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1}"#)?;
        let r = Recommended::from_hf_dir(dir.path())?;
        assert_eq!(
            (r.temperature, r.top_p, r.top_k, r.min_p),
            (Some(0.6), Some(0.95), Some(20), None)
        );
        write(r#"{"do_sample": false, "temperature": 0.6}"#)?;
        assert_eq!(Recommended::from_hf_dir(dir.path())?.temperature, Some(0.0));
        write("{oops")?;
        assert!(Recommended::from_hf_dir(dir.path()).is_err());
        Ok(())
    }
}
