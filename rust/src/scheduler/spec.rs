//! Speculative decoding in the scheduler: the n-gram proposer (`crate::spec::ngram`) run over
//! the token histories the store already holds, for every sequence that decodes next step,
//! in one call per step.
use crate::error::{Error, Result};
use crate::spec::propose_ngram;

use super::request::Request;
use super::Scheduler;

/// The drafts of one `propose_drafts` call, as flat arrays: sequence `seq_ids[i]` got
/// `num_draft_tokens[i]` tokens, its run of `draft_token_ids` (runs in order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftProposals {
    pub seq_ids: Vec<i64>,
    pub num_draft_tokens: Vec<i32>,
    pub draft_token_ids: Vec<i64>,
}

impl Scheduler {
    /// Proposes draft tokens with the configured n-gram proposer for every unfinished
    /// sequence of `running` that decodes one token next step (its prompt computed), walking
    /// `running` in order. A sequence gets at most `num_speculative_tokens`, fewer when the
    /// model length or its `max_tokens` leaves less room (a step yields its drafts plus one
    /// token), none when no suffix of its history recurs. Sequences without drafts are not
    /// listed.
    pub fn propose_drafts(&mut self) -> Result<DraftProposals> {
        let Some(cfg) = self.cfg.speculative else {
            return Err(Error::InvalidState(
                "speculative decoding is off (no num_speculative_tokens)".into(),
            ));
        };
        let max_len = self.cfg.max_seq_len();
        let mut out = DraftProposals::default();
        let mut tokens = Vec::new();
        for &h in &self.queues.running {
            let req = self.store.get(h);
            if req.needs_fork() {
                continue;
            }
            for i in req.active_seqs() {
                let s = &req.seqs[i];
                if s.tokens.len() != s.num_computed + 1 {
                    continue;
                }
                let room = draft_room(req, s.tokens.len(), max_len);
                let k = cfg.num_speculative_tokens.min(room);
                tokens.clear();
                let n = propose_ngram(&s.tokens, &cfg, k, &mut tokens);
                if n == 0 {
                    continue;
                }
                out.seq_ids.push(s.id as i64);
                out.num_draft_tokens.push(n as i32);
                out.draft_token_ids.extend(tokens.iter().map(|&t| t as i64));
            }
        }
        Ok(out)
    }
}

/// Drafts a sequence of `len` tokens of `req` may usefully take: a step with `d` drafts
/// computes positions `len - 1 .. len - 1 + d` (all below `max_len`) and yields up to `d + 1`
/// tokens, which `max_tokens` must leave room for.
fn draft_room(req: &Request, len: usize, max_len: usize) -> usize {
    let generated = len - req.prompt_len;
    let by_tokens = req.stop.max_tokens.saturating_sub(generated + 1);
    let by_len = max_len.saturating_sub(len);
    by_tokens.min(by_len)
}

#[cfg(test)]
mod tests {
    use crate::kv::CacheConfig;
    use crate::scheduler::{
        Policy, PreemptionMode, RequestParams, Scheduler, SchedulerConfig, StopParams, Strategy,
    };
    use crate::spec::NgramConfig;

    fn sched(speculative: Option<NgramConfig>) -> Scheduler {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 16,
            max_model_len: 32,
            strategy: Strategy::Unified,
            policy: Policy::Fcfs,
            preemption_mode: PreemptionMode::Auto,
            long_prefill_token_threshold: 0,
            num_lookahead_slots: 0,
            delay_factor: 0.0,
            max_loras: 0,
            speculative,
        };
        let cache = CacheConfig {
            block_size: 4,
            num_device_blocks: 64,
            num_host_blocks: 0,
            watermark: 0.0,
            enable_prefix_caching: false,
        };
        Scheduler::new(cache, cfg).unwrap()
    }

    fn add(s: &mut Scheduler, id: &str, prompt: Vec<u32>, max_tokens: usize) {
        let params = RequestParams {
            prompt,
            n: 1,
            priority: 0,
            arrival_time: 0.0,
            stop: StopParams {
                max_tokens,
                ..StopParams::default()
            },
            extra_key: 0,
            lora_id: 0,
            structured_output: false,
        };
        s.add_request(id, params).unwrap();
    }

    fn step(s: &mut Scheduler, token: i64) {
        let out = s.schedule(0.0).unwrap();
        let sampled = vec![token; out.num_samples()];
        s.update_from_output(out.step, &sampled, None).unwrap();
    }

    #[test]
    fn proposes_for_decoding_sequences_only() {
        let mut s = sched(Some(NgramConfig::new(3, 2, 1).unwrap()));
        add(&mut s, "a", vec![1, 2, 3, 4, 5, 1], 16);
        add(&mut s, "b", vec![7, 8, 9], 16);
        // nothing computed yet: nothing decodes next step
        assert_eq!(s.propose_drafts().unwrap().seq_ids.len(), 0);
        step(&mut s, 2);
        let p = s.propose_drafts().unwrap();
        // "a" is 1 2 3 4 5 1 2: [1, 2] recurs, followed by 3 4 5; "b" (7 8 9 2) has no repeat
        assert_eq!(p.seq_ids, vec![0]);
        assert_eq!(p.num_draft_tokens, vec![3]);
        assert_eq!(p.draft_token_ids, vec![3, 4, 5]);
    }

    #[test]
    fn drafts_are_trimmed_to_max_tokens_and_model_length() {
        let mut s = sched(Some(NgramConfig::new(4, 2, 1).unwrap()));
        // after one step: 2 generated of max 4 ... a step yields drafts + 1, so 1 draft
        add(&mut s, "a", vec![1, 2, 3, 4, 5, 6, 1], 3);
        step(&mut s, 2);
        assert_eq!(s.propose_drafts().unwrap().draft_token_ids, vec![3]);
        let mut s = sched(Some(NgramConfig::new(4, 2, 1).unwrap()));
        // 29 tokens + 1 sampled = 30 of max_model_len 32: room for 2 drafts
        let mut prompt: Vec<u32> = (10..37).collect();
        prompt.extend([1, 2, 3, 4, 1]);
        prompt.drain(..3);
        add(&mut s, "b", prompt, 100);
        step(&mut s, 2);
        assert_eq!(s.propose_drafts().unwrap().draft_token_ids, vec![3, 4]);
    }

    #[test]
    fn off_without_a_configuration() {
        let mut s = sched(None);
        assert!(s.propose_drafts().is_err());
    }
}
