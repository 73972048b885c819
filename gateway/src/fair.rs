//! Fair admission: while every engine has a backlog, a tenant is admitted up to its weighted
//! share of the places the engines are running, and past it only as far as its own queue can
//! still start within its tier's TTFT target; the rest is refused at once (429, `Retry-After`
//! from the queue) instead of waiting for seconds in an engine. Without a backlog everything
//! is admitted (work-conserving: a tenant alone may use all of the capacity).
//!
//! Places alone misjudge a quiet tenant whose requests live long (the batch runs at its TPOT
//! target): beside other tenants, one whose share of the tokens served recently is well
//! below its weighted share is admitted up to twice its share of the places, in flight or
//! waiting for a first token: the engines' fair order runs its requests before a tenant past
//! its share, so those that already stream hold places but keep nobody waiting (a flood of
//! long prompts holds few places but most of the tokens, so places alone would turn the
//! quiet tenant away). One within its weighted share of the tokens is admitted while its own
//! requests waiting for a first token are within its share of the places.
//!
//! The engines' VTC order and batch control serve each tenant its share of the places; this
//! keeps a tenant's excess out of their queues, where it would only wait. With Redis the
//! replicas judge together: each publishes what it has in flight and has served, per tenant,
//! and reads the others' ([`crate::fair_peers`]), so a tenant whose load is split over several
//! gateways is judged by all of it; without Redis (or with a view older than [`PEERS_STALE`])
//! each replica judges by its own requests alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the gateway knows of one tenant's work in flight.
#[derive(Debug, Default)]
struct Tenant {
    in_flight: u64,
    /// Of those, admitted and not yet streaming a token (not counted: answers that are not
    /// streamed, whose first token the gateway does not see).
    waiting: u64,
    /// The prompt tokens of those waiting.
    waiting_tokens: u64,
    weight: u64,
}

/// One tenant as a replica publishes it: its sequences in flight there, its weight and the
/// tokens served to it there (decayed to when it was published).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Published {
    pub in_flight: u64,
    /// Of those, waiting for their first token (absent from an older replica: none).
    #[serde(default)]
    pub waiting: u64,
    /// The prompt tokens of those waiting (absent from an older replica: none).
    #[serde(default)]
    pub waiting_tokens: u64,
    pub weight: u64,
    pub tokens: f64,
}

/// What the other gateway replicas have in flight and have served, summed over them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Peers {
    /// Per tenant, over every other replica.
    pub tenants: HashMap<String, Published>,
    /// The replicas read, this one not counted.
    pub replicas: usize,
    /// Sequences in flight and tokens served over every tenant, summed as they are added
    /// (each admission reads them; the peers change ten times a second).
    in_flight: u64,
    tokens: f64,
}

impl Peers {
    /// Adds one replica's published tenants.
    pub fn add(&mut self, replica: &HashMap<String, Published>) {
        for (tenant, p) in replica {
            let tokens = if p.tokens.is_finite() { p.tokens.max(0.0) } else { 0.0 };
            let e = self.tenants.entry(tenant.clone()).or_default();
            e.in_flight += p.in_flight;
            e.waiting += p.waiting;
            e.waiting_tokens += p.waiting_tokens;
            e.weight = e.weight.max(p.weight);
            e.tokens += tokens;
            self.in_flight += p.in_flight;
            self.tokens += tokens;
        }
        self.replicas += 1;
    }
}

/// How long the other replicas' view is used after it was read: past it (Redis unreachable
/// or slow) each replica judges by its own requests.
pub const PEERS_STALE: Duration = Duration::from_secs(1);

/// A tenant's standing as admission judges it: this replica's figures plus the others'.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Standing {
    in_flight: u64,
    waiting: u64,
    all_in_flight: u64,
    /// The weights of the other tenants with sequences in flight.
    others_weight: u64,
    served: f64,
    all_served: f64,
}

#[derive(Debug, Default)]
struct State {
    tenants: HashMap<String, Tenant>,
    /// The other replicas' figures and when they were read.
    peers: Option<(Peers, Instant)>,
    /// How long a request holds its place once it runs (first token to the end), seconds:
    /// an exponentially weighted mean over completed requests, and how many it has seen.
    service_s: f64,
    samples: u64,
    /// Tokens served per tenant, decayed with `RATE_TAU` (kept while the tenant is idle, so a
    /// quiet tenant between requests keeps its history), and when last updated.
    tokens: HashMap<String, (f64, Instant)>,
    /// Per tenant with tokens served of late, how fast its queue of prompts drains: at each
    /// first token, the prompt tokens that waited ahead of the request when it was admitted
    /// plus its own, over the time from admission to that token (beside other tenants, its
    /// share of the engines' prefill; with its prefix-cache hits); an exponentially weighted
    /// mean, known from the first request that streams.
    prefill_tps: HashMap<String, f64>,
}

/// The time constant of the tokens-served counts, seconds.
const RATE_TAU: f64 = 10.0;
/// A tenant is served "well below" its share under this fraction of it.
const LIGHT_SHARE: f64 = 0.8;

fn decayed(count: f64, since: Instant, now: Instant) -> f64 {
    count * (-now.saturating_duration_since(since).as_secs_f64() / RATE_TAU).exp()
}

impl State {
    /// `tenant`'s standing at `now`, over every replica whose figures are fresh.
    /// The other replicas' figures, while they are fresh at `now`.
    fn fresh_peers(&self, now: Instant) -> Option<&Peers> {
        self.peers
            .as_ref()
            .filter(|(_, at)| now.saturating_duration_since(*at) < PEERS_STALE)
            .map(|(p, _)| p)
    }

    /// `tenant`'s prompt tokens waiting for a first token, at every replica whose figures are
    /// fresh (what every admission reads, judged or not: only its own entries).
    fn waiting_tokens(&self, tenant: &str, now: Instant) -> u64 {
        let peer = self.fresh_peers(now).and_then(|p| p.tenants.get(tenant));
        self.tenants.get(tenant).map_or(0, |t| t.waiting_tokens)
            + peer.map_or(0, |p| p.waiting_tokens)
    }

    fn standing(&self, tenant: &str, now: Instant) -> Standing {
        let peers = self.fresh_peers(now);
        let peer = |t: &str| peers.and_then(|p| p.tenants.get(t)).copied().unwrap_or_default();
        let mut weights: HashMap<&str, u64> = HashMap::new();
        for (t, v) in &self.tenants {
            weights.insert(t, v.weight);
        }
        for (t, p) in peers.iter().flat_map(|p| &p.tenants).filter(|(_, p)| p.in_flight > 0) {
            let w = weights.entry(t).or_insert(p.weight);
            *w = (*w).max(p.weight);
        }
        let own_tokens = |t: &str| self.tokens.get(t).map_or(0.0, |&(c, at)| decayed(c, at, now));
        let (peers_in_flight, peers_tokens) = peers.map_or((0, 0.0), |p| (p.in_flight, p.tokens));
        Standing {
            in_flight: self.tenants.get(tenant).map_or(0, |t| t.in_flight) + peer(tenant).in_flight,
            waiting: self.tenants.get(tenant).map_or(0, |t| t.waiting) + peer(tenant).waiting,
            all_in_flight: self.tenants.values().map(|t| t.in_flight).sum::<u64>()
                + peers_in_flight,
            others_weight: weights.iter().filter(|(t, _)| **t != tenant).map(|(_, w)| w).sum(),
            served: own_tokens(tenant) + peer(tenant).tokens,
            all_served: self.tokens.values().map(|&(c, at)| decayed(c, at, now)).sum::<f64>()
                + peers_tokens,
        }
    }
}

/// Requests seen before the service time is trusted.
const WARM_UP: u64 = 8;
/// Weight of the newest sample in the service-time mean.
const ALPHA: f64 = 0.1;

/// The gateway's fair admission (shared by its request handlers).
#[derive(Debug, Default)]
pub struct FairShare {
    state: Mutex<State>,
}

/// A request's places (one per choice) in its tenant's count of sequences in flight; dropping
/// it gives them back.
#[derive(Debug)]
pub struct Slot {
    fair: Arc<FairShare>,
    tenant: String,
    places: u64,
    /// Its prompt's tokens, in its tenant's queue until it starts.
    tokens: u64,
    /// The tenant's prompt tokens waiting when it was admitted, and when.
    ahead: u64,
    admitted: Instant,
    /// Whether its first token went out (it no longer waits).
    started: bool,
}

impl Slot {
    /// The request's first token went out: it no longer waits in its tenant's queue, and
    /// how fast that queue drained is learned.
    pub fn start(&mut self) {
        self.start_at(Instant::now());
    }

    fn start_at(&mut self, now: Instant) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let Ok(mut s) = self.fair.state.lock() else { return };
        if let Some(t) = s.tenants.get_mut(&self.tenant) {
            t.waiting = t.waiting.saturating_sub(self.places);
            t.waiting_tokens = t.waiting_tokens.saturating_sub(self.tokens);
        }
        let seconds = now.saturating_duration_since(self.admitted).as_secs_f64();
        let drained = self.ahead + self.tokens;
        if drained > 0 && seconds > 0.0 {
            let tps = drained as f64 / seconds;
            s.prefill_tps
                .entry(self.tenant.clone())
                .and_modify(|r| *r = ALPHA * tps + (1.0 - ALPHA) * *r)
                .or_insert(tps);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Ok(mut s) = self.fair.state.lock() else { return };
        if let Some(t) = s.tenants.get_mut(&self.tenant) {
            t.in_flight = t.in_flight.saturating_sub(self.places);
            if !self.started {
                t.waiting = t.waiting.saturating_sub(self.places);
                t.waiting_tokens = t.waiting_tokens.saturating_sub(self.tokens);
            }
            if t.in_flight == 0 {
                s.tenants.remove(&self.tenant);
            }
        }
    }
}

/// What one admission looks at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judged {
    /// The tenant's sequences in flight, before this request's.
    pub in_flight: u64,
    /// Of those, the ones still waiting for a first token.
    pub waiting: u64,
    /// The prompt tokens of those waiting.
    pub waiting_tokens: u64,
    /// This request's prompt tokens (once, whatever its `n`).
    pub prompt_tokens: u64,
    /// How fast the tenant's queue of prompts drained of late, tokens a second (0: not known).
    pub prefill_tps: f64,
    /// This request's sequences (its `n`).
    pub wanted: u64,
    /// Every tenant's sequences in flight, before this request's.
    pub all_in_flight: u64,
    /// The tenant's weight.
    pub weight: u64,
    /// The weights of every tenant with requests in flight, this one's included.
    pub active_weight: u64,
    /// The places the backlogged engines are running.
    pub places: u64,
    /// How long a running request holds its place, seconds.
    pub service_s: f64,
    /// The tenant's TTFT target, seconds.
    pub ttft_target_s: f64,
    /// Tokens served to the tenant recently (decayed).
    pub served: f64,
    /// Tokens served to every tenant recently (decayed).
    pub all_served: f64,
}

/// The rule, pure: admitted (`None`)
/// - within the tenant's share of the places (work-conserving: alone, that is all of them);
/// - beside other tenants, while its queue of prompts drains in time (the prompts waiting
///   ahead of it, its own included, are prefilled within the target at the rate the tenant's
///   queue drained of late, or nothing of its own waits, so it always has one queued, or it is
///   served well below its weighted share of the tokens, or nothing was served of late), and
///   - it holds no more than its share of all the sequences in flight (one holding no more
///     than its share of the queue, its prompts draining, is not the one to turn away,
///     however the places the engines report move), or
///   - its share of the tokens served recently is within its weighted share and its requests
///     waiting for a first token, this one's included, are within its share of the places, or
///   - its share of the tokens served is well below its weighted share and either its requests
///     in flight or those waiting for a first token are within twice its share of the places;
/// - past those, while the requests ahead of this one in the tenant's own queue can start
///   within the target: its places turn over fast enough (`service_s` 0: not known yet), and
///   its prompts are prefilled in time as above (a queue of long prompts waits on prefill, not
///   on places).
///
/// Else the time after which trying again can succeed.
pub fn judge(j: Judged) -> Option<Duration> {
    let of = |total: u64| total as f64 * j.weight as f64 / j.active_weight.max(1) as f64;
    let share = of(j.places).max(1.0);
    let position = (j.in_flight + j.wanted.max(1)) as f64;
    let others = j.active_weight > j.weight;
    if position <= share {
        return None;
    }
    let within_tokens =
        j.all_served > 0.0 && j.served * (j.active_weight as f64) <= j.all_served * j.weight as f64;
    let served_little = j.all_served > 0.0
        && j.served * (j.active_weight as f64) < LIGHT_SHARE * j.all_served * j.weight as f64;
    // The prompts waiting ahead of it, its own included, at the rate its queue drained of late.
    let prefill = if j.prefill_tps > 0.0 {
        (j.waiting_tokens + j.prompt_tokens) as f64 / j.prefill_tps
    } else {
        0.0
    };
    // Beside others, the shares below admit a tenant only while its queue of prompts drains
    // within the target, or nothing of its own waits (so it always has one queued), or it is
    // served well below its share (a light tenant is never the one its queue turns away), or
    // nothing was served of late (no flood to tell it from).
    let drains =
        j.all_served <= 0.0 || served_little || j.waiting == 0 || prefill <= j.ttft_target_s;
    if others && drains && position <= of(j.all_in_flight + j.wanted.max(1)) {
        return None;
    }
    // Its own requests waiting for a first token, this one's included.
    let queue = (j.waiting + j.wanted.max(1)) as f64;
    let bound = if served_little { 2.0 * share } else { share };
    if others && drains && within_tokens && (queue <= bound || served_little && position <= bound) {
        return None;
    }
    // Its places turn over once per service time: the queue past the share starts at that rate.
    let turnover = (position - share) / share * j.service_s;
    let wait = turnover.max(prefill);
    (wait > j.ttft_target_s).then(|| Duration::from_secs_f64(wait - j.ttft_target_s))
}

impl FairShare {
    /// Admits a request of `tenant` (`weight`, TTFT target `ttft_target`) running `n`
    /// sequences on a prompt of `prompt_tokens`, or says when to retry. `places` is what the
    /// engines run while all of them have a backlog (`None`: some engine has room, so
    /// everything is admitted); without a target nothing is refused.
    pub fn admit(
        self: &Arc<Self>,
        tenant: &str,
        weight: u32,
        n: u64,
        prompt_tokens: u64,
        ttft_target: Option<Duration>,
        places: Option<u64>,
    ) -> Result<Slot, Duration> {
        let n = n.max(1);
        let now = Instant::now();
        let slot = |ahead: u64| Slot {
            fair: Arc::clone(self),
            tenant: tenant.to_owned(),
            places: n,
            tokens: prompt_tokens,
            ahead,
            admitted: now,
            started: false,
        };
        let Ok(mut s) = self.state.lock() else {
            // A poisoned count refuses nobody.
            return Ok(slot(0));
        };
        let weight = u64::from(weight.max(1));
        let ahead = s.waiting_tokens(tenant, now);
        let prefill_tps = s.prefill_tps.get(tenant).copied().unwrap_or(0.0);
        // Judged once the places' service time or the tenant's queue's drain rate is known.
        let known = s.samples >= WARM_UP || prefill_tps > 0.0;
        if let (Some(places), Some(target), true) = (places, ttft_target, known) {
            let st = s.standing(tenant, now);
            let j = Judged {
                in_flight: st.in_flight,
                waiting: st.waiting,
                waiting_tokens: ahead,
                prompt_tokens,
                prefill_tps,
                wanted: n,
                all_in_flight: st.all_in_flight,
                weight,
                active_weight: st.others_weight + weight,
                places,
                service_s: if s.samples >= WARM_UP { s.service_s } else { 0.0 },
                ttft_target_s: target.as_secs_f64(),
                served: st.served,
                all_served: st.all_served,
            };
            if let Some(retry) = judge(j) {
                tracing::debug!(tenant, ?j, ?retry, "fair admission refused");
                return Err(retry);
            }
        }
        let t = s.tenants.entry(tenant.to_owned()).or_default();
        t.in_flight += n;
        t.waiting += n;
        t.waiting_tokens += prompt_tokens;
        t.weight = weight;
        Ok(slot(ahead))
    }

    /// A request held its place for `seconds` (the engine's prefill and decode).
    pub fn served(&self, seconds: f64) {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let Ok(mut s) = self.state.lock() else { return };
        s.service_s =
            if s.samples == 0 { seconds } else { ALPHA * seconds + (1.0 - ALPHA) * s.service_s };
        s.samples += 1;
    }

    /// `tokens` of `tenant`'s were served: a request's prompt once it is admitted, its
    /// completion as it ends.
    pub fn used(&self, tenant: &str, tokens: u64) {
        let Ok(mut s) = self.state.lock() else { return };
        let now = Instant::now();
        // Counts decayed to nothing are dropped (bounded memory).
        s.tokens.retain(|_, &mut (c, at)| decayed(c, at, now) >= 1.0);
        let e = s.tokens.entry(tenant.to_owned()).or_insert((0.0, now));
        *e = (decayed(e.0, e.1, now) + tokens as f64, now);
        let State { tokens, prefill_tps, .. } = &mut *s;
        prefill_tps.retain(|t, _| tokens.contains_key(t));
    }

    /// Whether `n` more sequences of `tenant` (`weight`) would hold more than its weighted
    /// share of every sequence in flight (at every replica whose figures are fresh), theirs
    /// included. A tenant alone
    /// holds all of it; beside others, one that floods the engines' queues is past its share
    /// and one that sends a request now and then is not, so a full queue turns away the
    /// flood, not everyone.
    pub fn past_queue_share(&self, tenant: &str, weight: u32, n: u64) -> bool {
        let Ok(s) = self.state.lock() else { return true };
        let weight = u64::from(weight.max(1));
        let n = n.max(1);
        let st = s.standing(tenant, Instant::now());
        let (mine, all) = (st.in_flight + n, st.all_in_flight + n);
        if st.others_weight == 0 {
            return true;
        }
        (mine as f64) > all as f64 * weight as f64 / (st.others_weight + weight) as f64
    }

    /// Sequences in flight of `tenant` at this replica.
    pub fn in_flight(&self, tenant: &str) -> u64 {
        self.state.lock().map_or(0, |s| s.tenants.get(tenant).map_or(0, |t| t.in_flight))
    }

    /// Sequences in flight of `tenant` at every replica whose figures are fresh.
    pub fn in_flight_everywhere(&self, tenant: &str) -> u64 {
        self.state.lock().map_or(0, |s| s.standing(tenant, Instant::now()).in_flight)
    }

    /// What this replica publishes to the others: per tenant with work in flight or tokens
    /// served of late, its figures now.
    pub fn published(&self) -> HashMap<String, Published> {
        let Ok(s) = self.state.lock() else { return HashMap::new() };
        let now = Instant::now();
        let mut out: HashMap<String, Published> = s
            .tenants
            .iter()
            .map(|(t, v)| {
                let p = Published {
                    in_flight: v.in_flight,
                    waiting: v.waiting,
                    waiting_tokens: v.waiting_tokens,
                    weight: v.weight,
                    tokens: 0.0,
                };
                (t.clone(), p)
            })
            .collect();
        for (t, &(c, at)) in &s.tokens {
            out.entry(t.clone()).or_default().tokens = decayed(c, at, now);
        }
        out
    }

    /// The other replicas' figures as just read (`None`: they could not be, and this replica
    /// judges alone).
    pub fn set_peers(&self, peers: Option<Peers>) {
        if let Ok(mut s) = self.state.lock() {
            s.peers = peers.map(|p| (p, Instant::now()));
        }
    }

    /// The other replicas whose figures are used now.
    pub fn peer_replicas(&self) -> usize {
        let Ok(s) = self.state.lock() else { return 0 };
        s.peers.as_ref().filter(|(_, at)| at.elapsed() < PEERS_STALE).map_or(0, |(p, _)| p.replicas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt's tokens, where they do not matter (no prefill rate is known).
    const PROMPT: u64 = 128;

    fn j(in_flight: u64, weight: u64, active_weight: u64) -> Judged {
        Judged {
            in_flight,
            waiting: in_flight,
            waiting_tokens: 0,
            prompt_tokens: PROMPT,
            prefill_tps: 0.0,
            wanted: 1,
            all_in_flight: in_flight,
            weight,
            active_weight,
            places: 12,
            service_s: 6.0,
            ttft_target_s: 1.0,
            served: 0.0,
            all_served: 0.0,
        }
    }

    #[test]
    fn the_share_is_weighted_and_the_queue_past_it_is_bounded_by_the_target() {
        // Two equal tenants of 12 places: 6 each. The 6th request is within the share.
        assert_eq!(judge(j(5, 1, 2)), None);
        // The 7th waits (7 - 6) / 6 x 6 s = 1 s: just within a 1 s target.
        assert_eq!(judge(j(6, 1, 2)), None);
        // The 8th would wait 2 s: refused, to retry after the 1 s past the target.
        assert_eq!(judge(j(7, 1, 2)), Some(Duration::from_secs(1)));
        // Weight 2 against weight 1: 8 of the 12 places.
        assert_eq!(judge(j(7, 2, 3)), None);
        assert!(judge(j(9, 2, 3)).is_some());
        // Alone, a tenant has every place (work-conserving).
        assert_eq!(judge(j(11, 1, 1)), None);
        // Even a tiny share is one place.
        assert_eq!(judge(Judged { places: 1, ..j(0, 1, 100) }), None);
        // A request of n choices takes n places: 5 in flight + 3 wanted is the 8th place.
        assert_eq!(judge(Judged { wanted: 3, ..j(5, 1, 2) }), Some(Duration::from_secs(1)));
        // However few places the engines report, a tenant within its share of everything in
        // flight is admitted: 3 of 40 against an equal neighbour.
        let few = Judged { places: 2, all_in_flight: 40, ..j(3, 1, 2) };
        assert_eq!(judge(few), None);
        // The neighbour holding 37 of them is judged by the places.
        assert!(judge(Judged { places: 2, all_in_flight: 40, ..j(37, 1, 2) }).is_some());
        // A tenant served a quarter of the tokens of late, against an equal neighbour (half),
        // is admitted up to twice its 6 places; at 80% of its share it is judged by places.
        let little = |in_flight: u64, served: f64| Judged {
            all_in_flight: 14,
            served,
            all_served: 1000.0,
            ..j(in_flight, 1, 2)
        };
        assert_eq!(judge(little(9, 250.0)), None);
        assert!(judge(little(12, 250.0)).is_some(), "past twice its places");
        assert!(judge(little(9, 400.0)).is_some(), "not well below its share");
        // Alone, the tokens served say nothing.
        assert!(judge(Judged { served: 0.0, all_served: 1000.0, ..j(15, 1, 1) }).is_some());
    }

    #[test]
    fn a_tenant_within_its_tokens_is_judged_by_its_own_queue() {
        // As measured beside a flood of 1,024-token prompts: the engines run 2 places (a
        // share of 1), the quiet tenant (weight 2 of 4) has 2 requests decoding, the flood 2
        // prefilling, and the quiet tenant was served 16% of the tokens of late.
        let quiet = Judged {
            in_flight: 2,
            waiting: 0,
            all_in_flight: 4,
            places: 2,
            served: 730.0,
            all_served: 4489.0,
            ..j(2, 2, 4)
        };
        assert_eq!(judge(quiet), None);
        // One of its own waiting and this one: twice its share, still admitted (it is served
        // well below its share).
        assert_eq!(judge(Judged { waiting: 1, ..quiet }), None);
        // Two waiting and this one: past twice its share, the places judge it.
        assert!(judge(Judged { waiting: 2, ..quiet }).is_some());
        // Served 40% against a 50% share (within it, not well below): its queue may be its
        // share of the places, 1, and no more.
        let near = Judged { served: 1800.0, ..quiet };
        assert_eq!(judge(near), None);
        assert!(judge(Judged { waiting: 1, ..near }).is_some());
        // Past its share of the tokens (60% against 50%), nothing waiting does not help.
        assert!(judge(Judged { served: 2700.0, ..quiet }).is_some());
        // Alone, a tenant is judged by the places.
        assert!(judge(Judged { active_weight: 2, ..quiet }).is_some());
    }

    #[test]
    fn a_request_waits_until_its_first_token() -> Result<(), Duration> {
        let fair = Arc::new(FairShare::default());
        let target = Some(Duration::from_secs(1));
        let waiting = |f: &FairShare| f.published().get("t").map_or(0, |p| p.waiting);
        let mut a = fair.admit("t", 1, 2, PROMPT, target, None)?;
        let b = fair.admit("t", 1, 1, PROMPT, target, None)?;
        assert_eq!(waiting(&fair), 3);
        a.start();
        a.start();
        assert_eq!(waiting(&fair), 1, "two choices started, once");
        drop(b);
        assert_eq!(waiting(&fair), 0, "an answer that ends unstarted waits no more");
        drop(a);
        assert_eq!(fair.in_flight("t"), 0);
        Ok(())
    }

    #[test]
    fn places_are_counted_and_given_back() {
        let fair = Arc::new(FairShare::default());
        let target = Some(Duration::from_secs(1));
        for _ in 0..WARM_UP {
            fair.served(6.0);
        }
        // No backlog: everything is admitted.
        let free: Vec<Slot> =
            (0..20).filter_map(|_| fair.admit("noisy", 1, 1, PROMPT, target, None).ok()).collect();
        assert_eq!((free.len(), fair.in_flight("noisy")), (20, 20));
        drop(free);
        assert_eq!(fair.in_flight("noisy"), 0);
        // A backlog of 4 places: the noisy tenant, alone, gets 4 and the queue that starts
        // within its target (4 x (1 + 1 s / 6 s) = 4.67); a quiet tenant still gets in.
        let mut held = Vec::new();
        while let Ok(s) = fair.admit("noisy", 1, 1, PROMPT, target, Some(4)) {
            held.push(s);
        }
        assert_eq!(held.len(), 4);
        let retry = fair.admit("noisy", 1, 1, PROMPT, target, Some(4)).err();
        assert!(retry.is_some_and(|r| r > Duration::ZERO));
        let quiet = fair.admit("quiet", 1, 1, PROMPT, target, Some(4));
        assert!(quiet.is_ok(), "the quiet tenant is within its share");
        // Without a TTFT target nobody is refused.
        let untargeted = fair.admit("noisy", 1, 3, PROMPT, None, Some(4));
        assert_eq!(fair.in_flight("noisy"), 7, "three more places");
        drop((held, untargeted));
        assert_eq!(fair.in_flight("noisy"), 0);
        assert_eq!(fair.in_flight("quiet"), 1);
    }

    /// What `from` publishes, as the other replica reads it.
    fn peers_of(from: &FairShare) -> Peers {
        let mut p = Peers::default();
        p.add(&from.published());
        p
    }

    /// Admits `tenant`'s requests alternately at `a` and `b` until both refuse; with
    /// `exchange`, each reads the other's figures after every admission.
    fn split_flood(a: &Arc<FairShare>, b: &Arc<FairShare>, exchange: bool) -> Vec<Slot> {
        let target = Some(Duration::from_secs(1));
        let mut held = Vec::new();
        let mut refused = [false, false];
        while !refused.iter().all(|r| *r) {
            for (i, f) in [a, b].into_iter().enumerate() {
                match f.admit("flood", 1, 1, PROMPT, target, Some(12)) {
                    Ok(slot) => held.push(slot),
                    Err(_) => refused[i] = true,
                }
                if exchange {
                    a.set_peers(Some(peers_of(b)));
                    b.set_peers(Some(peers_of(a)));
                }
            }
        }
        held
    }

    #[test]
    fn replicas_sharing_their_figures_judge_a_split_load_as_one() -> Result<(), Duration> {
        let target = Some(Duration::from_secs(1));
        let pair = || -> Result<_, Duration> {
            let (a, b) = (Arc::new(FairShare::default()), Arc::new(FairShare::default()));
            for f in [&a, &b] {
                for _ in 0..WARM_UP {
                    f.served(6.0);
                }
            }
            // A quiet tenant (weight 1, as the flood) has one request in flight at a.
            let quiet = a.admit("quiet", 1, 1, PROMPT, target, Some(12))?;
            Ok((a, b, quiet))
        };
        // 12 places, 6 each; the flood's queue past its 6 starts within 1 s up to the 7th.
        let (a, b, _quiet) = pair()?;
        let shared = split_flood(&a, &b, true);
        assert_eq!(shared.len(), 7, "split over two replicas, judged as one");
        assert_eq!(a.in_flight_everywhere("flood"), 7);
        assert_eq!(b.in_flight_everywhere("quiet"), 1);
        assert_eq!(b.peer_replicas(), 1);
        // Each judging alone: a admits 7 beside the quiet tenant, b (which has never seen it)
        // the flood's whole 12 places and its queue, 14.
        let (a, b, _quiet) = pair()?;
        let alone = split_flood(&a, &b, false);
        assert_eq!(alone.len(), 21);
        // The others' figures gone (Redis down), a replica judges by its own again.
        b.set_peers(None);
        assert_eq!((b.in_flight_everywhere("flood"), b.peer_replicas()), (14, 0));
        // Tokens served at a are published with its requests in flight, and counted at b.
        a.used("quiet", 100);
        a.used("flood", 900);
        let published = a.published();
        assert_eq!(published["quiet"].in_flight, 1);
        assert!((published["flood"].tokens - 900.0).abs() < 1.0, "{published:?}");
        b.set_peers(Some(peers_of(&a)));
        let at_b = b.state.lock().map(|s| s.standing("quiet", Instant::now())).ok();
        let (served, all) = at_b.map_or((0.0, 0.0), |st| (st.served, st.all_served));
        assert!((served - 100.0).abs() < 1.0 && (all - 1000.0).abs() < 2.0, "{served} {all}");
        Ok(())
    }

    #[test]
    fn nobody_is_refused_before_the_service_time_or_a_drain_rate_is_known() {
        let fair = Arc::new(FairShare::default());
        let target = Some(Duration::from_millis(1));
        let held: Vec<Slot> =
            (0..10).filter_map(|_| fair.admit("t", 1, 1, PROMPT, target, Some(1)).ok()).collect();
        assert_eq!(held.len(), 10);
        fair.served(f64::NAN);
        fair.served(-1.0);
        assert_eq!(fair.state.lock().map(|s| s.samples).unwrap_or(99), 0);
    }

    #[test]
    fn a_full_queue_turns_away_the_tenant_past_its_share_not_everyone() -> Result<(), Duration> {
        let fair = Arc::new(FairShare::default());
        // The flood: 40 requests of n = 8 from one tenant.
        let mut held = Vec::new();
        for _ in 0..40 {
            held.push(fair.admit("flood", 1, 8, PROMPT, None, None)?);
        }
        // Alone, the tenant holding the queue is past its share.
        assert!(fair.past_queue_share("flood", 1, 1));
        // A quiet tenant's request (and one of n = 8) is within its share of what is in flight.
        assert!(!fair.past_queue_share("quiet", 1, 1));
        assert!(!fair.past_queue_share("quiet", 1, 8));
        held.push(fair.admit("quiet", 1, 8, PROMPT, None, None)?);
        // The flood's next, beside the quiet one, is still past its share; n counts.
        assert!(fair.past_queue_share("flood", 1, 1));
        assert!(!fair.past_queue_share("quiet", 1, 8));
        assert!(fair.past_queue_share("quiet", 1, 400));
        // Weight counts: a weight-100 tenant's share of 329 sequences is 326.
        assert!(!fair.past_queue_share("big", 100, 300));
        drop(held);
        assert_eq!(fair.in_flight("flood"), 0);
        Ok(())
    }

    #[test]
    fn a_queue_of_long_prompts_is_bounded_by_its_prefill_not_its_places() {
        // Alone on 4 places turning over every 6 s, the 5th request would wait 1.5 s by
        // turnover: refused after 0.5 s. The 4th is within the share whatever it waits.
        let alone = |in_flight: u64, waiting_tokens: u64, prefill_tps: f64| Judged {
            waiting: in_flight,
            waiting_tokens,
            prompt_tokens: 1024,
            prefill_tps,
            places: 4,
            ..j(in_flight, 1, 1)
        };
        assert_eq!(judge(alone(3, 8 * 1024, 1000.0)), None);
        // The 5th, with no prefill rate known yet: by turnover alone, (5 - 4) / 4 x 6 s.
        let by_places = judge(alone(4, 0, 0.0));
        assert_eq!(by_places, Some(Duration::from_secs_f64(0.5)));
        // Four 1,024-token prompts waiting at 2,000 tokens a second, and its own: 2.56 s.
        let by_prefill = judge(alone(4, 4 * 1024, 2000.0));
        assert_eq!(by_prefill, Some(Duration::from_secs_f64(5.0 * 1024.0 / 2000.0 - 1.0)));
        // The same queue prefilled fast enough waits by its places only.
        assert_eq!(judge(alone(4, 4 * 1024, 100_000.0)), by_places);
        // A short queue behind places that turn over fast: admitted.
        let quick = Judged { service_s: 1.0, ..alone(4, 1024, 4096.0) };
        assert_eq!(judge(quick), None);
        // The same places, a queue of 8 long prompts ahead: refused.
        assert!(judge(Judged { service_s: 1.0, ..alone(4, 8 * 1024, 4096.0) }).is_some());
    }

    #[test]
    fn beside_others_a_queue_of_long_prompts_is_bounded_by_its_prefill_too() {
        // As measured beside a decode flood and a vip tenant: 8 places, 40 sequences in
        // flight, the prefill flood (weight 2 of 6) holding 6 of them, 4 of its 1,024-token
        // prompts waiting, its queue draining at 800 tokens a second and its places turning
        // over every 0.5 s. Its share of everything in flight is 41 / 3 = 13.7, so that alone
        // admitted it; its queue would wait (4 + 1) x 1,024 / 800 = 6.4 s. It was served half
        // the tokens of late.
        let flood = Judged {
            waiting: 4,
            waiting_tokens: 4 * 1024,
            prompt_tokens: 1024,
            prefill_tps: 800.0,
            all_in_flight: 40,
            places: 8,
            service_s: 0.5,
            served: 2000.0,
            all_served: 4000.0,
            ..j(6, 2, 6)
        };
        let past = 5.0 * 1024.0 / 800.0 - 1.0;
        assert_eq!(judge(flood), Some(Duration::from_secs_f64(past)));
        // Nothing of its own waiting: admitted, so the engines always have one of its prompts.
        assert_eq!(judge(Judged { waiting: 0, waiting_tokens: 0, ..flood }), None);
        // One waiting, drained in 2,048 / 2,048 = 1 s: within the target.
        let one = Judged { waiting: 1, waiting_tokens: 1024, prefill_tps: 2048.0, ..flood };
        assert_eq!(judge(one), None);
        // No drain rate known yet: judged by its share of what is in flight, as before.
        assert_eq!(judge(Judged { prefill_tps: 0.0, ..flood }), None);
        // Nothing served of late by anyone: no flood to tell it from.
        assert_eq!(judge(Judged { all_served: 0.0, ..flood }), None);
        // Served well below its share of the tokens (2.5% against 33%), it is a light tenant
        // whatever its queue's rate: admitted. Near its share (30%), its queue judges it.
        assert_eq!(judge(Judged { served: 100.0, all_served: 4000.0, ..flood }), None);
        let near = Judged { served: 1200.0, all_served: 4000.0, ..flood };
        assert_eq!(judge(near), Some(Duration::from_secs_f64(past)));
        // A tenant near its share with one short prompt waiting, drained fast, is admitted as
        // before.
        let quiet = Judged {
            waiting: 1,
            waiting_tokens: 128,
            prompt_tokens: 128,
            prefill_tps: 1000.0,
            served: 1200.0,
            all_served: 4000.0,
            ..j(2, 2, 6)
        };
        assert_eq!(judge(Judged { all_in_flight: 40, places: 8, ..quiet }), None);
    }

    #[test]
    fn prompts_wait_in_their_tenants_queue_until_their_first_token() -> Result<(), Duration> {
        let fair = Arc::new(FairShare::default());
        let target = Some(Duration::from_secs(1));
        let queued = |f: &FairShare| f.published().get("t").map_or(0, |p| p.waiting_tokens);
        let mut a = fair.admit("t", 1, 1, 1000, target, None)?;
        let b = fair.admit("t", 1, 2, 300, target, None)?;
        assert_eq!(queued(&fair), 1300, "one prompt a request, whatever its n");
        a.start();
        assert_eq!(queued(&fair), 300);
        drop(b);
        assert_eq!(queued(&fair), 0, "an answer that ends unstarted waits no more");
        drop(a);
        // Another replica's queue counts at this one.
        let other = Arc::new(FairShare::default());
        let _c = other.admit("t", 1, 1, 700, target, None)?;
        fair.set_peers(Some(peers_of(&other)));
        let waiting = fair.state.lock().map(|s| s.waiting_tokens("t", Instant::now())).ok();
        assert_eq!(waiting, Some(700));
        Ok(())
    }

    #[test]
    fn a_tenants_queue_drain_rate_is_learned_at_first_tokens_and_bounds_its_queue()
    -> Result<(), Duration> {
        let fair = Arc::new(FairShare::default());
        let target = Some(Duration::from_secs(1));
        let rate =
            |f: &FairShare| f.state.lock().ok().and_then(|s| s.prefill_tps.get("t").copied());
        let at = |slot: &Slot, seconds: f64| slot.admitted + Duration::from_secs_f64(seconds);
        // Nothing known yet (no service time, no drain rate): a backlog refuses nobody.
        let mut first = fair.admit("t", 1, 1, 1024, target, Some(4))?;
        assert_eq!(rate(&fair), None);
        // Its first token 0.5 s after admission: 2,048 prompt tokens a second.
        first.start_at(at(&first, 0.5));
        assert_eq!(rate(&fair), Some(2048.0));
        first.start_at(at(&first, 0.1));
        assert_eq!(rate(&fair), Some(2048.0), "a request starts once");
        // The service time still unknown, its queue is judged by its prefill: the 4 places
        // hold the first and three more; a fifth would wait (3 x 1,024 + 1,024) / 2,048 = 2 s.
        let mut held = Vec::new();
        while let Ok(slot) = fair.admit("t", 1, 1, 1024, target, Some(4)) {
            held.push(slot);
        }
        assert_eq!(held.len(), 3);
        // Two start, each behind those admitted before it, at the same rate.
        for (k, slot) in held.iter_mut().enumerate().take(2) {
            let t = at(slot, 0.5 * (k + 1) as f64);
            slot.start_at(t);
        }
        assert_eq!(rate(&fair), Some(2048.0));
        // One prompt waits now: (1,024 + 1,024) / 2,048 = 1 s, within the target.
        let fifth = fair.admit("t", 1, 1, 1024, target, Some(4))?;
        // Behind two, even 16 tokens wait 2,064 / 2,048 s: refused for the 1/128 s past it.
        let short = fair.admit("t", 1, 1, 16, target, Some(4)).err();
        assert_eq!(short, Some(Duration::from_secs_f64(0.0078125)));
        // Without a target, or without a backlog, nobody is refused.
        let untargeted = fair.admit("t", 1, 1, 4096, None, Some(4))?;
        let free = fair.admit("t", 1, 1, 4096, target, None)?;
        drop((first, held, fifth, untargeted, free));
        assert_eq!(fair.in_flight("t"), 0);
        Ok(())
    }
}
