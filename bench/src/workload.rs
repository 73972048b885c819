//! What each request asks for, generated up front from a seed like the send schedule:
//! random prompts whose input and output lengths follow a distribution (fixed, uniform,
//! normal, log-normal, or sampled from a file of lengths), shared-prefix sets (N system
//! prompts x M suffixes), multi-turn sessions (each turn carries the previous turns and
//! replies), and ShareGPT-format conversations.

use serde_json::Value;

use crate::arrivals::Rng;

/// A distribution of lengths in tokens (always at least 1).
#[derive(Clone, Debug, PartialEq)]
pub enum Lengths {
    /// Always `n`.
    Fixed(usize),
    /// Uniform in `lo..=hi`.
    Uniform(usize, usize),
    /// Normal with this mean and standard deviation, rounded, at least 1.
    Normal(f64, f64),
    /// Log-normal with this median and sigma (of the log), rounded, at least 1.
    LogNormal(f64, f64),
    /// Drawn from these observed lengths.
    Sample(Vec<usize>),
}

impl Lengths {
    /// Parses `N`, `fixed:N`, `uniform:LO:HI`, `normal:MEAN:SD`, `lognormal:MEDIAN:SIGMA`;
    /// `file:PATH` is read by the caller and given as [`Lengths::Sample`].
    pub fn parse(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |i: usize| -> Result<f64, String> {
            let v = parts.get(i).ok_or_else(|| format!("{s:?}: missing a number"))?;
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("{s:?}: {v:?} is not a non-negative number"))
        };
        let count = |i: usize| -> Result<usize, String> {
            let x = num(i)?;
            if x < 1.0 || x.fract() != 0.0 {
                return Err(format!("{s:?}: lengths are whole numbers of at least 1"));
            }
            Ok(x as usize)
        };
        let d = match parts[0] {
            _ if parts.len() == 1 => Self::Fixed(count(0)?),
            "fixed" => Self::Fixed(count(1)?),
            "uniform" => {
                let (lo, hi) = (count(1)?, count(2)?);
                if lo > hi {
                    return Err(format!("{s:?}: the low end is above the high end"));
                }
                Self::Uniform(lo, hi)
            }
            "normal" => Self::Normal(num(1)?, num(2)?),
            "lognormal" => Self::LogNormal(num(1)?.max(1.0), num(2)?),
            other => {
                return Err(format!(
                    "{s:?}: unknown distribution {other:?} (fixed, uniform, normal, lognormal, file)"
                ));
            }
        };
        if parts.len() > 3 || (matches!(d, Self::Fixed(_)) && parts.len() > 2) {
            return Err(format!("{s:?}: too many fields"));
        }
        Ok(d)
    }

    /// One length.
    pub fn draw(&self, rng: &mut Rng) -> usize {
        let x = match self {
            Self::Fixed(n) => return *n,
            Self::Uniform(lo, hi) => return lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize,
            Self::Normal(mean, sd) => mean + sd * rng.normal(),
            Self::LogNormal(median, sigma) => median * (sigma * rng.normal()).exp(),
            Self::Sample(v) if v.is_empty() => return 1,
            Self::Sample(v) => return v[(rng.next_u64() % v.len() as u64) as usize].max(1),
        };
        x.round().clamp(1.0, 1e6) as usize
    }
}

/// One turn's content: token ids (completions) or text (chat).
#[derive(Clone, Debug, PartialEq)]
pub enum Content {
    /// Token ids, sent as a completions `prompt` array.
    Tokens(Vec<u64>),
    /// Text.
    Text(String),
}

/// What one request asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The conversation so far: user turns and assistant replies alternating, the last one
    /// the user's (one element for single-turn workloads).
    pub turns: Vec<Content>,
    /// `max_tokens` (the server ignores end-of-sequence).
    pub output_len: usize,
    /// Intended prompt length in tokens (for length buckets; the server's count is measured).
    pub input_len: usize,
    /// Session of a multi-turn workload, prefix group of a shared-prefix one.
    pub group: Option<usize>,
}

/// A workload: how the requests' contents are made.
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    /// Independent random prompts.
    Random,
    /// `prefixes` distinct shared prompt starts of `prefix_len` tokens, each request one of
    /// them plus its own random suffix (input length = suffix length).
    SharedPrefix {
        /// Distinct prefixes.
        prefixes: usize,
        /// Tokens in each prefix.
        prefix_len: usize,
    },
    /// `sessions` conversations of `turns` turns; turn k sends the k previous turns and
    /// replies plus a new user turn (input length = the new turn's length).
    MultiTurn {
        /// Conversations.
        sessions: usize,
        /// Turns per conversation.
        turns: usize,
    },
    /// Conversations from a ShareGPT-format file: each request is the first human turn, and
    /// its output length the first reply's length in words (a proxy for tokens).
    ShareGpt(Vec<(String, usize)>),
}

/// Reads a ShareGPT-format file (`[{"conversations": [{"from": "human", "value": ...},
/// {"from": "gpt", "value": ...}]}]`): the first human turn and the reply's word count of each
/// conversation that has both.
pub fn parse_sharegpt(text: &str) -> Result<Vec<(String, usize)>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let items = v.as_array().ok_or("the file must be a JSON array of conversations")?;
    let mut out = Vec::new();
    for c in items {
        let turns = c["conversations"].as_array().map(Vec::as_slice).unwrap_or_default();
        let (Some(q), Some(a)) = (turns.first(), turns.get(1)) else { continue };
        let (Some(q), Some(a)) = (q["value"].as_str(), a["value"].as_str()) else { continue };
        if !q.trim().is_empty() && !a.trim().is_empty() {
            out.push((q.to_owned(), a.split_whitespace().count().max(1)));
        }
    }
    if out.is_empty() {
        return Err("no conversation with a human turn and a reply".into());
    }
    Ok(out)
}

const WORDS: &[&str] = &[
    "river", "stone", "light", "paper", "window", "garden", "cloud", "number", "signal", "forest",
    "bridge", "letter", "market", "silver", "engine", "harbor",
];

/// `n` random tokens: ids in a range every vocabulary of interest has (plain tokens, no
/// specials), or as many words.
fn random_content(rng: &mut Rng, n: usize, text: bool) -> Content {
    if text {
        let words: Vec<&str> =
            (0..n).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect();
        Content::Text(words.join(" "))
    } else {
        Content::Tokens((0..n).map(|_| 1000 + rng.next_u64() % 20_000).collect())
    }
}

/// Gives `reqs` a first token (a first word) of their own for `salt`: the same first token
/// stays the same within one salt (prompts that share a prefix still share it) and differs
/// between salts, so runs with different salts never hit each other's prefix cache.
pub fn salt(reqs: &mut [Request], salt: u64) {
    for r in reqs {
        match r.turns.first_mut() {
            Some(Content::Tokens(t)) => {
                if let Some(first) = t.first_mut() {
                    *first = 1000 + (first.saturating_sub(1000) + salt) % 20_000;
                }
            }
            Some(Content::Text(x)) => {
                let word = WORDS[(salt % WORDS.len() as u64) as usize];
                *x = format!("{word}{} {x}", salt / WORDS.len() as u64);
            }
            None => {}
        }
    }
}

fn concat(a: &Content, b: &Content) -> Content {
    match (a, b) {
        (Content::Tokens(x), Content::Tokens(y)) => {
            Content::Tokens([x.clone(), y.clone()].concat())
        }
        (Content::Text(x), Content::Text(y)) => Content::Text(format!("{x}\n{y}")),
        (Content::Text(x), Content::Tokens(_)) | (Content::Tokens(_), Content::Text(x)) => {
            Content::Text(x.clone())
        }
    }
}

/// `n` requests of `workload`, input and output lengths drawn from `input` and `output`;
/// `text` makes words (chat) instead of token ids (completions). Same seed, same requests.
pub fn generate(
    workload: &Workload,
    n: usize,
    input: &Lengths,
    output: &Lengths,
    text: bool,
    seed: u64,
) -> Vec<Request> {
    let mut rng = Rng::new(seed);
    match workload {
        Workload::Random => (0..n)
            .map(|_| {
                let (i, o) = (input.draw(&mut rng), output.draw(&mut rng));
                Request {
                    turns: vec![random_content(&mut rng, i, text)],
                    output_len: o,
                    input_len: i,
                    group: None,
                }
            })
            .collect(),
        Workload::SharedPrefix { prefixes, prefix_len } => {
            let heads: Vec<Content> = (0..(*prefixes).max(1))
                .map(|_| random_content(&mut rng, *prefix_len, text))
                .collect();
            (0..n)
                .map(|_| {
                    let g = (rng.next_u64() % heads.len() as u64) as usize;
                    let (i, o) = (input.draw(&mut rng), output.draw(&mut rng));
                    let suffix = random_content(&mut rng, i, text);
                    Request {
                        turns: vec![concat(&heads[g], &suffix)],
                        output_len: o,
                        input_len: prefix_len + i,
                        group: Some(g),
                    }
                })
                .collect()
        }
        Workload::MultiTurn { sessions, turns } => {
            // Requests interleave sessions turn by turn: session s's turn k comes after its
            // turn k-1 in the schedule. Replies stand in for what the model said (their
            // lengths are the output lengths asked for).
            let (sessions, turns) = ((*sessions).max(1), (*turns).max(1));
            let mut history: Vec<Vec<Content>> = vec![Vec::new(); sessions];
            let mut out = Vec::with_capacity(n);
            'outer: for _ in 0..turns {
                for (s, h) in history.iter_mut().enumerate() {
                    if out.len() == n {
                        break 'outer;
                    }
                    let (i, o) = (input.draw(&mut rng), output.draw(&mut rng));
                    h.push(random_content(&mut rng, i, text));
                    out.push(Request {
                        turns: h.clone(),
                        output_len: o,
                        input_len: i,
                        group: Some(s),
                    });
                    h.push(random_content(&mut rng, o, text));
                }
            }
            out
        }
        Workload::ShareGpt(convs) => (0..n)
            .map(|_| {
                let (q, reply) = &convs[(rng.next_u64() % convs.len().max(1) as u64) as usize];
                Request {
                    turns: vec![Content::Text(q.clone())],
                    output_len: *reply,
                    input_len: q.split_whitespace().count().max(1),
                    group: None,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn salts_keep_shared_prefixes_within_a_run_and_part_runs() {
        let w = Workload::SharedPrefix { prefixes: 2, prefix_len: 8 };
        let lens = |n| Lengths::Fixed(n);
        let base = generate(&w, 6, &lens(4), &lens(2), false, 7);
        let first = |r: &Request| match r.turns.first() {
            Some(Content::Tokens(t)) => t.first().copied(),
            _ => None,
        };
        let mut a = base.clone();
        salt(&mut a, 1);
        let mut b = base.clone();
        salt(&mut b, 2);
        for ((x, y), z) in base.iter().zip(&a).zip(&b) {
            // Only the first token moves, to one of the salt's own.
            assert_ne!(first(x), first(y));
            assert_ne!(first(y), first(z));
            assert!(first(y).is_some_and(|t| (1000..21_000).contains(&t)));
            if let (Some(Content::Tokens(p)), Some(Content::Tokens(q))) =
                (x.turns.first(), y.turns.first())
            {
                assert_eq!((p.len(), &p[1..]), (q.len(), &q[1..]));
            }
        }
        // Two requests of one prefix still share their first token after salting.
        for (i, j) in [(0, 1), (0, 2), (1, 2), (2, 3)] {
            assert_eq!(first(&base[i]) == first(&base[j]), first(&a[i]) == first(&a[j]));
        }
    }

    use super::*;

    #[test]
    fn length_distributions_parse_and_draw_within_their_definitions() -> Result<(), String> {
        assert_eq!(Lengths::parse("128")?, Lengths::Fixed(128));
        assert_eq!(Lengths::parse("uniform:10:20")?, Lengths::Uniform(10, 20));
        for bad in ["0", "uniform:20:10", "normal:x:1", "zipf:3", "fixed:1:2", "1.5"] {
            assert!(Lengths::parse(bad).is_err(), "{bad} accepted");
        }
        let mut rng = Rng::new(7);
        let draws =
            |d: &Lengths, rng: &mut Rng| (0..20_000).map(|_| d.draw(rng)).collect::<Vec<_>>();
        let u = draws(&Lengths::parse("uniform:10:20")?, &mut rng);
        assert!(u.iter().all(|x| (10..=20).contains(x)));
        assert!(u.contains(&10) && u.contains(&20));
        let n = draws(&Lengths::parse("normal:200:20")?, &mut rng);
        let mean = n.iter().sum::<usize>() as f64 / n.len() as f64;
        assert!((mean - 200.0).abs() < 1.0, "normal mean {mean}");
        let mut l = draws(&Lengths::parse("lognormal:100:0.5")?, &mut rng);
        l.sort_unstable();
        let median = l[l.len() / 2] as f64;
        assert!((median - 100.0).abs() < 3.0, "lognormal median {median}");
        assert!(draws(&Lengths::parse("normal:1:50")?, &mut rng).iter().all(|x| *x >= 1));
        Ok(())
    }

    #[test]
    fn shared_prefixes_and_sessions_have_their_shape() -> Result<(), String> {
        let w = Workload::SharedPrefix { prefixes: 3, prefix_len: 50 };
        let reqs = generate(&w, 60, &Lengths::Fixed(10), &Lengths::Fixed(5), false, 1);
        let mut starts = std::collections::BTreeSet::new();
        for r in &reqs {
            let Content::Tokens(t) = &r.turns[0] else { return Err("tokens expected".into()) };
            assert_eq!(t.len(), 60);
            starts.insert(t[..50].to_vec());
        }
        assert_eq!(starts.len(), 3, "three distinct prefixes");
        let w = Workload::MultiTurn { sessions: 2, turns: 3 };
        let reqs = generate(&w, 6, &Lengths::Fixed(4), &Lengths::Fixed(2), true, 1);
        assert_eq!(reqs.iter().map(|r| r.turns.len()).collect::<Vec<_>>(), [1, 1, 3, 3, 5, 5]);
        // Turn 2 of session 0 starts with turn 1 of it, word for word.
        assert_eq!(reqs[2].turns[0], reqs[0].turns[0]);
        assert_eq!(reqs[2].group, Some(0));
        // Same seed, same requests.
        assert_eq!(reqs, generate(&w, 6, &Lengths::Fixed(4), &Lengths::Fixed(2), true, 1));
        Ok(())
    }

    #[test]
    fn sharegpt_files_give_first_turns_and_reply_lengths() -> Result<(), String> {
        let text = r#"[{"conversations": [{"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello, how can I help?"}]},
            {"conversations": [{"from": "human", "value": "only a question"}]}]"#;
        let convs = parse_sharegpt(text)?;
        assert_eq!(convs, vec![("Hi there".to_owned(), 5)]);
        assert!(parse_sharegpt("{}").is_err());
        Ok(())
    }
}
