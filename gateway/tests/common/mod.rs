//! Helpers shared by the gateway's integration tests.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use chrono::Utc;
use sluice_billing::{FinishReason, UsageEvent};
use sluice_policies::redis_conn::{RedisConn, RedisTarget};

/// A private `redis-server` (the test may stop it), killed when dropped.
pub struct RedisServer(Child);

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl RedisServer {
    /// Starts one on `port`, keeping nothing on disk.
    pub fn start(port: u16) -> anyhow::Result<RedisServer> {
        Ok(RedisServer(
            Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no"])
                .stdout(Stdio::null())
                .spawn()
                .context("redis-server is needed for this test")?,
        ))
    }
}

/// A free port on the loopback.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A connection to the server on `port`, once it answers (10 s at most).
pub async fn connect(port: u16) -> anyhow::Result<RedisConn> {
    let client = RedisTarget::open(&format!("redis://127.0.0.1:{port}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client.connect().await {
            Ok(c) => return Ok(c),
            Err(e) => {
                ensure!(Instant::now() < deadline, "redis-server did not start: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

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
