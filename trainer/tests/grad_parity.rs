//! Gradient parity with PyTorch autograd through transformers' Qwen3.5, on
//! the fixtures of tests/ref/make_grad_fixtures.py (tests/fixtures/grads),
//! and agreement of the trainer's log-probs with the engine's `score`.

mod common;
use arcticd_engine::Qwen3_5;
use arcticd_trainer::model::{self, Packed};
use arcticd_trainer::ModelGrads;
use common::rel_err;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/grads")
        .join(case)
}

fn read_f32_tensors(path: &std::path::Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, data)
        })
        .collect()
}

struct Batch {
    sequences: Vec<Vec<u32>>,
    weights: Vec<Vec<f32>>,
    loss: f64,
    logprobs: Vec<Vec<Option<f64>>>,
}

fn read_batch(case: &str) -> Batch {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(case).join("batch.json")).unwrap())
            .unwrap();
    let sequences = serde_json::from_value(v["sequences"].clone()).unwrap();
    let weights = serde_json::from_value(v["weights"].clone()).unwrap();
    let logprobs = serde_json::from_value(v["logprobs"].clone()).unwrap();
    Batch {
        sequences,
        weights,
        loss: v["loss"].as_f64().unwrap(),
        logprobs,
    }
}

/// Rows (token index whose hidden state predicts), targets and weights of
/// every scored position t >= 1 of every sequence.
fn scored(packed: &Packed, b: &Batch) -> (Vec<usize>, Vec<u32>, Vec<f32>) {
    let (mut rows, mut targets, mut w) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &(start, n)) in packed.spans.iter().enumerate() {
        for t in 1..n {
            rows.push(start + t - 1);
            targets.push(b.sequences[s][t]);
            w.push(b.weights[s][t]);
        }
    }
    (rows, targets, w)
}

fn check_case(case: &str) {
    let dir = fixture(case);
    let m = Qwen3_5::load(&dir).unwrap();
    let b = read_batch(case);
    let packed = Packed::new(&b.sequences, m.config.vocab_size).unwrap();
    let (rows, targets, w) = scored(&packed, &b);
    let acts = model::forward(&m, packed).unwrap();
    let lp = model::token_logprobs(&m, &acts.hidden, &rows, &targets).unwrap();

    // Log-probs and loss against PyTorch.
    let want_lp: Vec<f64> = b
        .logprobs
        .iter()
        .flat_map(|r| r[1..].iter().map(|x| x.unwrap()))
        .collect();
    let max_lp = lp
        .iter()
        .zip(&want_lp)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max);
    assert!(
        max_lp < 1e-4,
        "{case}: log-probs differ from PyTorch by {max_lp:e}"
    );
    let loss: f64 = lp.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum();
    assert!(
        (loss - b.loss).abs() < 1e-4 * b.loss.abs().max(1.0),
        "{case}: loss {loss} vs {}",
        b.loss
    );

    let mut grads = ModelGrads::zeros_like(&m);
    grads.check_matches(&m).unwrap();
    let dhidden =
        model::token_logprobs_backward(&m, &mut grads, &acts.hidden, &rows, &targets, &w).unwrap();
    model::backward(&m, &acts, &dhidden, &mut grads).unwrap();

    let want = read_f32_tensors(&dir.join("grads.safetensors"));
    let named = grads.named();
    assert_eq!(named.len(), want.len(), "{case}: number of gradients");
    let mut worst: HashMap<String, f64> = HashMap::new();
    for (name, g) in &named {
        let r = want
            .get(name)
            .unwrap_or_else(|| panic!("{case}: no reference for {name}"));
        let e = rel_err(g, r);
        // Tensor kind: the name without the layer index.
        let kind = match name.split_once("layers.") {
            Some((_, rest)) => rest.split_once('.').map_or(rest, |x| x.1).to_string(),
            None => name.trim_start_matches("model.").to_string(),
        };
        let slot = worst.entry(kind).or_insert(0.0);
        *slot = slot.max(e);
        assert!(e <= 1e-4, "{case}: {name} relative error {e:e}");
    }
    let mut kinds: Vec<_> = worst.into_iter().collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, e) in kinds {
        println!("{case}: {k:<40} max rel err {e:.2e}");
    }
    println!(
        "{case}: max |lp - torch| {max_lp:.2e}, loss {loss} vs {}",
        b.loss
    );
}

#[test]
fn gradients_match_pytorch_untied_gqa() {
    check_case("gqa_untied");
}

#[test]
fn gradients_match_pytorch_tied_mqa() {
    check_case("mqa_tied");
}

/// The trainer's log-probs are the engine's: same kernels, same order.
#[test]
fn trainer_logprobs_equal_engine_score() {
    for case in ["gqa_untied", "mqa_tied"] {
        let m = Qwen3_5::load(&fixture(case)).unwrap();
        let b = read_batch(case);
        let packed = Packed::new(&b.sequences, m.config.vocab_size).unwrap();
        let (rows, targets, _) = scored(&packed, &b);
        let acts = model::forward(&m, packed).unwrap();
        let lp = model::token_logprobs(&m, &acts.hidden, &rows, &targets).unwrap();
        let engine: Vec<f32> = m
            .score(&b.sequences)
            .unwrap()
            .into_iter()
            .flat_map(|r| r.into_iter().skip(1).map(|x| x.unwrap()))
            .collect();
        let max = lp
            .iter()
            .zip(&engine)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let identical = lp
            .iter()
            .zip(&engine)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        println!(
            "{case}: trainer vs engine max |diff| {max:e}, {identical}/{} bit-identical",
            lp.len()
        );
        assert!(
            max <= 1e-6,
            "{case}: trainer and engine log-probs differ by {max:e}"
        );
    }
}

/// Gradients for upstream `dlp` that depend on (sequence id, position), so
/// a sequence gets the same per-token weights alone or packed.
fn grads_of(m: &Qwen3_5, seqs: &[(usize, Vec<u32>)], recompute: bool) -> ModelGrads {
    let tokens: Vec<Vec<u32>> = seqs.iter().map(|(_, s)| s.clone()).collect();
    let packed = Packed::new(&tokens, m.config.vocab_size).unwrap();
    let (mut rows, mut targets, mut dlp) = (Vec::new(), Vec::new(), Vec::new());
    for ((id, seq), &(start, _)) in seqs.iter().zip(&packed.spans) {
        for (t, &tok) in seq.iter().enumerate().skip(1) {
            rows.push(start + t - 1);
            targets.push(tok);
            dlp.push(((id * 31 + t) % 7) as f32 * 0.1 - 0.3);
        }
    }
    let opts = model::ForwardOptions {
        recompute_layers: recompute,
    };
    let acts = model::forward_with(m, packed, opts).unwrap();
    let mut g = ModelGrads::zeros_like(m);
    let dh =
        model::token_logprobs_backward(m, &mut g, &acts.hidden, &rows, &targets, &dlp).unwrap();
    model::backward(m, &acts, &dh, &mut g).unwrap();
    g
}

fn numbered(case: &str) -> Vec<(usize, Vec<u32>)> {
    read_batch(case).sequences.into_iter().enumerate().collect()
}

/// Per-layer recomputation gives the same gradients bit for bit.
#[test]
fn recomputed_layers_give_identical_gradients() {
    let m = Qwen3_5::load(&fixture("gqa_untied")).unwrap();
    let seqs = numbered("gqa_untied");
    let (a, b) = (grads_of(&m, &seqs, false), grads_of(&m, &seqs, true));
    for ((n, x), (_, y)) in a.named().iter().zip(b.named()) {
        assert_eq!(*x, y, "{n}");
    }
}

/// Nothing leaks across sequence boundaries, forward or backward: the
/// gradient of a packed batch is the sum of its sequences' gradients taken
/// one at a time.
#[test]
fn packed_gradient_is_the_sum_of_per_sequence_gradients() {
    for case in ["gqa_untied", "mqa_tied"] {
        let m = Qwen3_5::load(&fixture(case)).unwrap();
        let seqs = numbered(case);
        let packed = grads_of(&m, &seqs, false);
        let mut alone = grads_of(&m, &seqs[..1], false);
        for s in &seqs[1..] {
            let g = grads_of(&m, std::slice::from_ref(s), false);
            for ((_, x), (_, y)) in alone.named_mut().into_iter().zip(g.named()) {
                x.iter_mut().zip(y).for_each(|(p, q)| *p += q);
            }
        }
        for ((n, x), (_, y)) in packed.named().iter().zip(alone.named()) {
            let e = rel_err(x, y);
            assert!(e < 1e-5, "{case}: {n} packed vs alone: {e:e}");
        }
    }
}

/// The entropy path through the model: d(sum_t c_t H_t)/d(final norm weight)
/// against central differences of the forward.
#[test]
fn entropy_gradient_matches_finite_differences() {
    let m = Qwen3_5::load(&fixture("mqa_tied")).unwrap();
    let seqs: Vec<Vec<u32>> = read_batch("mqa_tied").sequences;
    let loss_and_grad = |m: &Qwen3_5, grad: bool| {
        let packed = Packed::new(&seqs, m.config.vocab_size).unwrap();
        let rows: Vec<usize> = (0..packed.len()).collect();
        let targets: Vec<u32> = packed.ids.clone();
        let coef: Vec<f32> = (0..rows.len())
            .map(|i| (i % 5) as f32 * 0.1 - 0.2)
            .collect();
        let acts = model::forward(m, packed).unwrap();
        let (_, ent) =
            model::token_logprobs_entropy(m, &acts.hidden, &rows, &targets, true, 1.0).unwrap();
        let ent = ent.unwrap();
        let loss: f64 = ent
            .iter()
            .zip(&coef)
            .map(|(h, c)| *h as f64 * *c as f64)
            .sum();
        if !grad {
            return (loss, None);
        }
        let mut g = ModelGrads::zeros_like(m);
        let zeros = vec![0.0f32; rows.len()];
        let dh = model::token_logprobs_entropy_backward(
            m,
            &mut g,
            &acts.hidden,
            &rows,
            &targets,
            &zeros,
            Some(&coef),
            1.0,
        )
        .unwrap();
        model::backward(m, &acts, &dh, &mut g).unwrap();
        (loss, Some(g.norm.clone()))
    };
    let analytic = loss_and_grad(&m, true).1.unwrap();
    let eps = 1e-2f32;
    for i in [0usize, 7, 31] {
        let shifted = |d: f32| {
            let mut mm = m.clone();
            mm.norm.as_f32_mut().unwrap()[i] += d;
            loss_and_grad(&mm, false).0
        };
        let num = (shifted(eps) - shifted(-eps)) / (2.0 * eps as f64);
        let err = (num - analytic[i] as f64).abs() / num.abs().max(1e-2);
        assert!(
            err < 1e-2,
            "norm.weight[{i}]: analytic {} vs numeric {num}",
            analytic[i]
        );
    }
}

/// At a temperature other than 1 the trainer's log-probs are those the
/// engine's sampler reports: `log_softmax(logits / T)` of the sampled token.
#[test]
fn trainer_logprobs_at_temperature_equal_the_samplers() {
    use arcticd_engine::sampler::{Sampler, SamplingParams};
    let m = Qwen3_5::load(&fixture("gqa_untied")).unwrap();
    let b = read_batch("gqa_untied");
    let packed = Packed::new(&b.sequences, m.config.vocab_size).unwrap();
    let acts = model::forward(&m, packed).unwrap();
    let h = m.config.hidden_size;
    let n = acts.hidden.len() / h;
    let logits = m.logits(&acts.hidden).unwrap();
    let v = m.config.vocab_size;
    for t in [0.7f32, 1.3] {
        let params = SamplingParams {
            temperature: t,
            seed: Some(3),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(&params, 0);
        let (mut rows, mut targets, mut engine) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..n {
            let s = sampler.sample(&logits[r * v..(r + 1) * v]).unwrap();
            rows.push(r);
            targets.push(s.token);
            engine.push(s.logprob);
        }
        let (lp, _) =
            model::token_logprobs_entropy(&m, &acts.hidden, &rows, &targets, false, t).unwrap();
        let (lp1, _) =
            model::token_logprobs_entropy(&m, &acts.hidden, &rows, &targets, false, 1.0).unwrap();
        let max = lp
            .iter()
            .zip(&engine)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let off = lp1
            .iter()
            .zip(&engine)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("T={t}: trainer vs sampler max |diff| {max:e}; at T=1 it would be {off:e}");
        assert!(max <= 1e-6, "T={t}: trainer and sampler differ by {max:e}");
        assert!(off > 1e-3, "T={t} must change the log-probs");
    }
}

/// Per tensor, `|g - ref| / |ref|` and the largest `|g_i - ref_i| / |ref_i|`.
fn errors(g: &[f32], r: &[f32]) -> (f64, f64) {
    let element = g
        .iter()
        .zip(r)
        .filter(|(_, r)| **r != 0.0)
        .map(|(g, r)| ((*g as f64 - *r as f64) / *r as f64).abs())
        .fold(0.0, f64::max);
    (rel_err(g, r), element)
}

/// One 3,840-token sequence with weights of both signs, against float64
/// autograd (tests/ref/make_long_grad_fixture.py): every gradient at least
/// as accurate as PyTorch float32's, within a small factor, element by
/// element on the decay parameters (A_log, dt_bias), whose gradients are
/// sums that mostly cancel and whose sign Adam turns into a full step.
#[test]
fn long_sequence_gradients_against_float64() {
    let dir = fixture("long_f64");
    let m = Qwen3_5::load(&fixture("gqa_untied")).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(v["ids"].clone()).unwrap();
    let weights: Vec<f64> = serde_json::from_value(v["weights"].clone()).unwrap();
    let torch: HashMap<String, HashMap<String, f64>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("torch_f32_errors.json")).unwrap())
            .unwrap();
    let want = read_f32_tensors(&dir.join("ref_grads.safetensors"));

    let packed = Packed::new(std::slice::from_ref(&ids), m.config.vocab_size).unwrap();
    let rows: Vec<usize> = (0..ids.len() - 1).collect();
    let targets = ids[1..].to_vec();
    let w: Vec<f32> = weights[1..].iter().map(|&x| x as f32).collect();
    let acts = model::forward(&m, packed).unwrap();
    let mut grads = ModelGrads::zeros_like(&m);
    let dhidden =
        model::token_logprobs_backward(&m, &mut grads, &acts.hidden, &rows, &targets, &w).unwrap();
    model::backward(&m, &acts, &dhidden, &mut grads).unwrap();

    let (mut all_d, mut all_r, mut all_t) = (0.0f64, 0.0f64, 0.0f64);
    let mut failures = Vec::new();
    for (name, g) in grads.named() {
        let r = &want[&name];
        let (norm, element) = errors(g, r);
        let t = &torch[&name];
        let (t_norm, t_element) = (t["norm"], t["element"]);
        let rr: f64 = r.iter().map(|x| (*x as f64).powi(2)).sum();
        all_d += norm.powi(2) * rr;
        all_r += rr;
        all_t += t_norm.powi(2) * rr;
        let decay = name.ends_with("A_log") || name.ends_with("dt_bias");
        println!(
            "{name:<45} ours: norm {norm:.2e} element {element:.2e}   torch f32: norm {t_norm:.2e} element {t_element:.2e}"
        );
        // A factor of 4 over PyTorch float32 (or 1e-5, where float32 is
        // nearly exact), on the tensor and, for the decay parameters, on
        // every element.
        if norm > (4.0 * t_norm).max(1e-5) || (decay && element > (4.0 * t_element).max(1e-5)) {
            failures.push(name);
        }
    }
    let (ours, theirs) = ((all_d / all_r).sqrt(), (all_t / all_r).sqrt());
    println!("whole gradient: ours {ours:.2e}, torch f32 {theirs:.2e}");
    assert!(
        failures.is_empty(),
        "less accurate than float32 PyTorch: {failures:?}"
    );
}
