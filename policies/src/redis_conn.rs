//! One Redis connection type for the whole platform, over one server or a Redis Cluster.
//!
//! `--redis-url redis://host:port` is one server; several URLs separated by commas
//! (`redis://10.0.0.1:6379,redis://10.0.0.2:6379`) are seed nodes of a Cluster, whose slots
//! are learned from them and followed across failovers. Everything Sluice keeps in Redis is
//! usable on a Cluster unchanged: each script, transaction and pipeline touches the keys of one
//! hash tag (a tenant's `{sluice:t:<tenant>}`, the usage stream's `{sluice}`), so one slot.
//!
//! A connection to one server is [`Reconnecting`]: one multiplexed connection, with a
//! connection and a response timeout, dropped on the first sign that it broke and made anew by
//! the next command. redis-rs's `ConnectionManager` was not used for it: after an outage longer
//! than its reconnection attempts it left every later command pending even once the server was
//! back (`gateway/tests/redis_reconnect.rs` holds that case), which would have held every
//! admission that waits on Redis for good.

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, RedisError};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a command may wait for its answer (longer than any `BLOCK` Sluice sends: the
/// usage consumer blocks for 1 s).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Redis is: one server, or a Redis Cluster given by some of its nodes.
#[derive(Clone)]
pub enum RedisTarget {
    /// One server.
    Server(redis::Client),
    /// A Redis Cluster.
    Cluster(Box<ClusterClient>),
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.write_str(match self {
            Self::Server(_) => "RedisTarget::Server",
            Self::Cluster(_) => "RedisTarget::Cluster",
        })
    }
}

impl From<redis::Client> for RedisTarget {
    fn from(c: redis::Client) -> Self {
        Self::Server(c)
    }
}

impl RedisTarget {
    /// `redis://...` (one server) or comma-separated `redis://...` seed nodes (a Cluster).
    pub fn open(url: &str) -> RedisResult<Self> {
        let nodes: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        if nodes.len() > 1 {
            let client = redis::cluster::ClusterClientBuilder::new(nodes)
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .build()?;
            Ok(Self::Cluster(Box::new(client)))
        } else {
            Ok(Self::Server(redis::Client::open(url)?))
        }
    }

    /// Whether this is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// A shared connection (cheap to clone): reconnecting, or following the Cluster's slots.
    pub async fn connect(&self) -> RedisResult<RedisConn> {
        match self {
            Self::Server(c) => {
                let conn = Arc::new(Reconnecting { client: c.clone(), state: Default::default() });
                // Connected now, so a wrong address is an error at start, not at first use.
                conn.connection().await?;
                Ok(RedisConn::Server(conn))
            }
            Self::Cluster(c) => Ok(RedisConn::Cluster(c.get_async_connection().await?)),
        }
    }
}

/// One server's connection, made anew after it broke (see the module docs).
pub struct Reconnecting {
    client: redis::Client,
    state: std::sync::Mutex<State>,
}

type Connecting = Shared<BoxFuture<'static, Result<(), Arc<RedisError>>>>;

#[derive(Default)]
struct State {
    /// Which connection this is: an error or a cancellation only drops the one it came from.
    generation: u64,
    conn: Option<MultiplexedConnection>,
    /// The connection attempt under way, shared by every caller waiting for it. It runs as a
    /// task of its own, so a caller that gives up (the limiter waits 300 ms) does not cancel
    /// it for the others.
    connecting: Option<Connecting>,
}

impl Reconnecting {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live connection, or a new one once the shared attempt (bounded by the connection
    /// timeout) succeeds.
    async fn connection(self: &Arc<Self>) -> Result<(u64, MultiplexedConnection), RedisError> {
        let attempt = {
            let mut st = self.state();
            if let Some(c) = &st.conn {
                return Ok((st.generation, c.clone()));
            }
            match &st.connecting {
                Some(a) => a.clone(),
                None => {
                    let me = Arc::clone(self);
                    let task = tokio::spawn(async move {
                        let config = AsyncConnectionConfig::new()
                            .set_connection_timeout(CONNECT_TIMEOUT)
                            .set_response_timeout(RESPONSE_TIMEOUT);
                        let made =
                            me.client.get_multiplexed_async_connection_with_config(&config).await;
                        let mut st = me.state();
                        st.connecting = None;
                        let c = made.map_err(Arc::new)?;
                        st.generation += 1;
                        st.conn = Some(c);
                        Ok(())
                    });
                    let attempt: Connecting = async move {
                        task.await.unwrap_or_else(|e| {
                            Err(Arc::new(RedisError::from(std::io::Error::other(e.to_string()))))
                        })
                    }
                    .boxed()
                    .shared();
                    st.connecting = Some(attempt.clone());
                    attempt
                }
            }
        };
        attempt
            .await
            .map_err(|e| RedisError::from((e.kind(), "connecting to Redis", e.to_string())))?;
        let st = self.state();
        match &st.conn {
            Some(c) => Ok((st.generation, c.clone())),
            None => Err(RedisError::from((
                redis::ErrorKind::IoError,
                "connecting to Redis",
                "the new connection was dropped at once".to_owned(),
            ))),
        }
    }

    /// Drops connection `generation` (not a newer one another caller already made), so the
    /// next command connects again.
    fn invalidate(&self, generation: u64) {
        let mut st = self.state();
        if st.generation == generation {
            st.conn = None;
        }
    }

    /// After an error: a broken or silent connection is dropped. (A reply error, `NOSCRIPT`
    /// say, leaves it.)
    fn after(&self, generation: u64, e: &RedisError) {
        if e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_unrecoverable_error()
        {
            self.invalidate(generation);
        }
    }

    /// Runs one command or pipeline on the live connection. A caller that gives up before
    /// the answer (its own timeout) drops the connection too: a connection that left it
    /// unanswered may be half-open (a peer gone without a reset), and would otherwise hold
    /// every later command until the kernel gives up on it.
    async fn run<T, F>(
        self: &Arc<Self>,
        send: impl FnOnce(MultiplexedConnection) -> F,
    ) -> RedisResult<T>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let (generation, c) = self.connection().await?;
        let mut pending = Pending { conn: self, generation, armed: true };
        let r = send(c).await;
        pending.armed = false;
        if let Err(e) = &r {
            self.after(generation, e);
        }
        r
    }
}

/// Drops the connection when a command's caller gave up before its answer.
struct Pending<'a> {
    conn: &'a Reconnecting,
    generation: u64,
    armed: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.invalidate(self.generation);
        }
    }
}

/// A connection to one server or to a Cluster; every command Sluice sends works on both.
#[derive(Clone)]
pub enum RedisConn {
    /// One server.
    Server(Arc<Reconnecting>),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Server(_) => "RedisConn::Server",
            Self::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Server(s) => {
                async move { s.run(|mut c| async move { c.req_packed_command(cmd).await }).await }
                    .boxed()
            }
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Server(s) => async move {
                s.run(|mut c| async move { c.req_packed_commands(cmd, offset, count).await }).await
            }
            .boxed(),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(s) => s.client.get_connection_info().redis.db,
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// The names one deployment's state lives under in Redis (`--redis-namespace`), so that
/// deployments sharing a Redis (staging beside production, two teams' platforms) share
/// nothing: not a tenant's counters, reservations and journals, nor the usage stream one
/// billing service consumes into its ledger, nor the control-plane announcements.
///
/// A namespace `ns` names the tenants' keys `{ns:t:<tenant>}:…` (one hash tag a tenant),
/// the gateways' journals and peers `ns:…`, and the usage stream, its dead letters and the
/// control channel `{ns}:…` (one hash tag for those): every script and pipeline still
/// touches one Cluster slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace(String);

impl Namespace {
    /// The namespace of a deployment that names none.
    pub const DEFAULT: &'static str = "sluice";
    /// The longest a namespace may be.
    pub const MAX_LEN: usize = 64;

    /// A namespace of 1 to [`Namespace::MAX_LEN`] ASCII letters, digits, `-`, `_` and `.`
    /// (no `{`, `}` or `:`, which would move the hash tags or the separators); the error says
    /// what is wrong.
    pub fn new(name: &str) -> Result<Namespace, String> {
        if name.is_empty() || name.len() > Self::MAX_LEN {
            return Err(format!("must be 1 to {} characters (got {})", Self::MAX_LEN, name.len()));
        }
        match name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
            Some(c) => Err(format!("{c:?} is not allowed: only ASCII letters, digits, -, _ and .")),
            None => Ok(Namespace(name.to_owned())),
        }
    }

    /// The name itself: the prefix of the limits, journals and peers.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The usage stream gateways publish to and billing consumes.
    pub fn usage_stream(&self) -> String {
        format!("{{{}}}:usage", self.0)
    }

    /// The channel billing announces control-plane changes on.
    pub fn control_channel(&self) -> String {
        format!("{{{}}}:control", self.0)
    }

    /// The counter of those changes.
    pub fn control_version_key(&self) -> String {
        format!("{{{}}}:control:version", self.0)
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Namespace(Self::DEFAULT.to_owned())
    }
}

impl std::str::FromStr for Namespace {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Namespace::new(s)
    }
}

impl std::fmt::Display for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Namespace;

    #[test]
    fn a_namespace_names_every_shared_key_and_refuses_what_would_move_a_hash_tag() {
        let ns = Namespace::new("blue-prod.2").map_err(|e| e.to_string());
        assert_eq!(ns.as_ref().map(Namespace::usage_stream), Ok("{blue-prod.2}:usage".into()));
        assert_eq!(ns.as_ref().map(Namespace::control_channel), Ok("{blue-prod.2}:control".into()));
        let default = Namespace::default();
        assert_eq!(default.as_str(), "sluice");
        assert_eq!(default.control_version_key(), "{sluice}:control:version");
        for bad in ["", "a{b", "a}b", "a:b", "a b", "é", &"x".repeat(65)] {
            assert!(Namespace::new(bad).is_err(), "{bad:?} was taken");
        }
        assert!(Namespace::new(&"x".repeat(64)).is_ok());
    }
}
