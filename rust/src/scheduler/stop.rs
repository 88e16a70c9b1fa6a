//! Stop rules: when a sequence that just received a token is done (EOS, stop ids, the length
//! caps), and the length below which none of them can fire (`update_from_output`'s fast
//! skip). The caller's stop strings arrive as `stop_hit` in `update_from_output`.
use crate::ids::TokenId;

/// Why a sequence stopped (`CompletionOutput.finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string found by the caller.
    Stop,
    /// `max_tokens` or the model length.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Sampling limits the scheduler enforces (the sampler enforces the rest).
#[derive(Debug, Clone, Default)]
pub struct StopParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_id: Option<TokenId>,
    pub stop_token_ids: Vec<TokenId>,
    pub ignore_eos: bool,
}

impl StopParams {
    /// Smallest total length at which `check` can return a stop for a request with a
    /// `prompt_len` prompt: the length caps, and EOS / stop ids once `min_tokens` are out
    /// (only if any can match). Below it `check` is `None` for every token.
    pub fn quiet_until(&self, prompt_len: usize, max_len: usize) -> usize {
        let mut until = (prompt_len + self.max_tokens).min(max_len);
        let token_rules =
            !self.stop_token_ids.is_empty() || (!self.ignore_eos && self.eos_token_id.is_some());
        if token_rules {
            until = until.min(prompt_len + self.min_tokens);
        }
        until
    }

    /// Stop rule for a sequence that just received `token`, making `num_output` generated
    /// tokens and `total_len` tokens in all. `min_tokens` holds back EOS and stop ids only;
    /// the length limits always apply.
    pub fn check(
        &self,
        token: TokenId,
        num_output: usize,
        total_len: usize,
        max_len: usize,
    ) -> Option<(FinishReason, Option<TokenId>)> {
        if num_output >= self.min_tokens {
            if !self.ignore_eos && self.eos_token_id == Some(token) {
                return Some((FinishReason::Stop, None));
            }
            if self.stop_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(token)));
            }
        }
        if num_output >= self.max_tokens || total_len >= max_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> StopParams {
        StopParams {
            max_tokens: 5,
            min_tokens: 2,
            eos_token_id: Some(2),
            stop_token_ids: vec![9],
            ignore_eos: false,
        }
    }

    #[test]
    fn eos_stops_once_min_tokens_are_out() {
        let p = params();
        assert_eq!(p.check(2, 1, 10, 100), None);
        assert_eq!(p.check(2, 2, 10, 100), Some((FinishReason::Stop, None)));
    }

    #[test]
    fn stop_id_reports_itself_and_lengths_cap() {
        let p = params();
        assert_eq!(p.check(9, 3, 10, 100), Some((FinishReason::Stop, Some(9))));
        assert_eq!(p.check(7, 5, 10, 100), Some((FinishReason::Length, None)));
        assert_eq!(p.check(7, 3, 100, 100), Some((FinishReason::Length, None)));
        let ignore = StopParams {
            ignore_eos: true,
            ..params()
        };
        assert_eq!(ignore.check(2, 3, 10, 100), None);
    }

    #[test]
    fn quiet_until_is_the_first_length_a_rule_can_fire() {
        let variants = [
            params(),
            StopParams {
                ignore_eos: true,
                stop_token_ids: vec![],
                ..params()
            },
            StopParams {
                eos_token_id: None,
                ..params()
            },
            StopParams {
                min_tokens: 0,
                ..params()
            },
        ];
        for p in variants {
            for max_len in [6, 8, 100] {
                let until = p.quiet_until(3, max_len);
                for total in 4..max_len.min(3 + p.max_tokens) + 1 {
                    let fires = [2, 9, 7]
                        .iter()
                        .any(|&t| p.check(t, total - 3, total, max_len).is_some());
                    assert_eq!(
                        fires,
                        total >= until,
                        "{p:?} total {total} max_len {max_len}"
                    );
                }
            }
        }
    }
}
