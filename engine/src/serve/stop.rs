//! Stop strings that may span tokens: text that could still begin a stop string is held
//! back until it cannot.

/// Text output of one request with stop-string detection.
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

/// Result of feeding text.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Keep going; this text is final.
    Continue(String),
    /// A stop string matched; this is the final text before it.
    Stopped(String),
}

impl StopText {
    /// Detection for these stop strings (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopText {
        StopText {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Default::default()
        }
    }

    /// Adds decoded text.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.text.push_str(delta);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A match must involve the new text, so it starts no earlier than this.
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            let out = self.text.get(self.emitted..at).unwrap_or_default().to_string();
            self.emitted = self.text.len();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > hold && self.text.ends_with(&s[..k]) {
                    hold = k;
                }
            }
        }
        let end = (self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        StopOutcome::Continue(out)
    }

    /// Releases held-back text at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Option<String>, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut st = StopText::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            match st.push(p) {
                StopOutcome::Continue(t) => out.push(t),
                StopOutcome::Stopped(t) => return (out, Some(t), String::new()),
            }
        }
        let rest = st.finish();
        (out, None, rest)
    }

    #[test]
    fn stop_string_across_tokens() {
        let (out, stopped, _) = feed(&["END"], &["Hello E", "N", "D more"]);
        assert_eq!(out, vec!["Hello ", ""]);
        assert_eq!(stopped.as_deref(), Some(""));
    }

    #[test]
    fn false_start_is_released() {
        let (out, stopped, rest) = feed(&["END"], &["an E", "lephant", "!"]);
        assert_eq!(out.concat(), "an Elephant!");
        assert_eq!(stopped, None);
        assert_eq!(rest, "");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_held_text_flushes_at_the_end() {
        let (out, stopped, _) = feed(&["\n\n", "Q:"], &["x Q", ":\n\n"]);
        assert_eq!((out.concat(), stopped.as_deref()), ("x ".into(), Some("")));
        let (out, stopped, rest) = feed(&["###"], &["a#", "#"]);
        assert_eq!((out.concat(), stopped, rest), ("a".into(), None, "##".into()));
    }

    #[test]
    fn multibyte_text_is_never_split() {
        let (out, stopped, _) = feed(&["é!"], &["café", "é", "!"]);
        assert_eq!(out, vec!["caf", "é"]);
        assert_eq!(stopped.as_deref(), Some(""));
    }
}
