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

/// The golden llama.cpp reference for the default model (`engine/tests/golden/`, whose README
/// says where it came from). Compiled in relative to this file, so every crate whose tests
/// include this module reads the same in-repository copy.
pub fn golden() -> anyhow::Result<serde_json::Value> {
    parse_golden(
        "smollm2-135m-q4_1.llamacpp.json",
        include_str!("../golden/smollm2-135m-q4_1.llamacpp.json"),
    )
}

/// The golden llama.cpp reference for Gemma 3 270M (`engine/tests/golden/`).
pub fn gemma_golden() -> anyhow::Result<serde_json::Value> {
    parse_golden(
        "gemma-3-270m-q4_k_m.llamacpp.json",
        include_str!("../golden/gemma-3-270m-q4_k_m.llamacpp.json"),
    )
}

fn parse_golden(name: &str, text: &str) -> anyhow::Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| anyhow::anyhow!("engine/tests/golden/{name}: {e}"))
}

/// Token ids of a JSON array.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
        .unwrap_or_default()
}
