//! The execution identity every request runs under (never a bare model alias): the type is
//! the wire's, so the gateway and billing read what the engine writes.

pub use sluice_wire::ExecutionIdentity;

/// Version of this engine build.
pub const ENGINE_VERSION: &str = concat!("sluice-engine/", env!("CARGO_PKG_VERSION"));
