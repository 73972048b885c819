//! Helpers shared by the gateway's integration tests.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use chrono::Utc;
use sluice_billing::{FinishReason, UsageEvent};

/// A usage event of request `id`: 3 prompt and 2 generated tokens, ended by a stop.
pub fn event(id: &str) -> UsageEvent {
    UsageEvent {
        request_id: id.into(),
        idempotency_key: None,
        tenant_id: "t".into(),
        key_id: "k".into(),
        model_id: "m".into(),
        model_revision: "sha256:r".into(),
        tokenizer_revision: "sha256:t".into(),
        chat_template_version: "sha256:c".into(),
        adapter: None,
        engine_version: None,
        engine_worker: None,
        prompt_tokens: 3,
        cached_prompt_tokens: 0,
        completion_tokens: 2,
        finish_reason: FinishReason::Stop,
        http_status: 200,
        error_type: None,
        client_disconnected: false,
        arrival_at: Utc::now(),
        first_token_at: None,
        last_token_at: None,
        ttft_ms: None,
        tpot_ms: None,
        itl_max_ms: None,
        itl_p99_ms: None,
        e2e_ms: Some(5.0),
        engine_queue_ms: None,
        engine_prefill_ms: None,
        engine_decode_ms: None,
        trace_id: None,
        prompt_sha256: "ab".repeat(32),
        prompt_chars: 10,
        user_sha256: None,
        cost_micros: 1,
        price_list_version: "test-1".to_owned(),
        price_input_micros: 0,
        price_cached_input_micros: 0,
        price_output_micros: 0,
    }
}
