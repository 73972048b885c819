//! Engine events of one HTTP request (one engine request per choice) into an OpenAI body or
//! an SSE stream.
//!
//! The SSE body stream owns the engine's [`RequestStream`]s: when the client goes away, hyper
//! drops the body, the streams are dropped and the engine aborts the work.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{BoxStream, StreamExt, select_all, unfold};
use sluice_wire::{ChoiceFinish, ErrorBody};

use crate::identity::ExecutionIdentity;
use crate::loader::LoadedModel;
use crate::serve::handle::RequestStream;
use crate::serve::{EngineEvent, EngineTimings, FinishReason, PromptLogprob, TokenOutput, Usage};
use crate::server::error::ApiError;
use crate::server::openai::{
    AssistantMessage, ChatBody, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs,
    ChatTokenLogprob, ChatTopLogprob, ChoiceDetail, CompletionBody, CompletionChoice,
    CompletionLogprobs, RankedMap, SluiceExt, ToolCallBody, usage_body,
};
use crate::server::validate::{Plan, choice_id};
use sluice_text::tools::{OutputParser, ToolCall};

/// Which API shape to answer in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// Everything needed to shape the answer to one HTTP request.
#[derive(Debug)]
pub struct Shaper {
    /// Which API.
    pub endpoint: Endpoint,
    /// Served model name.
    pub model_name: String,
    /// The request id (choice ids derive from it).
    pub request_id: String,
    /// Tenant, for the log line.
    pub tenant: Option<String>,
    /// W3C trace id.
    pub trace_id: Option<String>,
    /// Unix seconds at arrival.
    pub created: u64,
    /// What computes the response.
    pub identity: ExecutionIdentity,
    /// For token texts in logprobs.
    pub model: Arc<LoadedModel>,
    /// The checked request.
    pub plan: Plan,
}

/// Events of all choices, tagged with the choice index.
pub type Events = BoxStream<'static, (usize, EngineEvent)>;

/// Merges the choices' engine streams.
pub fn merge(streams: Vec<RequestStream>) -> Events {
    select_all(streams.into_iter().enumerate().map(|(i, rs)| {
        unfold(rs, move |mut rs| async move {
            let ev = rs.next().await?;
            Some(((i, ev), rs))
        })
        .boxed()
    }))
    .boxed()
}

#[derive(Clone, Debug)]
struct Finish {
    reason: FinishReason,
    usage: Usage,
    timings: EngineTimings,
    error: Option<String>,
}

impl Shaper {
    fn id(&self) -> String {
        match self.endpoint {
            Endpoint::Completions => format!("cmpl-{}", self.request_id),
            Endpoint::Chat => format!("chatcmpl-{}", self.request_id),
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.model.tokenizer.token_text(id).unwrap_or_default()
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.model.tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default()
    }

    /// Legacy completions logprobs; `offset` is the running character offset.
    fn completion_logprobs(
        &self,
        prompt: &[PromptLogprob],
        tokens: &[TokenOutput],
        offset: &mut usize,
    ) -> CompletionLogprobs {
        let mut lp = CompletionLogprobs::default();
        let ranked = |top: &[(u32, f32)]| {
            RankedMap(top.iter().map(|&(t, l)| (self.token_text(t), l)).collect())
        };
        let rows = prompt
            .iter()
            .map(|p| (p.token, p.logprob, p.logprob.map(|_| ranked(&p.top))))
            .chain(tokens.iter().map(|t| (t.token, Some(t.logprob), Some(ranked(&t.top)))));
        for (token, logprob, top) in rows {
            let text = self.token_text(token);
            lp.text_offset.push(*offset);
            *offset += text.chars().count();
            lp.tokens.push(text);
            lp.token_logprobs.push(logprob);
            lp.top_logprobs.push(top);
        }
        lp
    }

    fn chat_logprobs(&self, tokens: &[TokenOutput]) -> ChatLogprobs {
        let content = tokens
            .iter()
            .map(|t| ChatTokenLogprob {
                token: self.token_text(t.token),
                logprob: t.logprob,
                bytes: self.token_bytes(t.token),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|&(id, logprob)| ChatTopLogprob {
                        token: self.token_text(id),
                        logprob,
                        bytes: self.token_bytes(id),
                    })
                    .collect(),
            })
            .collect();
        ChatLogprobs { content }
    }

    /// The extension of a body or a choice's final chunk.
    fn full_ext(&self, request_id: String, timings: Option<EngineTimings>) -> SluiceExt {
        SluiceExt {
            request_id: Some(request_id),
            trace_id: self.trace_id.clone(),
            execution_identity: Some(self.identity.clone()),
            parameters: Some(self.plan.params.clone()),
            timings,
            ..SluiceExt::default()
        }
    }

    fn start_offset(&self) -> usize {
        if self.plan.echo.is_some() { 0 } else { self.plan.prompt_chars }
    }

    fn log(&self, outcome: &str, usage: Usage, timings: Option<EngineTimings>) {
        if !super::REQUEST_LOG.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        // Lengths and counts only: prompt text is never logged.
        eprintln!(
            "request {} {} tenant={} trace={} n={} prompt_tokens={} cached_tokens={} completion_tokens={} outcome={} e2e={:.3}s",
            self.request_id,
            self.endpoint.name(),
            self.tenant.as_deref().unwrap_or("-"),
            self.trace_id.as_deref().unwrap_or("-"),
            self.plan.params.n,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            outcome,
            timings.map_or(0.0, |t| t.e2e),
        );
    }
}

/// OpenAI's finish reason: an answer that ended with calls ends with `tool_calls`.
fn finish_reason(reason: FinishReason, calls: bool) -> &'static str {
    ChoiceFinish::of(reason, calls).as_str()
}

/// Usage of a whole request: the prompt once, completions summed, cached tokens of the
/// choice that reused least.
fn total_usage<'a>(usages: impl Iterator<Item = &'a Usage>) -> Usage {
    let mut total: Option<Usage> = None;
    for u in usages {
        total = Some(match total {
            None => *u,
            Some(t) => Usage {
                prompt_tokens: t.prompt_tokens,
                cached_tokens: t.cached_tokens.min(u.cached_tokens),
                completion_tokens: t.completion_tokens + u.completion_tokens,
            },
        });
    }
    total.unwrap_or_default()
}

/// Logs a non-streamed request whose client went away while it ran.
struct DisconnectLog<'a> {
    shaper: &'a Shaper,
    armed: bool,
}

impl DisconnectLog<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for DisconnectLog<'_> {
    fn drop(&mut self) {
        if self.armed {
            let usage = Usage { prompt_tokens: self.shaper.plan.prompt.len(), ..Usage::default() };
            self.shaper.log("client_disconnected", usage, None);
        }
    }
}

#[derive(Default)]
struct Collected {
    text: String,
    tokens: Vec<TokenOutput>,
    prompt_logprobs: Vec<PromptLogprob>,
    finish: Option<Finish>,
}

/// Waits for every choice and answers with one body. If the client goes away first, this
/// future is dropped with the streams in it, which aborts the engine requests.
pub async fn collect(shaper: Shaper, mut events: Events) -> Result<Response, ApiError> {
    let n = shaper.plan.params.n;
    let mut out: Vec<Collected> = (0..n).map(|_| Collected::default()).collect();
    let waiting = DisconnectLog { shaper: &shaper, armed: true };
    while let Some((i, ev)) = events.next().await {
        let Some(c) = out.get_mut(i) else { continue };
        match ev {
            EngineEvent::PromptLogprobs(p) => c.prompt_logprobs = p,
            EngineEvent::Tokens { tokens, text } => {
                c.tokens.extend(tokens);
                c.text.push_str(&text);
            }
            EngineEvent::Finished { reason, text, usage, timings, error } => {
                c.text.push_str(&text);
                c.finish = Some(Finish { reason, usage, timings, error });
            }
        }
    }
    waiting.disarm();
    let mut finishes = Vec::with_capacity(n);
    for c in &out {
        match &c.finish {
            None => {
                shaper.log("engine_stopped", Usage::default(), None);
                return Err(ApiError::internal("the engine stopped before the request finished"));
            }
            Some(f) if f.reason == FinishReason::Error => {
                shaper.log("error", f.usage, Some(f.timings));
                return Err(ApiError::internal(format!(
                    "the engine failed: {}",
                    f.error.as_deref().unwrap_or("unknown error")
                )));
            }
            Some(f) => finishes.push(f.clone()),
        }
    }
    let usage = total_usage(finishes.iter().map(|f| &f.usage));
    let first = finishes.first().map(|f| f.timings);
    let mut ext = shaper.full_ext(shaper.request_id.clone(), first);
    if n > 1 {
        ext.choices = Some(
            finishes
                .iter()
                .enumerate()
                .map(|(i, f)| ChoiceDetail {
                    index: i,
                    request_id: choice_id(&shaper.request_id, i, n),
                    usage: usage_body(f.usage),
                    timings: f.timings,
                })
                .collect(),
        );
    }
    let reason = |i: usize| finishes.get(i).map(|f| f.reason.as_str());
    shaper.log(reason(0).unwrap_or("-"), usage, first);
    let reason_with =
        |i: usize, calls: bool| finishes.get(i).map(|f| finish_reason(f.reason, calls));
    let response = match shaper.endpoint {
        Endpoint::Completions => {
            let choices = out
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let logprobs = shaper.plan.logprobs.map(|_| {
                        let mut offset = shaper.start_offset();
                        shaper.completion_logprobs(&c.prompt_logprobs, &c.tokens, &mut offset)
                    });
                    let text = match &shaper.plan.echo {
                        Some(prompt) => format!("{prompt}{}", c.text),
                        None => c.text,
                    };
                    CompletionChoice { index: i, text, logprobs, finish_reason: reason(i) }
                })
                .collect();
            Json(CompletionBody {
                id: shaper.id(),
                object: "text_completion",
                created: shaper.created,
                model: shaper.model_name.clone(),
                choices,
                usage: Some(usage_body(usage)),
                sluice: ext,
            })
            .into_response()
        }
        Endpoint::Chat => {
            let choices = out
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let logprobs = shaper.plan.logprobs.map(|_| shaper.chat_logprobs(&c.tokens));
                    let (content, calls) = match shaper.plan.tools {
                        Some(generic) => {
                            let mut parser = OutputParser::new(generic);
                            let head = parser.push(&c.text);
                            let (rest, calls) = parser.finish();
                            (head + &rest, calls)
                        }
                        None => (c.text, Vec::new()),
                    };
                    let finish_reason = reason_with(i, !calls.is_empty());
                    let message = AssistantMessage {
                        role: "assistant",
                        content: (calls.is_empty() || !content.is_empty()).then_some(content),
                        tool_calls: (!calls.is_empty()).then(|| {
                            calls.into_iter().map(|c| ToolCallBody::new(c, None)).collect()
                        }),
                    };
                    ChatChoice { index: i, logprobs, message, finish_reason }
                })
                .collect();
            Json(ChatBody {
                id: shaper.id(),
                object: "chat.completion",
                created: shaper.created,
                model: shaper.model_name.clone(),
                choices,
                usage: usage_body(usage),
                sluice: ext,
            })
            .into_response()
        }
    };
    Ok(response)
}

#[derive(Default)]
struct ChoiceStream {
    started: bool,
    /// Tokens whose text is still held back; they ride on the next chunk with text.
    pending: Vec<TokenOutput>,
    offset: usize,
    /// Tokens received so far.
    generated: usize,
    finish: Option<Finish>,
    /// Reads the answer of a request with tools.
    tools: Option<OutputParser>,
}

struct StreamState {
    shaper: Shaper,
    events: Events,
    choices: Vec<ChoiceStream>,
    queue: VecDeque<Event>,
    closed: bool,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if !self.closed {
            // The client went away: the streams in `events` drop now and abort the work.
            let usage = Usage {
                prompt_tokens: self.shaper.plan.prompt.len(),
                cached_tokens: 0,
                completion_tokens: self.choices.iter().map(|c| c.generated).sum(),
            };
            self.shaper.log("client_disconnected", usage, None);
        }
    }
}

/// One stream chunk, before it becomes JSON.
struct Piece {
    index: usize,
    text: String,
    tokens: Vec<TokenOutput>,
    prompt: Vec<PromptLogprob>,
    role: bool,
    finish: Option<Finish>,
    calls: Vec<ToolCall>,
}

impl StreamState {
    fn event<T: serde::Serialize>(chunk: &T) -> Event {
        match serde_json::to_string(chunk) {
            Ok(s) => Event::default().data(s),
            Err(e) => {
                let body = ErrorBody::new(
                    &format!("serializing a chunk: {e}"),
                    "server_error",
                    None,
                    None,
                );
                Event::default().data(serde_json::to_string(&body).unwrap_or_default())
            }
        }
    }

    fn push(&mut self, p: Piece) {
        let sh = &self.shaper;
        let n = sh.plan.params.n;
        let mut ext = match &p.finish {
            Some(f) => {
                let mut ext = sh.full_ext(choice_id(&sh.request_id, p.index, n), Some(f.timings));
                ext.error = f.error.clone();
                ext
            }
            None => SluiceExt::default(),
        };
        ext.tokens = Some(p.tokens.len());
        let reason = p.finish.as_ref().map(|f| finish_reason(f.reason, !p.calls.is_empty()));
        let event = match sh.endpoint {
            Endpoint::Completions => {
                let logprobs = match (sh.plan.logprobs, self.choices.get_mut(p.index)) {
                    (Some(_), Some(c)) => {
                        Some(sh.completion_logprobs(&p.prompt, &p.tokens, &mut c.offset))
                    }
                    _ => None,
                };
                Self::event(&CompletionBody {
                    id: sh.id(),
                    object: "text_completion",
                    created: sh.created,
                    model: sh.model_name.clone(),
                    choices: vec![CompletionChoice {
                        index: p.index,
                        text: p.text,
                        logprobs,
                        finish_reason: reason,
                    }],
                    usage: None,
                    sluice: ext,
                })
            }
            Endpoint::Chat => {
                let logprobs = match sh.plan.logprobs {
                    Some(_) if !p.tokens.is_empty() => Some(sh.chat_logprobs(&p.tokens)),
                    _ => None,
                };
                let calls: Vec<ToolCallBody> = p
                    .calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| ToolCallBody::new(c, Some(i)))
                    .collect();
                let delta = ChatDelta {
                    role: p.role.then_some("assistant"),
                    content: (p.role || !p.text.is_empty()).then_some(p.text),
                    tool_calls: (!calls.is_empty()).then_some(calls),
                };
                Self::event(&ChatChunk {
                    id: sh.id(),
                    object: "chat.completion.chunk",
                    created: sh.created,
                    model: sh.model_name.clone(),
                    choices: vec![ChatChunkChoice {
                        index: p.index,
                        delta,
                        logprobs,
                        finish_reason: reason,
                    }],
                    usage: None,
                    sluice: ext,
                })
            }
        };
        self.queue.push_back(event);
    }

    fn piece(index: usize) -> Piece {
        Piece {
            index,
            text: String::new(),
            tokens: Vec::new(),
            prompt: Vec::new(),
            role: false,
            finish: None,
            calls: Vec::new(),
        }
    }

    fn on_event(&mut self, i: usize, ev: EngineEvent) {
        let Some(c) = self.choices.get_mut(i) else { return };
        let first = !std::mem::replace(&mut c.started, true);
        if first && let Some(echo) = self.shaper.plan.echo.clone() {
            // The prompt goes first, with its log-probabilities when they were asked for
            // (then they are this first event).
            let prompt = match ev {
                EngineEvent::PromptLogprobs(p) => p,
                other => {
                    self.push(Piece { text: echo, ..Self::piece(i) });
                    return self.on_event(i, other);
                }
            };
            self.push(Piece { text: echo, prompt, ..Self::piece(i) });
            return;
        }
        let Some(c) = self.choices.get_mut(i) else { return };
        match ev {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Tokens { tokens, text } => {
                c.generated += tokens.len();
                c.pending.extend(tokens);
                let text = match &mut c.tools {
                    Some(parser) => parser.push(&text),
                    None => text,
                };
                if !text.is_empty() {
                    let tokens = std::mem::take(&mut c.pending);
                    self.push(Piece { text, tokens, ..Self::piece(i) });
                }
            }
            EngineEvent::Finished { reason, text, usage, timings, error } => {
                let finish = Finish { reason, usage, timings, error };
                c.finish = Some(finish.clone());
                let tokens = std::mem::take(&mut c.pending);
                let (text, calls) = match c.tools.take() {
                    Some(mut parser) => {
                        let head = parser.push(&text);
                        let (rest, calls) = parser.finish();
                        (head + &rest, calls)
                    }
                    None => (text, Vec::new()),
                };
                self.push(Piece { text, tokens, finish: Some(finish), calls, ..Self::piece(i) });
                if self.choices.iter().all(|c| c.finish.is_some()) {
                    self.close();
                }
            }
        }
    }

    /// The engine stream ended: choices without an end get an error end.
    fn on_end(&mut self) {
        for i in 0..self.choices.len() {
            let unfinished = self.choices.get(i).is_some_and(|c| c.finish.is_none());
            if unfinished {
                let finish = Finish {
                    reason: FinishReason::Error,
                    usage: Usage {
                        prompt_tokens: self.shaper.plan.prompt.len(),
                        ..Usage::default()
                    },
                    timings: EngineTimings::default(),
                    error: Some("the engine stopped before the request finished".into()),
                };
                if let Some(c) = self.choices.get_mut(i) {
                    c.finish = Some(finish.clone());
                }
                self.push(Piece { finish: Some(finish), ..Self::piece(i) });
            }
        }
        self.close();
    }

    fn close(&mut self) {
        let finishes: Vec<&Finish> =
            self.choices.iter().filter_map(|c| c.finish.as_ref()).collect();
        let usage = total_usage(finishes.iter().map(|f| &f.usage));
        let outcome = finishes.first().map_or("-", |f| f.reason.as_str());
        let timings = finishes.first().map(|f| f.timings);
        self.shaper.log(outcome, usage, timings);
        if self.shaper.plan.include_usage {
            let sh = &self.shaper;
            let ext = SluiceExt {
                tokens: Some(0),
                request_id: Some(sh.request_id.clone()),
                trace_id: sh.trace_id.clone(),
                ..SluiceExt::default()
            };
            let event = match sh.endpoint {
                Endpoint::Completions => Self::event(&CompletionBody {
                    id: sh.id(),
                    object: "text_completion",
                    created: sh.created,
                    model: sh.model_name.clone(),
                    choices: Vec::new(),
                    usage: Some(usage_body(usage)),
                    sluice: ext,
                }),
                Endpoint::Chat => Self::event(&ChatChunk {
                    id: sh.id(),
                    object: "chat.completion.chunk",
                    created: sh.created,
                    model: sh.model_name.clone(),
                    choices: Vec::new(),
                    usage: Some(usage_body(usage)),
                    sluice: ext,
                }),
            };
            self.queue.push_back(event);
        }
        self.queue.push_back(Event::default().data("[DONE]"));
        self.closed = true;
    }
}

/// Answers with server-sent events: `data: {chunk}` per step, `data: [DONE]` at the end.
pub fn stream(shaper: Shaper, events: Events) -> Response {
    let n = shaper.plan.params.n;
    let start = shaper.start_offset();
    let mut state = StreamState {
        choices: (0..n)
            .map(|_| ChoiceStream {
                offset: start,
                tools: shaper.plan.tools.map(OutputParser::new),
                ..ChoiceStream::default()
            })
            .collect(),
        shaper,
        events,
        queue: VecDeque::new(),
        closed: false,
    };
    if state.shaper.endpoint == Endpoint::Chat {
        for i in 0..n {
            state.push(Piece { role: true, ..StreamState::piece(i) });
        }
    }
    let body = unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(ev), st));
            }
            if st.closed {
                return None;
            }
            match st.events.next().await {
                Some((i, ev)) => st.on_event(i, ev),
                None => st.on_end(),
            }
        }
    });
    let mut resp = Sse::new(body).into_response();
    resp.headers_mut().insert(
        axum::http::header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-cache"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_of_several_choices_counts_the_prompt_once() {
        let u = |p, c, o| Usage { prompt_tokens: p, cached_tokens: c, completion_tokens: o };
        assert_eq!(total_usage([].iter()), Usage::default());
        assert_eq!(total_usage([u(10, 4, 3)].iter()), u(10, 4, 3));
        assert_eq!(total_usage([u(10, 4, 3), u(10, 0, 5), u(10, 8, 1)].iter()), u(10, 0, 9));
    }
}
