//! Shared prefixes (`TrainConfig::share_prefixes`): the attempts of a task
//! share its prompt, which the trainer runs once, with every attempt's rest
//! continuing from the prompt's caches. Against running every sequence
//! whole: the same log-probs bit for bit, the same gradient to fp32
//! rounding (the prefix's gradient is a sum over its group in another
//! order), on both fixture models (GQA and MQA, both layer kinds), with
//! and without layer recomputation, with prefixes shorter than the conv
//! window, and through a whole optimizer step.

mod common;
use arcticd_engine::Qwen3_5;
use arcticd_trainer::loss::PgConfig;
use arcticd_trainer::model::{self, ForwardOptions, PrefixGroup};
use arcticd_trainer::optim::AdamWConfig;
use arcticd_trainer::step::{store_of, PgExample, StepMetrics, TrainConfig, Trainer};
use arcticd_trainer::ModelGrads;
use common::rel_err;
use std::path::PathBuf;

fn fixture(case: &str) -> Qwen3_5 {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/grads")
        .join(case);
    Qwen3_5::load(&dir).unwrap()
}

/// `n` pseudo-random ids below 128 from `seed`.
fn ids(seed: u32, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) % 128
        })
        .collect()
}

/// Three attempts at a 13-token prompt, two at a 2-token one (shorter than
/// the conv window), one alone; and `(prompt, attempt lengths)` of each.
fn batch() -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut seqs = Vec::new();
    let mut prompts = Vec::new();
    for (prompt, rests, seed) in [(13, vec![5, 9, 1], 1), (2, vec![6, 3], 7)] {
        let p = ids(seed, prompt);
        for (i, n) in rests.into_iter().enumerate() {
            seqs.push([p.clone(), ids(seed * 31 + i as u32 + 2, n)].concat());
            prompts.push(prompt);
        }
    }
    seqs.push(ids(99, 11));
    prompts.push(1);
    (seqs, prompts)
}

/// Rows and targets of every generated token (after its prompt), as the
/// step scores them: row `t - 1` of the whole packing predicts token `t`.
fn scored(seqs: &[Vec<u32>], prompts: &[usize]) -> (Vec<usize>, Vec<u32>) {
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    let mut start = 0;
    for (seq, &p) in seqs.iter().zip(prompts) {
        for (t, &id) in seq.iter().enumerate().skip(p) {
            rows.push(start + t - 1);
            targets.push(id);
        }
        start += seq.len();
    }
    (rows, targets)
}

/// Log-probs, entropies, tokens run and the gradient of a fixed mix of
/// both, with `groups` sharing their prefixes.
fn run(
    m: &Qwen3_5,
    seqs: &[&[u32]],
    groups: &[PrefixGroup],
    rows: &[usize],
    targets: &[u32],
    recompute: bool,
) -> (Vec<f32>, Vec<f32>, usize, ModelGrads) {
    let opts = ForwardOptions {
        recompute_layers: recompute,
    };
    let (acts, moved) = model::forward_shared(m, seqs, groups, rows, opts).unwrap();
    let (lp, ent) =
        model::token_logprobs_entropy(m, &acts.hidden, &moved, targets, true, 1.0).unwrap();
    let dlp: Vec<f32> = (0..rows.len())
        .map(|i| (i % 7) as f32 * 0.3 - 1.0)
        .collect();
    let dent: Vec<f32> = (0..rows.len()).map(|i| (i % 3) as f32 * 0.1).collect();
    let mut g = ModelGrads::zeros_like(m);
    let dh = model::token_logprobs_entropy_backward(
        m,
        &mut g,
        &acts.hidden,
        &moved,
        targets,
        &dlp,
        Some(&dent),
        1.0,
    )
    .unwrap();
    model::backward_shared(m, &acts, &dh, &mut g).unwrap();
    (lp, ent.unwrap(), acts.tokens(), g)
}

#[test]
fn shared_prefixes_give_the_unshared_logprobs_and_gradient() {
    let (seqs, prompts) = batch();
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let (rows, targets) = scored(&seqs, &prompts);
    let groups = model::plan_prefixes(&refs);
    // Each prompt is shared; the first generated token is scored from its
    // last position, inside the prefix, once for every attempt.
    assert_eq!(
        groups,
        vec![
            PrefixGroup {
                members: 0..3,
                shared: 13
            },
            PrefixGroup {
                members: 3..5,
                shared: 2
            },
        ]
    );
    for case in ["gqa_untied", "mqa_tied"] {
        let m = fixture(case);
        for recompute in [false, true] {
            let (lp0, ent0, n0, g0) = run(&m, &refs, &[], &rows, &targets, recompute);
            let (lp1, ent1, n1, g1) = run(&m, &refs, &groups, &rows, &targets, recompute);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&lp1), bits(&lp0), "{case}: log-probs");
            assert_eq!(bits(&ent1), bits(&ent0), "{case}: entropies");
            assert_eq!(n0, seqs.iter().map(Vec::len).sum::<usize>());
            assert_eq!(n1, n0 - 2 * 13 - 2);
            let mut worst = 0.0f64;
            for ((name, a), (_, b)) in g1.named().iter().zip(g0.named()) {
                let e = rel_err(a, b);
                assert!(
                    e < 1e-5,
                    "{case} recompute={recompute}: {name} shared vs whole: {e:e}"
                );
                worst = worst.max(e);
            }
            println!("{case} recompute={recompute}: worst relative gradient error {worst:.1e}");
        }
    }
}

/// A row past the batch, or a group whose members do not share its
/// tokens, is refused.
#[test]
fn bad_rows_and_groups_are_refused() {
    let m = fixture("mqa_tied");
    let (seqs, prompts) = batch();
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let (mut rows, _) = scored(&seqs, &prompts);
    let past = seqs.iter().map(Vec::len).sum::<usize>();
    rows.push(past);
    let groups = model::plan_prefixes(&refs);
    let err = model::forward_shared(&m, &refs, &groups, &rows, ForwardOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("row {past}")), "{err}");
    // A group whose members do not share its tokens is refused too.
    let wrong = vec![PrefixGroup {
        members: 2..4,
        shared: 5,
    }];
    let err = model::forward_shared(&m, &refs, &wrong, &[], ForwardOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("shared tokens"), "{err}");
}

/// A policy-gradient step with shared prefixes (a KL term to a reference
/// model too, whose forward shares them): the loss of the unshared step,
/// bit for bit, and its gradients within fp32 rounding.
#[test]
fn a_step_with_shared_prefixes_is_the_unshared_step() {
    let (seqs, prompts) = batch();
    let batch: Vec<PgExample> = seqs
        .iter()
        .zip(&prompts)
        .enumerate()
        .map(|(i, (s, &p))| PgExample {
            tokens: s.clone(),
            loss_mask: (0..s.len()).map(|t| u8::from(t >= p)).collect(),
            behaviour_logprobs: vec![-1.5; s.len()],
            proximal_logprobs: None,
            advantage: if i % 2 == 0 { 1.0 } else { -0.5 },
            weight_versions: Vec::new(),
        })
        .collect();
    let step = |share: bool, budget: usize| {
        let cfg = TrainConfig {
            micro_batch_tokens: budget,
            optimizer: AdamWConfig {
                lr: 1e-3,
                ..AdamWConfig::default()
            },
            share_prefixes: share,
            pg: PgConfig {
                ref_kl_coef: 0.1,
                ..PgConfig::default()
            },
            ..TrainConfig::default()
        };
        let mut reference = fixture("gqa_untied");
        reference.norm.as_f32_mut().unwrap()[0] += 0.5;
        let mut t = Trainer::new(store_of(fixture("gqa_untied")), cfg)
            .unwrap()
            .with_reference(reference)
            .unwrap();
        let metrics = t.pg_step(&batch).unwrap();
        let grads = t.grads().clone();
        (metrics, grads)
    };
    let whole: usize = seqs.iter().map(Vec::len).sum();
    let ((m0, g0), (m1, g1)) = (step(false, 1 << 14), step(true, 1 << 14));
    assert_eq!(m1.loss.to_bits(), m0.loss.to_bits());
    let ref_kl = |m: &StepMetrics| m.pg.as_ref().unwrap().ref_kl;
    assert!(ref_kl(&m0) > 0.0);
    assert_eq!(ref_kl(&m1).to_bits(), ref_kl(&m0).to_bits());
    assert_eq!(m1.tokens, m0.tokens);
    assert_eq!(m0.tokens_run, whole);
    assert_eq!(m1.tokens_run, whole - 2 * 13 - 2);
    // A budget of 25 tokens cuts the first group (18, 22 and 14 tokens,
    // 13 shared): its first attempt alone, the other two sharing the
    // prompt; no micro-batch runs more than the budget.
    let (m2, g2) = step(true, 25);
    assert_eq!(m2.tokens_run, whole - 13 - 2);
    assert_eq!(m2.micro_batches, 3);
    let rel = (m2.loss - m0.loss).abs() / m0.loss.abs();
    assert!(rel < 1e-6, "loss {} vs {}", m2.loss, m0.loss);
    for (m, g) in [(&m1, &g1), (&m2, &g2)] {
        let rel = (m.grad_norm - m0.grad_norm).abs() / m0.grad_norm;
        assert!(rel < 1e-6, "grad norm {} vs {}", m.grad_norm, m0.grad_norm);
        for ((n, a), (_, b)) in g.named().iter().zip(g0.named()) {
            let e = rel_err(a, b);
            assert!(e < 1e-5, "{n}: the step's gradients differ by {e:e}");
        }
    }
}
