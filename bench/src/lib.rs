//! `sluice bench serve` building blocks (issue 6): arrival schedules generated up front from a
//! seed ([`arrivals`]), what each request asks for ([`workload`]), the serving metrics exactly
//! as MISSION.md defines them ([`metrics`]) and the report's charts ([`svg`]), kept free of
//! I/O so they are tested on hand-made traces.

pub mod arrivals;
pub mod metrics;
pub mod svg;
pub mod workload;
