//! Stop rules: when a sequence that just received a token is done (EOS, stop ids, the length
//! caps), and the length below which none of them can fire (`update_from_output`'s fast
//! skip). The one answer to "why did this sequence stop": the updates apply it, and the engine
//! asks `stop_cuts` for its text (which token ends a sequence, and whether by itself). The
//! caller's stop strings arrive as `stop_hit` in `update_from_output`.
use crate::error::Result;
use crate::ids::TokenId;

use crate::scheduler::Scheduler;

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

/// Where the stop rules end a run of tokens appended to a sequence of `len` tokens (`prompt_len`
/// of them the prompt): the number of tokens kept (through the one that stops it) and that
/// token's finish; the whole run and `None` when no token stops it. `hit`: a stop string
/// matched at the run's last token. The one rule both the scheduler's run update and the
/// engine's text (`Scheduler::run_stop_cuts`) follow.
pub(crate) fn cut_run(
    stop: &StopParams,
    prompt_len: usize,
    len: usize,
    run: &[i64],
    hit: bool,
    max_len: usize,
) -> (usize, Option<(FinishReason, Option<TokenId>)>) {
    for (j, &t) in run.iter().enumerate() {
        let total = len + j + 1;
        if hit && j + 1 == run.len() {
            return (j + 1, Some((FinishReason::Stop, None)));
        }
        if let Some(fin) = stop.check(t as TokenId, total - prompt_len, total, max_len) {
            return (j + 1, Some(fin));
        }
    }
    (run.len(), None)
}

/// (start, count) of each run in a flat token array of runs of `num_tokens[k]` tokens.
pub(super) fn run_starts(num_tokens: &[i64]) -> impl Iterator<Item = (usize, usize)> + '_ {
    num_tokens.iter().scan(0usize, |at, &n| {
        let start = *at;
        *at += n as usize;
        Some((start, n as usize))
    })
}

/// Where the stop rules cut each sample's tokens (`Scheduler::stop_cuts`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopCuts {
    /// Tokens each sample's sequence keeps of its run (through the token that stops it).
    pub kept: Vec<i64>,
    /// Whether that last kept token stopped the sequence by itself (EOS or a stop id once
    /// `min_tokens` are out): its text is not part of the output (vLLM).
    pub by_token: Vec<bool>,
}

impl Scheduler {
    /// Where the stop rules (`cut_run`) end the tokens of the latest step, before they are
    /// applied: one token per sample (`num_tokens` None), or a run of `num_tokens[k]` tokens of
    /// `sampled` per sample (speculative decoding) as `update_from_output_runs` takes them — a
    /// token is a run of one. The engine reads it before appending text, so tokens after a
    /// stop are never detokenized and a stopping token's text is left out;
    /// `update_from_output` then ends the sequences at the same place. A sample whose sequence
    /// is gone since the step keeps its whole run.
    pub fn stop_cuts(
        &self,
        step: u64,
        sampled: &[i64],
        num_tokens: Option<&[i64]>,
    ) -> Result<StopCuts> {
        self.ledger.check_latest(step)?;
        let ones;
        let num_tokens = match num_tokens {
            Some(counts) => counts,
            None => {
                ones = vec![1i64; sampled.len()];
                &ones
            }
        };
        self.check_runs(sampled, num_tokens)?;
        let max_len = self.cfg.max_seq_len();
        let mut cuts = StopCuts {
            kept: Vec::with_capacity(num_tokens.len()),
            by_token: Vec::with_capacity(num_tokens.len()),
        };
        for (k, (start, n)) in run_starts(num_tokens).enumerate() {
            let run = &sampled[start..start + n];
            let (h, gen, idx) = self.ledger.sample(k);
            let seq = self
                .store
                .is_live(h, gen)
                .then(|| self.store.get(h))
                .and_then(|req| Some((req, req.seqs.get(idx)?)));
            let (kept, fin) = match seq {
                // Common case: no rule can fire within the run (see `quiet_until`).
                Some((req, s)) if s.tokens.len() + n < req.quiet_until => (n, None),
                Some((req, s)) => cut_run(
                    &req.stop,
                    req.prompt_len,
                    s.tokens.len(),
                    run,
                    false,
                    max_len,
                ),
                None => (n, None),
            };
            cuts.kept.push(kept as i64);
            cuts.by_token
                .push(matches!(fin, Some((FinishReason::Stop, _))));
        }
        Ok(cuts)
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
    fn a_run_is_cut_at_its_first_stopping_token() {
        let p = params();
        // prompt 3, 3 tokens so far (0 generated): EOS 2 is held back until min_tokens = 2
        assert_eq!(
            cut_run(&p, 3, 3, &[2, 7, 2, 7], false, 100),
            (3, Some((FinishReason::Stop, None)))
        );
        assert_eq!(
            cut_run(&p, 3, 3, &[7, 9, 7], false, 100),
            (2, Some((FinishReason::Stop, Some(9))))
        );
        // max_tokens 5 reached at the run's third token
        assert_eq!(
            cut_run(&p, 3, 5, &[7, 7, 7, 7], false, 100),
            (3, Some((FinishReason::Length, None)))
        );
        assert_eq!(cut_run(&p, 3, 3, &[7, 7], false, 100), (2, None));
        // a stop string at the run's last token is its reason, before any token rule
        assert_eq!(
            cut_run(&p, 3, 5, &[7, 9], true, 100),
            (2, Some((FinishReason::Stop, None)))
        );
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
