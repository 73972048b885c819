//! What the engine itself did for each HTTP request: prompt, cached and generated tokens and
//! how it ended, summed over the request's choices, kept for a while after it ended.
//!
//! The engine is the only party that knows how many tokens it generated for a request whose
//! client went away (a non-streamed response is never written; a stream is cut between steps),
//! so the gateway asks here before it bills such a request, and an auditor's reconciliation
//! compares the ledger with these counts. The core records every choice's end, however it
//! ended (finished, stopped, aborted, failed); the server registers each choice before it
//! submits it, so a request is `running` until each submitted choice has ended.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::serve::{FinishReason, Usage};

/// Requests remembered at most (the oldest are forgotten first).
const CAPACITY: usize = 100_000;

pub use sluice_wire::{Outcome, OutcomeState};

fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

struct Inner {
    by_id: HashMap<String, Outcome>,
    /// Choice id -> request id.
    choices: HashMap<String, String>,
    order: VecDeque<String>,
}

/// The outcome log shared by the engine core (writer) and the server (reader).
pub struct OutcomeLog {
    inner: Mutex<Inner>,
    ended: Condvar,
}

impl std::fmt::Debug for OutcomeLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutcomeLog").finish_non_exhaustive()
    }
}

impl Default for OutcomeLog {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                by_id: HashMap::new(),
                choices: HashMap::new(),
                order: VecDeque::new(),
            }),
            ended: Condvar::new(),
        }
    }
}

impl OutcomeLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers choice `choice_id` of request `request_id` before it is submitted; false for
    /// a duplicate of a running choice (the core refuses it without running it), which must
    /// not be unregistered.
    pub fn register(&self, request_id: &str, choice_id: &str, tenant: Option<&str>) -> bool {
        let mut g = self.lock();
        if g.choices.contains_key(choice_id) {
            return false;
        }
        if !g.by_id.contains_key(request_id) {
            if g.order.len() >= CAPACITY
                && let Some(old) = g.order.pop_front()
            {
                g.by_id.remove(&old);
                // Only running choices have entries: few.
                g.choices.retain(|_, r| *r != old);
            }
            let created =
                SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            g.by_id.insert(
                request_id.to_owned(),
                Outcome {
                    request_id: request_id.to_owned(),
                    tenant: tenant.map(str::to_owned),
                    state: OutcomeState::Running,
                    choices: 0,
                    ended: 0,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    completion_tokens: 0,
                    finish_reason: None,
                    created,
                    ended_ms: None,
                },
            );
            g.order.push_back(request_id.to_owned());
        }
        if let Some(o) = g.by_id.get_mut(request_id) {
            o.choices += 1;
            o.state = OutcomeState::Running;
            o.ended_ms = None;
        }
        g.choices.insert(choice_id.to_owned(), request_id.to_owned());
        true
    }

    /// A choice that was registered but could not be submitted.
    pub fn unregister(&self, choice_id: &str) {
        let mut g = self.lock();
        if let Some(id) = g.choices.remove(choice_id)
            && let Some(o) = g.by_id.get_mut(&id)
        {
            o.choices = o.choices.saturating_sub(1);
            if o.ended >= o.choices {
                o.state = OutcomeState::Finished;
                o.ended_ms = Some(now_ms());
            }
        }
        self.ended.notify_all();
    }

    /// The core: a choice ended (a choice never registered is not an HTTP request's).
    pub fn ended(&self, choice_id: &str, usage: &Usage, reason: FinishReason) {
        let mut g = self.lock();
        let Some(id) = g.choices.remove(choice_id) else { return };
        if let Some(o) = g.by_id.get_mut(&id) {
            o.ended += 1;
            o.prompt_tokens = usage.prompt_tokens as u64;
            // One rule with the response's usage: the prompt is billed once, its cached part
            // that of the choice that reused least (the others reused the first one's work).
            let cached = usage.cached_tokens as u64;
            o.cached_tokens = if o.ended == 1 { cached } else { o.cached_tokens.min(cached) };
            o.completion_tokens += usage.completion_tokens as u64;
            o.finish_reason = Some(reason);
            if o.ended >= o.choices {
                o.state = OutcomeState::Finished;
                o.ended_ms = Some(now_ms());
            }
        }
        drop(g);
        self.ended.notify_all();
    }

    /// The request's outcome, waiting up to `wait` for it to finish.
    pub fn get(&self, request_id: &str, wait: Duration) -> Option<Outcome> {
        let deadline = Instant::now() + wait;
        let mut g = self.lock();
        loop {
            let o = g.by_id.get(request_id)?;
            let now = Instant::now();
            if o.finished() || now >= deadline {
                return Some(o.clone());
            }
            g = self.ended.wait_timeout(g, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// The choices of `request_id` still running.
    pub fn running_choices(&self, request_id: &str) -> Vec<String> {
        let g = self.lock();
        g.choices.iter().filter(|(_, r)| r.as_str() == request_id).map(|(c, _)| c.clone()).collect()
    }

    /// Every remembered request created at or after `since` (seconds since the Unix epoch).
    pub fn since(&self, since: u64) -> Vec<Outcome> {
        let g = self.lock();
        g.order
            .iter()
            .filter_map(|id| g.by_id.get(id))
            .filter(|o| o.created >= since)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(p: usize, c: usize, g: usize) -> Usage {
        Usage { prompt_tokens: p, cached_tokens: c, completion_tokens: g }
    }

    #[test]
    fn a_request_finishes_when_every_submitted_choice_ended() -> Result<(), &'static str> {
        let log = OutcomeLog::default();
        assert!(log.register("r", "r-0", Some("t")));
        assert!(log.register("r", "r-1", Some("t")));
        assert!(!log.register("r", "r-1", Some("t")), "a duplicate of a running choice");
        log.ended("r-0", &usage(5, 0, 3), FinishReason::Stop);
        let o = log.get("r", Duration::ZERO).ok_or("registered")?;
        assert_eq!((o.state, o.ended, o.completion_tokens), (OutcomeState::Running, 1, 3));
        assert_eq!(o.ended_ms, None);
        log.ended("r-1", &usage(5, 4, 2), FinishReason::Abort);
        let o = log.get("r", Duration::ZERO).ok_or("registered")?;
        // Cached: the least of the choices', as the response's usage says (once the most,
        // so a client that hung up paid less for the prompt than one that waited).
        assert_eq!((o.state, o.completion_tokens, o.cached_tokens), (OutcomeState::Finished, 5, 0));
        assert!(o.ended_ms.is_some_and(|ms| ms >= o.created * 1000), "{:?}", o.ended_ms);
        assert_eq!(o.finish_reason, Some(FinishReason::Abort));
        assert_eq!(o.tenant.as_deref(), Some("t"));
        // A choice that could not be submitted does not hold the request open.
        log.register("q", "q-0", None);
        log.register("q", "q-1", None);
        log.ended("q-0", &usage(1, 0, 1), FinishReason::Length);
        log.unregister("q-1");
        assert_eq!(log.get("q", Duration::ZERO).map(|o| o.state), Some(OutcomeState::Finished));
        assert!(log.get("unknown", Duration::ZERO).is_none());
        log.ended("never-registered", &usage(1, 0, 1), FinishReason::Stop);
        assert_eq!(log.since(0).len(), 2);
        Ok(())
    }

    #[test]
    fn a_waiting_reader_sees_the_end() -> Result<(), &'static str> {
        let log = std::sync::Arc::new(OutcomeLog::default());
        log.register("r", "r", None);
        let writer = std::sync::Arc::clone(&log);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.ended("r", &usage(2, 0, 7), FinishReason::Abort);
        });
        let o = log.get("r", Duration::from_secs(10)).ok_or("registered")?;
        assert_eq!((o.state, o.completion_tokens), (OutcomeState::Finished, 7));
        t.join().map_err(|_| "writer")?;
        Ok(())
    }
}
