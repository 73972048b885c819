//! Parse, don't validate: a request body becomes a [`Plan`] (and from it the engine's
//! [`ValidRequest`]s) or a 400 naming the parameter at fault.

use std::sync::Arc;

use serde::Deserialize as _;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::defaults::SamplingDefaults;
use crate::loader::LoadedModel;
use crate::sampler::SamplingParams;
use crate::serve::{CacheScope, RequestAdapter, ValidRequest};
use crate::server::context::RequestContext;
use crate::server::error::ApiError;
use crate::server::openai::{ChatFields, CompletionFields, GenerationParams, SamplingFields};
use crate::structured::{Grammar, Spelling};
use sluice_text::template::encode_chat_tools;
use sluice_text::tokenizer::{PROMPT_FIELD, PromptTokens};
use sluice_text::tools::{ToolChoice, Tools};

/// Most stop strings per request (OpenAI's cap).
pub const MAX_STOP: usize = 4;
/// Roles a chat message may have; which orders are legal is the template's call.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];
/// OpenAI's default `max_tokens` for legacy completions.
const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Server-side caps and model sizes every request is checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    /// The model's context length.
    pub context_length: usize,
    /// Most tokens one request can hold in the KV cache.
    pub capacity_tokens: usize,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Most choices per request.
    pub max_n: usize,
    /// Most alternatives per token.
    pub max_logprobs: usize,
    /// What the sampling parameters a request leaves out are.
    pub sampling: SamplingDefaults,
}

/// A checked request, ready to become `n` engine requests.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Prompt token ids (non-empty, inside the vocabulary, shorter than the context).
    pub prompt: Vec<u32>,
    /// Text to put before the completion (`echo`).
    pub echo: Option<String>,
    /// Characters of the prompt text (where completion text offsets start without echo).
    pub prompt_chars: usize,
    /// Return per-token log-probabilities.
    pub logprobs: Option<usize>,
    /// Return prompt log-probabilities (echo with logprobs).
    pub prompt_logprobs: Option<usize>,
    /// Extra stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Include a usage chunk when streaming.
    pub include_usage: bool,
    /// Everything else, as it will be reported back.
    pub params: GenerationParams,
    /// The grammar the output must follow (`response_format`, or tool calls).
    pub grammar: Option<Arc<Grammar>>,
    /// The request offers tools: the answer is read for calls, in the generic format (`true`)
    /// or the template's own.
    pub tools: Option<bool>,
}

impl Plan {
    /// The engine requests: one per choice, seeds `seed`, `seed + 1`, ...; choice ids
    /// `REQ-i` when there are several. All choices share one cache scope: the tenant's, or a
    /// fresh private one (never derived from anything the client sent).
    pub fn requests(
        &self,
        ctx: &RequestContext,
        adapter: Option<&RequestAdapter>,
    ) -> Vec<ValidRequest> {
        let scope = match &ctx.tenant {
            Some(t) => CacheScope::Tenant(t.clone()),
            None => CacheScope::Private(uuid::Uuid::new_v4().simple().to_string()),
        };
        let p = &self.params;
        (0..p.n)
            .map(|i| ValidRequest {
                request_id: choice_id(&ctx.request_id, i, p.n),
                prompt: self.prompt.clone(),
                max_tokens: p.max_tokens,
                sampling: SamplingParams {
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    presence_penalty: p.presence_penalty,
                    frequency_penalty: p.frequency_penalty,
                    seed: p.seed.wrapping_add(i as u64),
                    logit_bias: p.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
                },
                stop: p.stop.clone(),
                stop_token_ids: self.stop_token_ids.clone(),
                ignore_eos: p.ignore_eos,
                logprobs: self.logprobs,
                prompt_logprobs: self.prompt_logprobs,
                cache_scope: scope.clone(),
                priority: ctx.priority,
                weight: ctx.weight,
                tpot_target: ctx.tpot_target,
                arrival: ctx.arrival,
                grammar: self.grammar.clone(),
                adapter: adapter.cloned(),
            })
            .collect()
    }
}

/// The engine id of choice `i`.
pub fn choice_id(request_id: &str, i: usize, n: usize) -> String {
    if n == 1 { request_id.to_string() } else { format!("{request_id}-{i}") }
}

/// The body as a JSON object, or a 400.
pub fn parse_body(bytes: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid_body(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid_body("the body must be a JSON object"));
    }
    Ok(v)
}

/// Reads typed fields out of the body; a wrong type is a 400 naming its path.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // A missing field is reported at its parent; name the field itself.
        let param = match inner.strip_prefix("missing field `").and_then(|r| r.split_once('`')) {
            Some((field, _)) if path == "." => field.to_string(),
            Some((field, _)) => format!("{path}.{field}"),
            None => path,
        };
        ApiError::invalid(param.clone(), format!("{param}: {inner}"))
    })
}

/// Checks the `model` field against the names this engine answers to.
pub fn check_model(requested: Option<&str>, names: &[&str]) -> Result<(), ApiError> {
    match requested {
        Some(m) if !names.contains(&m) => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// A `/v1/completions` body.
pub fn completion_plan(
    body: &Value,
    model: &LoadedModel,
    limits: &Limits,
) -> Result<Plan, ApiError> {
    parameters(body, Api::Completions)?;
    let f: CompletionFields = fields(body)?;
    let s: SamplingFields = fields(body)?;
    // Only a text prompt was tokenized by the gateway.
    let tokenized = match &f.prompt {
        Some(Value::String(s)) if !s.is_empty() => gateway_tokens(body, model, None, limits),
        _ => None,
    };
    let (prompt, text) = completion_prompt(f.prompt.as_ref(), tokenized, model, limits)?;
    let logprobs = match f.logprobs {
        None => None,
        Some(k) => Some(in_range("logprobs", k, 0, limits.max_logprobs)?),
    };
    let echo = f.echo.unwrap_or(false);
    let prompt_chars = text.chars().count();
    let mut plan = sampling_plan(s, prompt, None, Some(DEFAULT_COMPLETION_MAX_TOKENS), limits)?;
    plan.logprobs = logprobs;
    plan.prompt_chars = prompt_chars;
    if echo {
        plan.prompt_logprobs = logprobs;
        plan.echo = Some(text);
    }
    Ok(plan)
}

/// Which API a body is for: each has its own parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// Parameters both APIs take (Sluice's extensions included: `top_k`, `min_p`, `ignore_eos`,
/// `stop_token_ids`) and the gateway's own fields.
const COMMON_PARAMS: [&str; 21] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "service_tier",
    "store",
    "metadata",
    PROMPT_FIELD,
];

/// Chat's parameters beyond [`COMMON_PARAMS`].
const CHAT_PARAMS: [&str; 17] = [
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
];

/// Completions' parameters beyond [`COMMON_PARAMS`].
const COMPLETION_PARAMS: [&str; 5] = ["prompt", "echo", "logprobs", "suffix", "best_of"];

/// Every parameter is implemented or refused by name, never accepted and ignored (an answer
/// that ignores what was asked is a wrong answer, not a degraded one): a parameter neither
/// API has is a 400 naming it, and so is a value of one that asks for what this server does
/// not do. The values that ask for nothing pass (`store: false`, `modalities: ["text"]`,
/// `function_call: "none"`, `service_tier: "auto"`, a `best_of` equal to `n`, ...).
pub fn parameters(body: &Value, api: Api) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else { return Ok(()) };
    let own: &[&str] = match api {
        Api::Chat => &CHAT_PARAMS,
        Api::Completions => &COMPLETION_PARAMS,
    };
    for name in obj.keys() {
        if !COMMON_PARAMS.contains(&name.as_str()) && !own.contains(&name.as_str()) {
            let shown: String = name.chars().take(64).collect();
            return Err(ApiError::invalid(
                &shown,
                format!("unrecognized request argument supplied: {shown}"),
            )
            .with_code("unknown_parameter"));
        }
    }
    let refuse = |name: &str, why: &str| {
        Err(ApiError::invalid(name, format!("{name} is not supported: {why}"))
            .with_code("unsupported_parameter"))
    };
    // A value that asks for something: not null, false, empty, or "none".
    let asks = |name: &str| match obj.get(name) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::String(s)) => !s.is_empty() && s != "none",
        Some(_) => true,
    };
    let deprecated = "it is deprecated; use tools and tool_choice";
    let fixed: [(&str, &str); 7] = [
        ("functions", deprecated),
        ("function_call", deprecated),
        ("store", "Sluice does not store completions (the ledger keeps counts, never text)"),
        ("metadata", "it only annotates stored completions, and Sluice stores none"),
        ("reasoning_effort", "the served models do not reason before answering"),
        ("audio", "the served models answer in text only"),
        ("prediction", "predicted outputs are not implemented"),
    ];
    for (name, why) in fixed {
        if asks(name) {
            return refuse(name, why);
        }
    }
    // Any value of these asks for something (an empty `web_search_options` turns search on).
    let more: [(&str, &str); 4] = [
        ("web_search_options", "Sluice does not search the web"),
        ("verbosity", "the served models have no verbosity setting"),
        ("prompt_cache_key", "prefix caching is per tenant and automatic"),
        ("suffix", "the served models do not fill in the middle"),
    ];
    for (name, why) in more {
        let asked = match obj.get(name) {
            None | Some(Value::Null) => false,
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if asked {
            return refuse(name, why);
        }
    }
    match obj.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "auto" || t == "default" => {}
        Some(_) => {
            return refuse(
                "service_tier",
                "only auto or default; a key's tier sets its service (ask your operator)",
            );
        }
    }
    match obj.get("modalities") {
        None | Some(Value::Null) => {}
        Some(Value::Array(m)) if m.iter().all(|x| x == "text") => {}
        Some(_) => return refuse("modalities", "the served models answer in text only"),
    }
    if obj.get("user").is_some_and(|u| !u.is_null() && !u.is_string()) {
        return Err(ApiError::invalid("user", "user must be a string"));
    }
    if let Some(b) = obj.get("best_of").filter(|b| !b.is_null()) {
        let n = obj.get("n").and_then(Value::as_i64).unwrap_or(1);
        match b.as_i64() {
            Some(b) if b == n => {}
            Some(b) if b < n => {
                return Err(ApiError::invalid("best_of", "best_of must be at least n"));
            }
            Some(_) => {
                return refuse(
                    "best_of",
                    "only a best_of equal to n (choosing among more candidates than are returned is not implemented)",
                );
            }
            None => return Err(ApiError::invalid("best_of", "best_of must be an integer")),
        }
    }
    Ok(())
}

/// `logit_bias`: token ids (as strings, OpenAI's form) to biases from -100 to 100, at most
/// 300 of them, each id inside the vocabulary.
fn logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let param = "logit_bias";
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(param, "logit_bias must map token ids to numbers"));
        }
    };
    if map.len() > 300 {
        return Err(ApiError::invalid(param, "logit_bias may bias at most 300 tokens"));
    }
    let mut out = Vec::with_capacity(map.len());
    for (id, bias) in map {
        let at = format!("{param}.{}", id.chars().take(32).collect::<String>());
        let token = id.parse::<u32>().ok().filter(|&t| (t as usize) < vocab).ok_or_else(|| {
            ApiError::invalid(&at, format!("{at}: keys must be token ids below {vocab}"))
        })?;
        let bias = bias.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(&at, format!("{at} must be a number from -100 to 100"))
        })?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// The tools a chat request offers, or a 400 naming the parameter at fault.
pub fn tools(body: &Value) -> Result<Option<Tools>, ApiError> {
    Tools::from_body(body).map_err(|e| ApiError::invalid(e.param, e.message))
}

/// The grammar an answer with tools follows: the generic format's, or under a template's own
/// format a forced call's (`tool_choice` `required` or a function), as JSON; a template's own
/// answer to `auto` is free. A function schema this server cannot enforce is a 400 naming it.
pub fn tool_grammar(tools: &Tools, generic: bool) -> Result<Option<Arc<Grammar>>, ApiError> {
    if !generic && tools.choice == ToolChoice::Auto {
        return Ok(None);
    }
    for (i, f) in tools.functions.iter().enumerate() {
        Grammar::from_schema(&f.parameters).map_err(|e| {
            let param = format!("tools[{i}].function.parameters");
            ApiError::invalid("tools", format!("{param} at {e}")).with_code("unsupported_parameter")
        })?;
    }
    let grammar = Grammar::from_schema(&tools.output_schema()).map_err(|e| {
        ApiError::invalid("tools", format!("tools: the schema of the calls at {e}"))
            .with_code("unsupported_parameter")
    })?;
    Ok(Some(Arc::new(grammar)))
}

/// The grammar `response_format` asks for: none for `{"type": "text"}` or no field, any
/// JSON object for `json_object`, the schema's for `json_schema` (a schema this server
/// cannot enforce is a 400 naming the part and keyword at fault).
pub fn response_format(body: &Value) -> Result<Option<Arc<Grammar>>, ApiError> {
    let param = "response_format";
    let rf = match body.get(param) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(ApiError::invalid(param, "response_format must be an object")),
    };
    let grammar = match rf.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Grammar::any_object(),
        Some("json_schema") => {
            let param = "response_format.json_schema.schema";
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| ApiError::invalid(param, format!("{param} is required")))?;
            Grammar::from_schema(schema).map_err(|e| {
                ApiError::invalid(param, format!("{param} at {e}"))
                    .with_code("unsupported_parameter")
            })?
        }
        _ => {
            return Err(ApiError::invalid(
                "response_format.type",
                "response_format.type must be text, json_object or json_schema",
            ));
        }
    };
    Ok(Some(Arc::new(grammar)))
}

/// A `/v1/chat/completions` body.
pub fn chat_plan(body: &Value, model: &LoadedModel, limits: &Limits) -> Result<Plan, ApiError> {
    parameters(body, Api::Chat)?;
    let f: ChatFields = fields(body)?;
    let s: SamplingFields = fields(body)?;
    let messages =
        f.messages.ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("messages[{i}].role must be one of {}", ROLES.join(", ")),
            ));
        }
    }
    let template = model.template.as_ref().ok_or_else(|| {
        ApiError::invalid("messages", "this model has no chat template; use /v1/completions")
    })?;
    let tools = tools(body)?;
    let generic = !template.supports_tools();
    let tool_grammar = match &tools {
        Some(t) => tool_grammar(t, generic)?,
        None => None,
    };
    // Content is text: only the template's own structure yields special tokens.
    let version = model.identity.chat_template_version.as_deref();
    let prompt = match gateway_tokens(body, model, version, limits) {
        Some(ids) => ids,
        None => {
            tracing::trace!(messages = messages.len(), "tokenizing the prompt in the engine");
            encode_chat_tools(template, &model.tokenizer, &messages, tools.as_ref(), true)
                .map_err(|e| ApiError::from_engine(&e.into(), Some("messages")))?
                .0
        }
    };
    check_prompt_len(prompt.len(), "messages", limits)?;
    let top = match (f.logprobs, f.top_logprobs) {
        (Some(true), k) => Some(match k {
            Some(k) => in_range("top_logprobs", k, 0, limits.max_logprobs)?,
            None => 0,
        }),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ));
        }
        (_, None) => None,
    };
    let max = match f.max_completion_tokens {
        Some(m) => Some(("max_completion_tokens", m)),
        None => s.max_tokens.map(|m| ("max_tokens", m)),
    };
    let mut plan = sampling_plan(s, prompt, max, None, limits)?;
    plan.logprobs = top;
    plan.grammar = response_format(body)?;
    if tools.is_some() {
        if plan.grammar.is_some() {
            return Err(ApiError::invalid(
                "response_format",
                "response_format cannot be combined with tools yet; send one or the other",
            )
            .with_code("unsupported_parameter"));
        }
        plan.grammar = tool_grammar;
        plan.tools = Some(generic);
    }
    if let Some(g) = &plan.grammar {
        let param = max.map_or("max_tokens", |(param, _)| param);
        check_budget(g, plan.params.max_tokens, param, model.spelling())?;
    }
    Ok(plan)
}

/// A format whose shortest value does not fit the output budget is a 400 naming the budget:
/// its answer could only stop mid-value, a 200 whose content does not parse.
fn check_budget(
    grammar: &Grammar,
    max_tokens: usize,
    param: &str,
    spelling: &Spelling,
) -> Result<(), ApiError> {
    let shortest = grammar.shortest_value().unwrap_or_default();
    if spelling.fewer_than(shortest, max_tokens.saturating_add(1)) {
        return Ok(());
    }
    let need = match spelling.tokens(shortest) {
        usize::MAX => format!("{} bytes that this vocabulary cannot spell", shortest.len()),
        t => format!("{t} tokens"),
    };
    Err(ApiError::invalid(
        param,
        format!(
            "{param} is {max_tokens}, but the shortest answer in the requested format takes {need}"
        ),
    ))
}

/// The prompt's token ids as the gateway sent them ([`PROMPT_FIELD`]), when they were made
/// with this model's tokenizer (and, for a chat, `template`): the engine then does not
/// tokenize the same prompt again. `None` means tokenize here: the gateway sent none, counted
/// with another tokenizer or template, or sent something unreadable or outside the vocabulary
/// (the gateway's fault, never the client's, so not a 400). The server removes the field from
/// bodies that did not come with the internal token.
fn gateway_tokens(
    body: &Value,
    model: &LoadedModel,
    template: Option<&str>,
    limits: &Limits,
) -> Option<Vec<u32>> {
    let sent = PromptTokens::deserialize(body.get(PROMPT_FIELD)?);
    let sent = match sent {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("ignoring an unreadable {PROMPT_FIELD}: {e}");
            return None;
        }
    };
    let same = sent.tokenizer_revision == model.identity.tokenizer_revision
        && sent.chat_template_version.as_deref() == template;
    let known = sent.ids.iter().all(|id| (*id as usize) < limits.vocab_size);
    if same && !known {
        tracing::warn!("ignoring {PROMPT_FIELD}: a token id outside the vocabulary");
    }
    (same && known && !sent.ids.is_empty()).then_some(sent.ids)
}

/// The completion prompt's token ids and text; a string prompt uses the gateway's ids when
/// it sent them (`tokenized`).
fn completion_prompt(
    prompt: Option<&Value>,
    tokenized: Option<Vec<u32>>,
    model: &LoadedModel,
    limits: &Limits,
) -> Result<(Vec<u32>, String), ApiError> {
    if let (Some(Value::String(s)), Some(ids)) = (prompt, tokenized) {
        check_prompt_len(ids.len(), "prompt", limits)?;
        return Ok((ids, s.clone()));
    }
    let shape = "prompt must be a string or an array of token ids";
    let one = |p: &Value, param: &str| -> Result<(Vec<u32>, String), ApiError> {
        match p {
            Value::String(s) if s.is_empty() => {
                Err(ApiError::invalid(param, "prompt must not be empty"))
            }
            Value::String(s) => {
                tracing::trace!(chars = s.chars().count(), "tokenizing the prompt in the engine");
                let ids =
                    model.encode_prompt(s).map_err(|e| ApiError::from_engine(&e, Some(param)))?;
                Ok((ids, s.clone()))
            }
            Value::Array(items) if items.is_empty() => {
                Err(ApiError::invalid(param, "prompt must not be empty"))
            }
            Value::Array(items) => {
                let ids = token_ids(items, param, limits.vocab_size)?;
                let text = model
                    .tokenizer
                    .decode(&ids, false)
                    .map_err(|e| ApiError::from_engine(&e.into(), Some(param)))?;
                Ok((ids, text))
            }
            _ => Err(ApiError::invalid(param, shape)),
        }
    };
    let (ids, text) = match prompt {
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::Array(items)) if items.iter().all(|v| v.is_string() || v.is_array()) => {
            match items.as_slice() {
                [] => return Err(ApiError::invalid("prompt", "prompt must not be empty")),
                [single] => one(single, "prompt[0]")?,
                _ => {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "only one prompt per request is supported (got {}); send one request per prompt",
                            items.len()
                        ),
                    ));
                }
            }
        }
        Some(p) => one(p, "prompt")?,
    };
    check_prompt_len(ids.len(), "prompt", limits)?;
    Ok((ids, text))
}

fn token_ids(items: &[Value], param: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            Some(id) => Err(ApiError::invalid(
                format!("{param}[{i}]"),
                format!("token id {id} is outside the vocabulary of {vocab} tokens"),
            )),
            None => Err(ApiError::invalid(
                format!("{param}[{i}]"),
                "token ids must be non-negative integers",
            )),
        })
        .collect()
}

fn check_prompt_len(len: usize, param: &str, limits: &Limits) -> Result<(), ApiError> {
    if len == 0 {
        return Err(ApiError::invalid(param, "the prompt has no tokens"));
    }
    let room = limits.context_length.min(limits.capacity_tokens);
    if len >= room {
        let what = if limits.context_length <= limits.capacity_tokens {
            format!("the model's context length of {}", limits.context_length)
        } else {
            format!("this engine's KV cache, which holds {} tokens", limits.capacity_tokens)
        };
        return Err(ApiError::invalid(
            param,
            format!("the prompt has {len} tokens, which leaves no room to generate within {what}"),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

fn in_range(param: &str, v: i64, lo: usize, hi: usize) -> Result<usize, ApiError> {
    match usize::try_from(v) {
        Ok(u) if (lo..=hi).contains(&u) => Ok(u),
        _ => Err(ApiError::invalid(param, format!("{param} must be between {lo} and {hi}"))),
    }
}

fn in_f32(
    param: &str,
    v: Option<f64>,
    default: f32,
    ok: impl Fn(f64) -> bool,
    rule: &str,
) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && ok(x) => Ok(x as f32),
        Some(_) => Err(ApiError::invalid(param, format!("{param} must be {rule}"))),
    }
}

/// Checks the shared fields. `max` is the explicit output limit and the name it came under
/// (`max_tokens` when `None`); without one, `default_max` cut to what the context leaves, or
/// all it leaves.
fn sampling_plan(
    s: SamplingFields,
    prompt: Vec<u32>,
    max: Option<(&'static str, i64)>,
    default_max: Option<usize>,
    limits: &Limits,
) -> Result<Plan, ApiError> {
    let max = max.or(s.max_tokens.map(|m| ("max_tokens", m)));
    let room = limits.context_length.min(limits.capacity_tokens).saturating_sub(prompt.len());
    let max_tokens = match max {
        None => default_max.map_or(room, |d| d.min(room)),
        Some((param, m)) => {
            let m = usize::try_from(m)
                .ok()
                .filter(|&m| m >= 1)
                .ok_or_else(|| ApiError::invalid(param, format!("{param} must be at least 1")))?;
            let need = prompt.len() + m;
            if need > limits.context_length {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "the prompt ({} tokens) plus {param} ({m}) is {need} tokens, more than the context length of {}; at most {} can be generated",
                        prompt.len(),
                        limits.context_length,
                        limits.context_length.saturating_sub(prompt.len())
                    ),
                )
                .with_code("context_length_exceeded"));
            }
            if need > limits.capacity_tokens {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "the prompt ({} tokens) plus {param} ({m}) is {need} tokens, more than this engine's KV cache holds ({}); at most {room} can be generated",
                        prompt.len(),
                        limits.capacity_tokens
                    ),
                ));
            }
            m
        }
    };
    // OpenAI's range.
    let temperature = in_f32(
        "temperature",
        s.temperature,
        limits.sampling.temperature,
        |x| (0.0..=2.0).contains(&x),
        "a number from 0 to 2",
    )?;
    let d = &limits.sampling;
    let top_p = in_f32("top_p", s.top_p, d.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
    let min_p = in_f32("min_p", s.min_p, d.min_p, |x| (0.0..=1.0).contains(&x), "in [0, 1]")?;
    let penalty = |x: f64| (-2.0..=2.0).contains(&x);
    let presence_penalty =
        in_f32("presence_penalty", s.presence_penalty, 0.0, penalty, "in [-2, 2]")?;
    let frequency_penalty =
        in_f32("frequency_penalty", s.frequency_penalty, 0.0, penalty, "in [-2, 2]")?;
    let top_k = match s.top_k {
        None => d.top_k,
        Some(-1) => 0,
        Some(k) => usize::try_from(k).map_err(|_| {
            ApiError::invalid("top_k", "top_k must be >= 0 (0 or -1: no top-k cut)")
        })?,
    };
    let n = match s.n {
        None => 1,
        Some(n) => in_range("n", n, 1, limits.max_n)?,
    };
    let stop = stop_strings(s.stop.as_ref())?;
    let logit_bias = logit_bias(s.logit_bias.as_ref(), limits.vocab_size)?.into_iter().collect();
    let stop_token_ids = match &s.stop_token_ids {
        None => Vec::new(),
        Some(ids) => {
            let vals: Vec<Value> = ids.iter().map(|&i| Value::from(i)).collect();
            token_ids(&vals, "stop_token_ids", limits.vocab_size)?
        }
    };
    // Without a seed each request draws one, so sampled outputs differ between requests;
    // the seed used is reported back, so any output can be reproduced.
    let seed = match s.seed {
        Some(seed) => seed as u64,
        None => uuid::Uuid::new_v4().as_u64_pair().0,
    };
    let stream = s.stream.unwrap_or(false);
    if !stream && s.stream_options.is_some() {
        // As OpenAI and vLLM answer it: options of a stream that is not asked for are a
        // mistake, not something to ignore.
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let include_usage = s.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    Ok(Plan {
        prompt,
        echo: None,
        prompt_chars: 0,
        logprobs: None,
        prompt_logprobs: None,
        stop_token_ids,
        include_usage,
        params: GenerationParams {
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            seed,
            stop,
            stream,
            n,
            ignore_eos: s.ignore_eos.unwrap_or(false),
            logit_bias,
        },
        grammar: None,
        tools: None,
    })
}

fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let shape = || ApiError::invalid("stop", "stop must be a string or an array of strings");
    let list = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(shape))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(shape()),
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop strings are allowed (got {})", list.len()),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> Limits {
        Limits {
            context_length: 100,
            capacity_tokens: 80,
            vocab_size: 1000,
            max_n: 8,
            max_logprobs: 20,
            sampling: SamplingDefaults::default(),
        }
    }

    fn plan(body: Value, prompt_len: usize) -> Result<Plan, ApiError> {
        let s: SamplingFields = fields(&body)?;
        sampling_plan(s, vec![1; prompt_len], None, Some(DEFAULT_COMPLETION_MAX_TOKENS), &limits())
    }

    fn param_of(r: Result<Plan, ApiError>) -> Option<String> {
        r.err().and_then(|e| e.param)
    }

    #[test]
    fn every_parameter_is_implemented_or_refused_by_name() {
        let tool = json!([{"type": "function", "function": {"name": "f"}}]);
        let chat = |extra: Value| {
            let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().into_iter().flatten() {
                b[k] = v.clone();
            }
            parameters(&b, Api::Chat).err().and_then(|e| e.param)
        };
        for (extra, param) in [
            (json!({"functions": [{"name": "f"}]}), Some("functions")),
            (json!({"function_call": {"name": "f"}}), Some("function_call")),
            (json!({"functions": [], "function_call": "none"}), None),
            (json!({"tools": tool, "tool_choice": "auto", "parallel_tool_calls": true}), None),
            // Implemented by the tool grammar (one call at most).
            (json!({"tools": tool, "parallel_tool_calls": false}), None),
            (json!({"some_extra": {"x": 1}}), Some("some_extra")),
            (json!({"store": true}), Some("store")),
            (json!({"store": false, "metadata": {}}), None),
            (json!({"metadata": {"a": "b"}}), Some("metadata")),
            (json!({"service_tier": "auto"}), None),
            (json!({"service_tier": "flex"}), Some("service_tier")),
            (json!({"reasoning_effort": "low"}), Some("reasoning_effort")),
            (json!({"modalities": ["text"]}), None),
            (json!({"modalities": ["text", "audio"]}), Some("modalities")),
            (json!({"audio": {"voice": "alloy"}}), Some("audio")),
            (json!({"web_search_options": {}}), Some("web_search_options")),
            (json!({"prompt_cache_key": "k"}), Some("prompt_cache_key")),
            (json!({"user": "u-1", "logit_bias": {"5": 1}}), None),
            (json!({"user": 5}), Some("user")),
            (json!({"suffix": "x"}), Some("suffix")),
        ] {
            assert_eq!(chat(extra.clone()).as_deref(), param, "{extra}");
        }
        let completion = |b: Value| parameters(&b, Api::Completions).err().and_then(|e| e.param);
        for (body, param) in [
            (json!({"prompt": "x", "suffix": "y"}), Some("suffix")),
            (json!({"prompt": "x", "suffix": ""}), None),
            (json!({"prompt": "x", "best_of": 1}), None),
            (json!({"prompt": "x", "best_of": 3, "n": 3}), None),
            (json!({"prompt": "x", "best_of": 4, "n": 3}), Some("best_of")),
            (json!({"prompt": "x", "best_of": 2, "n": 3}), Some("best_of")),
            (json!({"prompt": "x", "messages": []}), Some("messages")),
        ] {
            assert_eq!(completion(body.clone()).as_deref(), param, "{body}");
        }
    }

    #[test]
    fn logit_bias_is_read_and_bounded() {
        let read = |v: Value| logit_bias(Some(&v), 100).map_err(|e| e.param.unwrap_or_default());
        assert_eq!(read(json!({"7": -100, "3": 2.5})), Ok(vec![(3, 2.5), (7, -100.0)]));
        assert_eq!(read(json!({"100": 1})), Err("logit_bias.100".to_string()));
        assert_eq!(read(json!({"x": 1})), Err("logit_bias.x".to_string()));
        assert_eq!(read(json!({"1": 101})), Err("logit_bias.1".to_string()));
        assert_eq!(read(json!([1])), Err("logit_bias".to_string()));
        let many: serde_json::Map<String, Value> =
            (0..301).map(|i| (i.to_string(), json!(1))).collect();
        assert!(logit_bias(Some(&Value::Object(many)), 1000).is_err());
    }

    #[test]
    fn tools_become_a_grammar_or_a_400_naming_the_fault() -> Result<(), ApiError> {
        let offer = |params: Value| json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]});
        let none = || ApiError::internal("no tools");
        let ok = offer(json!({"type": "object", "properties": {"a": {"type": "string"}}}));
        let ok = tools(&ok)?.ok_or_else(none)?;
        assert!(tool_grammar(&ok, true)?.is_some());
        // A template's own format answers `auto` freely; a forced call is still JSON.
        assert!(tool_grammar(&ok, false)?.is_none());
        let forced = Tools { choice: ToolChoice::Required, ..ok };
        assert!(tool_grammar(&forced, false)?.is_some());
        let pattern =
            json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}});
        let bad = tools(&offer(pattern))?.ok_or_else(none)?;
        let e = tool_grammar(&bad, true).err();
        assert_eq!(e.as_ref().and_then(|e| e.param.as_deref()), Some("tools"));
        let message = e.map(|e| e.message).unwrap_or_default();
        assert!(
            message.starts_with("tools[0].function.parameters at /properties/a")
                && message.contains("pattern"),
            "{message}"
        );
        let e = tools(&json!({"tool_choice": "required"})).err();
        assert_eq!(e.and_then(|e| e.param).as_deref(), Some("tool_choice"));
        Ok(())
    }

    #[test]
    fn response_format_is_a_grammar_or_a_400_naming_the_fault() {
        let rf = |v: Value| response_format(&json!({ "response_format": v }));
        assert!(matches!(rf(json!({"type": "text"})), Ok(None)));
        assert!(matches!(response_format(&json!({})), Ok(None)));
        assert!(matches!(rf(json!({"type": "json_object"})), Ok(Some(_))));
        let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let ok = rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}));
        assert!(matches!(ok, Ok(Some(_))));
        let pattern =
            json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a"}}});
        let err =
            rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": pattern}}));
        let err = err.err().map(|e| (e.param, e.message));
        assert_eq!(
            err,
            Some((
                Some("response_format.json_schema.schema".to_string()),
                "response_format.json_schema.schema at /properties/a: the keyword `pattern` is \
                 not supported"
                    .to_string()
            ))
        );
        for (v, param) in [
            (json!({"type": "xml"}), "response_format.type"),
            (json!({"type": "json_schema"}), "response_format.json_schema.schema"),
            (json!("json"), "response_format"),
        ] {
            assert_eq!(rf(v.clone()).err().and_then(|e| e.param).as_deref(), Some(param), "{v}");
        }
    }

    #[test]
    fn bad_fields_name_their_parameter() {
        let cases = [
            (json!({"temperature": -0.5}), "temperature"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
            (json!({"frequency_penalty": -3}), "frequency_penalty"),
            (json!({"n": 0}), "n"),
            (json!({"n": 9}), "n"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": [""]}), "stop"),
            (json!({"stop": 3}), "stop"),
            (json!({"stop": ["a", 3]}), "stop"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"max_tokens": 91}), "max_tokens"),
            (json!({"max_tokens": 71}), "max_tokens"),
            (json!({"stream": "yes"}), "stream"),
            (json!({"stream_options": {"include_usage": 1}}), "stream_options.include_usage"),
            (json!({"stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"stream": false, "stream_options": {}}), "stream_options"),
            (json!({"stop_token_ids": [5000]}), "stop_token_ids[0]"),
        ];
        for (body, param) in cases {
            assert_eq!(param_of(plan(body.clone(), 10)), Some(param.to_string()), "{body}");
        }
    }

    #[test]
    fn defaults_and_limits() -> Result<(), ApiError> {
        let p = plan(json!({"unknown_field": [1, 2], "user": "u", "cache_salt": "x"}), 10)?;
        assert_eq!(p.params.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS);
        assert_eq!((p.params.temperature, p.params.top_p, p.params.n), (1.0, 1.0, 1));
        assert!(!p.include_usage);
        // The default is cut to what the KV cache leaves (80 - 70).
        assert_eq!(plan(json!({}), 70)?.params.max_tokens, 10);
        assert_eq!(plan(json!({"max_tokens": 70}), 10)?.params.max_tokens, 70);
        let p = plan(
            json!({"seed": 7, "n": 3, "stop": "x", "top_k": -1, "stream": true,
                   "stream_options": {"include_usage": true}}),
            5,
        )?;
        assert_eq!((p.params.seed, p.params.n, p.params.top_k), (7, 3, 0));
        assert_eq!(p.params.stop, vec!["x".to_string()]);
        assert!(p.include_usage);
        // A model's defaults fill what a request leaves out, never what it says.
        let mut l = limits();
        l.sampling = SamplingDefaults::for_model(&Default::default(), "smollm2-135m-instruct");
        let s: SamplingFields = fields(&json!({"top_p": 0.5}))?;
        let p = sampling_plan(s, vec![1; 5], None, None, &l)?;
        assert_eq!((p.params.temperature, p.params.top_p), (0.2, 0.5));
        Ok(())
    }

    #[test]
    fn prompt_length_and_token_ids() {
        let l = limits();
        assert_eq!(
            check_prompt_len(80, "prompt", &l).err().map(|e| e.code),
            Some(Some("context_length_exceeded"))
        );
        assert!(check_prompt_len(79, "prompt", &l).is_ok());
        assert!(check_prompt_len(0, "prompt", &l).is_err());
        let ids = token_ids(&[json!(1), json!(999)], "prompt", 1000);
        assert_eq!(ids.ok(), Some(vec![1, 999]));
        let bad = token_ids(&[json!(1), json!(1000)], "prompt", 1000);
        assert_eq!(bad.err().and_then(|e| e.param), Some("prompt[1]".into()));
        let bad = token_ids(&[json!(-1)], "prompt", 1000);
        assert_eq!(bad.err().and_then(|e| e.param), Some("prompt[0]".into()));
    }

    #[test]
    fn body_shape() {
        assert!(parse_body(b"{").is_err());
        assert!(parse_body(b"[1]").is_err());
        assert!(parse_body(b"{}").is_ok());
        let e: Result<ChatFields, _> = fields(&json!({"messages": [{"role": "user"}]}));
        assert_eq!(e.err().and_then(|e| e.param), Some("messages[0].content".into()));
        let e: Result<ChatFields, _> = fields(&json!({"messages": "hi"}));
        assert_eq!(e.err().and_then(|e| e.param), Some("messages".into()));
        assert!(check_model(Some("other"), &["m"]).is_err());
        assert!(check_model(Some("m"), &["m"]).is_ok());
        assert!(check_model(None, &["m"]).is_ok());
    }
}
