//! Text to token ids and back.
//!
//! Two sources, one result: GGUF metadata (`tokenizer.ggml.*`), interpreted the way llama.cpp's
//! `llama-vocab.cpp` interprets it, and Hugging Face `tokenizer.json` files. Both become a
//! [`tokenizers::Tokenizer`], whose canonical serialization is hashed into the tokenizer
//! revision that execution identities carry.
//!
//! `encode` never adds BOS: callers decide (see [`Tokenizer::add_bos`]), because a rendered chat
//! template may already contain it.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Result, TextError};
use crate::gguf::{GgufFile, MetaValue};

/// The body field in which the gateway hands the engine a prompt's token ids.
pub const PROMPT_FIELD: &str = "sluice_prompt";

/// The most token ids the gateway hands over: beyond every served context length (a longer
/// prompt is the engine's to refuse), and small enough that the ids (at most 11 bytes each)
/// and the largest body the gateway accepts stay within the engine's body limit.
pub const MAX_PROMPT_IDS: usize = 131_072;

/// A prompt the gateway has already tokenized, as it travels to the engine: the engine uses
/// the ids instead of tokenizing again only when its own tokenizer has this revision (and, for
/// a chat, its chat template this version). Fields may be added: a reader ignores those it
/// does not know, and one it cannot read makes the engine tokenize itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PromptTokens {
    /// The prompt's token ids: the rendered chat, or the completion prompt with its BOS.
    pub ids: Vec<u32>,
    /// `sha256:` and the tokenizer's revision.
    pub tokenizer_revision: String,
    /// `sha256:` and the chat template's version, for a chat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_version: Option<String>,
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
mod token_type {
    pub const NORMAL: u64 = 1;
    pub const UNKNOWN: u64 = 2;
    pub const CONTROL: u64 = 3;
    pub const USER_DEFINED: u64 = 4;
    pub const BYTE: u64 = 6;
}

/// SentencePiece's word-boundary marker.
const SPM_SPACE: &str = "\u{2581}";

/// The GPT-2 split regex. llama.cpp writes it without the final `|\s+` but its implementation
/// behaves as if it were there; Hugging Face's ByteLevel uses this exact form.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3: case-insensitive contractions spelled out (as llama.cpp does; `(?i)` would also fold
/// `ſ` and the Kelvin sign), digits in groups of one to three.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2: as Llama 3 but every digit on its own.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Every digit on its own, applied before the GPT-2 regex (StarCoder, SmolLM).
const DIGIT_REGEX: &str = r"\p{N}";

/// Texts llama.cpp treats as end-of-generation wherever they appear in a vocabulary.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// How a BPE vocabulary's text is split before merging, by `tokenizer.ggml.pre`.
struct PreTokenization {
    /// Regexes applied in turn, each splitting the pieces the previous one produced.
    regexes: &'static [&'static str],
    /// Whether a word that is itself in the vocabulary skips merging (Llama 3).
    ignore_merges: bool,
    /// `add_bos` when `tokenizer.ggml.add_bos_token` is absent.
    add_bos: bool,
}

const SUPPORTED_PRE: &str = "default, gpt-2, smollm, starcoder, refact, llama-bpe, llama3, llama-v3, \
                             qwen2, stablelm2, deepseek-r1-qwen";

impl PreTokenization {
    fn from_name(pre: &str) -> Result<PreTokenization> {
        let (regexes, ignore_merges, add_bos): (&'static [&'static str], bool, bool) = match pre {
            // llama.cpp's fallback for GGUFs converted before `tokenizer.ggml.pre` existed.
            "default" => {
                (&[r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"], false, false)
            }
            "gpt-2" => (&[GPT2_REGEX], false, false),
            "smollm" | "starcoder" | "refact" => (&[DIGIT_REGEX, GPT2_REGEX], false, false),
            "llama-bpe" | "llama3" | "llama-v3" => (&[LLAMA3_REGEX], true, true),
            "qwen2" | "stablelm2" | "deepseek-r1-qwen" => (&[QWEN2_REGEX], false, false),
            other => {
                return Err(TextError::Tokenizer(format!(
                    "unsupported pre-tokenizer tokenizer.ggml.pre = {other:?} (supported: {SUPPORTED_PRE})"
                )));
            }
        };
        Ok(PreTokenization { regexes, ignore_merges, add_bos })
    }

    fn pre_tokenizer(&self) -> Result<PreTokenizerWrapper> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(self.regexes.len() + 1);
        for regex in self.regexes {
            let split = Split::new(
                SplitPattern::Regex((*regex).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TextError::Tokenizer(format!("pre-tokenizer regex {regex:?}: {e}")))?;
            steps.push(split.into());
        }
        // Bytes to the GPT-2 printable alphabet; the splitting is already done.
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(PreTokenizerSequence::new(steps).into())
    }
}

/// A tokenizer for one model, with the special token ids the engine needs.
pub struct Tokenizer {
    /// Parses special tokens in the input text.
    inner: tokenizers::Tokenizer,
    /// Treats special tokens' text as plain text; cloned from `inner` on first use.
    literal: OnceLock<tokenizers::Tokenizer>,
    /// The texts of the special tokens; collected on first use.
    special_texts: OnceLock<Vec<String>>,
    /// The bytes each token stands for when streamed on its own.
    pieces: Vec<Vec<u8>>,
    special: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    stop_ids: Vec<u32>,
    revision: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.pieces.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .field("revision", &self.revision)
            .finish()
    }
}

/// Typed access to the `tokenizer.ggml.*` keys, with errors naming the key.
struct Meta<'a>(&'a GgufFile);

impl<'a> Meta<'a> {
    fn bad(&self, key: &str, what: &str) -> TextError {
        TextError::format(self.0.path(), format!("metadata {key}: {what}"))
    }

    fn array(&self, key: &str) -> Result<Option<&'a [MetaValue]>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => v.as_array().map(Some).ok_or_else(|| self.bad(key, "is not an array")),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, "is not a string")),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, "is not a boolean")),
        }
    }

    /// Every item of an array converted by `f`; an item of another type names its index.
    fn items<T>(
        &self,
        key: &str,
        what: &str,
        f: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.array(key)? else { return Ok(None) };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| f(v).ok_or_else(|| self.bad(key, &format!("item {i} is not {what}"))))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        self.items(key, "a string", MetaValue::as_str)
    }

    fn u64s(&self, key: &str) -> Result<Option<Vec<u64>>> {
        self.items(key, "a non-negative integer", MetaValue::as_u64)
    }

    fn f32s(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.items(key, "a number", |v| v.as_f64().map(|x| x as f32))
    }

    /// A token id that must lie inside the vocabulary.
    fn token_id(&self, key: &str, n_vocab: usize) -> Result<Option<u32>> {
        let Some(v) = self.0.get(key) else { return Ok(None) };
        let id = v.as_u64().ok_or_else(|| self.bad(key, "is not a non-negative integer"))?;
        match u32::try_from(id) {
            Ok(id) if (id as usize) < n_vocab => Ok(Some(id)),
            _ => {
                Err(self.bad(key, &format!("token id {id} is outside the vocabulary of {n_vocab}")))
            }
        }
    }
}

/// The GGUF vocabulary kinds this engine builds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum VocabKind {
    /// `gpt2`: byte-level BPE with explicit merges.
    ByteLevelBpe,
    /// `llama`: SentencePiece pieces with scores, byte fallback.
    SentencePiece,
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let meta = Meta(file);
        let model = meta
            .str("tokenizer.ggml.model")?
            .ok_or_else(|| meta.bad("tokenizer.ggml.model", "missing"))?;
        let kind = match model {
            "gpt2" => VocabKind::ByteLevelBpe,
            "llama" => VocabKind::SentencePiece,
            other => {
                return Err(TextError::Tokenizer(format!(
                    "unsupported tokenizer model tokenizer.ggml.model = {other:?} (supported: gpt2, llama)"
                )));
            }
        };
        let tokens = meta
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| meta.bad("tokenizer.ggml.tokens", "missing"))?;
        let n_vocab = tokens.len();
        if n_vocab == 0 || u32::try_from(n_vocab).is_err() {
            return Err(meta.bad("tokenizer.ggml.tokens", &format!("{n_vocab} tokens")));
        }
        let types = match meta.u64s("tokenizer.ggml.token_type")? {
            Some(t) if t.len() == n_vocab => t,
            Some(t) => {
                return Err(meta.bad(
                    "tokenizer.ggml.token_type",
                    &format!("{} entries for {n_vocab} tokens", t.len()),
                ));
            }
            None => vec![token_type::NORMAL; n_vocab],
        };

        let (mut inner, default_add_bos) = match kind {
            VocabKind::ByteLevelBpe => {
                let pre_name = meta.str("tokenizer.ggml.pre")?.unwrap_or("default");
                let pre = PreTokenization::from_name(pre_name)?;
                (byte_level_bpe(&meta, &tokens, &pre)?, pre.add_bos)
            }
            VocabKind::SentencePiece => {
                let add_space_prefix =
                    meta.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                (sentence_piece(&meta, &tokens, &types, add_space_prefix)?, true)
            }
        };

        let mut special = Vec::new();
        let mut user_defined = Vec::new();
        let mut special_ids = HashSet::new();
        for (id, (text, &ty)) in tokens.iter().zip(&types).enumerate() {
            if text.is_empty() {
                continue;
            }
            // llama.cpp matches these on the raw text, before any normalization.
            match ty {
                token_type::CONTROL | token_type::UNKNOWN => {
                    special.push(AddedToken::from(*text, true).normalized(false));
                    special_ids.insert(id as u32);
                }
                token_type::USER_DEFINED => {
                    user_defined.push(AddedToken::from(*text, false).normalized(false))
                }
                _ => {}
            }
        }
        inner.add_special_tokens(&special);
        inner.add_tokens(&user_defined);

        let bos = meta.token_id("tokenizer.ggml.bos_token_id", n_vocab)?;
        let eos = meta.token_id("tokenizer.ggml.eos_token_id", n_vocab)?;
        let eot = meta.token_id("tokenizer.ggml.eot_token_id", n_vocab)?;
        let eom = meta.token_id("tokenizer.ggml.eom_token_id", n_vocab)?;
        let add_bos = meta.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        let by_text = tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| END_OF_GENERATION_TEXTS.contains(t))
            .map(|(id, _)| id as u32);
        let stop_ids = dedup([eos, eot, eom].into_iter().flatten().chain(by_text));

        let pieces = match kind {
            VocabKind::ByteLevelBpe => {
                let table = byte_level_table();
                tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| match ty {
                        token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                            t.as_bytes().to_vec()
                        }
                        _ => byte_level_bytes(&table, t),
                    })
                    .collect()
            }
            VocabKind::SentencePiece => tokens
                .iter()
                .zip(&types)
                .map(|(t, &ty)| match ty {
                    token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                        t.as_bytes().to_vec()
                    }
                    _ => sentence_piece_bytes(t),
                })
                .collect(),
        };

        Self::assemble(inner, pieces, special_ids, bos, eos, add_bos, stop_ids)
    }

    /// Loads a Hugging Face `tokenizer.json`; `tokenizer_config` (the parsed
    /// `tokenizer_config.json`) supplies `bos_token`, `eos_token` and `add_bos_token`.
    ///
    /// Without `add_bos_token`, BOS is added when the file's post-processor would add it
    /// (Llama 3 style), so callers prepend exactly what `transformers` would.
    pub fn from_hf_file(
        path: &Path,
        tokenizer_config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TextError::format(path, format!("tokenizer.json: {e}")))?;
        let vocab = inner.get_vocab(true);
        let n_vocab = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let config_token = |key: &str| -> Result<Option<u32>> {
            let Some(value) = tokenizer_config.and_then(|c| c.get(key)) else { return Ok(None) };
            let text = match value {
                serde_json::Value::Null => return Ok(None),
                serde_json::Value::String(s) => s.as_str(),
                other => other.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                    TextError::format(
                        path,
                        format!("tokenizer_config.json {key} is neither a string nor {{content}}"),
                    )
                })?,
            };
            inner.token_to_id(text).map(Some).ok_or_else(|| {
                TextError::format(
                    path,
                    format!("tokenizer_config.json {key} {text:?} is not in the vocabulary"),
                )
            })
        };
        let bos = config_token("bos_token")?;
        let eos = config_token("eos_token")?;
        let add_bos = match tokenizer_config.and_then(|c| c.get("add_bos_token")) {
            Some(v) => v.as_bool().ok_or_else(|| {
                TextError::format(path, "tokenizer_config.json add_bos_token is not a boolean")
            })?,
            None => match bos {
                Some(bos) => {
                    let probe = inner
                        .encode_fast("a", true)
                        .map_err(|e| TextError::Tokenizer(e.to_string()))?;
                    probe.get_ids().first() == Some(&bos)
                }
                None => false,
            },
        };
        let added = inner.get_added_tokens_decoder();
        let special_ids: HashSet<u32> =
            added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let mut by_text: Vec<u32> = added
            .iter()
            .filter(|(_, t)| END_OF_GENERATION_TEXTS.contains(&t.content.as_str()))
            .map(|(&id, _)| id)
            .collect();
        by_text.sort_unstable();
        let stop_ids = dedup(eos.into_iter().chain(by_text));

        let decoder_json =
            inner.get_decoder().and_then(|d| serde_json::to_string(d).ok()).unwrap_or_default();
        let table = byte_level_table();
        let mut pieces = vec![Vec::new(); n_vocab];
        for (text, &id) in &vocab {
            let bytes = if added.get(&id).is_some() {
                text.as_bytes().to_vec()
            } else if decoder_json.contains("\"ByteLevel\"") {
                byte_level_bytes(&table, text)
            } else if decoder_json.contains("\"ByteFallback\"")
                || decoder_json.contains("\"Metaspace\"")
            {
                sentence_piece_bytes(text)
            } else {
                inner
                    .decode(&[id], false)
                    .map_err(|e| TextError::Tokenizer(e.to_string()))?
                    .into_bytes()
            };
            if let Some(slot) = pieces.get_mut(id as usize) {
                *slot = bytes;
            }
        }
        Self::assemble(inner, pieces, special_ids, bos, eos, add_bos, stop_ids)
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        pieces: Vec<Vec<u8>>,
        special: HashSet<u32>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
        stop_ids: Vec<u32>,
    ) -> Result<Tokenizer> {
        let serialized =
            inner.to_string(false).map_err(|e| TextError::Tokenizer(format!("serialize: {e}")))?;
        let mut canonical = serialized.into_bytes();
        // What the serialization does not hold but tokenization depends on.
        let extra = format!("\nbos={bos:?} eos={eos:?} add_bos={add_bos} stop_ids={stop_ids:?}");
        canonical.extend_from_slice(extra.as_bytes());
        let revision = sha256_hex(&canonical);
        Ok(Tokenizer {
            inner,
            literal: OnceLock::new(),
            special_texts: OnceLock::new(),
            pieces,
            special,
            bos,
            eos,
            add_bos,
            stop_ids,
            revision,
        })
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether prompts should start with BOS (callers add it; [`Tokenizer::encode`] never does).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Tokens that end generation: EOS, EOT, EOM and the end-of-turn tokens llama.cpp
    /// recognizes by their text (such as `<|im_end|>` and `<|endoftext|>`), EOS first.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Number of token ids (the highest id plus one).
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Whether `id` is a special (control) token, hidden by `decode(.., skip_special = true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The id of a token given its vocabulary text (e.g. `<|im_end|>`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// The bytes one token stands for on its own (may be part of a UTF-8 sequence).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// The text of one token on its own, with leading spaces kept (unlike `decode` of a
    /// SentencePiece sequence); bytes that are not whole UTF-8 become U+FFFD.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// Token ids of `text` as a raw prompt: BOS when the model adds one, special tokens in the
    /// text parsed as special (what the engine computes and the gateway counts).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos() {
            ids.extend(self.bos_id());
        }
        ids.extend(self.encode(text, true)?);
        Ok(ids)
    }

    /// Tokenizes `text` without adding BOS; with `parse_special`, text such as `<|im_start|>`
    /// becomes its special token instead of being tokenized as characters.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tokenizer = if parse_special { &self.inner } else { self.literal() };
        let encoding = tokenizer
            .encode_fast(text, false)
            .map_err(|e| TextError::Tokenizer(format!("encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether `text` holds the text of a special token (`<|im_end|>`), which tokenizing with
    /// special parsing would turn into that token.
    pub fn holds_special_text(&self, text: &str) -> bool {
        self.special_texts
            .get_or_init(|| {
                self.inner
                    .get_added_tokens_decoder()
                    .values()
                    .filter(|t| t.special && !t.content.is_empty())
                    .map(|t| t.content.clone())
                    .collect()
            })
            .iter()
            .any(|s| text.contains(s.as_str()))
    }

    fn literal(&self) -> &tokenizers::Tokenizer {
        self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        })
    }

    /// Turns ids back into text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.pieces.len()) {
            return Err(TextError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.pieces.len()
            )));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Tokenizer(format!("decode: {e}")))
    }

    /// Hex SHA-256 of the tokenizer's canonical serialization and its BOS/EOS/stop settings.
    pub fn revision(&self) -> &str {
        &self.revision
    }
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
fn byte_level_bpe(
    meta: &Meta<'_>,
    tokens: &[&str],
    pre: &PreTokenization,
) -> Result<tokenizers::Tokenizer> {
    let key = "tokenizer.ggml.merges";
    let raw =
        meta.strings(key)?.ok_or_else(|| meta.bad(key, "missing (required by the gpt2 model)"))?;
    let merges = raw
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // Split at the first space after the first character, as llama.cpp does (a left
            // part may be a lone space in vocabularies that are not byte-level).
            let first = m.chars().next().map_or(0, char::len_utf8);
            m[first..]
                .find(' ')
                .map(|at| (m[..first + at].to_string(), m[first + at + 1..].to_string()))
                .ok_or_else(|| meta.bad(key, &format!("item {i} {m:?} is not \"left right\"")))
        })
        .collect::<Result<Vec<_>>>()?;
    let vocab: Vocab =
        tokens.iter().enumerate().map(|(id, t)| (t.to_string(), id as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| TextError::Tokenizer(format!("byte-level BPE: {e}")))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre.pre_tokenizer()?));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    Ok(tokenizer)
}

/// SentencePiece vocabulary (`tokenizer.ggml.model = llama`) as a byte-fallback BPE, the way
/// Hugging Face converts it: a pair merges when both halves and their concatenation are pieces,
/// higher-scored results first. llama.cpp's SPM tokenizer merges the same way.
fn sentence_piece(
    meta: &Meta<'_>,
    tokens: &[&str],
    types: &[u64],
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let key = "tokenizer.ggml.scores";
    let scores = match meta.f32s(key)? {
        Some(s) if s.len() == tokens.len() => s,
        Some(s) => {
            return Err(meta.bad(key, &format!("{} entries for {} tokens", s.len(), tokens.len())));
        }
        None => vec![0.0; tokens.len()],
    };
    let mergeable =
        |ty: u64| !matches!(ty, token_type::CONTROL | token_type::UNKNOWN | token_type::BYTE);
    let index: HashMap<&str, u32> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, ty))| mergeable(**ty))
        .map(|(id, (t, _))| (*t, id as u32))
        .collect();
    // (score of the result, result id, left id, right id)
    let mut candidates: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, (text, &ty)) in tokens.iter().zip(types).enumerate() {
        if !mergeable(ty) {
            continue;
        }
        for (at, _) in text.char_indices().skip(1) {
            let (left, right) = text.split_at(at);
            if let (Some(&l), Some(&r)) = (index.get(left), index.get(right)) {
                candidates.push((scores[id], id as u32, l, r));
            }
        }
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    let merges = candidates
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l as usize].to_string(), tokens[r as usize].to_string()))
        .collect();

    let unk = match meta.token_id("tokenizer.ggml.unknown_token_id", tokens.len())? {
        Some(id) => Some(id as usize),
        None => types.iter().position(|&ty| ty == token_type::UNKNOWN),
    };
    let vocab: Vocab =
        tokens.iter().enumerate().map(|(id, t)| (t.to_string(), id as u32)).collect();
    let mut builder =
        BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(tokens[unk].to_string());
    }
    let bpe =
        builder.build().map_err(|e| TextError::Tokenizer(format!("SentencePiece BPE: {e}")))?;

    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| TextError::Tokenizer(format!("replace {from:?}: {e}")))
    };
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new(SPM_SPACE.to_string()).into());
    }
    normalizers.push(replace(" ", SPM_SPACE)?.into());
    let mut decoders: Vec<DecoderWrapper> =
        vec![replace(SPM_SPACE, " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// GPT-2's byte-to-printable-character mapping, inverted: index by `char as usize`.
fn byte_level_table() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = vec![None; 256 + 256];
    let mut shifted = 0usize;
    for b in 0..=255u8 {
        if printable(b) {
            table[usize::from(b)] = Some(b);
        } else {
            table[256 + shifted] = Some(b);
            shifted += 1;
        }
    }
    table
}

/// The bytes of a byte-level token; a text outside the alphabet stands for itself (as in
/// Hugging Face's ByteLevel decoder).
fn byte_level_bytes(table: &[Option<u8>], text: &str) -> Vec<u8> {
    text.chars()
        .map(|c| table.get(c as usize).copied().flatten())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| text.as_bytes().to_vec())
}

/// The bytes of a SentencePiece token: `<0xNN>` is one byte, `▁` is a space.
fn sentence_piece_bytes(text: &str) -> Vec<u8> {
    let byte = text
        .strip_prefix("<0x")
        .and_then(|t| t.strip_suffix('>'))
        .filter(|hex| hex.len() == 2)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
    match byte {
        Some(b) => vec![b],
        None => text.replace(SPM_SPACE, " ").into_bytes(),
    }
}

fn dedup(ids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut seen = HashSet::new();
    ids.into_iter().filter(|id| seen.insert(*id)).collect()
}

/// Lower-case hex SHA-256 (revisions and versions).
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;

    fn strings(items: &[&str]) -> MetaValue {
        MetaValue::Array(items.iter().map(|s| MetaValue::String((*s).to_string())).collect())
    }

    fn ints(items: &[u64]) -> MetaValue {
        MetaValue::Array(items.iter().map(|&v| MetaValue::I64(v as i64)).collect())
    }

    fn load(w: &GgufWriter) -> Result<GgufFile> {
        let dir = tempfile::tempdir().map_err(|e| TextError::io("tempdir", e))?;
        let path = dir.path().join("tok.gguf");
        w.write(&path)?;
        GgufFile::open(&path)
    }

    const GPT2_TOKENS: &[&str] = &[
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "h",
        "e",
        "l",
        "o",
        "Ġ",
        "w",
        "r",
        "d",
        "1",
        "2",
        "3",
        "<",
        "|",
        "i",
        "m",
        "_",
        "s",
        "t",
        "a",
        ">",
        "he",
        "ll",
        "hell",
        "hello",
        "Ġw",
        "or",
        "Ġwor",
        "Ġworl",
        "Ġworld",
        "12",
    ];
    const GPT2_MERGES: &[&str] =
        &["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"];

    fn gpt2_writer(pre: &str) -> GgufWriter {
        let types: Vec<u64> = (0..GPT2_TOKENS.len()).map(|i| if i < 3 { 3 } else { 1 }).collect();
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
            .meta("tokenizer.ggml.pre", MetaValue::String(pre.into()))
            .meta("tokenizer.ggml.tokens", strings(GPT2_TOKENS))
            .meta("tokenizer.ggml.token_type", ints(&types))
            .meta("tokenizer.ggml.merges", strings(GPT2_MERGES))
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U64(1))
            .meta("tokenizer.ggml.eos_token_id", MetaValue::U64(2));
        w
    }

    fn ids(tokens: &[&str], pieces: &[&str]) -> Vec<u32> {
        pieces
            .iter()
            .map(|p| tokens.iter().position(|t| t == p).map_or(u32::MAX, |i| i as u32))
            .collect()
    }

    #[test]
    fn gpt2_byte_level_bpe() -> Result<()> {
        let tok = Tokenizer::from_gguf(&load(&gpt2_writer("smollm"))?)?;
        let text = "<|im_start|>hello world 123<|im_end|>";
        let got = tok.encode(text, true)?;
        let want = ids(
            GPT2_TOKENS,
            &["<|im_start|>", "hello", "Ġworld", "Ġ", "1", "2", "3", "<|im_end|>"],
        );
        assert_eq!(got, want);
        assert_eq!(tok.decode(&got, false)?, text);
        assert_eq!(tok.decode(&got, true)?, "hello world 123");
        // Special tokens' text stays text when not parsed.
        let literal = tok.encode("<|im_start|>", false)?;
        assert_eq!(
            literal,
            ids(GPT2_TOKENS, &["<", "|", "i", "m", "_", "s", "t", "a", "r", "t", "|", ">"])
        );
        assert_eq!(tok.token_text(27).as_deref(), Some(" w"));
        assert_eq!(tok.token_text(1).as_deref(), Some("<|im_start|>"));
        assert_eq!((tok.bos_id(), tok.eos_id(), tok.add_bos()), (Some(1), Some(2), false));
        // EOS first, then <|endoftext|> recognized by its text as llama.cpp does.
        assert_eq!(tok.stop_ids(), &[2, 0]);
        assert_eq!(tok.vocab_size(), GPT2_TOKENS.len());
        assert!(tok.is_special(1) && !tok.is_special(3));
        assert!(tok.decode(&[GPT2_TOKENS.len() as u32], false).is_err());
        Ok(())
    }

    #[test]
    fn pre_tokenizer_decides_digit_grouping() -> Result<()> {
        // GPT-2's regex keeps " 123" one word, so "1 2" merges; SmolLM splits digits first.
        let gpt2 = Tokenizer::from_gguf(&load(&gpt2_writer("gpt-2"))?)?;
        assert_eq!(gpt2.encode(" 123", true)?, ids(GPT2_TOKENS, &["Ġ", "12", "3"]));
        let smollm = Tokenizer::from_gguf(&load(&gpt2_writer("smollm"))?)?;
        assert_eq!(smollm.encode(" 123", true)?, ids(GPT2_TOKENS, &["Ġ", "1", "2", "3"]));
        assert_ne!(gpt2.revision(), smollm.revision());
        let again = Tokenizer::from_gguf(&load(&gpt2_writer("smollm"))?)?;
        assert_eq!(again.revision(), smollm.revision());
        assert_eq!(smollm.revision().len(), 64);
        for pre in ["default", "llama-bpe", "qwen2", "starcoder"] {
            let tok = Tokenizer::from_gguf(&load(&gpt2_writer(pre))?)?;
            assert_eq!(
                tok.decode(&tok.encode("hello world 123", true)?, false)?,
                "hello world 123",
                "{pre}"
            );
        }
        Ok(())
    }

    #[test]
    fn unknown_pre_tokenizer_is_named() -> Result<()> {
        let err =
            Tokenizer::from_gguf(&load(&gpt2_writer("mystery-pre"))?).err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("\"mystery-pre\"") && msg.contains("tokenizer.ggml.pre"), "{msg}");
        Ok(())
    }

    #[test]
    fn unknown_model_is_named() -> Result<()> {
        let mut w = gpt2_writer("gpt-2");
        w.meta("tokenizer.ggml.model", MetaValue::String("bert".into()));
        let msg = Tokenizer::from_gguf(&load(&w)?).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("\"bert\"") && msg.contains("tokenizer.ggml.model"), "{msg}");
        Ok(())
    }

    /// Writes `tok`'s Hugging Face serialization and loads it back with `config`.
    fn via_hf_file(tok: &Tokenizer, config: &serde_json::Value) -> Result<Tokenizer> {
        let dir = tempfile::tempdir().map_err(|e| TextError::io("tempdir", e))?;
        let path = dir.path().join("tokenizer.json");
        let json = tok.inner.to_string(false).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        std::fs::write(&path, json).map_err(|e| TextError::io(&path, e))?;
        Tokenizer::from_hf_file(&path, Some(config))
    }

    #[test]
    fn hugging_face_file_matches_the_gguf_build() -> Result<()> {
        let gguf = Tokenizer::from_gguf(&load(&gpt2_writer("smollm"))?)?;
        let config = serde_json::json!({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}});
        let hf = via_hf_file(&gguf, &config)?;
        let text = "<|im_start|>hello world 123<|im_end|>";
        assert_eq!(hf.encode(text, true)?, gguf.encode(text, true)?);
        assert_eq!(hf.encode(text, false)?, gguf.encode(text, false)?);
        assert_eq!((hf.bos_id(), hf.eos_id(), hf.add_bos()), (Some(1), Some(2), false));
        assert_eq!(hf.stop_ids(), &[2, 0]);
        assert_eq!(hf.vocab_size(), GPT2_TOKENS.len());
        assert_eq!(hf.token_text(27).as_deref(), Some(" w"));
        assert!(hf.is_special(1) && !hf.is_special(27));
        // add_bos_token decides when present; a token the vocabulary lacks is an error.
        let config = serde_json::json!({"bos_token": "<|im_start|>", "add_bos_token": true});
        assert!(via_hf_file(&gguf, &config)?.add_bos());
        let missing = via_hf_file(&gguf, &serde_json::json!({"eos_token": "<nope>"}));
        let msg = missing.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("eos_token") && msg.contains("<nope>"), "{msg}");

        let (w, _) =
            spm_writer(&[("▁", -1.0), ("h", -2.0), ("i", -3.0), ("▁h", -4.0), ("▁hi", -5.0)], None);
        let spm = Tokenizer::from_gguf(&load(&w)?)?;
        let hf = via_hf_file(&spm, &serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"}))?;
        let ids = hf.encode("hi hi", false)?;
        assert_eq!(ids, spm.encode("hi hi", false)?);
        assert_eq!(hf.decode(&ids, false)?, "hi hi");
        assert_eq!(hf.token_text(ids[1]).as_deref(), Some(" hi"));
        Ok(())
    }

    /// A SentencePiece vocabulary: control tokens, all 256 byte tokens, then pieces with scores.
    fn spm_writer(
        pieces: &[(&str, f64)],
        add_space_prefix: Option<bool>,
    ) -> (GgufWriter, Vec<String>) {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types: Vec<u64> = vec![2, 3, 3];
        let mut scores: Vec<f64> = vec![0.0; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (p, s) in pieces {
            tokens.push((*p).to_string());
            types.push(1);
            scores.push(*s);
        }
        let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
            .meta("tokenizer.ggml.tokens", strings(&refs))
            .meta("tokenizer.ggml.token_type", ints(&types))
            .meta(
                "tokenizer.ggml.scores",
                MetaValue::Array(scores.into_iter().map(MetaValue::F64).collect()),
            )
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U64(1))
            .meta("tokenizer.ggml.eos_token_id", MetaValue::U64(2))
            .meta("tokenizer.ggml.unknown_token_id", MetaValue::U64(0));
        if let Some(p) = add_space_prefix {
            w.meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(p));
        }
        (w, tokens)
    }

    fn spm_ids(tokens: &[String], pieces: &[&str]) -> Vec<u32> {
        let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        ids(&refs, pieces)
    }

    #[test]
    fn sentence_piece_with_byte_fallback() -> Result<()> {
        let pieces = [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -3.0),
            ("l", -4.0),
            ("o", -5.0),
            ("w", -6.0),
            ("r", -7.0),
            ("d", -8.0),
            ("▁h", -9.0),
            ("ll", -10.0),
            ("▁he", -11.0),
            ("▁hell", -12.0),
            ("▁hello", -13.0),
            ("▁w", -14.0),
            ("or", -15.0),
            ("▁wor", -16.0),
            ("ld", -17.0),
            ("▁world", -18.0),
        ];
        let (w, tokens) = spm_writer(&pieces, None);
        let tok = Tokenizer::from_gguf(&load(&w)?)?;
        assert!(tok.add_bos());
        let got = tok.encode("hello world", false)?;
        assert_eq!(got, spm_ids(&tokens, &["▁hello", "▁world"]));
        assert_eq!(tok.decode(&got, false)?, "hello world");
        // 'é' is not a piece: its two UTF-8 bytes become byte tokens.
        let got = tok.encode("hello é", false)?;
        assert_eq!(got, spm_ids(&tokens, &["▁hello", "▁", "<0xC3>", "<0xA9>"]));
        assert_eq!(tok.decode(&got, false)?, "hello é");
        assert_eq!(tok.token_bytes(got[2]), Some(&[0xC3u8][..]));
        assert_eq!(tok.token_text(got[0]).as_deref(), Some(" hello"));
        // A special token in the text; the text after it gets its own space prefix, as in
        // llama.cpp.
        let got = tok.encode("<s>hello", true)?;
        assert_eq!(got, spm_ids(&tokens, &["<s>", "▁hello"]));
        assert_eq!(tok.decode(&got, true)?, "hello");
        assert_eq!(tok.stop_ids(), &[2]);
        Ok(())
    }

    #[test]
    fn sentence_piece_merges_follow_scores() -> Result<()> {
        let order = |ab: f64, bc: f64| -> Result<Vec<u32>> {
            let (w, _) = spm_writer(
                &[("a", -1.0), ("b", -1.0), ("c", -1.0), ("ab", ab), ("bc", bc)],
                Some(false),
            );
            Tokenizer::from_gguf(&load(&w)?)?.encode("abc", false)
        };
        let (_, tokens) =
            spm_writer(&[("a", -1.0), ("b", -1.0), ("c", -1.0), ("ab", 0.0), ("bc", 0.0)], None);
        assert_eq!(order(-2.0, -3.0)?, spm_ids(&tokens, &["ab", "c"]));
        assert_eq!(order(-3.0, -2.0)?, spm_ids(&tokens, &["a", "bc"]));
        Ok(())
    }
}
