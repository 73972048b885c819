//! Sluice's load generator. The building blocks are free of I/O and tested on hand-made
//! traces: arrival schedules generated up front from a seed ([`arrivals`]), what each request
//! asks for ([`workload`]), the serving metrics exactly as MISSION.md defines them
//! ([`metrics`], over `sluice_text::stream`'s definitions) and the report's charts ([`svg`]).
//! On them: `sluice bench serve`, the open-loop driver against any OpenAI-compatible endpoint
//! ([`serve`]), `sluice bench sweep`, the capacity search over it ([`sweep`]), and `sluice
//! bench isolation`, each tenant of a mix alone and then together ([`isolation`]), or the
//! named floods with their targets ([`scenario`]); and `sluice bench engine`'s HTTP points,
//! `sluice engine` and llama.cpp's server started as child processes and driven in turn by the
//! same client ([`http`]).

pub mod arrivals;
pub mod http;
pub mod isolation;
pub mod metrics;
pub mod scenario;
pub mod serve;
pub mod svg;
pub mod sweep;
pub mod workload;
