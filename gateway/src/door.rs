//! The connection layer under pingora's HTTP/1 parser. pingora bounds each read of a request
//! head, not the head as a whole, so a client trickling header bytes could hold a connection
//! forever; and it answers a head it cannot parse with an empty-bodied 400 before any
//! [`pingora::proxy::ProxyHttp`] phase runs. [`HeadGuard`] wraps every client stream.
//!
//! The connection's first request head must arrive whole within `--header-timeout` (counted
//! from the accept), at most [`MAX_HEAD`] bytes, and well-formed; one that is not gets a 408,
//! 414, 431 or 400 with an OpenAI error body, and the connection closes. A later head on a
//! kept-alive connection gets the same deadline from its first byte, but past it the
//! connection just closes, and a malformed one is left to pingora: the guard does not follow
//! body framing, so after the first request it cannot tell a head from the rest of a body or
//! a pipelined request read in the middle, and must never write into a response that may
//! still be under way. Bodies and responses pass through untouched.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::ServerApp;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::{SslDigest, TlsRef};
use pingora::protocols::{
    ALPN, GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    Stream, TimingDigest, UniqueID, UniqueIDType,
};
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use pingora::server::configuration::ServerConf;
use pingora::services::listening::Service;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::admission::error_json;
use crate::proxy::Gateway;

/// The largest request head accepted (request line and header fields together).
pub const MAX_HEAD: usize = 64 * 1024;

/// A request line longer than this makes an over-long head a 414 rather than a 431.
const LONG_LINE: usize = 8 * 1024;

/// The most header fields in one head (pingora's own limit).
const MAX_FIELDS: usize = 256;

/// How long, and for how many bytes, a refused connection is drained before it closes.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// The pingora service's name, which its threads carry (what a profile or `sluice bench
/// gateway`'s layout finds them by; at most 15 bytes, the kernel's limit on a thread's name).
pub const SERVICE_NAME: &str = "sluice gateway";
const _: () = assert!(SERVICE_NAME.len() <= 15, "a thread's name is cut at 15 bytes");

/// The gateway as a pingora service whose client connections pass through [`HeadGuard`].
pub fn service(conf: &Arc<ServerConf>, gateway: Gateway) -> Service<FrontDoor> {
    let header_timeout = gateway.header_timeout();
    let proxy = Arc::new(pingora::proxy::http_proxy(conf, gateway));
    Service::new(SERVICE_NAME.into(), FrontDoor { proxy, header_timeout })
}

/// The gateway's HTTP proxy behind the head guard.
pub struct FrontDoor {
    proxy: Arc<HttpProxy<Gateway>>,
    header_timeout: Duration,
}

#[async_trait]
impl ServerApp for FrontDoor {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        // HTTP/2 frames its own headers; the guard reads HTTP/1 only.
        let stream: Stream = if matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
            stream
        } else {
            Box::new(HeadGuard::new(stream, self.header_timeout))
        };
        self.proxy.process_new(stream, shutdown).await
    }

    async fn cleanup(&self) {
        self.proxy.cleanup().await;
    }
}

/// Where a connection is in its request/response cycle, as far as heads are concerned.
#[derive(Debug)]
enum State {
    /// A request head is arriving: its bytes so far, its deadline, and whether it is the
    /// connection's first (only that one is refused with an answer; see the module docs).
    Head { head: Vec<u8>, deadline: Pin<Box<Sleep>>, first: bool },
    /// The head passed; the body goes through until the response starts.
    Message,
    /// The response has started: the next bytes that arrive begin a new head.
    Responding,
    /// Writing our refusal; `sent` bytes of it are out.
    Refusing { answer: Bytes, sent: usize },
    /// The refusal is out and our side shut: what the client still sends is read and dropped
    /// for a moment, so that closing does not reset the connection before it reads the answer.
    Lingering { left: usize, until: Pin<Box<Sleep>> },
    /// The refusal is out (or the client sent nothing): reads end.
    Closed,
}

/// A client stream that bounds and checks request heads (see the module docs).
#[derive(Debug)]
pub struct HeadGuard {
    inner: Stream,
    timeout: Duration,
    state: State,
}

impl HeadGuard {
    /// Guards `inner`; its first head's deadline starts now.
    pub fn new(inner: Stream, timeout: Duration) -> Self {
        let state = State::Head {
            head: Vec::new(),
            deadline: Box::pin(tokio::time::sleep(timeout)),
            first: true,
        };
        Self { inner, timeout, state }
    }

    /// Looks at the `fresh` bytes just read into `buf` (from `before`) while a head arrives.
    fn scan(&mut self, buf: &mut ReadBuf<'_>, before: usize) {
        let State::Head { head, first, .. } = &mut self.state else { return };
        let first = *first;
        let from = head.len().saturating_sub(2);
        let fresh = &buf.filled()[before..];
        let new_line = fresh.contains(&b'\n');
        head.extend_from_slice(fresh);
        let verdict = match head_end(head, from) {
            Some(end) if end > MAX_HEAD => Err(too_long(&head[..end])),
            Some(end) => check(&head[..end]).map(|()| true),
            None if head.len() > MAX_HEAD => Err(too_long(head)),
            // pingora parses a head as it arrives, and refuses it as soon as what it has is
            // wrong: judge every new line first.
            None if new_line => check(head).map(|()| false),
            None => return,
        };
        match verdict {
            Ok(true) => self.state = State::Message,
            Ok(false) => {}
            // A later head: pingora judges it.
            Err(_) if !first => self.state = State::Message,
            Err(answer) => {
                // pingora never sees the bytes that broke the rule.
                buf.set_filled(before);
                self.state = State::Refusing { answer, sent: 0 };
            }
        }
    }

    /// Writes the refusal, shuts our side and lingers; then the read fails, so pingora drops
    /// the connection. Every failure on the way is the client's going away: it ends the same.
    fn poll_refuse(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let inner = Pin::new(&mut self.inner);
            match &mut self.state {
                State::Refusing { answer, sent } if *sent < answer.len() => {
                    match ready!(inner.poll_write(cx, &answer[*sent..])) {
                        Ok(0) | Err(_) => self.state = State::Closed,
                        Ok(n) => *sent += n,
                    }
                }
                State::Refusing { .. } => {
                    let _ = ready!(inner.poll_flush(cx));
                    let _ = ready!(Pin::new(&mut self.inner).poll_shutdown(cx));
                    let until = Box::pin(tokio::time::sleep(LINGER));
                    self.state = State::Lingering { left: LINGER_BYTES, until };
                }
                State::Lingering { left, until } => {
                    let mut scratch = [0u8; 4096];
                    let mut sink = ReadBuf::new(&mut scratch);
                    match inner.poll_read(cx, &mut sink) {
                        Poll::Ready(Ok(())) if !sink.filled().is_empty() => {
                            *left = left.saturating_sub(sink.filled().len());
                            if *left == 0 {
                                self.state = State::Closed;
                            }
                        }
                        Poll::Ready(_) => self.state = State::Closed,
                        Poll::Pending => {
                            ready!(until.as_mut().poll(cx));
                            self.state = State::Closed;
                        }
                    }
                }
                _ => break,
            }
        }
        Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, "request head refused")))
    }
}

/// The end of the head in `head` (just past its empty line), searching from `from`.
fn head_end(head: &[u8], from: usize) -> Option<usize> {
    (from..head.len()).find_map(|i| match head[i..] {
        [b'\n', b'\n', ..] => Some(i + 2),
        [b'\n', b'\r', b'\n', ..] => Some(i + 3),
        _ => None,
    })
}

/// Refuses a head, whole or still arriving, that pingora would answer with an empty 400.
/// Request lines pingora repairs (unescaped bytes in the target, an odd version) are left to
/// it.
fn check(head: &[u8]) -> Result<(), Bytes> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    match httparse::Request::new(&mut fields).parse(head) {
        Ok(_) | Err(httparse::Error::Token | httparse::Error::Version) => Ok(()),
        Err(httparse::Error::TooManyHeaders) => Err(answer(
            431,
            &format!("the request has more than {MAX_FIELDS} header fields"),
            "request_header_fields_too_large",
        )),
        Err(e) => Err(answer(400, &format!("malformed request head: {e}"), "malformed_request")),
    }
}

/// The refusal for a head over [`MAX_HEAD`]: 414 when its request line is what is long (over
/// [`LONG_LINE`] bytes), else 431.
fn too_long(head: &[u8]) -> Bytes {
    let line = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    if line > LONG_LINE {
        let message = format!("the request line is {line} bytes; a head may have {MAX_HEAD}");
        answer(414, &message, "uri_too_long")
    } else {
        let message = format!("the request head is over {MAX_HEAD} bytes");
        answer(431, &message, "request_header_fields_too_large")
    }
}

/// A whole HTTP/1.1 response with an OpenAI error body, closing the connection.
fn answer(status: u16, message: &str, code: &str) -> Bytes {
    let reason = match status {
        408 => "Request Timeout",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        _ => "Bad Request",
    };
    let body = error_json(message, "invalid_request_error", None, Some(code));
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Bytes::from(out)
}

impl AsyncRead for HeadGuard {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let before = buf.filled().len();
            match &mut this.state {
                State::Refusing { .. } | State::Lingering { .. } => return this.poll_refuse(cx),
                State::Closed => return Poll::Ready(Ok(())),
                State::Message => return Pin::new(&mut this.inner).poll_read(cx, buf),
                State::Responding => {
                    ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
                    if buf.filled().len() == before {
                        return Poll::Ready(Ok(()));
                    }
                    let deadline = Box::pin(tokio::time::sleep(this.timeout));
                    this.state = State::Head { head: Vec::new(), deadline, first: false };
                }
                State::Head { head, deadline, first } => {
                    match Pin::new(&mut this.inner).poll_read(cx, buf) {
                        Poll::Pending => {
                            ready!(deadline.as_mut().poll(cx));
                            if head.is_empty() || !*first {
                                // Nothing was sent, or a later head (a response may be under
                                // way): close as an idle connection is closed.
                                this.state = State::Closed;
                                return Poll::Ready(Ok(()));
                            }
                            let secs = this.timeout.as_secs_f64();
                            let message = format!("the request head took longer than {secs} s");
                            let answer = answer(408, &message, "request_timeout");
                            this.state = State::Refusing { answer, sent: 0 };
                            continue;
                        }
                        Poll::Ready(r) => r?,
                    }
                    if buf.filled().len() == before {
                        return Poll::Ready(Ok(()));
                    }
                }
            }
            // New bytes of a head.
            this.scan(buf, before);
            if !matches!(this.state, State::Refusing { .. }) {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl AsyncWrite for HeadGuard {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.state {
            State::Refusing { .. } | State::Lingering { .. } | State::Closed => {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
            // pingora answers: whatever arrives next is a new request.
            State::Head { .. } | State::Message => this.state = State::Responding,
            State::Responding => {}
        }
        Pin::new(&mut this.inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for HeadGuard {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await;
    }
}

impl UniqueID for HeadGuard {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeadGuard {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }
    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }
    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeadGuard {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }
    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeadGuard {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for HeadGuard {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait]
impl Peek for HeadGuard {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_end_at_their_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody", 0), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.1\nHost: x\n\nbody", 0), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n", 0), None);
        // A scan resumed two bytes before the old end still finds a split empty line.
        let head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(head_end(head, 23), Some(27));
    }

    #[test]
    fn malformed_heads_get_json_and_repairable_lines_pass() {
        assert!(check(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_ok());
        // pingora escapes bytes like these in the target itself.
        assert!(check(b"GET /a|b HTTP/1.1\r\nHost: x\r\n\r\n").is_ok());
        let bad = check(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n").err().map(|b| b.to_vec());
        let text = String::from_utf8(bad.unwrap_or_default()).unwrap_or_default();
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
        assert!(text.contains("\"code\":\"malformed_request\""), "{text}");
        let many: String = (0..300).map(|i| format!("X-{i}: v\r\n")).collect();
        let head = format!("GET / HTTP/1.1\r\n{many}\r\n");
        let text = check(head.as_bytes()).err().map(|b| String::from_utf8_lossy(&b).into_owned());
        assert!(text.is_some_and(|t| t.starts_with("HTTP/1.1 431 ")));
        // Still arriving: wrong already, or not yet known to be.
        assert!(check(b"GET / HTTP/1.1\r\nno colon\r\nX-A: b").is_err());
        assert!(check(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b").is_ok());
    }

    #[test]
    fn a_long_request_line_is_414_and_a_long_head_431() {
        let line = vec![b'a'; MAX_HEAD + 1];
        assert!(too_long(&line).starts_with(b"HTTP/1.1 414 "));
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        head.extend_from_slice(&line);
        assert!(too_long(&head).starts_with(b"HTTP/1.1 431 "));
        let body = &answer(408, "m", "request_timeout");
        let text = String::from_utf8_lossy(body);
        let (_, json) = text.split_once("\r\n\r\n").unwrap_or_default();
        assert!(text.contains(&format!("content-length: {}\r\n", json.len())), "{text}");
    }
}
