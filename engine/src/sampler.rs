//! Sampling one token from a row of logits, and its log-probability.
//!
//! The reported log-probability is that of the distribution the token was
//! drawn from after temperature and before top-k/top-p truncation:
//! `log_softmax(logits / T)[token]`, with `T = 1` for greedy decoding
//! (temperature 0). That is the quantity the trainer recomputes from the
//! same logits (docs/ARCHITECTURE.md, "Contracts"); truncation is a sampling device,
//! not part of the policy being trained. At `T = 1` it is computed by the
//! same kernel as `Qwen3_5::score`, so the two agree to the last bit on the
//! same logits.
//!
//! Reproducibility: each sequence owns a seeded RNG; a request's `seed`
//! fixes its tokens (choice `i` of `n` uses `seed + i`).

use crate::guide::{Guide, TokenBytes};
use crate::{Error, Result};
pub use arcticd_kernels::cpu::logsoftmax::argmax;
use arcticd_kernels::cpu::logsoftmax::{greedy_pick, log_softmax_forward};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Sampling parameters of one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; 0 is greedy. Default 1.0.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// reaches `top_p`. Default 1.0 (off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 is off. Default 0.
    pub top_k: usize,
    /// RNG seed; `None` draws one. Default None.
    pub seed: Option<u64>,
    /// Most tokens to generate per choice. Default 16.
    pub max_tokens: usize,
    /// Stop when the generated text contains one of these. Default empty.
    pub stop: Vec<String>,
    /// Stop after generating one of these ids. Default empty.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens. Default false.
    pub ignore_eos: bool,
    /// Independent choices per request. Default 1.
    pub n: usize,
    /// Alternatives (id, log-prob) returned per generated token. Default 0.
    pub top_logprobs: usize,
    /// The generated text must begin with one of these strings (guided
    /// decoding, [`crate::guide`]); empty leaves sampling free. Needs the
    /// engine's tokenizer. Default empty.
    pub prefix_choices: Vec<String>,
    /// With `prefix_choices`: the text must be one whole choice, and the
    /// sequence stops once it is (vLLM's `guided_choice`). Default false.
    pub exact_choice: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            n: 1,
            top_logprobs: 0,
            prefix_choices: Vec::new(),
            exact_choice: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens`.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    /// Reject values no sampler can honour; the message goes to the client.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Input(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.n == 0 || self.n > 128 {
            return bad(format!("n must be between 1 and 128, got {}", self.n));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop strings must not be empty".into());
        }
        if self.prefix_choices.iter().any(|s| s.is_empty()) {
            return bad("prefix choices must not be empty".into());
        }
        if self.exact_choice {
            if self.prefix_choices.is_empty() {
                return bad("an exact choice needs the choices".into());
            }
            for a in &self.prefix_choices {
                if let Some(b) = self
                    .prefix_choices
                    .iter()
                    .find(|b| b.len() > a.len() && b.starts_with(a.as_str()))
                {
                    return bad(format!(
                        "choice {a:?} begins choice {b:?}, so {b:?} could never be written \
                         (the text ends at the first whole choice)"
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 1e-6
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// `log_softmax(logits / T)[token]` (T = 1 when greedy).
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens under the same distribution,
    /// most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Each of `targets` as its row of `logits` (`[targets, vocab]`) scores it
/// under the model's own distribution (temperature 1), with the `top` most
/// likely tokens there, pushed to `out`: what a prompt's tokens are given
/// when a client asks for the prompt's log-probs (`echo` with `logprobs`).
/// `logp` is scratch.
pub fn score_rows(
    logits: &[f32],
    targets: &[u32],
    top: usize,
    logp: &mut Vec<f32>,
    out: &mut Vec<Sampled>,
) -> Result<()> {
    if targets.is_empty() {
        return Ok(());
    }
    let vocab = logits.len() / targets.len();
    logp.resize(vocab, 0.0);
    for (row, &token) in logits.chunks_exact(vocab).zip(targets) {
        log_softmax_forward(logp, row, 1, vocab)?;
        let logprob = *logp.get(token as usize).ok_or_else(|| {
            Error::Input(format!(
                "token id {token} is not below the vocabulary size {vocab}"
            ))
        })?;
        out.push(Sampled {
            token,
            logprob,
            top: top_k_of(logp, top),
        });
    }
    Ok(())
}

/// Per-sequence sampler: the parameters and the sequence's RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Reused buffers, so sampling allocates nothing per token.
    logp: Vec<f32>,
    order: Vec<u32>,
    /// A draw was handed to a device ([`device_draw`](Self::device_draw))
    /// and its pick not yet taken.
    drawn_on_device: bool,
    /// The choices the text must begin with, while it must.
    guide: Option<Guide>,
    /// The tokens the guide allows next, reused.
    allowed: Vec<bool>,
}

/// How a device draws a sampler's next token where the logits are:
/// `None` greedy (the first largest logit, its log-prob at `T = 1`), or
/// `Some((1 / T, u))`, the inverse CDF at `u` of `softmax(logits * (1 /
/// T))` in vocabulary order, exactly as [`Sampler::sample`] draws from an
/// untruncated distribution.
pub type DeviceDraw = Option<(f32, f64)>;

impl Sampler {
    /// A sampler for choice `index` of a request.
    pub fn new(params: &SamplingParams, index: usize) -> Self {
        let seed = match params.seed {
            Some(s) => s.wrapping_add(index as u64),
            None => rand::thread_rng().gen(),
        };
        Sampler {
            params: params.clone(),
            rng: StdRng::seed_from_u64(seed),
            logp: Vec::new(),
            order: Vec::new(),
            drawn_on_device: false,
            guide: Guide::with(&params.prefix_choices, params.exact_choice),
            allowed: Vec::new(),
        }
    }

    /// Whether the next token is restricted by the request's
    /// [`prefix_choices`](SamplingParams::prefix_choices): it must then be
    /// sampled on the host with the token table
    /// ([`sample_with`](Self::sample_with)).
    pub fn is_guided(&self) -> bool {
        self.guide.as_ref().is_some_and(Guide::active)
    }

    /// Whether the text is now one whole choice of an exact guide
    /// ([`SamplingParams::exact_choice`]): the sequence ends.
    pub fn choice_written(&self) -> bool {
        self.guide.as_ref().is_some_and(Guide::finished)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether [`sample`](Self::sample) is a greedy pick with nothing
    /// else to compute (about a microsecond for a 4k vocabulary).
    pub fn is_cheap(&self) -> bool {
        self.params.is_greedy() && self.params.top_logprobs == 0 && !self.is_guided()
    }

    /// The next token's draw for a device that holds the logits, so only
    /// the pick travels: `None` when the host must see the row (top-k or
    /// top-p truncation over `vocab`, or alternatives to report). A draw
    /// takes the same uniform from the RNG as [`sample`](Self::sample)
    /// would, so a seed gives the same tokens on either side (to the
    /// device's rounding of the row's log-softmax).
    pub fn device_draw(&mut self, vocab: usize) -> Option<DeviceDraw> {
        let p = &self.params;
        let truncating = (p.top_k != 0 && p.top_k < vocab) || p.top_p < 1.0;
        if p.top_logprobs > 0 || truncating || self.is_guided() {
            return None;
        }
        if p.is_greedy() {
            return Some(None);
        }
        let t = p.temperature;
        let inv_t = if t == 1.0 { 1.0 } else { 1.0 / t };
        self.drawn_on_device = true;
        Some(Some((inv_t, self.rng.gen())))
    }

    /// Whether a [`device_draw`](Self::device_draw) awaits its pick;
    /// taking it clears it.
    pub fn take_device_draw(&mut self) -> bool {
        std::mem::take(&mut self.drawn_on_device)
    }

    /// Draw a token from one row of logits (a sampler with no guide;
    /// [`sample_with`](Self::sample_with) otherwise).
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled> {
        self.sample_with(logits, None)
    }

    /// Draw a token from one row of logits, among those a guided
    /// sequence's choices allow (`table` holds each token's bytes; a
    /// guided sampler needs it). The guide is a sampling device like
    /// top-k: the token's reported log-prob and its alternatives are the
    /// model's, unrestricted, as the trainer recomputes them.
    pub fn sample_with(&mut self, logits: &[f32], table: Option<&TokenBytes>) -> Result<Sampled> {
        let v = logits.len();
        if v == 0 {
            return Err(Error::Input("sampling from an empty vocabulary".into()));
        }
        let greedy = self.params.is_greedy();
        let guided = match self.guide.as_mut().filter(|g| g.active()) {
            Some(guide) => {
                let table = table.ok_or_else(|| {
                    Error::Invariant("a guided sequence was sampled without the token table".into())
                })?;
                guide.mask(table, &mut self.allowed)?;
                self.allowed.resize(v, false);
                Some(table)
            }
            None => None,
        };
        if self.is_cheap() {
            // Only the chosen token's log-prob is needed: the same
            // `x - logsumexp(x)` as the full log-softmax's entry.
            let (token, logprob) = greedy_pick(logits)?;
            return Ok(Sampled {
                token: token as u32,
                logprob,
                top: Vec::new(),
            });
        }
        self.logp.resize(v, 0.0);
        if greedy || self.params.temperature == 1.0 {
            log_softmax_forward(&mut self.logp, logits, 1, v)?;
        } else {
            let inv_t = 1.0 / self.params.temperature;
            let scaled: Vec<f32> = logits.iter().map(|&x| x * inv_t).collect();
            log_softmax_forward(&mut self.logp, &scaled, 1, v)?;
        }
        let token = match (guided, greedy) {
            (None, true) => argmax(logits) as u32,
            (None, false) => self.draw(),
            (Some(_), true) => self.best_allowed(logits),
            (Some(_), false) => self.draw_allowed(logits),
        };
        if let (Some(table), Some(guide)) = (guided, self.guide.as_mut()) {
            guide.advance(table.get(token as usize));
        }
        let top = if self.params.top_logprobs > 0 {
            top_k_of(&self.logp, self.params.top_logprobs)
        } else {
            Vec::new()
        };
        Ok(Sampled {
            token,
            logprob: self.logp[token as usize],
            top,
        })
    }

    /// The first largest logit among the allowed tokens (the mask holds
    /// at least one).
    fn best_allowed(&self, logits: &[f32]) -> u32 {
        let mut best: Option<usize> = None;
        for (i, &x) in logits.iter().enumerate() {
            if self.allowed[i] && best.is_none_or(|b| x > logits[b]) {
                best = Some(i);
            }
        }
        best.unwrap_or(0) as u32
    }

    /// A draw, with the request's truncation, from `self.logp`
    /// renormalized over the allowed tokens; `self.logp` is left as it
    /// was.
    fn draw_allowed(&mut self, logits: &[f32]) -> u32 {
        let best = self.best_allowed(logits);
        let max = self.logp[best as usize];
        let sum: f64 = self
            .logp
            .iter()
            .zip(&self.allowed)
            .filter(|(_, &a)| a)
            .map(|(&lp, _)| ((lp - max) as f64).exp())
            .sum();
        let shift = max + sum.ln() as f32;
        let unrestricted = std::mem::take(&mut self.logp);
        self.logp = unrestricted
            .iter()
            .zip(&self.allowed)
            .map(|(&lp, &a)| if a { lp - shift } else { f32::NEG_INFINITY })
            .collect();
        let token = self.draw();
        self.logp = unrestricted;
        // A draw lands on an allowed token (the others have no mass); the
        // best one stands in should rounding ever say otherwise.
        if self.allowed[token as usize] {
            token
        } else {
            best
        }
    }

    /// Sample from `self.logp` after top-k and top-p truncation.
    fn draw(&mut self) -> u32 {
        let v = self.logp.len();
        let k = if self.params.top_k == 0 {
            v
        } else {
            self.params.top_k.min(v)
        };
        let truncating = k < v || self.params.top_p < 1.0;
        if !truncating {
            // Inverse CDF over the full distribution, no sort needed.
            let u: f64 = self.rng.gen();
            let mut acc = 0.0f64;
            let mut last = 0;
            for (i, &lp) in self.logp.iter().enumerate() {
                let p = (lp as f64).exp();
                if p > 0.0 {
                    last = i;
                }
                acc += p;
                if u < acc {
                    return i as u32;
                }
            }
            return last as u32;
        }
        self.order.clear();
        self.order.extend(0..v as u32);
        let logp = &self.logp;
        let by_desc = |a: &u32, b: &u32| {
            logp[*b as usize]
                .total_cmp(&logp[*a as usize])
                .then(a.cmp(b))
        };
        if k < v {
            self.order.select_nth_unstable_by(k - 1, by_desc);
            self.order.truncate(k);
        }
        self.order.sort_unstable_by(by_desc);
        // Keep the shortest head whose mass reaches top_p (at least one).
        let mut mass = 0.0f64;
        let mut keep = 0;
        for &i in &self.order {
            mass += (logp[i as usize] as f64).exp();
            keep += 1;
            if mass >= self.params.top_p as f64 {
                break;
            }
        }
        let head = &self.order[..keep];
        let u: f64 = self.rng.gen::<f64>() * mass;
        let mut acc = 0.0f64;
        for &i in head {
            acc += (logp[i as usize] as f64).exp();
            if u < acc {
                return i;
            }
        }
        head[keep - 1]
    }
}

/// The `k` largest entries of `logp` with their indices, largest first.
pub fn top_k_of(logp: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logp.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let by_desc = |a: &u32, b: &u32| {
        logp[*b as usize]
            .total_cmp(&logp[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_desc);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_desc);
    idx.into_iter().map(|i| (i, logp[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_logprob_is_the_log_softmax_entry() {
        let mut rng = StdRng::seed_from_u64(6);
        let logits: Vec<f32> = (0..1000).map(|_| rng.gen_range(-5.0..5.0)).collect();
        let out = Sampler::new(&SamplingParams::greedy(4), 0)
            .sample(&logits)
            .unwrap();
        let mut full = vec![0.0f32; logits.len()];
        log_softmax_forward(&mut full, &logits, 1, logits.len()).unwrap();
        assert_eq!(out.logprob.to_bits(), full[out.token as usize].to_bits());
    }

    #[test]
    fn greedy_takes_argmax_with_untempered_logprob() {
        let logits = [0.1, 2.0, -1.0, 2.0];
        let mut s = Sampler::new(&SamplingParams::greedy(4), 0);
        let out = s.sample(&logits).unwrap();
        assert_eq!(out.token, 1);
        let lse = logits.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
        assert!((out.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn logprob_is_after_temperature() {
        let logits = [1.0, 0.0, -1.0];
        let mut s = Sampler::new(&params(0.5), 0);
        let out = s.sample(&logits).unwrap();
        let scaled: Vec<f64> = logits.iter().map(|x| *x as f64 / 0.5).collect();
        let lse = scaled.iter().map(|x| x.exp()).sum::<f64>().ln();
        let want = scaled[out.token as usize] - lse;
        assert!((out.logprob as f64 - want).abs() < 1e-6);
    }

    /// A device draw takes exactly the uniform `sample` would (the next
    /// host sample is the one a sampler that sampled twice gets second),
    /// and is refused where the host must see the row.
    #[test]
    fn device_draw_takes_the_samplers_uniform() {
        let logits = [0.3f32, -0.2, 1.1, 0.0, 0.7];
        let mut host = Sampler::new(&params(0.7), 0);
        let mut dev = Sampler::new(&params(0.7), 0);
        host.sample(&logits).unwrap();
        let Some(Some((inv_t, u))) = dev.device_draw(logits.len()) else {
            panic!("an untruncated sampler draws on the device");
        };
        assert_eq!(inv_t, 1.0 / 0.7f32);
        assert!((0.0..1.0).contains(&u));
        assert!(dev.take_device_draw() && !dev.take_device_draw());
        for _ in 0..20 {
            assert_eq!(
                host.sample(&logits).unwrap().token,
                dev.sample(&logits).unwrap().token
            );
        }
        let mut g = Sampler::new(&SamplingParams::greedy(4), 0);
        assert_eq!(g.device_draw(5), Some(None));
        assert!(!g.take_device_draw());
        for p in [
            SamplingParams {
                top_k: 2,
                ..params(1.0)
            },
            SamplingParams {
                top_p: 0.9,
                ..params(1.0)
            },
            SamplingParams {
                top_logprobs: 1,
                ..params(1.0)
            },
        ] {
            assert_eq!(Sampler::new(&p, 0).device_draw(5), None, "{p:?}");
        }
        // top_k at or past the vocabulary truncates nothing.
        let wide = SamplingParams {
            top_k: 5,
            ..params(1.0)
        };
        assert!(Sampler::new(&wide, 0).device_draw(5).is_some());
    }

    #[test]
    fn same_seed_same_tokens_and_frequencies_follow_probs() {
        let logits = [0.0f32, (3.0f32).ln(), 0.0, -100.0];
        let mut a = Sampler::new(&params(1.0), 0);
        let mut b = Sampler::new(&params(1.0), 0);
        let mut counts = [0usize; 4];
        for _ in 0..5000 {
            let x = a.sample(&logits).unwrap().token;
            assert_eq!(x, b.sample(&logits).unwrap().token);
            counts[x as usize] += 1;
        }
        // p = 0.2, 0.6, 0.2, ~0.
        assert!((counts[1] as f64 / 5000.0 - 0.6).abs() < 0.03, "{counts:?}");
        assert_eq!(counts[3], 0);
    }

    #[test]
    fn top_k_and_top_p_truncate() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut k1 = Sampler::new(
            &SamplingParams {
                top_k: 1,
                ..params(1.0)
            },
            0,
        );
        let mut p = Sampler::new(
            &SamplingParams {
                top_p: 0.7,
                ..params(1.0)
            },
            0,
        );
        for _ in 0..200 {
            assert_eq!(k1.sample(&logits).unwrap().token, 0);
            // p(0) = 0.644, p(1) = 0.237: the 0.7 nucleus is {0, 1}.
            assert!(p.sample(&logits).unwrap().token <= 1);
        }
    }

    #[test]
    fn top_logprobs_are_sorted() {
        let logits = [0.5f32, 3.0, 1.0, 2.0];
        let mut s = Sampler::new(
            &SamplingParams {
                top_logprobs: 3,
                ..SamplingParams::greedy(1)
            },
            0,
        );
        let out = s.sample(&logits).unwrap();
        let ids: Vec<u32> = out.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert_eq!(out.top[0].1, out.logprob);
    }

    #[test]
    fn validation_rejects_bad_values() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                n: 0,
                ..Default::default()
            },
            SamplingParams {
                top_logprobs: 99,
                ..Default::default()
            },
        ] {
            assert!(p.validate().is_err());
        }
        assert!(SamplingParams::default().validate().is_ok());
    }

    /// Tokens 0..5 are "a", "b", "ab", "c", "" (an id with no text).
    fn table() -> TokenBytes {
        TokenBytes::from_tokens([&b"a"[..], b"b", b"ab", b"c", b""])
    }

    fn guided(t: f32, choices: &[&str]) -> Sampler {
        let mut p = params(t);
        p.prefix_choices = choices.iter().map(|c| c.to_string()).collect();
        p.top_logprobs = 2;
        Sampler::new(&p, 0)
    }

    #[test]
    fn a_guided_greedy_pick_is_the_best_allowed_token_then_free() {
        let logits = [0.0, 1.0, 0.5, 3.0, 9.0];
        let mut s = guided(0.0, &["ab"]);
        let table = table();
        assert!(s.is_guided() && !s.is_cheap());
        assert_eq!(
            s.device_draw(5),
            None,
            "a guided row is sampled on the host"
        );
        let first = s.sample_with(&logits, Some(&table)).unwrap();
        assert_eq!(
            first.token, 2,
            "\"ab\" beats \"a\"; \"c\" and the empty id are masked"
        );
        // The reported log-prob and alternatives are the model's.
        let mut free = Sampler::new(&SamplingParams::greedy(4), 0);
        let mut lp = vec![0.0; 5];
        log_softmax_forward(&mut lp, &logits, 1, 5).unwrap();
        assert_eq!(first.logprob, lp[2]);
        assert_eq!(first.top[0].0, 4);
        assert!(!s.is_guided(), "the choice is written");
        assert_eq!(s.sample_with(&logits, Some(&table)).unwrap().token, 4);
        assert_eq!(free.sample(&logits).unwrap().token, 4);
    }

    #[test]
    fn a_guided_draw_lands_only_on_allowed_tokens_in_their_proportions() {
        let logits = [1.0, 0.0, 1.0f32.ln() + 1.0, 5.0, 5.0];
        let table = table();
        let mut counts = [0usize; 5];
        for seed in 0..2000 {
            let mut p = params(1.0);
            p.seed = Some(seed);
            p.prefix_choices = vec!["ab".into(), "b".into()];
            let mut s = Sampler::new(&p, 0);
            let out = s.sample_with(&logits, Some(&table)).unwrap();
            counts[out.token as usize] += 1;
        }
        assert_eq!(counts[3] + counts[4], 0, "{counts:?}");
        // Allowed: "a" (e^1), "b" (e^0), "ab" (e^1): shares 0.42, 0.16, 0.42.
        let share = |n: usize| n as f64 / 2000.0;
        assert!((share(counts[0]) - 0.4223).abs() < 0.04, "{counts:?}");
        assert!((share(counts[1]) - 0.1554).abs() < 0.04, "{counts:?}");
        assert!((share(counts[2]) - 0.4223).abs() < 0.04, "{counts:?}");
    }

    #[test]
    fn a_guided_sampler_needs_the_table_and_a_reachable_choice() {
        let logits = [0.0; 5];
        let err = guided(0.0, &["ab"]).sample(&logits).unwrap_err();
        assert!(err.to_string().contains("token table"), "{err}");
        let err = guided(0.0, &["z"])
            .sample_with(&logits, Some(&table()))
            .unwrap_err();
        assert!(err.to_string().contains("no token"), "{err}");
        let mut p = params(1.0);
        p.prefix_choices = vec![String::new()];
        assert!(p.validate().is_err());
    }

    #[test]
    fn an_exact_choice_is_validated_and_written_whole() {
        let mut p = params(0.0);
        p.exact_choice = true;
        assert!(p.validate().is_err(), "no choices");
        p.prefix_choices = vec!["a".into(), "ab".into()];
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains("could never be written"), "{err}");
        p.prefix_choices = vec!["ab".into(), "b".into()];
        p.validate().unwrap();
        let mut s = Sampler::new(&p, 0);
        let table = table();
        // "c" and then "a" lead in the logits; the guide writes "ab" as
        // "a" then "b" or "ab" at once, whichever is best allowed.
        let logits = [2.0, 0.0, 1.0, 9.0, 0.0];
        assert_eq!(s.sample_with(&logits, Some(&table)).unwrap().token, 0);
        assert!(!s.choice_written());
        assert_eq!(s.sample_with(&logits, Some(&table)).unwrap().token, 1);
        assert!(s.choice_written() && !s.is_guided());
    }
}
