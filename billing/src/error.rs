//! The billing crate's one error type.

/// Everything that can go wrong in the ledger and the ingestion loop.
#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    /// The database URL names a backend the ledger does not speak.
    #[error("unsupported database url (expected postgres:// or sqlite://)")]
    UnsupportedUrl,
    /// A query or connection failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A Redis command failed.
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    /// A usage event broke a rule of the wire format; the message never quotes the payload.
    #[error("invalid usage event: {0}")]
    InvalidEvent(&'static str),
    /// A usage event could not be serialized for publishing.
    #[error("could not encode usage event: {0}")]
    Encode(#[source] serde_json::Error),
    /// The usage writer's thread or runtime could not be started.
    #[error("could not start the usage writer: {0}")]
    Writer(#[source] std::io::Error),
    /// A benchmark could not run as set up (`sluice bench billing`).
    #[error("benchmark: {0}")]
    Bench(String),
}

impl BillingError {
    /// Whether trying the same operation again later can succeed (outage, timeout, lost
    /// connection) as opposed to an input the database will always refuse.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Database(err) => is_retryable_sqlx(err),
            Self::Redis(_) => true,
            Self::Migrate(_)
            | Self::UnsupportedUrl
            | Self::InvalidEvent(_)
            | Self::Encode(_)
            | Self::Writer(_)
            | Self::Bench(_) => false,
        }
    }

    /// HTTP status for when this error surfaces through an API.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::InvalidEvent(_) => 400,
            Self::Database(_) | Self::Redis(_) if self.is_retryable() => 503,
            Self::Database(_)
            | Self::Redis(_)
            | Self::Migrate(_)
            | Self::UnsupportedUrl
            | Self::Encode(_)
            | Self::Writer(_)
            | Self::Bench(_) => 500,
        }
    }

    /// Low-cardinality label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::UnsupportedUrl => "config",
            Self::Database(_) => "database",
            Self::Migrate(_) => "migration",
            Self::Redis(_) => "redis",
            Self::InvalidEvent(_) => "invalid_event",
            Self::Encode(_) => "encode",
            Self::Writer(_) => "writer",
            Self::Bench(_) => "bench",
        }
    }
}

/// Constraint violations and data exceptions are about the rows, so they fail again on retry;
/// everything else (I/O, pool timeouts, server shutting down, serialization failures) is about
/// the database's state at the moment and may pass later.
fn is_retryable_sqlx(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => {
            if !matches!(db.kind(), sqlx::error::ErrorKind::Other) {
                return false;
            }
            // Postgres class 22 = data exception (out of range, invalid text representation).
            !db.code().is_some_and(|code| code.starts_with("22"))
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}
