//! Chat templates: the Jinja templates Hugging Face tokenizers ship, rendered with minijinja in
//! an environment set up like `transformers`' `_compile_jinja_template`: `trim_blocks` and
//! `lstrip_blocks` on, the trailing newline of the template dropped, `raise_exception`,
//! `strftime_now` and Python's `json.dumps` behind `tojson`, plus the Python string and dict
//! methods templates call (`.strip()`, `.startswith()`, `.split()`, `.items()`, `.get()`, ...).
//!
//! A template's `raise_exception` (how templates refuse illegal role sequences) becomes an
//! [`TextError::Template`] carrying the template's own message.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, Output, State, context};
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Result, TextError};
use crate::gguf::GgufFile;
use crate::tokenizer::{Tokenizer, sha256_hex};
use crate::tools::Tools;

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, OpenAI style. `content` may arrive as a string or as an array of
/// `{"type": "text", "text": ...}` parts, which are joined with newlines (as vLLM does); an
/// assistant message that makes tool calls may have none (`null`), and reads as empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireMessage")]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (which roles and orders are legal is the template's call).
    pub role: String,
    /// The message text.
    pub content: String,
    /// The calls an assistant message made.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<MessageToolCall>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The function a `tool` message's result came from, or a participant's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..ChatMessage::default() }
    }
}

/// A call in an assistant message of the conversation. Its arguments arrive as JSON text
/// (OpenAI's wire form) and are kept parsed, as templates read them (`arguments | tojson`);
/// text that is not JSON stays a string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageToolCall {
    /// The call's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// What was called.
    pub function: MessageFunctionCall,
}

/// The function and arguments of a [`MessageToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageFunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments.
    #[serde(deserialize_with = "arguments_value")]
    pub arguments: serde_json::Value,
}

fn function_kind() -> String {
    "function".into()
}

fn arguments_value<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<serde_json::Value, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(s) => {
            serde_json::from_str(&s).unwrap_or(serde_json::Value::String(s))
        }
        other => other,
    })
}

/// A message as it arrives, before the rule that only a message with tool calls may lack
/// content.
#[derive(Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default, deserialize_with = "content_text")]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<MessageToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

impl TryFrom<WireMessage> for ChatMessage {
    type Error = String;

    fn try_from(w: WireMessage) -> std::result::Result<ChatMessage, String> {
        let tool_calls = w.tool_calls.unwrap_or_default();
        let content = match w.content {
            Some(c) => c,
            None if !tool_calls.is_empty() => String::new(),
            // The wording serde uses, so the error names `content`.
            None => return Err("missing field `content`".into()),
        };
        Ok(ChatMessage {
            role: w.role,
            content,
            tool_calls,
            tool_call_id: w.tool_call_id,
            name: w.name,
        })
    }
}

fn content_text<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<String>, D::Error> {
    use serde::de::Error as _;
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s)),
        serde_json::Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                match part.get("type").and_then(|t| t.as_str()) {
                    Some("text") => match part.get("text").and_then(|t| t.as_str()) {
                        Some(text) => texts.push(text),
                        None => {
                            return Err(D::Error::custom(format!(
                                "content part {i}: text part without a string `text`"
                            )));
                        }
                    },
                    Some(other) => {
                        return Err(D::Error::custom(format!(
                            "content part {i}: type {other:?} is not supported (only \"text\")"
                        )));
                    }
                    None => {
                        return Err(D::Error::custom(format!(
                            "content part {i}: missing string `type`"
                        )));
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        other => Err(D::Error::custom(format!(
            "content must be a string or an array of text parts, not {}",
            json_kind(&other)
        ))),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// One piece of a rendered chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatPart {
    /// The text.
    pub text: String,
    /// Whether it is a message's content (text, never control tokens) rather than the
    /// template's own.
    pub content: bool,
}

/// A chat prompt's token ids and its rendered text. Message content is text: a user who writes
/// `<|im_end|>` gets those characters, not the control token, so nobody can forge another
/// turn. Where no content holds a special token's text (nearly always), the prompt is rendered
/// and tokenized exactly as before; otherwise it is rendered in pieces ([`ChatTemplate::
/// render_parts`]) and only the template's own text is tokenized with special tokens parsed.
/// A template under which the pieces do not add up to the plain rendering (one that branches on
/// content, say) is refused for such content rather than rendered another way. The rendered
/// template carries its own BOS when the model wants one.
pub fn encode_chat(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<(Vec<u32>, String)> {
    encode_chat_tools(template, tokenizer, messages, None, add_generation_prompt)
}

/// As [`encode_chat`], for a request that may offer tools and whose conversation may hold
/// tool calls and results. A template that knows tools ([`ChatTemplate::supports_tools`])
/// gets them in `tools` and the messages as they came; tools, calls and ids it renders are its
/// own text, so any that holds a special token's text is refused. Any other template gets the
/// generic format of [`crate::tools`], all of it message content.
pub fn encode_chat_tools(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    add_generation_prompt: bool,
) -> Result<(Vec<u32>, String)> {
    let native = template.supports_tools();
    let speaks_tools = |m: &ChatMessage| m.role == "tool" || !m.tool_calls.is_empty();
    let converted;
    let messages = if !native && (tools.is_some() || messages.iter().any(speaks_tools)) {
        converted = crate::tools::generic_messages(messages, tools);
        converted.as_slice()
    } else {
        messages
    };
    let tools_value = if native { tools.map(Tools::template_value) } else { None };
    if native {
        let calls = messages.iter().flat_map(|m| {
            m.tool_calls
                .iter()
                .map(|c| serde_json::to_string(c).unwrap_or_default())
                .chain(m.tool_call_id.clone())
                .chain(m.name.clone())
        });
        if tools
            .into_iter()
            .flat_map(Tools::texts)
            .chain(calls)
            .any(|t| tokenizer.holds_special_text(&t))
        {
            return Err(TextError::Template(
                "a tool, tool call or name holds a special token's text, which this chat \
                 template would render as its own"
                    .into(),
            ));
        }
    }
    let tools_value = tools_value.as_ref();
    let text = template.render_tools(messages, tools_value, add_generation_prompt)?;
    if !messages.iter().any(|m| tokenizer.holds_special_text(&m.content)) {
        return Ok((tokenizer.encode(&text, true)?, text));
    }
    let parts = template.render_parts_tools(messages, tools_value, add_generation_prompt)?;
    if parts.iter().map(|p| p.text.as_str()).collect::<String>() != text {
        return Err(TextError::Template(
            "a message holds a special token's text, and this chat template renders content in \
             a way that cannot keep it apart from its own special tokens"
                .into(),
        ));
    }
    let mut ids = Vec::new();
    for p in &parts {
        ids.extend(tokenizer.encode(&p.text, !p.content)?);
    }
    Ok((ids, text))
}

/// A compiled chat template with the special-token texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    version: String,
    tools: bool,
    /// Whether the template renders a leading system message (found by rendering one).
    system_role: bool,
    /// Whether the template keeps a `developer` role (GPT-OSS's; elsewhere it becomes `system`).
    developer_role: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("version", &self.version).finish_non_exhaustive()
    }
}

/// The error `raise_exception` raises, found again in the render error's source chain.
#[derive(Debug)]
struct TemplateRaised(String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts templates see under those names.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.set_formatter(python_formatter);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::Template(format!("compile: {}", describe(&e))))?;
        let mut template = ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            version: sha256_hex(source.as_bytes()),
            tools: source.contains("tools"),
            system_role: true,
            // llama.cpp keeps `developer` only for GPT-OSS's template (its channels).
            developer_role: source.contains("<|channel|>"),
        };
        // As llama.cpp finds a template's capabilities: render a system message and look for it.
        let needle = "\u{E002}system needle\u{E002}";
        let probe = [ChatMessage::new("system", needle), ChatMessage::new("user", "x")];
        template.system_role =
            template.render_raw(&probe, None, false).is_ok_and(|text| text.contains(needle));
        Ok(template)
    }

    /// The messages as the template is given them, adapted as llama.cpp adapts them for
    /// templates that lack a role: `developer` becomes `system` (except for GPT-OSS's),
    /// and a leading system message the template would refuse or drop is put before the next
    /// message's content (with a newline), or dropped when it is the only message.
    fn prepare<'a>(&self, messages: &'a [ChatMessage]) -> std::borrow::Cow<'a, [ChatMessage]> {
        let developer = !self.developer_role && messages.iter().any(|m| m.role == "developer");
        let system = !self.system_role && messages.first().is_some_and(|m| m.role == "system");
        if !developer && !system {
            return std::borrow::Cow::Borrowed(messages);
        }
        let mut out = messages.to_vec();
        if developer {
            out.iter_mut().filter(|m| m.role == "developer").for_each(|m| m.role = "system".into());
        }
        if !self.system_role && out.first().is_some_and(|m| m.role == "system") {
            let first = out.remove(0);
            if let Some(next) = out.first_mut() {
                next.content = format!("{}\n{}", first.content, next.content);
            }
        }
        std::borrow::Cow::Owned(out)
    }

    /// The template in `tokenizer.chat_template`, with BOS/EOS texts from the vocabulary;
    /// `None` when the file has no template.
    pub fn from_gguf(file: &GgufFile) -> Result<Option<ChatTemplate>> {
        let Some(value) = file.get("tokenizer.chat_template") else { return Ok(None) };
        let source = value.as_str().ok_or_else(|| {
            TextError::format(file.path(), "metadata tokenizer.chat_template is not a string")
        })?;
        let tokens =
            file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).unwrap_or_default();
        let token_text = |key: &str| -> Result<String> {
            let Some(id) = file.get(key) else { return Ok(String::new()) };
            id.as_u64()
                .and_then(|id| usize::try_from(id).ok())
                .and_then(|id| tokens.get(id))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| {
                    TextError::format(
                        file.path(),
                        format!("metadata {key} is not a token of the vocabulary"),
                    )
                })
        };
        let bos = token_text("tokenizer.ggml.bos_token_id")?;
        let eos = token_text("tokenizer.ggml.eos_token_id")?;
        ChatTemplate::new(source, &bos, &eos).map(Some)
    }

    /// Renders `messages`; with `add_generation_prompt`, ends with the header that opens the
    /// assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_tools(messages, None, add_generation_prompt)
    }

    /// Whether the template reads `tools` (Hugging Face's variable for the tools offered), so
    /// tools are given to it rather than described in the generic format.
    pub fn supports_tools(&self) -> bool {
        self.tools
    }

    /// As [`render`](Self::render), with `tools` (OpenAI's request shape) in the template's
    /// `tools` variable.
    pub fn render_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_raw(&self.prepare(messages), tools, add_generation_prompt)
    }

    /// Renders the messages as they are.
    fn render_raw(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| TextError::Template(describe(&e)))?;
        // `transformers` passes `tools` and `documents` as None when absent. llama.cpp also
        // passes today's date (Llama 3.1's template prints `date_string`, else 26 Jul 2024).
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let ctx = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools.map(Value::from_serialize),
            documents => (),
            date_string => strftime("%d %b %Y", now),
            datetime => strftime("%b %d %Y", now),
        };
        template.render(ctx).map_err(|e| match raised_message(&e) {
            Some(message) => {
                TextError::Template(format!("template refused the messages: {message}"))
            }
            None => TextError::Template(format!("render: {}", describe(&e))),
        })
    }

    /// Renders `messages` as [`render`](Self::render) does, in pieces: the template's own text
    /// and each message's content apart, so content can be tokenized as text while only the
    /// template's structure yields special tokens. Each content is rendered as a marker padded
    /// with a space on either side: where the padding survives the template inserted the
    /// content verbatim, where it is gone the template trimmed it (`| trim`, `.strip()`); a
    /// template that otherwise changes content is refused rather than rendered unsafely.
    pub fn render_parts(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<ChatPart>> {
        self.render_parts_tools(messages, None, add_generation_prompt)
    }

    /// As [`render_parts`](Self::render_parts), with `tools` as in
    /// [`render_tools`](Self::render_tools).
    pub fn render_parts_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<ChatPart>> {
        // Adapted before marking, so each marker stands for the content the template is given.
        let messages = &*self.prepare(messages);
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let open = format!("\u{E000}{nonce}.");
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage { content: format!(" {open}{i}\u{E001} "), ..m.clone() })
            .collect();
        let text = self.render_raw(&marked, tools, add_generation_prompt)?;
        let changed = || {
            TextError::Template(
                "the chat template changes message content beyond trimming it; it cannot keep \
                 content apart from its own special tokens"
                    .into(),
            )
        };
        let mut parts = Vec::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(&open) {
            let after = &rest[at + open.len()..];
            let end = after.find('\u{E001}').ok_or_else(changed)?;
            let i: usize = after[..end].parse().map_err(|_| changed())?;
            let content = &messages.get(i).ok_or_else(changed)?.content;
            let (before, after) = (&rest[..at], &after[end + '\u{E001}'.len_utf8()..]);
            let (before, after, content) = match (before.strip_suffix(' '), after.strip_prefix(' '))
            {
                (Some(b), Some(a)) => (b, a, content.as_str()),
                (None, None) => (before, after, content.trim()),
                _ => return Err(changed()),
            };
            parts.push(ChatPart { text: before.to_owned(), content: false });
            parts.push(ChatPart { text: content.to_owned(), content: true });
            rest = after;
        }
        parts.push(ChatPart { text: rest.to_owned(), content: false });
        parts.retain(|p| !p.text.is_empty());
        Ok(parts)
    }

    /// Hex SHA-256 of the template text.
    pub fn version(&self) -> &str {
        &self.version
    }
}

fn raised_message(e: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<TemplateRaised>() {
            return Some(raised.0.clone());
        }
        source = err.source();
    }
    None
}

/// The error and its causes on one line.
fn describe(e: &Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        let _ = write!(out, ": {err}");
        source = err.source();
    }
    out
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, "raise_exception")
        .with_source(TemplateRaised(message)))
}

/// `strftime_now(format)`: the current UTC time formatted with C `strftime` directives.
fn strftime_now(format: &str) -> std::result::Result<Value, Error> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    Ok(Value::from(strftime(format, secs)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] =
    ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// Formats a Unix time (UTC) with the common `strftime` directives; others are copied through.
fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day % 3600 / 60, secs_of_day % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:>2}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{hour12:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{day_of_year:03}"),
            Some('B') => write!(out, "{month_name}"),
            Some('b') | Some('h') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}"),
            Some('T') => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as `transformers` defines it: Python's `json.dumps` with `ensure_ascii=False`,
/// `", "`/`": "` separators without `indent`, `","` and newlines with it, keys in their order.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let options = JsonOptions {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

struct JsonOptions {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn write_json(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    depth: usize,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let x = f64::try_from(value.clone())?;
                out.push_str(&python_float_repr(x));
            }
        }
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), options.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', &items, options, depth, |out, item, depth| {
                write_json(out, item, options, depth)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            let separator = ": ";
            write_container(out, '{', '}', &keys, options, depth, |out, key, depth| {
                let key_text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                write_json_string(out, &key_text, options.ensure_ascii);
                out.push_str(separator);
                write_json(out, &value.get_item(key)?, options, depth)
            })?;
        }
        ValueKind::Undefined => {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: value is undefined"));
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {other}"),
            ));
        }
    }
    Ok(())
}

fn write_container<F>(
    out: &mut String,
    open: char,
    close: char,
    items: &[Value],
    options: &JsonOptions,
    depth: usize,
    mut write_item: F,
) -> std::result::Result<(), Error>
where
    F: FnMut(&mut String, &Value, usize) -> std::result::Result<(), Error>,
{
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        match options.indent {
            Some(indent) => {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.extend(std::iter::repeat_n(' ', indent * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        write_item(out, item, depth + 1)?;
    }
    if let Some(indent) = options.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', indent * depth));
    }
    out.push(close);
    Ok(())
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Prints values the way Jinja2 does, through Python's `str`: `True`, `None`, `['a', 1]`.
fn python_formatter(
    out: &mut Output,
    state: &State,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value)?;
            out.write_str(&text)?;
            Ok(())
        }
        ValueKind::Number if !value.is_integer() => {
            let x = f64::try_from(value.clone())?;
            out.write_str(&python_float_str(x))?;
            Ok(())
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a value.
fn python_repr(out: &mut String, value: &Value) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => {
            out.push_str(&python_float_str(f64::try_from(value.clone())?))
        }
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        ValueKind::Undefined => {}
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str(float)`.
fn python_float_str(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        python_float_repr(x)
    }
}

/// Python's `json.dumps` of a float: `repr`, with JSON's names for the non-finite values.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if x == 0.0 || (1e-4..1e16).contains(&x.abs()) {
        let s = format!("{x}");
        return if s.contains('.') { s } else { format!("{s}.0") };
    }
    // Rust: "1.5e-7", Python: "1.5e-07".
    let s = format!("{x:e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// Python methods on strings and dicts that chat templates call.
fn python_method(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> std::result::Result<Value, Error> {
    // Python strips whitespace by default, or any of the given characters.
    let in_set =
        |chars: Option<&str>, c: char| chars.map_or(c.is_whitespace(), |set| set.contains(c));
    Ok(match method {
        "strip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_matches(|c| in_set(chars, c)))
        }
        "lstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_start_matches(|c| in_set(chars, c)))
        }
        "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_end_matches(|c| in_set(chars, c)))
        }
        "upper" => {
            let () = from_args(args)?;
            Value::from(s.to_uppercase())
        }
        "lower" => {
            let () = from_args(args)?;
            Value::from(s.to_lowercase())
        }
        "title" => {
            let () = from_args(args)?;
            Value::from(python_title(s))
        }
        "capitalize" => {
            let () = from_args(args)?;
            let mut chars = s.chars();
            Value::from(match chars.next() {
                Some(first) => first
                    .to_uppercase()
                    .chain(chars.as_str().to_lowercase().chars())
                    .collect::<String>(),
                None => String::new(),
            })
        }
        "startswith" | "endswith" => {
            let (affix,): (Value,) = from_args(args)?;
            let candidates: Vec<Value> = match affix.kind() {
                ValueKind::String => vec![affix],
                ValueKind::Seq => affix.try_iter()?.collect(),
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{method} takes a string or tuple, not {other}"),
                    ));
                }
            };
            let hit = candidates
                .iter()
                .filter_map(Value::as_str)
                .any(|a| if method == "startswith" { s.starts_with(a) } else { s.ends_with(a) });
            Value::from(hit)
        }
        "split" | "rsplit" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let limit = maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
            Value::from(python_split(s, sep, limit, method == "rsplit")?)
        }
        "splitlines" => {
            let () = from_args(args)?;
            Value::from(s.lines().map(str::to_string).collect::<Vec<_>>())
        }
        "replace" => {
            let (old, new, count): (&str, &str, Option<i64>) = from_args(args)?;
            Value::from(match count.filter(|&c| c >= 0) {
                Some(c) => s.replacen(old, new, c as usize),
                None => s.replace(old, new),
            })
        }
        "find" | "rfind" => {
            let (needle,): (&str,) = from_args(args)?;
            let at = if method == "find" { s.find(needle) } else { s.rfind(needle) };
            // Python counts characters, not bytes.
            Value::from(at.map_or(-1, |b| s[..b].chars().count() as i64))
        }
        "count" => {
            let (needle,): (&str,) = from_args(args)?;
            Value::from(if needle.is_empty() {
                s.chars().count() + 1
            } else {
                s.matches(needle).count()
            })
        }
        "join" => {
            let (items,): (Value,) = from_args(args)?;
            let parts: Vec<String> = items
                .try_iter()?
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                .collect();
            Value::from(parts.join(s))
        }
        "isdigit" | "isalpha" | "isalnum" | "isspace" | "islower" | "isupper" => {
            let () = from_args(args)?;
            let test: fn(char) -> bool = match method {
                "isdigit" => |c| c.is_numeric(),
                "isalpha" => char::is_alphabetic,
                "isalnum" => char::is_alphanumeric,
                "isspace" => char::is_whitespace,
                "islower" => |c| !c.is_uppercase(),
                _ => |c| !c.is_lowercase(),
            };
            let cased_needed = matches!(method, "islower" | "isupper");
            let has_cased = s.chars().any(|c| c.is_lowercase() || c.is_uppercase());
            Value::from(!s.is_empty() && s.chars().all(test) && (!cased_needed || has_cased))
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_lowercase() || c.is_uppercase();
    }
    out
}

fn python_split(
    s: &str,
    sep: Option<&str>,
    limit: Option<usize>,
    from_right: bool,
) -> std::result::Result<Vec<String>, Error> {
    let parts: Vec<String> = match sep {
        Some("") => return Err(Error::new(ErrorKind::InvalidOperation, "split: empty separator")),
        Some(sep) => match (limit, from_right) {
            (None, _) => s.split(sep).map(str::to_string).collect(),
            (Some(n), false) => s.splitn(n + 1, sep).map(str::to_string).collect(),
            (Some(n), true) => {
                let mut v: Vec<String> = s.rsplitn(n + 1, sep).map(str::to_string).collect();
                v.reverse();
                v
            }
        },
        None => {
            // Runs of whitespace separate; leading and trailing whitespace yields nothing.
            let words: Vec<&str> = s.split_whitespace().collect();
            match limit {
                Some(n) if n < words.len() => {
                    if from_right {
                        // Trailing whitespace goes; the head keeps its leading whitespace.
                        let mut head = s.trim_end();
                        let mut tail = Vec::with_capacity(n + 1);
                        for _ in 0..n {
                            match head.rfind(char::is_whitespace) {
                                Some(cut) => {
                                    let ws = head[cut..].chars().next().map_or(1, char::len_utf8);
                                    tail.push(head[cut + ws..].to_string());
                                    head = head[..cut].trim_end();
                                }
                                None => {
                                    tail.push(head.to_string());
                                    head = "";
                                }
                            }
                        }
                        if !head.is_empty() {
                            tail.push(head.to_string());
                        }
                        tail.reverse();
                        tail
                    } else {
                        let mut rest = s.trim_start();
                        let mut out = Vec::with_capacity(n + 1);
                        for _ in 0..n {
                            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                            out.push(rest[..end].to_string());
                            rest = rest[end..].trim_start();
                        }
                        out.push(rest.to_string());
                        out
                    }
                }
                _ => words.into_iter().map(str::to_string).collect(),
            }
        }
    };
    Ok(parts)
}

fn map_method(map: &Value, method: &str, args: &[Value]) -> std::result::Result<Value, Error> {
    Ok(match method {
        "items" => {
            let () = from_args(args)?;
            let mut pairs = Vec::new();
            for key in map.try_iter()? {
                let value = map.get_item(&key)?;
                pairs.push(Value::from(vec![key, value]));
            }
            Value::from(pairs)
        }
        "keys" => {
            let () = from_args(args)?;
            Value::from(map.try_iter()?.collect::<Vec<_>>())
        }
        "values" => {
            let () = from_args(args)?;
            let mut values = Vec::new();
            for key in map.try_iter()? {
                values.push(map.get_item(&key)?);
            }
            Value::from(values)
        }
        "get" => {
            let (key, default): (Value, Option<Value>) = from_args(args)?;
            let found = map.get_item(&key)?;
            if found.is_undefined() { default.unwrap_or(Value::from(())) } else { found }
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    fn render(
        source: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        ChatTemplate::new(source, "<s>", "</s>")?.render(messages, add_generation_prompt)
    }

    const ALTERNATING: &str = "{{ bos_token }}{% for message in messages %}\
        {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
        {% endif %}[{{ message['role'] }}] {{ message['content'] | trim }}\n{% endfor %}";

    #[test]
    fn raise_exception_carries_the_template_message() -> Result<()> {
        let ok = render(ALTERNATING, &[msg("user", " hi "), msg("assistant", "hello")], false)?;
        assert_eq!(ok, "<s>[user] hi\n[assistant] hello\n");
        let err =
            render(ALTERNATING, &[msg("assistant", "hello")], false).err().map(|e| e.to_string());
        let text = err.unwrap_or_default();
        let want =
            "chat template: template refused the messages: Conversation roles must alternate";
        assert!(text.starts_with(want), "{text}");
        Ok(())
    }

    #[test]
    fn empty_messages_render_the_generation_prompt_only() -> Result<()> {
        let src = "{% for m in messages %}{{ m.role }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        assert_eq!(render(src, &[], true)?, "<|assistant|>");
        assert_eq!(render(src, &[], false)?, "");
        Ok(())
    }

    #[test]
    fn content_parts_are_joined_and_checked() -> Result<()> {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"first"},{"type":"text","text":"second"}]}"#,
        )
        .map_err(|e| TextError::Template(e.to_string()))?;
        assert_eq!(m, msg("user", "first\nsecond"));
        let image = serde_json::from_str::<ChatMessage>(
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}"#,
        );
        let text = image.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("\"image_url\"") && text.contains("not supported"), "{text}");
        let null = serde_json::from_str::<ChatMessage>(r#"{"role":"assistant","content":null}"#);
        assert!(null.is_err());
        Ok(())
    }

    #[test]
    fn non_string_role_is_a_serde_error() {
        let r = serde_json::from_str::<ChatMessage>(r#"{"role":3,"content":"x"}"#);
        let text = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("invalid type: integer"), "{text}");
    }

    /// Expected outputs were produced by Python's jinja2 3.1 with `transformers`' settings.
    #[test]
    fn matches_jinja2_with_transformers_settings() -> Result<()> {
        let cases: &[(&str, &str)] = &[
            ("  {% if true %}\n  x\n  {% endif %}\ny\n", "  x\ny"),
            ("\n  {%- if true %}\n    x\n  {%- endif %}\n\n", "    x"),
            (
                "{{ '  a b  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}",
                "a b|hi|['a', 'b', '', 'c']|['a', 'b']",
            ),
            (
                "{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}{{ 'hello world'.title() }}",
                "TrueTrueHello World",
            ),
            (
                "{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ 'abc'.replace('b', 'B') }}|{{ 'abcb'.find('b') }}",
                "['a', 'b c']|['a b', 'c']|aBc|1",
            ),
            (
                "{{ '  a  b c '.split(none, 1) }}|{{ '  a  b c '.rsplit(none, 1) }}|{{ 'a\\nb\\n'.splitlines() }}|{{ '-'.join(['x', 'y']) }}",
                "['a', 'b c ']|['  a  b', 'c']|['a', 'b']|x-y",
            ),
            (
                "{{ 'abc'.upper() }}{{ 'ABC'.lower() }}{{ 'hELLO wORLD'.capitalize() }}{{ '123'.isdigit() }}{{ 'aaa'.count('a') }}",
                "ABCabcHello worldTrue3",
            ),
            (
                "{% for k, v in {'a': 2, 'b': 1}.items() %}{{ k }}={{ v }};{% endfor %}{{ {'a': 1}.get('z', 'd') }}{{ {'a': 1}.get('a') }}{{ {'a': 1}.get('z') }}",
                "a=2;b=1;d1None",
            ),
            (
                "{{ {'k': [1, 2.5, 'é\"', none, true]} | tojson }}",
                "{\"k\": [1, 2.5, \"é\\\"\", null, true]}",
            ),
            ("{{ [1, {'a': []}] | tojson(indent=2) }}", "[\n  1,\n  {\n    \"a\": []\n  }\n]"),
            (
                "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=true) }}|{{ 1e20 | tojson }}|{{ 0.00001 | tojson }}|{{ 'é\\n' | tojson(ensure_ascii=true) }}",
                "{\"a\": [1, 2], \"b\": 1}|1e+20|1e-05|\"\\u00e9\\n\"",
            ),
            (
                "{{ none }}|{{ true }}|{{ [1, 'a', none, 1.5, {'k': \"it's\"}] }}|{{ undefined_var }}|{{ 2.0 }}",
                "None|True|[1, 'a', None, 1.5, {'k': \"it's\"}]||2.0",
            ),
            (
                "{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] %}{% set ns.n = ns.n + x %}{% if loop.last %}{{ ns.n }}{% endif %}{% endfor %}",
                "6",
            ),
            (
                "{% for m in messages %}x{% else %}empty{% endfor %}{{ messages | length }}{{ tools is none }}{{ bos_token }}",
                "empty0True<s>",
            ),
        ];
        for (src, want) in cases {
            assert_eq!(render(src, &[], false)?, *want, "{src}");
        }
        Ok(())
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208.
        let t = 1_722_000_309;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %j %I%p %y %%", t),
            "Friday July 26 13:25:09 208 01PM 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%F", 951_782_400), "2000-02-29");
    }

    #[test]
    fn version_is_the_template_hash() -> Result<()> {
        let a = ChatTemplate::new("{{ messages }}", "", "")?;
        let b = ChatTemplate::new("{{ messages }} ", "", "")?;
        assert_eq!(a.version().len(), 64);
        assert_ne!(a.version(), b.version());
        Ok(())
    }
}
