//! The n-gram proposer (prompt lookup decoding): find the history's last `n` tokens earlier in
//! the history, for `n` from `prompt_lookup_max` down to `prompt_lookup_min`, and propose the
//! `k` tokens that followed that occurrence.
//!
//! Among matches the longest suffix wins; among equally long ones the most recent (closest to
//! the end) that is followed by all `k` tokens, else the most recent: in text that repeats
//! itself (code edits, quoting) the latest copy is the one being continued, and in a loop the
//! latest full period is (the occurrence just before the suffix would leave one token to
//! propose). One backward scan per history: at each earlier position the match length with the
//! suffix is counted from its last token backwards, capped at `prompt_lookup_max`, so the cost
//! is O(len) for histories without long repeats and stops at the first maximal full match.
use crate::error::{Error, Result};
use crate::ids::TokenId;

/// Parameters of the n-gram proposer (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// Tokens proposed per sequence and step (`num_speculative_tokens`).
    pub num_speculative_tokens: usize,
    /// Longest suffix looked up.
    pub prompt_lookup_max: usize,
    /// Shortest suffix that may match.
    pub prompt_lookup_min: usize,
}

/// Lookup bounds when neither is given (vLLM's).
pub const DEFAULT_PROMPT_LOOKUP_MAX: usize = 4;
pub const DEFAULT_PROMPT_LOOKUP_MIN: usize = 1;

impl NgramConfig {
    /// Checks the parameters: `k >= 1`, `1 <= min <= max`.
    pub fn new(k: usize, prompt_lookup_max: usize, prompt_lookup_min: usize) -> Result<Self> {
        if k == 0 {
            return Err(Error::InvalidArgument(
                "num_speculative_tokens must be >= 1, got 0".into(),
            ));
        }
        let (prompt_lookup_max, prompt_lookup_min) =
            Self::lookup_bounds(Some(prompt_lookup_max), Some(prompt_lookup_min))?;
        Ok(NgramConfig {
            num_speculative_tokens: k,
            prompt_lookup_max,
            prompt_lookup_min,
        })
    }

    /// The lookup bounds `(max, min)` from the ones given, checked (`1 <= min <= max`): one
    /// given, the other takes its value; neither, `DEFAULT_PROMPT_LOOKUP_MAX` / `_MIN`. The
    /// one rule behind the scheduler's arguments and the engine's `speculative_config`.
    pub fn lookup_bounds(max: Option<usize>, min: Option<usize>) -> Result<(usize, usize)> {
        // the values given are checked before one mirrors the other, so an error names the
        // setting the caller wrote
        for (name, value) in [("prompt_lookup_max", max), ("prompt_lookup_min", min)] {
            if value == Some(0) {
                return Err(Error::InvalidArgument(format!(
                    "{name} must be >= 1, got 0"
                )));
            }
        }
        let (max, min) = match (max, min) {
            (None, None) => (DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN),
            (Some(max), None) => (max, max),
            (None, Some(min)) => (min, min),
            (Some(max), Some(min)) => (max, min),
        };
        if min > max {
            return Err(Error::InvalidArgument(format!(
                "prompt_lookup_min ({min}) must be <= prompt_lookup_max ({max})"
            )));
        }
        Ok((max, min))
    }
}

/// Appends to `out` at most `k` tokens proposed for `history` (see the module doc); returns
/// how many. `k` may be below the configured count (the caller trims to what the step can
/// take); nothing is proposed for `k == 0` or when no suffix of `min..=max` tokens recurs.
pub fn propose_ngram(
    history: &[TokenId],
    cfg: &NgramConfig,
    k: usize,
    out: &mut Vec<TokenId>,
) -> usize {
    let len = history.len();
    if k == 0 || len < cfg.prompt_lookup_min + 1 {
        return 0;
    }
    let max_n = cfg.prompt_lookup_max.min(len - 1);
    let last = history[len - 1];
    // Best so far: (match length, followed by k tokens), and where it ends.
    let (mut best, mut best_end) = ((0usize, false), 0usize);
    // `end` is the last token of a candidate occurrence; it must leave a token to propose.
    for end in (0..len - 1).rev() {
        if history[end] != last {
            continue;
        }
        // Match length with the suffix, counted backwards; the occurrence may overlap the
        // suffix itself (a run like "a a a a" continues itself).
        let cap = max_n.min(end + 1);
        let mut m = 1;
        while m < cap && history[end - m] == history[len - 1 - m] {
            m += 1;
        }
        let found = (m, end + k < len);
        if found > best {
            (best, best_end) = (found, end);
            if found == (max_n, true) {
                break;
            }
        }
    }
    let best_len = best.0;
    if best_len < cfg.prompt_lookup_min {
        return 0;
    }
    let from = best_end + 1;
    let to = (from + k).min(len);
    out.extend_from_slice(&history[from..to]);
    to - from
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, max: usize, min: usize) -> NgramConfig {
        NgramConfig::new(k, max, min).unwrap()
    }

    fn propose(history: &[TokenId], c: &NgramConfig) -> Vec<TokenId> {
        let mut out = Vec::new();
        let n = propose_ngram(history, c, c.num_speculative_tokens, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn proposes_what_followed_the_suffix() {
        // suffix [1, 2] occurred at 0..2, followed by 3, 4, 5
        assert_eq!(
            propose(&[1, 2, 3, 4, 5, 9, 1, 2], &cfg(3, 2, 1)),
            vec![3, 4, 5]
        );
    }

    #[test]
    fn longest_match_wins_over_a_more_recent_shorter_one() {
        // [7, 1, 2] at 0..3 (followed by 8); only [1, 2] at 4..6 (followed by 9)
        let h = [7, 1, 2, 8, 1, 2, 9, 7, 1, 2];
        assert_eq!(propose(&h, &cfg(1, 3, 1)), vec![8]);
        // with max 2 both match two tokens: the most recent wins
        assert_eq!(propose(&h, &cfg(1, 2, 1)), vec![9]);
    }

    #[test]
    fn below_min_nothing_is_proposed() {
        let h = [5, 6, 1, 9, 1];
        assert_eq!(propose(&h, &cfg(2, 3, 1)), vec![9, 1]);
        assert!(propose(&h, &cfg(2, 3, 2)).is_empty());
        assert!(propose(&[1], &cfg(2, 3, 1)).is_empty());
        assert!(propose(&[1, 2, 3], &cfg(2, 3, 1)).is_empty());
    }

    #[test]
    fn proposal_stops_at_the_end_of_the_history() {
        // [3] recurs at 2, followed only by [4, 3]
        assert_eq!(propose(&[1, 2, 3, 4, 3], &cfg(5, 1, 1)), vec![4, 3]);
    }

    #[test]
    fn a_repeating_run_continues_itself() {
        // the latest occurrence followed by all k tokens wins over the one just before the end
        assert_eq!(propose(&[4, 4, 4, 4, 4, 4], &cfg(2, 3, 1)), vec![4, 4]);
        assert_eq!(
            propose(&[1, 2, 1, 2, 1, 2, 1, 2], &cfg(4, 2, 1)),
            vec![1, 2, 1, 2]
        );
        // none has k followers: the most recent
        assert_eq!(propose(&[4, 4, 4, 4], &cfg(3, 3, 1)), vec![4]);
    }

    #[test]
    fn k_trims_the_proposal() {
        let c = cfg(4, 2, 1);
        let mut out = vec![99];
        assert_eq!(propose_ngram(&[1, 2, 3, 4, 5, 1, 2], &c, 2, &mut out), 2);
        assert_eq!(out, vec![99, 3, 4]);
        assert_eq!(propose_ngram(&[1, 2, 3, 4, 5, 1, 2], &c, 0, &mut out), 0);
    }

    #[test]
    fn matches_a_brute_force_search() {
        // Reference: for n = max..=min, the latest earlier occurrence of the n-token suffix.
        fn brute(h: &[TokenId], c: &NgramConfig) -> Vec<TokenId> {
            let len = h.len();
            let k = c.num_speculative_tokens;
            for n in (c.prompt_lookup_min..=c.prompt_lookup_max).rev() {
                if n + 1 > len {
                    continue;
                }
                let suffix = &h[len - n..];
                let starts: Vec<usize> = (0..len - n)
                    .rev()
                    .filter(|&start| &h[start..start + n] == suffix)
                    .collect();
                let full = starts.iter().find(|&&start| start + n + k <= len);
                if let Some(&start) = full.or(starts.first()) {
                    let from = start + n;
                    return h[from..(from + k).min(len)].to_vec();
                }
            }
            Vec::new()
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..3000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = 1 + (state % 24) as usize;
            let vocab = 2 + (state >> 8) % 3;
            let h: Vec<TokenId> = (0..len)
                .map(|i| ((state >> (16 + i % 40)) % vocab) as TokenId)
                .collect();
            let max = 1 + (state >> 5) as usize % 4;
            let min = 1 + (state >> 9) as usize % max;
            let c = cfg(1 + (state >> 12) as usize % 5, max, min);
            assert_eq!(propose(&h, &c), brute(&h, &c), "{h:?} {c:?}");
        }
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(NgramConfig::new(0, 4, 1).is_err());
        assert!(NgramConfig::new(2, 4, 0).is_err());
        assert!(NgramConfig::new(2, 1, 2).is_err());
    }

    #[test]
    fn lookup_bounds_default_and_mirror_each_other() {
        let bounds = NgramConfig::lookup_bounds;
        assert_eq!(bounds(None, None).unwrap(), (4, 1));
        assert_eq!(bounds(Some(5), None).unwrap(), (5, 5));
        assert_eq!(bounds(None, Some(2)).unwrap(), (2, 2));
        assert_eq!(bounds(Some(3), Some(2)).unwrap(), (3, 2));
        let err = |max, min| bounds(max, min).unwrap_err().to_string();
        assert!(err(Some(0), None).contains("prompt_lookup_max must be >= 1, got 0"));
        assert!(err(None, Some(0)).contains("prompt_lookup_min must be >= 1, got 0"));
        assert!(err(Some(2), Some(3))
            .contains("prompt_lookup_min (3) must be <= prompt_lookup_max (2)"));
    }
}
