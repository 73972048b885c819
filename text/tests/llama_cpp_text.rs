//! Tokenizers and chat templates against llama.cpp's, on the reference outputs
//! `scripts/golden-text` recorded from llama-server (`golden/*.llamacpp.json`): every
//! `tokenizer.ggml.pre` Sluice claims, on a vocabulary whose merges cross the places
//! pre-tokenizers split, and every family's chat template.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_text::gguf::{GgufFile, GgufWriter, MetaValue};
use sluice_text::synth::SynthVocabulary;
use sluice_text::template::{ChatMessage, ChatTemplate};
use sluice_text::tokenizer::Tokenizer;

fn golden(name: &str) -> anyhow::Result<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn probe_tokenizer(pre: &str, dir: &Path) -> anyhow::Result<Tokenizer> {
    let path = dir.join(format!("{pre}.gguf"));
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()));
    SynthVocabulary::probe_named(pre, 0).write_gguf_meta(&mut w);
    w.write(&path)?;
    Ok(Tokenizer::from_gguf(&GgufFile::open(&path)?)?)
}

#[test]
fn every_claimed_pre_tokenizer_splits_as_llama_cpp_does() -> anyhow::Result<()> {
    let g = golden("tokenizers.llamacpp.json")?;
    let texts: Vec<&str> =
        g["texts"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let dir = tempfile::tempdir()?;
    let mut checked = 0;
    let mut wrong = Vec::new();
    for entry in g["tokenizers"].as_array().into_iter().flatten() {
        let pre = entry["pre"].as_str().unwrap_or_default();
        let tokenizer = probe_tokenizer(pre, dir.path())?;
        let expected = entry["ids"].as_array().map(Vec::as_slice).unwrap_or_default();
        assert_eq!(expected.len(), texts.len(), "{pre}: one list of ids a text");
        for (text, ids) in texts.iter().zip(expected) {
            let theirs: Vec<u32> = serde_json::from_value(ids.clone())?;
            let ours = tokenizer.encode(text, true)?;
            if ours != theirs {
                wrong
                    .push(format!("{pre} {text:?}:\n  ours      {ours:?}\n  llama.cpp {theirs:?}"));
            }
            checked += 1;
        }
    }
    assert!(checked >= 200, "only {checked} texts checked");
    assert!(wrong.is_empty(), "{} of {checked} differ:\n{}", wrong.len(), wrong.join("\n"));
    Ok(())
}

#[test]
fn the_probe_vocabulary_sees_splits() -> anyhow::Result<()> {
    // The check above is only as sharp as the merges: the same text must come out differently
    // under pre-tokenizers that split it differently.
    let dir = tempfile::tempdir()?;
    let (gpt2, llama3) =
        (probe_tokenizer("gpt-2", dir.path())?, probe_tokenizer("llama-bpe", dir.path())?);
    for text in ["12345 678", "it'S", "a!\n\nb"] {
        assert_ne!(gpt2.encode(text, true)?, llama3.encode(text, true)?, "{text:?}");
    }
    Ok(())
}

#[test]
fn chat_templates_render_as_llama_cpp_renders_them() -> anyhow::Result<()> {
    let g = golden("templates.llamacpp.json")?;
    let (bos, eos) =
        (g["bos_token"].as_str().unwrap_or_default(), g["eos_token"].as_str().unwrap_or_default());
    let recorded_date = g["date"].as_str().unwrap_or_default();
    // Templates that print today's date printed the recording day's there.
    let today =
        ChatTemplate::new("{{ strftime_now('%d %b %Y') }}", bos, eos)?.render(&[], false)?;
    let conversations: Vec<Vec<ChatMessage>> = g["conversations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| serde_json::from_value(c.clone()))
        .collect::<Result<_, _>>()?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/templates");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for entry in g["templates"].as_array().into_iter().flatten() {
        let name = entry["template"].as_str().unwrap_or_default();
        let source = std::fs::read_to_string(dir.join(name))?;
        let template = ChatTemplate::new(&source, bos, eos)?;
        for (messages, expected) in
            conversations.iter().zip(entry["prompts"].as_array().into_iter().flatten())
        {
            let ours = template.render(messages, true).map(|p| p.replace(&today, recorded_date));
            let agree = match (&ours, expected.as_str()) {
                (Ok(ours), Some(theirs)) => ours == theirs,
                (Err(_), None) => true,
                _ => false,
            };
            if !agree {
                wrong.push(format!(
                    "{name}, {} messages:\n  ours      {ours:?}\n  llama.cpp {expected}",
                    messages.len()
                ));
            }
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} renderings checked");
    assert!(wrong.is_empty(), "{} of {checked} differ:\n{}", wrong.len(), wrong.join("\n"));
    Ok(())
}
