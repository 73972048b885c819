//! How long a step takes, learned from the engine's own steps: the model behind SLO-aware batch
//! control. A step's time is fitted as `a + b * tokens + c * context`, where `tokens` are the
//! tokens the step computes (one per decoding request, a chunk per prefilling one) and
//! `context` the cached tokens their attention reads. The fit is least squares over an
//! exponentially decayed window of recent steps (so it follows a device that heats up or a
//! machine that gets busier), the same on CPU and GPU. The scheduler asks it two things: how
//! long a decode step of a batch would take (may the batch grow?) and how many prefill tokens
//! still fit a step of a given length ([`StepModel::fit_tokens`]). Plain synchronous state.

/// Steps observed before the model predicts anything.
const WARM_UP: u64 = 16;

/// Weight of the previous steps at each new one (an effective window of ~200 steps).
const DECAY: f64 = 0.995;

/// Feature scales, so the normal equations stay well conditioned.
const TOKEN_SCALE: f64 = 100.0;
const CONTEXT_SCALE: f64 = 10_000.0;

/// Ridge term added to the normal equations' diagonal.
const RIDGE: f64 = 1e-9;

/// The shape of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens computed.
    pub tokens: usize,
    /// Cached tokens read by their attention.
    pub context: usize,
}

/// A pure decode step of `seqs` sequences (test helper and shorthand).
#[cfg(test)]
pub(crate) fn decode(seqs: usize, context: usize) -> StepShape {
    StepShape { tokens: seqs, context }
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
}

fn features(tokens: usize, context: usize) -> [f64; 3] {
    [1.0, tokens as f64 / TOKEN_SCALE, context as f64 / CONTEXT_SCALE]
}

impl StepModel {
    /// Records that a step computing `tokens` tokens and reading `context` cached ones took
    /// `seconds`.
    pub fn observe(&mut self, shape: StepShape, seconds: f64) {
        let StepShape { tokens, context } = shape;
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
    }

    /// Whether the model predicts anything yet.
    pub fn is_warm(&self) -> bool {
        self.fit.is_some()
    }

    /// The predicted time of a step of this shape, in seconds (`None` until warm).
    pub fn predict(&self, tokens: usize, context: usize) -> Option<f64> {
        let c = self.fit?;
        let x = features(tokens, context);
        Some((c[0] * x[0] + c[1] * x[1] + c[2] * x[2]).max(0.0))
    }

    /// How many more tokens of one sequence, the first at position `start`, a step that
    /// already computes `tokens` tokens reading `context` may take and still be predicted to
    /// last at most `cap` seconds (`None`: until warm, or when more tokens cost nothing, any).
    pub fn fit_tokens(
        &self,
        tokens: usize,
        context: usize,
        start: usize,
        cap: f64,
    ) -> Option<usize> {
        let c = self.fit?;
        let per_token = c[1] / TOKEN_SCALE + c[2] / CONTEXT_SCALE;
        if per_token <= 0.0 {
            return None;
        }
        let base = self.predict(tokens, context + start)?;
        let room = ((cap - base) / per_token).floor();
        Some(if room.is_finite() && room > 0.0 { room as usize } else { 0 })
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
    fn it_says_how_many_prefill_tokens_fit_a_step() {
        let law = |t: usize, c: usize| 0.004 + 0.002 * t as f64 + 0.000_001 * c as f64;
        let mut m = StepModel::default();
        assert_eq!(m.fit_tokens(4, 400, 0, 0.1), None, "cold: no limit");
        for i in 0..100 {
            let (t, c) = (1 + i % 40, 100 * (i % 13) + 3 * i);
            m.observe(StepShape { tokens: t, context: c }, law(t, c));
        }
        // Four decoding (400 context) and a chunk from position 100: the chunk's k tokens
        // add k tokens and 100 + k context.
        let k = m.fit_tokens(4, 400, 100, 0.05).unwrap_or(usize::MAX);
        let with = |k: usize| law(4 + k, 400 + 100 + k);
        assert!(with(k) <= 0.05 + 1e-9 && with(k + 1) > 0.05, "{k}: {} {}", with(k), with(k + 1));
        // A step already over its length takes nothing more.
        assert_eq!(m.fit_tokens(40, 400, 0, 0.05), Some(0));
    }
}
