//! How long a step takes, learned from the engine's own steps: the model behind SLO-aware batch
//! control. A step's time is fitted as `a + b * tokens + c * context`, where `tokens` are the
//! tokens the step computes (one per decoding request, a chunk per prefilling one) and
//! `context` the cached tokens their attention reads. The fit is least squares over an
//! exponentially decayed window of recent steps (so it follows a device that heats up or a
//! machine that gets busier), the same on CPU and GPU.
//!
//! What a running request feels is the mean of all the steps it is in, and some of those also
//! carry newcomers' prefill chunks. So the model also keeps the recent ratio of each step's
//! time to a pure decode step of the same sequences, and [`StepModel::predict_tpot`] scales
//! the decode prediction by it: the time per output token a batch of that shape gives its
//! requests, prefills included. Plain synchronous state.

/// Steps observed before the model predicts anything.
const WARM_UP: u64 = 16;

/// Weight of the previous steps at each new one (an effective window of ~200 steps).
const DECAY: f64 = 0.995;

/// Feature scales, so the normal equations stay well conditioned.
const TOKEN_SCALE: f64 = 100.0;
const CONTEXT_SCALE: f64 = 10_000.0;

/// Ridge term added to the normal equations' diagonal.
const RIDGE: f64 = 1e-9;

/// Weight of each new step in the prefill slowdown's running mean.
const SLOWDOWN_ALPHA: f64 = 0.02;

/// The shape of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens computed.
    pub tokens: usize,
    /// Cached tokens read by their attention.
    pub context: usize,
    /// Sequences in the step.
    pub seqs: usize,
    /// Of them, sequences decoding (one new token past their prompt).
    pub decoding: usize,
}

/// A pure decode step of `seqs` sequences (test helper and shorthand).
#[cfg(test)]
pub(crate) fn decode(seqs: usize, context: usize) -> StepShape {
    StepShape { tokens: seqs, context, seqs, decoding: seqs }
}

/// The online step-time model (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct StepModel {
    /// Decayed sums of `x xᵀ` and `x y` for `x = [1, tokens, context]` (scaled).
    xtx: [[f64; 3]; 3],
    xty: [f64; 3],
    samples: u64,
    /// The fitted coefficients (seconds per unit of each scaled feature), once warm.
    fit: Option<[f64; 3]>,
    /// Recent mean of (step time / pure decode step of its sequences); 1 until measured.
    slowdown: Option<f64>,
}

fn features(tokens: usize, context: usize) -> [f64; 3] {
    [1.0, tokens as f64 / TOKEN_SCALE, context as f64 / CONTEXT_SCALE]
}

impl StepModel {
    /// Records that a step of `seqs` sequences (`decoding` of them producing a token each),
    /// computing `tokens` tokens and reading `context` cached ones, took `seconds`.
    pub fn observe(&mut self, shape: StepShape, seconds: f64) {
        let StepShape { tokens, context, seqs, decoding } = shape;
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = features(tokens, context);
        for i in 0..3 {
            for j in 0..3 {
                self.xtx[i][j] = DECAY * self.xtx[i][j] + x[i] * x[j];
            }
            self.xty[i] = DECAY * self.xty[i] + x[i] * seconds;
        }
        self.samples += 1;
        if self.samples >= WARM_UP {
            self.fit = solve(self.xtx, self.xty).map(|c| {
                // A step never gets faster for more work: a negative slope (noise, or two
                // features moving together) counts as none.
                [c[0], c[1].max(0.0), c[2].max(0.0)]
            });
        }
        // Only steps that a decoding request sat through say what the batch feels.
        if decoding == 0 {
            return;
        }
        if let Some(decode) = self.predict(seqs, context).filter(|d| *d > 0.0) {
            let ratio = (seconds / decode).clamp(0.5, 1000.0);
            let s = self.slowdown.get_or_insert(ratio);
            *s += SLOWDOWN_ALPHA * (ratio - *s);
        }
    }

    /// The time per output token a decode batch of `seqs` sequences reading `context` tokens
    /// gives its requests, with the recent share of prefill work (`None` until warm).
    pub fn predict_tpot(&self, seqs: usize, context: usize) -> Option<f64> {
        Some(self.predict(seqs, context)? * self.slowdown.unwrap_or(1.0).max(1.0))
    }

    /// The predicted time of a step of this shape, in seconds (`None` until warm).
    pub fn predict(&self, tokens: usize, context: usize) -> Option<f64> {
        let c = self.fit?;
        let x = features(tokens, context);
        Some((c[0] * x[0] + c[1] * x[1] + c[2] * x[2]).max(0.0))
    }
}

/// Solves `(a + ridge I) x = b` by Gaussian elimination with partial pivoting.
fn solve(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for (i, row) in a.iter_mut().enumerate() {
        row[i] += RIDGE;
    }
    for col in 0..3 {
        let pivot = (col..3).max_by(|&r, &s| a[r][col].abs().total_cmp(&a[s][col].abs()))?;
        if a[pivot][col].abs() < 1e-15 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (top, below) = a.split_at_mut(col + 1);
        let pivot_row = top[col];
        for (i, row) in below.iter_mut().enumerate() {
            let f = row[col] / pivot_row[col];
            for (x, p) in row.iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[col + 1 + i] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for r in (0..3).rev() {
        let s: f64 = (r + 1..3).map(|k| a[r][k] * x[k]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_learns_a_linear_law_and_waits_until_warm() {
        let law = |t: usize, c: usize| 0.004 + 0.0005 * t as f64 + 0.000_002 * c as f64;
        let mut m = StepModel::default();
        let shapes = [(1, 100), (8, 900), (3, 5000), (16, 2000), (64, 300), (2, 12_000)];
        for (i, &(t, c)) in shapes.iter().cycle().take(WARM_UP as usize - 1).enumerate() {
            m.observe(decode(t, c + i), law(t, c + i));
        }
        assert_eq!(m.predict(4, 400), None, "no prediction before the warm-up");
        for &(t, c) in shapes.iter().cycle().take(60) {
            m.observe(decode(t, c), law(t, c));
        }
        for (t, c) in [(5, 700), (32, 20_000), (1, 0)] {
            let p = m.predict(t, c).unwrap_or(f64::NAN);
            assert!((p - law(t, c)).abs() < 1e-6, "{t} tokens, {c} context: {p} vs {}", law(t, c));
        }
    }

    #[test]
    fn it_follows_a_machine_that_slows_down_and_ignores_bad_samples() {
        let mut m = StepModel::default();
        for i in 0..200 {
            m.observe(decode(1 + i % 8, 100 * (i % 5)), 0.01);
        }
        for i in 0..2000 {
            m.observe(decode(1 + i % 8, 100 * (i % 5)), 0.03);
        }
        m.observe(decode(4, 100), f64::NAN);
        m.observe(decode(4, 100), -1.0);
        let p = m.predict(4, 200).unwrap_or(f64::NAN);
        assert!((p - 0.03).abs() < 1e-3, "{p}");
    }

    #[test]
    fn more_work_never_predicts_less_time() {
        // Noise that would fit a negative slope on tokens.
        let mut m = StepModel::default();
        for i in 0..100 {
            let t = 1 + i % 10;
            m.observe(decode(t, 1000), 0.02 - 0.0001 * t as f64);
        }
        let (few, many) = (m.predict(1, 1000), m.predict(10, 1000));
        assert!(few.zip(many).is_some_and(|(f, n)| n >= f), "{few:?} {many:?}");
    }

    #[test]
    fn tpot_counts_the_prefill_chunks_that_share_the_steps() {
        // Four decoding sequences; every other step also carries a 128-token prefill chunk.
        let law = |tokens: usize| 0.004 + 0.004 * tokens as f64;
        let mut m = StepModel::default();
        for i in 0..400 {
            let (tokens, context) =
                if i % 2 == 0 { (4, 400 + i) } else { (4 + 128, 400 + 128 + i) };
            m.observe(StepShape { tokens, context, seqs: 4, decoding: 4 }, law(tokens));
        }
        let decode = m.predict(4, 800).unwrap_or(f64::NAN);
        assert!((decode - law(4)).abs() < 1e-4, "{decode}");
        // The mean step a running request sees: half decode, half with a chunk.
        let felt = (law(4) + law(132)) / 2.0;
        let tpot = m.predict_tpot(4, 800).unwrap_or(f64::NAN);
        assert!((tpot - felt).abs() / felt < 0.05, "{tpot} vs {felt}");
        // A long prompt prefilled alone, which nobody decoding sat through, changes nothing.
        let shape = StepShape { tokens: 2048, context: 2048, seqs: 1, decoding: 0 };
        m.observe(shape, law(2048));
        let after = m.predict_tpot(4, 800).unwrap_or(f64::NAN);
        assert!((after - tpot).abs() / tpot < 0.05, "{after} vs {tpot}");
    }
}
