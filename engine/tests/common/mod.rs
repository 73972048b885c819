//! Shared helpers for tests that use the real default model and the golden references.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::PathBuf;

/// File name of the default model.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the Gemma 3 270M model (`sluice model fetch gemma3-270m`).
pub const GEMMA_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// The default model file; fails with instructions when it is missing.
pub fn default_model() -> anyhow::Result<PathBuf> {
    cached(DEFAULT_MODEL_FILE, "sluice model fetch")
}

/// The Gemma 3 270M file; fails with instructions when it is missing.
pub fn gemma_model() -> anyhow::Result<PathBuf> {
    cached(GEMMA_FILE, "sluice model fetch gemma3-270m")
}

fn cached(file: &str, fetch: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("SLUICE_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sluice-models")
        }
    };
    let p = dir.join(file);
    anyhow::ensure!(p.is_file(), "{} is missing: run `{fetch}` first", p.display());
    Ok(p)
}

/// The golden llama.cpp reference for the default model, from the `shared/` folder that sits
/// beside the repository (found from whichever crate's tests are running).
pub fn golden() -> anyhow::Result<serde_json::Value> {
    golden_file("smollm2-135m-q4_1.llamacpp.json")
}

/// The golden llama.cpp reference for Gemma 3 270M.
pub fn gemma_golden() -> anyhow::Result<serde_json::Value> {
    golden_file("gemma-3-270m-q4_k_m.llamacpp.json")
}

fn golden_file(name: &str) -> anyhow::Result<serde_json::Value> {
    let rel = format!("shared/golden/{name}");
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let p = manifest
        .ancestors()
        .map(|a| a.join(&rel))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow::anyhow!("{rel} not found above {}", manifest.display()))?;
    let text = std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Token ids of a JSON array.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
        .unwrap_or_default()
}
