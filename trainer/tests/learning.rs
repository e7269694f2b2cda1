//! Learning checks: SFT on a handful of sequences drives the loss near zero;
//! the policy-gradient loss on a toy with one rewarded token raises that
//! token's probability; a poisoned batch is skipped with weights untouched.

use arcticd_engine::Qwen3_5;
use arcticd_trainer::optim::AdamWConfig;
use arcticd_trainer::step::{store_of, PgExample, SftExample, TrainConfig, Trainer};
use std::path::PathBuf;

fn tiny() -> Qwen3_5 {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/grads/mqa_tied");
    Qwen3_5::load(&dir).unwrap()
}

fn cfg(lr: f64) -> TrainConfig {
    TrainConfig {
        optimizer: AdamWConfig {
            lr,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
        grad_clip: Some(1.0),
        ..TrainConfig::default()
    }
}

#[test]
fn sft_memorizes_a_few_sequences() {
    let batch: Vec<SftExample> = (0..3u32)
        .map(|s| {
            let tokens: Vec<u32> = (0..16).map(|i| (s * 37 + i * 11) % 128).collect();
            let mut loss_mask = vec![1u8; 16];
            loss_mask[..4].fill(0);
            SftExample { tokens, loss_mask }
        })
        .collect();
    let mut tr = Trainer::new(store_of(tiny()), cfg(1e-2)).unwrap();
    let first = tr.sft_step(&batch).unwrap().loss;
    let mut last = first;
    for _ in 0..80 {
        last = tr.sft_step(&batch).unwrap().loss;
    }
    println!("SFT loss {first:.3} -> {last:.4}");
    assert!(first > 3.0 && last < 0.05, "loss {first} -> {last}");
}

#[test]
fn policy_gradient_raises_the_rewarded_token() {
    let prompt = [5u32, 17, 99];
    let (good, bad) = (42u32, 7u32);
    let mut tr = Trainer::new(store_of(tiny()), cfg(3e-3)).unwrap();
    let p_good = |tr: &Trainer| {
        let m = tr.store().read();
        let s = m.score(&[[&prompt[..], &[good]].concat()]).unwrap();
        s[0][3].unwrap().exp()
    };
    let before = p_good(&tr);
    for _ in 0..10 {
        // A group of two attempts, one rewarded: advantages +0.5 / -0.5;
        // behaviour log-probs from the current weights (on-policy).
        let scores = {
            let m = tr.store().read();
            m.score(&[
                [&prompt[..], &[good]].concat(),
                [&prompt[..], &[bad]].concat(),
            ])
            .unwrap()
        };
        let (adv, _) = arcticd_trainer::loss::group_advantages(&[1.0, 0.0], false);
        let batch: Vec<PgExample> = [good, bad]
            .iter()
            .zip(&scores)
            .zip(&adv)
            .map(|((&tok, sc), &a)| PgExample {
                tokens: [&prompt[..], &[tok]].concat(),
                loss_mask: vec![0, 0, 0, 1],
                behaviour_logprobs: vec![0.0, 0.0, 0.0, sc[3].unwrap()],
                proximal_logprobs: None,
                advantage: a,
                weight_versions: vec![],
            })
            .collect();
        let m = tr.pg_step(&batch).unwrap();
        let pg = m.pg.unwrap();
        assert!(
            pg.mismatch_max < 1e-6,
            "on-policy mismatch {}",
            pg.mismatch_max
        );
        assert_eq!(pg.tokens, 2);
    }
    let after = p_good(&tr);
    println!("p(rewarded token) {before:.4} -> {after:.4}");
    assert!(after > before * 2.0, "{before} -> {after}");
}

#[test]
fn non_finite_step_is_skipped_and_counted() {
    let mut tr = Trainer::new(store_of(tiny()), cfg(1e-2)).unwrap();
    let before: Vec<f32> = tr.store().read().named_params()[0]
        .1
        .as_f32()
        .unwrap()
        .to_vec();
    let batch = vec![PgExample {
        tokens: vec![1, 2, 3],
        loss_mask: vec![0, 1, 1],
        behaviour_logprobs: vec![0.0, -1.0, -1.0],
        proximal_logprobs: None,
        advantage: f32::NAN,
        weight_versions: vec![],
    }];
    let m = tr.pg_step(&batch).unwrap();
    assert!(m.skipped);
    assert_eq!(tr.skipped_steps, 1);
    assert_eq!(tr.store().weight_version(), 0);
    let after: Vec<f32> = tr.store().read().named_params()[0]
        .1
        .as_f32()
        .unwrap()
        .to_vec();
    assert_eq!(before, after);
}

/// Proximal log-probs: the PPO ratio is taken against them and the
/// proximal/behaviour gap enters as a truncated importance weight (cap 2).
#[test]
fn proximal_logprobs_give_a_truncated_importance_weight() {
    let tokens = vec![5u32, 17, 99, 42];
    let lp = {
        let m = tiny();
        m.score(std::slice::from_ref(&tokens)).unwrap()[0][3].unwrap()
    };
    let step = |behaviour: f32, proximal: Option<f32>| {
        let mut tr = Trainer::new(store_of(tiny()), cfg(1e-6)).unwrap();
        let ex = PgExample {
            tokens: tokens.clone(),
            loss_mask: vec![0, 0, 0, 1],
            behaviour_logprobs: vec![0.0, 0.0, 0.0, behaviour],
            proximal_logprobs: proximal.map(|p| vec![0.0, 0.0, 0.0, p]),
            advantage: 1.0,
            weight_versions: vec![],
        };
        tr.pg_step(&[ex]).unwrap()
    };
    let plain = step(lp, None);
    let weighted = step(lp - 4f32.ln(), Some(lp));
    let ratio = weighted.grad_norm / plain.grad_norm;
    println!("grad norm ratio with TIS weight min(4, 2): {ratio}");
    assert!((ratio - 2.0).abs() < 1e-3, "{ratio}");
    let pg = weighted.pg.unwrap();
    assert!((pg.mismatch_max - 4f64.ln()).abs() < 1e-5);
}

/// The KL to a reference policy: with the reference equal to the current
/// weights its gradient is exactly zero (the step's bits are the plain
/// step's); after the policy has drifted, steps that carry no reward
/// signal pull it back toward the reference, and the reported KL falls.
#[test]
fn kl_to_the_reference_pulls_a_drifted_policy_back() {
    use arcticd_trainer::loss::PgConfig;
    let tokens = vec![5u32, 17, 99, 42];
    let with_kl = |lr: f64| TrainConfig {
        pg: PgConfig {
            ref_kl_coef: 1.0,
            ..PgConfig::default()
        },
        ..cfg(lr)
    };
    let example = |tr: &Trainer, advantage: f32| {
        let lp = tr
            .store()
            .read()
            .score(std::slice::from_ref(&tokens))
            .unwrap()[0][3]
            .unwrap();
        PgExample {
            tokens: tokens.clone(),
            loss_mask: vec![0, 0, 0, 1],
            behaviour_logprobs: vec![0.0, 0.0, 0.0, lp],
            proximal_logprobs: None,
            advantage,
            weight_versions: vec![],
        }
    };

    // Reference == current weights: the same bits as without the term.
    let mut plain = Trainer::new(store_of(tiny()), cfg(1e-3)).unwrap();
    let mut kl = Trainer::new(store_of(tiny()), with_kl(1e-3))
        .unwrap()
        .with_reference(tiny())
        .unwrap();
    let ex = example(&plain, 1.0);
    let (a, b) = (
        plain.pg_step(std::slice::from_ref(&ex)).unwrap(),
        kl.pg_step(std::slice::from_ref(&ex)).unwrap(),
    );
    assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits());
    assert_eq!(b.pg.unwrap().ref_kl, 0.0);
    let bits = |t: &Trainer| -> Vec<u32> {
        t.store().read().named_params()[0]
            .1
            .as_f32()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(bits(&plain), bits(&kl));

    // Drift: SFT on the sequence raises its last token well above the
    // reference's probability.
    let mut tr = Trainer::new(store_of(tiny()), with_kl(1e-2))
        .unwrap()
        .with_reference(tiny())
        .unwrap();
    let reference_lp = tiny().score(std::slice::from_ref(&tokens)).unwrap()[0][3].unwrap();
    for _ in 0..8 {
        tr.sft_step(&[SftExample {
            tokens: tokens.clone(),
            loss_mask: vec![0, 0, 0, 1],
        }])
        .unwrap();
    }
    let drifted = example(&tr, 0.0).behaviour_logprobs[3];
    assert!(drifted > reference_lp + 0.5, "{reference_lp} -> {drifted}");
    // Advantage 0: only the KL term moves the weights.
    let mut kls = Vec::new();
    for _ in 0..8 {
        let ex = example(&tr, 0.0);
        kls.push(tr.pg_step(&[ex]).unwrap().pg.unwrap().ref_kl);
    }
    let back = example(&tr, 0.0).behaviour_logprobs[3];
    println!("log-prob: reference {reference_lp:.3}, drifted {drifted:.3}, after KL steps {back:.3}; KL {kls:?}");
    assert!(back < drifted - 0.2, "{drifted} -> {back}");
    assert!(kls[7] < kls[0], "{kls:?}");

    // On without a reference model is an error, not a silent zero.
    let mut none = Trainer::new(store_of(tiny()), with_kl(1e-3)).unwrap();
    let ex = example(&none, 1.0);
    assert!(none.pg_step(&[ex]).is_err());
}
