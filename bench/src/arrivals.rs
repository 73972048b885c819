//! Open-loop send schedules, generated whole before the run from a seed (and saved with the
//! results, never rescaled): constant rate, Poisson, or gamma-distributed gaps whose
//! burstiness is the gamma shape (1 = Poisson; below 1 burstier, above 1 smoother), the
//! convention of `vllm bench serve`.

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrival {
    /// Evenly spaced at `rate` per second.
    Constant,
    /// Gamma-distributed gaps with mean `1/rate` and shape `burstiness` (1.0 = Poisson).
    Gamma {
        /// The gamma shape; the gaps' squared coefficient of variation is `1/burstiness`.
        burstiness: f64,
    },
}

/// SplitMix64: small, fast, reproducible across platforms.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Gamma(shape, scale = 1) by Marsaglia and Tsang (with the boost for shape < 1).
    pub fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = self.uniform();
            return self.gamma(shape + 1.0) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.uniform();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }
}

/// Send times, in seconds from the start, of `n` requests at `rate` per second.
pub fn schedule(arrival: Arrival, rate: f64, n: usize, seed: u64) -> Vec<f64> {
    if !(rate.is_finite() && rate > 0.0) {
        // An infinite rate sends everything at once.
        return vec![0.0; n];
    }
    let mut rng = Rng::new(seed);
    let mut t = 0.0;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        match arrival {
            Arrival::Constant => out.push(i as f64 / rate),
            Arrival::Gamma { burstiness } => {
                out.push(t);
                let shape = burstiness.max(1e-3);
                t += rng.gamma(shape) / (shape * rate);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(s: &[f64]) -> Vec<f64> {
        s.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_cv2(g: &[f64]) -> (f64, f64) {
        let m = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / g.len() as f64;
        (m, var / (m * m))
    }

    #[test]
    fn rates_and_dispersion_match_their_definitions() {
        let rate = 20.0;
        let c = schedule(Arrival::Constant, rate, 1000, 1);
        assert!(gaps(&c).iter().all(|g| (g - 0.05).abs() < 1e-12));
        // Gamma gaps: mean 1/rate, squared coefficient of variation 1/shape.
        for shape in [0.25, 0.5, 1.0, 2.0, 8.0] {
            let s = schedule(Arrival::Gamma { burstiness: shape }, rate, 40_000, 7);
            let (m, cv2) = mean_cv2(&gaps(&s));
            assert!((m * rate - 1.0).abs() < 0.03, "shape {shape}: mean gap {m}");
            assert!((cv2 * shape - 1.0).abs() < 0.08, "shape {shape}: cv^2 {cv2}");
        }
    }

    #[test]
    fn a_seed_fixes_the_schedule() {
        let a = schedule(Arrival::Gamma { burstiness: 1.0 }, 5.0, 100, 42);
        assert_eq!(a, schedule(Arrival::Gamma { burstiness: 1.0 }, 5.0, 100, 42));
        assert_ne!(a, schedule(Arrival::Gamma { burstiness: 1.0 }, 5.0, 100, 43));
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(schedule(Arrival::Constant, f64::INFINITY, 3, 1), vec![0.0; 3]);
    }
}
