//! `sluice bench serve` building blocks (issue 6): arrival schedules generated up front from a
//! seed ([`arrivals`]) and the serving metrics exactly as MISSION.md defines them
//! ([`metrics`]), kept free of I/O so they are tested on hand-made traces.

pub mod arrivals;
pub mod metrics;
pub mod workload;
