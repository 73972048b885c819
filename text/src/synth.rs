//! The tokenizer of synthetic test models: GPT-2's byte-level alphabet, a handful of BPE
//! merges, ChatML's special tokens and template, written as GGUF metadata or as
//! `tokenizer.json` + `tokenizer_config.json` that tokenize alike. The engine's synthetic
//! models carry it; the gateway's tests count tokens with a vocabulary-only GGUF file.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::json;

use crate::error::Result;
use crate::gguf::{GgufWriter, MetaValue};

/// Special tokens, in id order after the byte-level and merged tokens.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// The ChatML template both formats carry.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
/// `tokenizer.ggml.pre` of the GGUF file: llama.cpp's fallback pre-tokenizer.
pub const GGUF_PRE_TOKENIZER: &str = "default";

/// The regexes llama.cpp's `default` pre-tokenizer applies in turn; tokenizer.json repeats
/// them as `Split` steps so both files tokenize alike.
const DEFAULT_PRE_REGEXES: [&str; 4] = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"\p{N}+",
    "[0-9][0-9][0-9]",
];

/// BPE merges in priority order, in the byte-level alphabet (`Ġ` is a space, `Ċ` a newline).
const MERGES: [(&str, &str); 23] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("l", "l"),
    ("Ġ", "s"),
    ("i", "s"),
    ("o", "r"),
    ("Ġ", "w"),
    ("H", "e"),
    ("He", "ll"),
    ("Hell", "o"),
    ("Ġw", "or"),
    ("Ġwor", "l"),
    ("Ġworl", "d"),
    ("Ċ", "Ċ"),
    ("Ġ", "Ġ"),
];

/// llama.cpp token types written to `tokenizer.ggml.token_type`.
const TYPE_NORMAL: u64 = 1;
const TYPE_UNKNOWN: u64 = 2;
const TYPE_CONTROL: u64 = 3;
const TYPE_UNUSED: u64 = 5;
const TYPE_BYTE: u64 = 6;
/// SentencePiece's word-boundary marker.
const SPM_SPACE: &str = "\u{2581}";

/// The GPT-2 byte-level alphabet: the character standing for each byte.
pub fn byte_level_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (b, c) in chars.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable { b as u32 } else { next };
        next += u32::from(!printable);
        // Codes are below 0x150, all valid scalar values.
        *c = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    chars
}

/// Tokens the synthetic tokenizer defines before `<unused_N>` padding.
pub fn tokenizer_token_count() -> usize {
    256 + MERGES.len() + SPECIAL_TOKENS.len()
}

/// The synthetic tokenizer's vocabulary, padded to `vocab` tokens.
#[derive(Clone, Debug)]
pub struct SynthVocabulary {
    tokens: Vec<String>,
    types: Vec<u64>,
    merges: Vec<(String, String)>,
    pre: String,
    /// A SentencePiece vocabulary's scores and space prefix (no merges, no pre-tokenizer).
    sentence_piece: Option<(Vec<f32>, bool)>,
    bos: usize,
    eos: usize,
}

impl SynthVocabulary {
    /// The vocabulary padded with `<unused_N>` tokens to `vocab` (at least
    /// [`tokenizer_token_count`]).
    pub fn new(vocab: usize) -> SynthVocabulary {
        let merges = MERGES.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        SynthVocabulary::with_merges(merges, GGUF_PRE_TOKENIZER, vocab)
    }

    /// A vocabulary for checking a pre-tokenizer against llama.cpp's: a merge for every two
    /// bytes of [`PROBE_CORPUS`] (see `probe_merges`), so the ids a text becomes show where the
    /// pre-tokenizer named `pre` split it. Padded to `vocab` tokens when that is more.
    pub fn probe(pre: &str, vocab: usize) -> SynthVocabulary {
        SynthVocabulary::with_merges(probe_merges(PROBE_CORPUS), pre, vocab)
    }

    /// The probe vocabulary called `name`: `spm` or `spm-no-space-prefix` for
    /// [`probe_sentence_piece`](Self::probe_sentence_piece), else [`probe`](Self::probe) with
    /// that `tokenizer.ggml.pre`.
    pub fn probe_named(name: &str, vocab: usize) -> SynthVocabulary {
        match name {
            "spm" => SynthVocabulary::probe_sentence_piece(true, vocab),
            "spm-no-space-prefix" => SynthVocabulary::probe_sentence_piece(false, vocab),
            pre => SynthVocabulary::probe(pre, vocab),
        }
    }

    fn with_merges(merges: Vec<(String, String)>, pre: &str, vocab: usize) -> SynthVocabulary {
        let mut tokens: Vec<String> = byte_level_chars().iter().map(|c| c.to_string()).collect();
        let mut known: HashSet<String> = tokens.iter().cloned().collect();
        for (a, b) in &merges {
            // Two merges may spell the same token; the vocabulary holds it once.
            let joined = format!("{a}{b}");
            if known.insert(joined.clone()) {
                tokens.push(joined);
            }
        }
        let mut types = vec![TYPE_NORMAL; tokens.len()];
        let first_special = tokens.len();
        tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
        types.resize(tokens.len(), TYPE_CONTROL);
        let n = tokens.len();
        tokens.extend((0..vocab.saturating_sub(n)).map(|i| format!("<unused_{i}>")));
        types.resize(tokens.len(), TYPE_UNUSED);
        SynthVocabulary {
            tokens,
            types,
            merges,
            pre: pre.to_string(),
            sentence_piece: None,
            bos: first_special,
            eos: first_special + 2,
        }
    }

    /// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as Gemma, Mistral, Phi-3
    /// and Llama 2 files have) for checking against llama.cpp's: `<unk>`, `<s>`, `</s>`, the
    /// 256 byte tokens, every character of [`PROBE_CORPUS`] (a space as `▁`) and every pair
    /// of them, scored so the pairs side by side in the corpus merge first.
    pub fn probe_sentence_piece(add_space_prefix: bool, vocab: usize) -> SynthVocabulary {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.resize(tokens.len(), TYPE_BYTE);
        let mut scores = vec![0.0; tokens.len()];
        let text: Vec<char> = PROBE_CORPUS.replace(' ', SPM_SPACE).chars().collect();
        let mut chars = text.clone();
        chars.sort_unstable();
        chars.dedup();
        for c in &chars {
            tokens.push(c.to_string());
            scores.push(-1e6);
        }
        let mut counts: HashMap<(char, char), usize> = HashMap::new();
        for pair in text.windows(2) {
            *counts.entry((pair[0], pair[1])).or_default() += 1;
        }
        let mut pairs: Vec<(char, char)> =
            chars.iter().flat_map(|&a| chars.iter().map(move |&b| (a, b))).collect();
        pairs.sort_by_key(|p| (std::cmp::Reverse(counts.get(p).copied().unwrap_or(0)), *p));
        for (rank, (a, b)) in pairs.into_iter().enumerate() {
            tokens.push(format!("{a}{b}"));
            scores.push(-(rank as f32));
        }
        types.resize(tokens.len(), TYPE_NORMAL);
        let n = tokens.len();
        tokens.extend((0..vocab.saturating_sub(n)).map(|i| format!("<unused_{i}>")));
        types.resize(tokens.len(), TYPE_UNUSED);
        scores.resize(tokens.len(), -1e9);
        SynthVocabulary {
            tokens,
            types,
            merges: Vec::new(),
            pre: String::new(),
            sentence_piece: Some((scores, add_space_prefix)),
            bos: 1,
            eos: 2,
        }
    }

    /// Number of tokens, padding included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the vocabulary has no tokens (never: it holds at least the 256 bytes).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Id of the beginning-of-sequence token.
    pub fn bos(&self) -> usize {
        self.bos
    }

    /// Id of the end-of-sequence token.
    pub fn eos(&self) -> usize {
        self.eos
    }

    /// Writes the `tokenizer.*` metadata (GPT-2 byte-level BPE) and the chat template.
    pub fn write_gguf_meta(&self, w: &mut GgufWriter) {
        let u = |v: usize| MetaValue::U64(v as u64);
        match &self.sentence_piece {
            Some((scores, prefix)) => w
                .meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
                .meta(
                    "tokenizer.ggml.scores",
                    MetaValue::Array(
                        scores.iter().map(|&s| MetaValue::F64(f64::from(s))).collect(),
                    ),
                )
                .meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(*prefix)),
            None => w
                .meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
                .meta("tokenizer.ggml.pre", MetaValue::String(self.pre.clone()))
                .meta(
                    "tokenizer.ggml.merges",
                    strings(self.merges.iter().map(|(a, b)| format!("{a} {b}"))),
                ),
        };
        w.meta("tokenizer.ggml.tokens", strings(&self.tokens))
            .meta(
                "tokenizer.ggml.token_type",
                // INT32, as llama.cpp requires (the writer narrows I64 values that fit).
                MetaValue::Array(self.types.iter().map(|&t| MetaValue::I64(t as i64)).collect()),
            )
            .meta("tokenizer.ggml.bos_token_id", u(self.bos))
            .meta("tokenizer.ggml.eos_token_id", u(self.eos))
            .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
            .meta("tokenizer.chat_template", MetaValue::String(CHAT_TEMPLATE.into()));
    }

    /// `tokenizer_config.json` for a model of `context` tokens.
    pub fn tokenizer_config_json(&self, context: usize) -> serde_json::Value {
        json!({
            "add_bos_token": false,
            "add_eos_token": false,
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[2],
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": context,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false,
        })
    }

    /// A Hugging Face byte-level BPE `tokenizer.json` equivalent to the GGUF metadata.
    pub fn tokenizer_json(&self) -> serde_json::Value {
        let v = self;
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (id, (text, &ty)) in v.tokens.iter().zip(&v.types).enumerate() {
            // Specials are in the model's vocabulary too: `tokenizers` renumbers added tokens
            // that would leave holes in it.
            vocab.insert(text.clone(), json!(id));
            if ty == TYPE_CONTROL {
                added.push(json!({
                    "id": id, "content": text, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true,
                }));
            }
        }
        let mut pre: Vec<serde_json::Value> = DEFAULT_PRE_REGEXES
        .iter()
        .map(|r| {
            json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false})
        })
        .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
        pre.push(byte_level.clone());
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": self.merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
            },
        })
    }
}

/// Text the probe vocabulary's merges are learnt from: what pre-tokenizers disagree on
/// (contractions in both cases, digit runs, runs of spaces and newlines, punctuation next to
/// words, letters of other scripts, marks, code).
pub const PROBE_CORPUS: &str = "Hello world, the cat's hat isn't THE CAT'S HAT. We'll see; they'd've \
gone. I'm sure you're right!\n\nNumbers: 1 12 123 1234 12345 123456 3.14159 2,000,000 007 \
x1y22z333 v2.0.1 (42) [3] {99}.\n  two spaces  then\tone tab\t\ttwo tabs   \n\n\n   \
trailing   \r\nwindows\r\n line.\nfn main() {\n    let x = a+b*c^2 - d/e % f;\n    \
if x >= 10 && y != 0 || z <= -1 { return; }\n}\n<html><body class=\"x\">$100 @user \
#tag ~/path_to/file-name.txt</body></html>\ncafé naïve résumé Ærø Straße ſ K \
Привет мир Καλημέρα 日本語のテキスト 中文 한국어 مرحبا ١٢٣ ٣ Ⅻ x² ½ 🎉 👍🏽 e\u{301} \
...!!! ??? --- ___ *** ''' '' \" a.b,c;d:e!f?g a\u{308} \u{915}\u{93f} \u{2154} \u{2460}\u{2461} \
\u{ff11}\u{ff12} \u{fb01} \u{a0}\u{2009}\u{3000}\u{200b} `|[]^ \u{212a}elvin";

/// Merges of the probe vocabulary: every ordered pair of the bytes [`PROBE_CORPUS`] holds,
/// the pairs it holds side by side first (most often first), then the rest in byte order.
/// Inside a piece of pre-tokenized text every two neighbours can merge, so the ids show each
/// place where the pre-tokenizer cut.
fn probe_merges(corpus: &str) -> Vec<(String, String)> {
    let chars = byte_level_chars();
    let bytes = corpus.as_bytes();
    let mut seen = [false; 256];
    bytes.iter().for_each(|&b| seen[usize::from(b)] = true);
    let mut counts: HashMap<(u8, u8), usize> = HashMap::new();
    for pair in bytes.windows(2) {
        *counts.entry((pair[0], pair[1])).or_default() += 1;
    }
    let present: Vec<u8> = (0..=255u8).filter(|&b| seen[usize::from(b)]).collect();
    let mut pairs: Vec<(u8, u8)> =
        present.iter().flat_map(|&a| present.iter().map(move |&b| (a, b))).collect();
    pairs.sort_by_key(|p| (std::cmp::Reverse(counts.get(p).copied().unwrap_or(0)), *p));
    pairs
        .into_iter()
        .map(|(a, b)| (chars[usize::from(a)].to_string(), chars[usize::from(b)].to_string()))
        .collect()
}

fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> MetaValue {
    MetaValue::Array(items.into_iter().map(|s| MetaValue::String(s.as_ref().into())).collect())
}

/// Writes a GGUF file holding only this vocabulary's tokenizer and chat template (no tensors):
/// what a token counter needs.
pub fn write_vocab_gguf(vocab: usize, path: &Path) -> Result<()> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()));
    SynthVocabulary::new(vocab).write_gguf_meta(&mut w);
    w.write(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelText;

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        let chars = byte_level_chars();
        assert_eq!((chars[b' ' as usize], chars[b'\n' as usize]), ('Ġ', 'Ċ'));
        assert_eq!((chars[b'a' as usize], chars[0], chars[0xAD]), ('a', 'Ā', 'Ń'));
        let mut sorted = chars.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn every_merge_joins_existing_tokens() {
        let v = SynthVocabulary::new(320);
        for (i, (a, b)) in MERGES.iter().enumerate() {
            let known = |t: &str| v.tokens[..256 + i].iter().any(|x| x == t);
            assert!(known(a) && known(b), "merge {i}: {a} {b}");
        }
        assert_eq!(v.tokens.len(), 320);
        assert_eq!(
            [v.tokens[v.bos].as_str(), v.tokens[v.eos].as_str()],
            [SPECIAL_TOKENS[0], SPECIAL_TOKENS[2]]
        );
        assert_eq!(v.tokens[319], format!("<unused_{}>", 319 - tokenizer_token_count()));
    }

    #[test]
    fn both_files_tokenize_alike() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| crate::TextError::io("tempdir", e))?;
        let gguf = dir.path().join("v.gguf");
        write_vocab_gguf(320, &gguf)?;
        let v = SynthVocabulary::new(320);
        let hf = dir.path().join("hf");
        std::fs::create_dir_all(&hf).map_err(|e| crate::TextError::io(&hf, e))?;
        for (name, value) in [
            ("tokenizer.json", v.tokenizer_json()),
            ("tokenizer_config.json", v.tokenizer_config_json(64)),
        ] {
            let p = hf.join(name);
            std::fs::write(&p, value.to_string()).map_err(|e| crate::TextError::io(&p, e))?;
        }
        let (a, b) = (ModelText::open(&gguf)?, ModelText::open(&hf)?);
        let text = "Hello world, the tin is in the theatre.\n\n  <|im_end|>";
        assert_eq!(a.tokenizer.encode_prompt(text)?, b.tokenizer.encode_prompt(text)?);
        assert!(a.template.is_some() && b.template.is_some());
        Ok(())
    }
}
