//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, seeded.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// Sampling parameters of one request (validated by the caller's request layer).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// 0.0 means no min-p cut.
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency_penalty: f32,
    /// Seed; the same seed and inputs give the same tokens.
    pub seed: u64,
    /// Added to these tokens' logits before any other transform (OpenAI's `logit_bias`,
    /// -100 to 100: -100 all but bans a token, 100 all but forces it). Log-probabilities stay
    /// the model's own.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// Per-request sampler state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    counts: std::collections::HashMap<u32, u32>,
}

/// A token and its log-probability, with the top alternatives when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// Chosen token.
    pub token: u32,
    /// Its log-probability under the model's raw distribution (before sampling transforms);
    /// NaN unless log-probabilities were asked for (computing them costs a softmax).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for one request.
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler { params, rng, counts: Default::default() }
    }

    /// Picks the next token from `logits`; with `logprobs = Some(k)` also its log-probability
    /// and `k` alternatives.
    pub fn sample(&mut self, logits: &[f32], logprobs: Option<usize>) -> Sampled {
        let token = self.choose(logits);
        self.commit(token, logits, logprobs)
    }

    /// The token [`sample`](Self::sample) would pick from `logits`, not yet taken: a
    /// constrained request may refuse it and choose again among other logits.
    pub fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.argmax_only(None) { argmax(logits) } else { self.pick(logits) }
    }

    /// Takes `token` as the next, with its log-probability under `logits` when asked.
    pub fn commit(&mut self, token: u32, logits: &[f32], logprobs: Option<usize>) -> Sampled {
        *self.counts.entry(token).or_insert(0) += 1;
        let Some(k) = logprobs else {
            return Sampled { token, logprob: f32::NAN, top: Vec::new() };
        };
        let lp = log_softmax(logits);
        Sampled {
            token,
            logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
            top: top_n(&lp, k),
        }
    }

    /// Whether the next token is the plain argmax of the logits with nothing else needed
    /// from them (greedy, no penalties, no log-probabilities): then the backend may choose it
    /// where the logits are ([`Backend::forward_picking`](crate::backend::Backend::forward_picking))
    /// and hand it to [`Sampler::accept`].
    pub fn argmax_only(&self, logprobs: Option<usize>) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logit_bias.is_empty()
            && logprobs.is_none()
    }

    /// When the next token is a plain draw (temperature above 0, top-k/top-p cuts only, no
    /// penalties, no min-p, no log-probabilities), the draw for a device to make
    /// ([`Pick::Draw`](crate::forward::Pick::Draw)), with its uniform taken from this
    /// request's seeded generator (one value per token, as a host draw takes). The device
    /// walks tokens in id order, the host in probability order: the same seed gives the same
    /// tokens on one backend, not across backends.
    pub fn device_draw(&mut self, logprobs: Option<usize>) -> Option<crate::forward::Pick> {
        let p = &self.params;
        if p.temperature.is_nan()
            || p.temperature <= 0.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || p.min_p > 0.0
            || !p.logit_bias.is_empty()
            || logprobs.is_some()
        {
            return None;
        }
        let uniform = (self.rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        Some(crate::forward::Pick::Draw {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            uniform,
        })
    }

    /// Takes a token chosen elsewhere by [`Sampler::argmax_only`]'s rule, as
    /// [`Sampler::sample`] would have returned it.
    pub fn accept(&mut self, token: u32) -> Sampled {
        *self.counts.entry(token).or_insert(0) += 1;
        Sampled { token, logprob: f32::NAN, top: Vec::new() }
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        let mut adjusted: Vec<f32> = logits.to_vec();
        let p = &self.params;
        for &(tok, bias) in &p.logit_bias {
            if let Some(l) = adjusted.get_mut(tok as usize) {
                *l += bias;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&tok, &n) in &self.counts {
                if let Some(l) = adjusted.get_mut(tok as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        if p.temperature <= 0.0 { argmax(&adjusted) } else { self.draw(&adjusted) }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let top = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) / p.temperature;
        // Tokens less likely than e^-30 of the best cannot matter; leaving them out spares
        // sorting the whole vocabulary at every step.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .filter(|c| c.1 >= top - 30.0)
            .collect();
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_prob);
            cand.truncate(p.top_k);
        }
        // Ties broken by token id so the order (and so the draw) is deterministic.
        cand.sort_unstable_by(by_prob);
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.min_p > 0.0 {
            let floor = p.min_p * probs.first().copied().unwrap_or(0.0);
            let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            probs.truncate(keep);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let mut target = u as f32 * total;
        for (i, x) in probs.iter().enumerate() {
            if target < *x {
                return cand[i].0;
            }
            target -= x;
        }
        cand[probs.len().saturating_sub(1)].0
    }
}

/// Index of the largest value (the lowest index on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let Some(&first) = x.first() else { return 0 };
    // The largest value first, in 16 lanes the compiler keeps in vector registers (each
    // lane starts at `x[0]` and takes only what is strictly greater, so NaNs are passed
    // over, and a NaN at 0 wins, as a plain scan from 0 would have it); then its first place.
    let mut lanes = [first; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let mut max = first;
    for &v in lanes.iter().chain(tail) {
        if v > max {
            max = v;
        }
    }
    x.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Log-softmax in f64 accumulation.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = sum.ln() as f32 + max;
    logits.iter().map(|&l| l - lse).collect()
}

/// The `n` largest entries, best first (ties by lower id).
pub fn top_n(x: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut v: Vec<(u32, f32)> = x.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let n = n.min(v.len());
    v.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v.truncate(n);
    v.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 7919) % 97) as f32 / 10.0).collect()
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let l = logits();
        let s = Sampler::new(SamplingParams::default()).sample(&l, Some(3));
        assert_eq!(s.token, argmax(&l));
        assert_eq!(s.top.len(), 3);
        assert_eq!(s.top[0].0, s.token);
        assert!(s.top[0].1 >= s.top[1].1 && s.top[1].1 >= s.top[2].1);
    }

    #[test]
    fn argmax_is_the_first_largest_as_a_plain_scan_finds_it() {
        fn scan(x: &[f32]) -> u32 {
            let mut best = 0;
            for (i, v) in x.iter().enumerate() {
                if *v > x[best] {
                    best = i;
                }
            }
            best as u32
        }
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![f32::NAN, 5.0, 7.0],
            vec![f32::NEG_INFINITY; 40],
            vec![-0.0, 0.0, -0.0],
        ];
        for n in [15, 16, 17, 33, 1000] {
            let base: Vec<f32> = (0..n).map(|i| ((i * 7919) % 97) as f32 - 50.0).collect();
            cases.push(base.clone());
            // Ties: the largest value at several places, one of them in the tail.
            let mut ties = base.clone();
            for i in [3, n / 2, n - 1] {
                ties[i] = 1e9;
            }
            cases.push(ties);
            let mut nans = base.clone();
            nans.iter_mut().skip(1).step_by(5).for_each(|v| *v = f32::NAN);
            cases.push(nans);
        }
        for c in &cases {
            assert_eq!(argmax(c), scan(c), "{c:?}");
        }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let l = logits();
        let run = |seed| {
            let mut s =
                Sampler::new(SamplingParams { temperature: 5.0, seed, ..Default::default() });
            (0..32).map(|_| s.sample(&l, None).token).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_restricts() {
        let l = logits();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            seed: 3,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&l, None).token == argmax(&l)));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            seed: 3,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&l, None).token == argmax(&l)));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.999,
            seed: 3,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&l, None).token == argmax(&l)));
    }

    #[test]
    fn penalties_move_away_from_repeats() {
        let l = vec![1.0, 0.9, 0.0];
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..Default::default() });
        assert_eq!(s.sample(&l, None).token, 0);
        assert_eq!(s.sample(&l, None).token, 1);
    }

    #[test]
    fn logit_bias_moves_greedy_and_sampled_choices_alike() {
        let l = logits();
        let best = argmax(&l);
        let other = (best + 1) % 100;
        // Greedy: a bias of 100 makes another token the choice, -100 bans the best.
        let bias = |b: Vec<(u32, f32)>| SamplingParams { logit_bias: b, ..Default::default() };
        let mut s = Sampler::new(bias(vec![(other, 100.0)]));
        assert!(!s.argmax_only(None) && s.device_draw(None).is_none());
        assert_eq!(s.sample(&l, None).token, other);
        let banned = Sampler::new(bias(vec![(best, -100.0)])).sample(&l, None).token;
        assert_ne!(banned, best);
        // Sampled: never the banned token, and log-probabilities stay the model's.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 5,
            logit_bias: vec![(best, -100.0)],
            ..Default::default()
        });
        for _ in 0..50 {
            let t = s.sample(&l, Some(1));
            assert_ne!(t.token, best);
            assert_eq!(t.top[0].0, best, "the model's own best stays first");
        }
        // An id past the vocabulary changes nothing (the request layer refuses it anyway).
        assert_eq!(Sampler::new(bias(vec![(1000, 100.0)])).sample(&l, None).token, best);
    }
}
