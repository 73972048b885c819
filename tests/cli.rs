//! The `sluice` command line against the real default model and llama.cpp's golden outputs.

#[path = "../engine/tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

fn sluice(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output()?)
}

fn ok_stdout(args: &[&str]) -> anyhow::Result<String> {
    let out = sluice(args)?;
    ensure!(
        out.status.success(),
        "sluice {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// Index of the first generated position where llama.cpp's top-1 may not be clear: its lead
/// over the second is < 0.3, or the golden file has no log-probabilities there (positions
/// ending inside an incomplete UTF-8 character), so the lead is unknown.
fn first_near_tie(item: &Value) -> usize {
    let n = ids(&item["completion_tokens"]).len();
    let mut lead = vec![None; n];
    for s in item["steps"].as_array().into_iter().flatten() {
        let top = &s["top"];
        if let Some(p) = s["pos"].as_u64().map(|p| p as usize).filter(|&p| p < n) {
            lead[p] = Some(top[0][1].as_f64().unwrap_or(0.0) - top[1][1].as_f64().unwrap_or(0.0));
        }
    }
    lead.iter().position(|l| l.is_none_or(|l| l < 0.3)).unwrap_or(n)
}

#[test]
fn tokenize_prints_llama_cpp_ids() -> anyhow::Result<()> {
    let m = common::default_model()?;
    let g = common::golden()?;
    for item in g["completion"].as_array().into_iter().flatten() {
        let prompt = item["prompt"].as_str().context("prompt")?;
        let out = ok_stdout(&["tokenize", "--model", m.to_str().context("path")?, prompt])?;
        let got: Vec<u64> = serde_json::from_str(out.trim())?;
        ensure!(got == ids(&item["prompt_tokens"]), "{prompt:?}: {got:?}");
    }
    Ok(())
}

#[test]
fn template_prints_the_golden_rendering() -> anyhow::Result<()> {
    let m = common::default_model()?;
    let dir = tempfile::tempdir()?;
    for (i, item) in common::golden()?["chat"].as_array().into_iter().flatten().enumerate() {
        let f = dir.path().join(format!("m{i}.json"));
        std::fs::write(&f, serde_json::to_string(&item["messages"])?)?;
        let out = ok_stdout(&[
            "template",
            "--model",
            m.to_str().context("path")?,
            "--messages-file",
            f.to_str().context("path")?,
        ])?;
        ensure!(out == item["rendered"].as_str().context("rendered")?, "item {i}: {out:?}");
    }
    Ok(())
}

#[test]
fn greedy_run_matches_llama_cpp_up_to_the_first_near_tie() -> anyhow::Result<()> {
    let m = common::default_model()?;
    let m = m.to_str().context("path")?;
    let g = common::golden()?;
    let dir = tempfile::tempdir()?;
    let mut full = 0;
    let mut compared = 0;
    for (kind, items) in [("completion", &g["completion"]), ("chat", &g["chat"])] {
        for (i, item) in items.as_array().into_iter().flatten().enumerate() {
            let out = if kind == "completion" {
                ok_stdout(&[
                    "run",
                    "--model",
                    m,
                    "--json",
                    "--max-tokens",
                    "48",
                    item["prompt"].as_str().context("prompt")?,
                ])?
            } else {
                let f = dir.path().join(format!("c{i}.json"));
                std::fs::write(&f, serde_json::to_string(&item["messages"])?)?;
                ok_stdout(&[
                    "run",
                    "--model",
                    m,
                    "--json",
                    "--max-tokens",
                    "48",
                    "--messages-file",
                    f.to_str().context("path")?,
                ])?
            };
            let v: Value = serde_json::from_str(out.trim())?;
            let ours = ids(&v["completion_tokens"]);
            let theirs = ids(&item["completion_tokens"]);
            let k = first_near_tie(item);
            ensure!(ours.len() >= k.min(theirs.len()), "{kind} {i}: only {} tokens", ours.len());
            ensure!(
                ours[..k.min(theirs.len())] == theirs[..k.min(theirs.len())],
                "{kind} {i}: ours {ours:?} llama.cpp {theirs:?} (first near-tie at {k})"
            );
            compared += k.min(theirs.len());
            if k >= theirs.len() {
                ensure!(ours == theirs, "{kind} {i}: no near-tie, yet ours {ours:?} vs {theirs:?}");
                full += 1;
            }
            for key in ["completion_text", "finish_reason", "timings", "execution_identity"] {
                ensure!(v.get(key).is_some(), "run --json lacks {key}");
            }
            ensure!(
                v["execution_identity"]["model_revision"]
                    == "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
            );
        }
    }
    println!("{compared} tokens compared; {full} of 14 items have no near-tie and match in full");
    ensure!(compared >= 100, "only {compared} tokens could be compared");
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("nope.gguf");
    let out = sluice(&["tokenize", "--model", missing.to_str().context("path")?, "hi"])?;
    ensure!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(err.contains("nope.gguf") && !err.contains("panicked"), "{err}");

    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00garbage")?;
    let out = sluice(&["run", "--model", junk.to_str().context("path")?, "hi"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("junk.gguf") && err.contains("truncated"),
        "{err}"
    );

    let m = common::default_model()?;
    let msgs = dir.path().join("bad.json");
    std::fs::write(&msgs, r#"[{"role": 3, "content": "x"}]"#)?;
    let out = sluice(&[
        "template",
        "--model",
        m.to_str().context("path")?,
        "--messages-file",
        msgs.to_str().context("path")?,
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("bad.json") && !err.contains("panicked"),
        "{err}"
    );

    let out = sluice(&["run", "--model", m.to_str().context("path")?, "--temperature=-1", "hi"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("--temperature"), "{err}");

    // A GPU that is not there is a clear error, not a panic (this machine has no driver).
    let model = m.to_str().context("path")?;
    let out = sluice(&["engine", "--model", model, "--listen", "127.0.0.1:0", "--device", "cuda"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    let no_gpu = err.contains("no NVIDIA driver found") || err.contains("no CUDA backend");
    ensure!(!out.status.success() && no_gpu && !err.contains("panicked"), "{err}");
    let out = sluice(&["engine", "--model", model, "--device", "tpu"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && err.contains("--device"), "{err}");
    // `sluice up` on a GPU that is not there: the same clear error.
    let dir = tempfile::tempdir()?;
    let state = dir.path().to_str().context("path")?;
    let out = sluice(&["up", "--dir", state, "--model", model, "--device", "cuda"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    let no_gpu = err.contains("no NVIDIA driver found") || err.contains("no CUDA backend");
    ensure!(!out.status.success() && no_gpu && !err.contains("panicked"), "{err}");
    // A share of device memory sizes only a GPU's cache, within (0, 1], and not beside a size
    // in MiB.
    for (args, says) in [
        (&["--gpu-memory-utilization", "0.5"][..], "on the CPU give --kv-cache-mb"),
        (&["--device", "cuda", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (&["--gpu-memory-utilization", "0.5", "--kv-cache-mb", "64"], "cannot be used with"),
    ] {
        let out =
            sluice(&[&["engine", "--model", model, "--listen", "127.0.0.1:0"], args].concat())?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
    Ok(())
}

/// `--policies DIR`: a file there that does not parse stops the start, naming the file, the
/// tier and the field; a directory without the file keeps the compiled-in copy.
#[test]
fn a_malformed_policy_file_stops_the_start_naming_file_and_field() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().to_str().context("utf-8")?;
    // An empty directory: every policy is the compiled-in one.
    sluice(&["--policies", path, "model", "list"])
        .and_then(|o| if o.status.success() { Ok(()) } else { bail!("{o:?}") })?;
    let cases = [
        ("tiers.json", r#"{"free": {"rpm": "many"}}"#, "free.rpm"),
        ("tiers.json", r#"{"free": {"max_n": 99}}"#, "max_n"),
        ("scheduling.json", r#"{"free": {"weight": 1, "ttft": 5}}"#, "ttft"),
        (
            "prices.json",
            r#"{"version": "v", "default": {"input": -1, "cached_input": 0, "output": 0}}"#,
            "input",
        ),
        ("models.json", r#"{"aliases": {"a": ""}}"#, "a"),
        ("sampling.json", r#"{"m": {"temperature": 9}}"#, "m"),
    ];
    for (file, text, field) in cases {
        let d = tempfile::tempdir()?;
        std::fs::write(d.path().join(file), text)?;
        let out = sluice(&["--policies", d.path().to_str().context("utf-8")?, "model", "list"])?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{file} {text}: started");
        ensure!(err.contains(file) && err.contains(field), "{file} {text}: {err}");
    }
    let out = sluice(&["--policies", "/no/such/dir", "model", "list"])?;
    ensure!(!out.status.success(), "a missing directory was accepted");
    ensure!(String::from_utf8_lossy(&out.stderr).contains("--policies"), "{out:?}");
    Ok(())
}
