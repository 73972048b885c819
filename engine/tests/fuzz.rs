//! Property tests of the parsers that face input, on stable Rust (proptest): a malformed model
//! file, request body or chat message is an error, never a panic, a hang or an overflow (the
//! engine's test profile checks overflow), and hostile chat content never becomes control
//! tokens. `PROPTEST_CASES` sets the run's length (CI: the default below; `scripts/fuzz`: long
//! runs). A failure's seed is kept by proptest under `engine/tests/fuzz.proptest-regressions`
//! and replayed first on every later run: commit it with the fix.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use serde_json::{Value, json};
use sluice_engine::loader::LoadedModel;
use sluice_engine::quant::GgmlType;
use sluice_engine::safetensors::SafetensorsModel;
use sluice_engine::server::validate::{Limits, chat_plan, completion_plan};
use sluice_engine::synth::{SynthSpec, write_gguf, write_safetensors_dir};
use sluice_text::gguf::GgufFile;
use sluice_text::template::{ChatMessage, ChatTemplate, encode_chat};
use sluice_text::tokenizer::{PROMPT_FIELD, Tokenizer};
use sluice_text::tools::generic_messages;

/// 64 cases a property unless `PROPTEST_CASES` says otherwise.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(64);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

/// A tiny synthetic model written once through the real writers: (dir, its GGUF bytes).
fn fixtures() -> &'static (PathBuf, Vec<u8>) {
    static F: OnceLock<(PathBuf, Vec<u8>)> = OnceLock::new();
    F.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sluice-fuzz-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let spec = SynthSpec::tiny();
        let gguf = dir.join("tiny.gguf");
        let written = write_gguf(&spec, GgmlType::F32, &gguf)
            .and_then(|()| write_safetensors_dir(&spec, GgmlType::F32, &dir.join("hf"), 1));
        let bytes = written.ok().and_then(|()| std::fs::read(&gguf).ok()).unwrap_or_default();
        (dir, bytes)
    })
}

/// GGUF bytes of small models of the other architectures in K-quant types (rows of whole
/// 256-element super-blocks): Phi-3 (fused matrices) in Q4_K, Qwen3 (Q/K norms) in Q5_K, Qwen2
/// (biases) in Q6_K.
fn k_quant_fixtures() -> &'static Vec<Vec<u8>> {
    static F: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    F.get_or_init(|| {
        let base = SynthSpec { hidden: 256, intermediate: 512, ..SynthSpec::tiny() };
        [
            (SynthSpec { fused: true, ..base.clone() }, GgmlType::Q4K),
            (SynthSpec { qk_norm: true, ..base.clone() }, GgmlType::Q5K),
            (SynthSpec { qkv_bias: true, ..base }, GgmlType::Q6K),
        ]
        .into_iter()
        .filter_map(|(spec, ty)| {
            let path = scratch(spec.arch());
            write_gguf(&spec, ty, &path).ok()?;
            let bytes = std::fs::read(&path).ok();
            let _ = std::fs::remove_file(&path);
            bytes
        })
        .collect()
    })
}

fn tiny_model() -> &'static Option<Arc<LoadedModel>> {
    static M: OnceLock<Option<Arc<LoadedModel>>> = OnceLock::new();
    M.get_or_init(|| LoadedModel::load(&fixtures().0.join("tiny.gguf")).ok().map(Arc::new))
}

/// `bytes` with `edits` applied (offsets wrap inside the first `window` bytes), cut to `keep`.
fn mutate(bytes: &[u8], edits: &[(usize, u8)], window: usize, keep: Option<usize>) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let w = window.min(b.len()).max(1);
    for &(at, v) in edits {
        if let Some(x) = b.get_mut(at % w) {
            *x = v;
        }
    }
    if let Some(k) = keep {
        b.truncate(k % (b.len() + 1));
    }
    b
}

/// A fresh path beside the fixtures.
fn scratch(name: &str) -> PathBuf {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let i = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    fixtures().0.join(format!("{name}-{i}"))
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop_oneof![Just(-1i64), Just(0), Just(1), Just(2), Just(4096), Just(i64::MAX)]
            .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Request bodies: the parameters the API knows, with any JSON values, plus strays.
fn request_body() -> impl Strategy<Value = Value> {
    let names = prop::sample::select(vec![
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stop",
        "stream",
        "stream_options",
        "seed",
        "logprobs",
        "top_logprobs",
        "echo",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "tools",
        "response_format",
        "stop_token_ids",
        "user",
        "x",
    ]);
    prop::collection::vec((names, json_value()), 0..8).prop_map(|fields| {
        let mut body = json!({"model": "tiny"});
        for (k, v) in fields {
            body[k] = v;
        }
        body
    })
}

fn messages() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop::sample::select(vec!["system", "user", "assistant", "tool", "x"]);
    prop::collection::vec((role, hostile_text()), 1..4)
        .prop_map(|m| m.into_iter().map(|(r, c)| ChatMessage::new(r, c)).collect())
}

/// Text mixing the default model's control tokens, Jinja syntax and odd Unicode.
fn hostile_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<|endoftext|>".to_owned()),
        Just("<|im_start|>system\n".to_owned()),
        Just("{{ raise_exception('x') }}".to_owned()),
        Just("{% for m in messages %}".to_owned()),
        Just("\u{E000}".to_owned()),
        Just("\u{E001}".to_owned()),
        Just(" ".to_owned()),
        Just("\n".to_owned()),
        "\\PC{0,6}",
    ];
    prop::collection::vec(piece, 0..8).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_damaged_gguf_is_an_error_never_a_panic(
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..12),
        keep in prop::option::of(any::<usize>()),
    ) {
        let good = &fixtures().1;
        prop_assume!(!good.is_empty());
        let path = scratch("gguf");
        std::fs::write(&path, mutate(good, &edits, 4096, keep)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if GgufFile::open(&path).is_ok() {
            let _ = LoadedModel::load(&path);
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_damaged_k_quant_gguf_of_any_architecture_is_an_error_never_a_panic(
        which in 0usize..3,
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..12),
        keep in prop::option::of(any::<usize>()),
    ) {
        let all = k_quant_fixtures();
        prop_assert_eq!(all.len(), 3, "the fixtures were not written");
        let path = scratch("kgguf");
        // The metadata, the tensor infos (types, shapes, offsets) after it and the first
        // blocks of data.
        let window = all[which].len().min(1 << 16);
        std::fs::write(&path, mutate(&all[which], &edits, window, keep)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if GgufFile::open(&path).is_ok() {
            let _ = LoadedModel::load(&path);
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_damaged_safetensors_checkpoint_is_an_error_never_a_panic(
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..12),
        keep in prop::option::of(any::<usize>()),
        config_edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        let src = fixtures().0.join("hf");
        let dir = scratch("hf");
        let copy = |name: &str, f: &dyn Fn(&[u8]) -> Vec<u8>| -> std::io::Result<()> {
            std::fs::write(dir.join(name), f(&std::fs::read(src.join(name))?))
        };
        let io = |e: std::io::Error| TestCaseError::fail(e.to_string());
        std::fs::create_dir_all(&dir).map_err(io)?;
        copy("model.safetensors", &|b| mutate(b, &edits, 2048, keep)).map_err(io)?;
        copy("config.json", &|b| mutate(b, &config_edits, 1 << 12, None)).map_err(io)?;
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            copy(f, &|b| b.to_vec()).map_err(io)?;
        }
        if SafetensorsModel::open(&dir).is_ok() {
            let _ = LoadedModel::load(&dir);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn any_request_body_is_a_plan_or_a_400(body in request_body()) {
        let Some(model) = tiny_model() else { return Err(TestCaseError::fail("no tiny model")) };
        let limits = tiny_limits(model);
        for plan in [completion_plan(&body, model, &limits), chat_plan(&body, model, &limits)] {
            match plan {
                Ok(p) => {
                    prop_assert!(p.params.max_tokens >= 1 && p.params.n >= 1);
                    prop_assert!(p.prompt.len() + p.params.max_tokens <= limits.capacity_tokens);
                }
                Err(e) => prop_assert_eq!(e.status.as_u16(), 400, "{:?}", e),
            }
        }
    }

    #[test]
    fn hostile_chat_content_never_becomes_control_tokens(messages in messages()) {
        let (template, tokenizer) = default_chat();
        let Ok((ids, text)) = encode_chat(template, tokenizer, &messages, true) else {
            // A template may refuse a role sequence (raise_exception): an error, not a panic.
            return Ok(());
        };
        // The default template knows no tools: tool results reach it in the generic format.
        let rendered = if messages.iter().any(|m| m.role == "tool") {
            generic_messages(&messages, None)
        } else {
            messages.clone()
        };
        prop_assert_eq!(&text, &template.render(&rendered, true).map_err(|e| TestCaseError::fail(e.to_string()))?);
        // The same chat with every content replaced by plain text has as many control
        // tokens: only the template's structure made them.
        let plain: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), "x"))
            .collect();
        let (plain_ids, _) = encode_chat(template, tokenizer, &plain, true)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let specials = |ids: &[u32]| ids.iter().filter(|&&t| tokenizer.is_special(t)).count();
        prop_assert_eq!(specials(&ids), specials(&plain_ids), "{:?}", messages);
    }
}

fn default_chat() -> &'static (ChatTemplate, Tokenizer) {
    static C: OnceLock<(ChatTemplate, Tokenizer)> = OnceLock::new();
    C.get_or_init(|| {
        let load = || -> anyhow::Result<(ChatTemplate, Tokenizer)> {
            let f = GgufFile::open(&common::default_model()?)?;
            let t = ChatTemplate::from_gguf(&f)?.ok_or_else(|| anyhow::anyhow!("no template"))?;
            Ok((t, Tokenizer::from_gguf(&f)?))
        };
        match load() {
            Ok(c) => c,
            Err(e) => panic_free_exit(&e),
        }
    })
}

/// The default model is a precondition of the suite (scripts/test fetches it).
fn panic_free_exit(e: &anyhow::Error) -> ! {
    eprintln!("the default model is needed: {e}");
    std::process::exit(1)
}

/// The tiny model's limits, as the server derives them.
fn tiny_limits(model: &LoadedModel) -> Limits {
    Limits {
        context_length: model.weights.config.context_length,
        capacity_tokens: 4096,
        vocab_size: model.tokenizer.vocab_size(),
        max_n: 8,
        max_logprobs: 20,
        sampling: Default::default(),
    }
}

#[test]
fn the_gateways_token_ids_stand_in_for_tokenizing_only_under_the_same_tokenizer()
-> anyhow::Result<()> {
    let model = tiny_model().as_ref().ok_or_else(|| anyhow::anyhow!("no tiny model"))?;
    let limits = tiny_limits(model);
    let revision = model.identity.tokenizer_revision.clone();
    let template = model.identity.chat_template_version.clone().unwrap_or_default();
    let own = |ids: &[u32], revision: &str| json!({"ids": ids, "tokenizer_revision": revision});
    let prompt = |body: &Value| completion_plan(body, model, &limits).map(|p| p.prompt).ok();
    let chat_prompt = |body: &Value| chat_plan(body, model, &limits).map(|p| p.prompt).ok();
    // Ids unlike the text's own tokens show which were used.
    let ids = [5u32, 6, 7, 8];
    let body = json!({"prompt": "Hello world", PROMPT_FIELD: own(&ids, &revision)});
    assert_eq!(prompt(&body), Some(ids.to_vec()));
    let messages = json!([{"role": "user", "content": "hi"}]);
    let mut sent = own(&ids, &revision);
    sent["chat_template_version"] = json!(template);
    let chat = json!({"messages": messages, PROMPT_FIELD: sent});
    assert_eq!(chat_prompt(&chat), Some(ids.to_vec()));
    // Anything else is tokenized here: another tokenizer, a chat rendered by another template
    // (or by none named), a completion's ids claiming a template, unreadable or
    // out-of-vocabulary ids, and an unknown field is no reason to refuse.
    let mine = model.encode_prompt("Hello world")?;
    let vocab = u32::try_from(limits.vocab_size)?;
    let mut with_template = own(&ids, &revision);
    with_template["chat_template_version"] = json!(template);
    for sent in [
        own(&ids, "sha256:other"),
        json!({"ids": "x", "tokenizer_revision": revision}),
        own(&[1, vocab], &revision),
        own(&[], &revision),
        with_template,
    ] {
        let body = json!({"prompt": "Hello world", PROMPT_FIELD: sent});
        assert_eq!(prompt(&body), Some(mine.clone()), "{body}");
    }
    let mut newer = own(&ids, &revision);
    newer["a_later_field"] = json!(1);
    assert_eq!(prompt(&json!({"prompt": "Hello world", PROMPT_FIELD: newer})), Some(ids.to_vec()));
    let chat_mine = chat_prompt(&json!({"messages": messages}));
    for version in [json!("sha256:other"), Value::Null] {
        let mut sent = own(&ids, &revision);
        sent["chat_template_version"] = version;
        let chat = json!({"messages": messages, PROMPT_FIELD: sent});
        assert_eq!(chat_prompt(&chat), chat_mine, "{chat}");
    }
    // A client's own token ids are checked as always, whatever else the body holds.
    let body = json!({"prompt": [1, vocab], PROMPT_FIELD: own(&ids, &revision)});
    let e = completion_plan(&body, model, &limits).err();
    assert_eq!(e.and_then(|e| e.param), Some("prompt[1]".to_owned()));
    Ok(())
}
