//! Data-parallel steps with the in-process communicator: 2 and 4 ranks,
//! each stepping on its share of the batch with its own copy of the
//! weights, give the weights of one rank stepping on the whole batch (to the
//! fp32 order of the gradient sums), identical bits on every rank, the
//! whole batch's loss and metrics, and errors on every rank when one
//! rank's share is bad or the ranks' weights diverge.

use arcticd_engine::Qwen3_5;
use arcticd_trainer::comm::{Communicator, LocalComm};
use arcticd_trainer::optim::AdamWConfig;
use arcticd_trainer::step::{
    store_of, weights_checksum, PgExample, SftExample, StepMetrics, TrainConfig, Trainer,
};
use arcticd_trainer::{Error, Result};
use std::path::PathBuf;
use std::sync::Arc;

fn tiny() -> Qwen3_5 {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/grads/mqa_tied");
    Qwen3_5::load(&dir).unwrap()
}

const LR: f64 = 1e-3;
const EPS: f64 = 1e-8;

fn cfg() -> TrainConfig {
    TrainConfig {
        optimizer: AdamWConfig {
            lr: LR,
            eps: EPS,
            ..AdamWConfig::default()
        },
        grad_clip: Some(1.0),
        checksum_every: 1,
        ..TrainConfig::default()
    }
}

fn sft_batch() -> Vec<SftExample> {
    (0..8u32)
        .map(|s| {
            let n = 9 + (s as usize * 5) % 13;
            let tokens: Vec<u32> = (0..n as u32).map(|i| (s * 37 + i * 11 + 3) % 128).collect();
            let mut loss_mask = vec![1u8; n];
            loss_mask[..3].fill(0);
            SftExample { tokens, loss_mask }
        })
        .collect()
}

fn pg_batch() -> Vec<PgExample> {
    sft_batch()
        .into_iter()
        .enumerate()
        .map(|(i, ex)| {
            let n = ex.tokens.len();
            PgExample {
                behaviour_logprobs: (0..n).map(|t| -2.0 - 0.01 * t as f32).collect(),
                proximal_logprobs: None,
                advantage: if i % 2 == 0 { 0.5 } else { -0.5 },
                weight_versions: vec![0; n],
                tokens: ex.tokens,
                loss_mask: ex.loss_mask,
            }
        })
        .collect()
}

/// The i-th of `ranks` contiguous shares of `batch`.
fn share<T: Clone>(batch: &[T], rank: usize, ranks: usize) -> Vec<T> {
    let per = batch.len().div_ceil(ranks);
    batch.iter().skip(rank * per).take(per).cloned().collect()
}

struct Ran {
    metrics: Vec<StepMetrics>,
    /// The summed (clipped) gradient of the first step.
    first_grads: Vec<f32>,
    weights: Vec<f32>,
}

fn flat(model: &Qwen3_5) -> Vec<f32> {
    model
        .named_params()
        .into_iter()
        .flat_map(|(_, p)| p.as_f32().unwrap().to_vec())
        .collect()
}

/// `steps` steps on every rank of a world of `ranks` (threads), each on
/// its share; `step(trainer, share)` takes one. One rank: no communicator.
fn run<T: Clone + Send + Sync + 'static>(
    ranks: usize,
    batch: &[T],
    steps: usize,
    step: fn(&mut Trainer, &[T]) -> Result<StepMetrics>,
    tamper: Option<usize>,
) -> Vec<Result<Ran>> {
    let one = move |comm: Option<Arc<dyn Communicator>>, part: Vec<T>| -> Result<Ran> {
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        let mut tr = Trainer::new(store_of(tiny()), cfg())?;
        if let Some(c) = comm {
            tr = tr.with_comm(c);
        }
        if tamper == Some(rank) {
            tr.dev.optimizer.master[0][0] += 1e-3;
        }
        let mut metrics = Vec::new();
        let mut first_grads = Vec::new();
        for s in 0..steps {
            metrics.push(step(&mut tr, &part)?);
            if s == 0 {
                first_grads = tr
                    .grads()
                    .named()
                    .into_iter()
                    .flat_map(|(_, g)| g.to_vec())
                    .collect();
            }
        }
        let weights = flat(&tr.store().read());
        Ok(Ran {
            metrics,
            first_grads,
            weights,
        })
    };
    if ranks == 1 {
        return vec![one(None, batch.to_vec())];
    }
    let handles: Vec<_> = LocalComm::world(ranks)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let part = share(batch, r, ranks);
            std::thread::spawn(move || one(Some(Arc::new(c)), part))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Checks `ranks` ranks against one rank on the whole batch.
fn matches_one_rank<T: Clone + Send + Sync + 'static>(
    batch: &[T],
    step: fn(&mut Trainer, &[T]) -> Result<StepMetrics>,
) {
    const STEPS: usize = 3;
    let one = run(1, batch, STEPS, step, None).remove(0).unwrap();
    let gmax = one
        .first_grads
        .iter()
        .fold(0.0f64, |a, g| a.max(g.abs() as f64));
    for ranks in [2, 4] {
        let all: Vec<Ran> = run(ranks, batch, STEPS, step, None)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        // Every rank holds the same bits: nothing is ever broadcast.
        for r in &all[1..] {
            assert_eq!(bits(&r.weights), bits(&all[0].weights), "{ranks} ranks");
            assert_eq!(bits(&r.first_grads), bits(&all[0].first_grads));
            assert_eq!(
                r.metrics.last().unwrap().weights_checksum,
                all[0].metrics.last().unwrap().weights_checksum
            );
        }
        let dp = &all[0];
        assert!(dp.metrics.iter().all(|m| m.weights_checksum.is_some()));
        // The gradient is the whole batch's, up to the order of fp32 sums.
        let dg = max_abs_diff(&dp.first_grads, &one.first_grads);
        // One AdamW step from zero moments moves each weight by
        // lr * g / (|g| + eps) (bias-corrected), a function of g with
        // Lipschitz constant 1 / eps: the first step's weights differ by at
        // most lr * dg / eps, plus rounding.
        let dw = max_abs_diff(&dp.weights, &one.weights);
        let (m1, mo) = (&dp.metrics[0], &one.metrics[0]);
        println!(
            "{ranks} ranks: gradient max diff {dg:.2e} (max |g| {gmax:.2e}), weights after {STEPS} steps {dw:.2e} (lr {LR:.0e}), loss {} vs {}",
            m1.loss, mo.loss
        );
        assert!(
            dg <= 1e-5 * gmax,
            "gradient differs by {dg} (max |g| {gmax})"
        );
        assert!(
            dw <= STEPS as f64 * LR * (dg / EPS).min(2.0) + 1e-6,
            "weights differ by {dw}"
        );
        assert_eq!((m1.tokens, m1.step), (mo.tokens, mo.step));
        assert!((m1.loss - mo.loss).abs() <= 1e-6 * mo.loss.abs().max(1.0));
        assert!((m1.grad_norm - mo.grad_norm).abs() <= 1e-5 * mo.grad_norm);
        if let (Some(a), Some(b)) = (&m1.pg, &mo.pg) {
            assert_eq!(a.tokens, b.tokens);
            assert!((a.mismatch_mean - b.mismatch_mean).abs() <= 1e-6 * b.mismatch_mean);
            assert!((a.mismatch_max - b.mismatch_max).abs() <= 1e-6 * b.mismatch_max);
            assert!((a.clipped_fraction - b.clipped_fraction).abs() < 1e-12);
            let (sa, sb) = (m1.mismatch.as_ref().unwrap(), mo.mismatch.as_ref().unwrap());
            assert_eq!(sa.same_version_tokens, sb.same_version_tokens);
            assert!(
                (sa.same_version_mean - sb.same_version_mean).abs() <= 1e-6 * sb.same_version_mean
            );
        }
    }
}

#[test]
fn sft_on_2_and_4_ranks_matches_one_rank_on_the_whole_batch() {
    matches_one_rank(&sft_batch(), Trainer::sft_step);
}

#[test]
fn pg_on_2_and_4_ranks_matches_one_rank_on_the_whole_batch() {
    // Versions 0: same-version tokens at the first step, policy lag after.
    matches_one_rank(&pg_batch(), Trainer::pg_step);
}

#[test]
fn a_rank_with_an_empty_share_takes_part() {
    let batch = &sft_batch()[..3];
    let one = run(1, batch, 2, Trainer::sft_step, None).remove(0).unwrap();
    let all: Vec<Ran> = run(4, batch, 2, Trainer::sft_step, None)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(bits(&all[3].weights), bits(&all[0].weights));
    assert!(max_abs_diff(&all[0].weights, &one.weights) <= 2.0 * LR);
    assert_eq!(all[3].metrics[0].tokens, one.metrics[0].tokens);
}

#[test]
fn a_bad_share_fails_the_step_on_every_rank() {
    let mut batch = sft_batch();
    batch[6].tokens[2] = 100_000;
    let out = run(4, &batch, 1, Trainer::sft_step, None);
    for (r, o) in out.iter().enumerate() {
        match (r, o) {
            (3, Err(Error::Input(m))) => assert!(m.contains("100000"), "{m}"),
            (3, other) => panic!("rank 3: {:?}", other.as_ref().err()),
            (_, Err(Error::Collective(m))) => assert!(m.contains("rank 3 failed"), "{m}"),
            (_, other) => panic!("rank {r}: {:?}", other.as_ref().err()),
        }
    }
}

#[test]
fn diverged_weights_fail_the_checksum_on_every_rank() {
    let out = run(2, &sft_batch(), 1, Trainer::sft_step, Some(1));
    for o in &out {
        match o {
            Err(Error::Collective(m)) => assert!(m.contains("weights differ"), "{m}"),
            other => panic!("{:?}", other.as_ref().err()),
        }
    }
    // The checksum itself is of the bits.
    let (a, mut b) = (tiny(), tiny());
    assert_eq!(weights_checksum(&a).unwrap(), weights_checksum(&b).unwrap());
    b.named_params_mut()[0].1.as_f32_mut().unwrap()[0] += 1e-6;
    assert_ne!(weights_checksum(&a).unwrap(), weights_checksum(&b).unwrap());
}
