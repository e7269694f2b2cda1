//! `N` SFT steps of the trainer (AdamW, clip_grad_norm_, token-mean loss,
//! micro-batching) against `N` steps of `torch.optim.AdamW` through
//! transformers on the same data (tests/fixtures/grads/sft_adamw, made by
//! tests/ref/make_grad_fixtures.py), plus checkpoint round trips.

mod common;
use arcticd_engine::Qwen3_5;
use arcticd_trainer::checkpoint::save_checkpoint;
use arcticd_trainer::data::{batch_for_step, read_sft_jsonl};
use arcticd_trainer::device::RestorePoint;
use arcticd_trainer::optim::{AdamWConfig, LrSchedule};
use arcticd_trainer::step::{store_of, TrainConfig, Trainer};
use common::rel_err;
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/grads")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("sft_adamw/expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn config(args: &serde_json::Value, micro_batch_tokens: usize) -> TrainConfig {
    let f = |k: &str| args[k].as_f64().unwrap();
    TrainConfig {
        optimizer: AdamWConfig {
            lr: f("lr"),
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
        },
        schedule: LrSchedule::Constant,
        grad_clip: args["grad_clip"].as_f64(),
        micro_batch_tokens,
        ..TrainConfig::default()
    }
}

fn tmpdir(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("arcticd-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn sft_steps_match_pytorch_adamw() {
    let exp = expected();
    let args = &exp["args"];
    let base = fixtures().join(exp["base_checkpoint"].as_str().unwrap());
    let model = Qwen3_5::load(&base).unwrap();
    let vocab = model.config.vocab_size;
    let data = read_sft_jsonl(&fixtures().join("sft_adamw/data.jsonl"), vocab, None, None).unwrap();
    // A small token budget forces several micro-batches per step.
    let mut tr = Trainer::new(store_of(model), config(args, 24)).unwrap();
    let steps = args["steps"].as_u64().unwrap() as usize;
    let bs = args["batch_size"].as_u64().unwrap() as usize;
    for step in 0..steps {
        let m = tr.sft_step(&batch_for_step(&data, step, bs)).unwrap();
        let want_loss = exp["losses"][step].as_f64().unwrap();
        let want_norm = exp["grad_norms_before_clip"][step].as_f64().unwrap();
        println!(
            "step {step}: loss {} vs torch {want_loss}, grad norm {} vs {want_norm}, {} micro-batches",
            m.loss, m.grad_norm, m.micro_batches
        );
        assert!(m.micro_batches > 1);
        assert!((m.loss - want_loss).abs() < 1e-4 * want_loss.abs(), "loss");
        assert!(
            (m.grad_norm - want_norm).abs() < 1e-4 * want_norm,
            "grad norm"
        );
        assert_eq!(m.weight_version, step as u64 + 1);
    }
    let bytes = std::fs::read(fixtures().join("sft_adamw/final.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let model = tr.store().read();
    let mut worst = 0.0f64;
    for (name, p) in model.named_params() {
        let want: Vec<f32> = st
            .tensor(&name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let e = rel_err(p.as_f32().unwrap(), &want);
        assert!(
            e <= 1e-4,
            "{name}: relative error {e:e} after {steps} steps"
        );
        worst = worst.max(e);
    }
    println!("max relative weight error after {steps} AdamW steps: {worst:.2e}");
}

/// Every parameter of `a` and `b` bit for bit.
fn assert_same_params(a: &Qwen3_5, b: &Qwen3_5, what: &str) {
    for ((n, pa), (_, pb)) in a.named_params().iter().zip(b.named_params()) {
        assert_eq!(
            pa.as_f32().unwrap(),
            pb.as_f32().unwrap(),
            "{n} differs: {what}"
        );
    }
}

/// A trainer on the `gqa_untied` fixture after one SFT step, checkpointed
/// at `dir/step1`.
struct OneStep {
    a: Trainer,
    base: PathBuf,
    data: Vec<arcticd_trainer::step::SftExample>,
    cfg: TrainConfig,
    dir: PathBuf,
    ck: PathBuf,
}

fn one_step_checkpointed(tag: &str) -> OneStep {
    let exp = expected();
    let base = fixtures().join("gqa_untied");
    let data = read_sft_jsonl(&fixtures().join("sft_adamw/data.jsonl"), 128, None, None).unwrap();
    let cfg = config(&exp["args"], 1 << 20);
    let mut a = Trainer::new(store_of(Qwen3_5::load(&base).unwrap()), cfg.clone()).unwrap();
    a.sft_step(&batch_for_step(&data, 0, 2)).unwrap();
    let dir = tmpdir(tag);
    let ck = dir.join("step1");
    save_checkpoint(&ck, &a.store().read(), &base, Some(&a.dev.optimizer)).unwrap();
    OneStep {
        a,
        base,
        data,
        cfg,
        dir,
        ck,
    }
}

/// Save after one step, resume from disk, take a second step: the same
/// weights as two steps in one process; and the saved model scores like the
/// in-memory one.
#[test]
fn checkpoint_resume_is_exact() {
    let OneStep {
        mut a,
        base,
        data,
        cfg,
        dir,
        ck,
    } = one_step_checkpointed("ckpt");
    // Saving again over an existing checkpoint replaces it.
    save_checkpoint(&ck, &a.store().read(), &base, Some(&a.dev.optimizer)).unwrap();
    a.sft_step(&batch_for_step(&data, 1, 2)).unwrap();

    let reloaded = Qwen3_5::load(&ck).unwrap();
    let seqs = vec![data[0].tokens.clone(), data[3].tokens.clone()];
    let mut b = Trainer::new(store_of(reloaded), cfg.clone()).unwrap();
    b.load_optimizer(&ck).unwrap();
    assert_eq!(b.dev.optimizer.step, 1);
    let s1 = b.store().read().score(&seqs).unwrap();
    b.sft_step(&batch_for_step(&data, 1, 2)).unwrap();
    assert_same_params(&a.store().read(), &b.store().read(), "after resume");
    assert!(s1.iter().flatten().all(|x| x.is_none_or(f32::is_finite)));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["step1".to_string()],
        "no temporary directories left"
    );
    // A resume (or replay) with changed AdamW settings steps with them, not
    // with those the checkpoint was written with.
    let mut changed = cfg.clone();
    changed.optimizer.eps *= 10.0;
    let mut c = Trainer::new(store_of(Qwen3_5::load(&ck).unwrap()), changed.clone()).unwrap();
    c.load_optimizer(&ck).unwrap();
    assert_eq!(c.dev.optimizer.step, 1);
    assert_eq!(c.dev.optimizer.config, changed.optimizer);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same weights, moments and step count.
fn assert_same_trainers(a: &Trainer, b: &Trainer, what: &str) {
    assert_same_params(&a.store().read(), &b.store().read(), what);
    assert_eq!(a.dev.optimizer.step, b.dev.optimizer.step, "{what}");
    for i in 0..a.dev.optimizer.exp_avg.len() {
        assert_eq!(
            a.dev.optimizer.exp_avg[i], b.dev.optimizer.exp_avg[i],
            "{what}"
        );
        assert_eq!(
            a.dev.optimizer.exp_avg_sq[i], b.dev.optimizer.exp_avg_sq[i],
            "{what}"
        );
    }
}

/// A rollback to a checkpoint taken earlier in the same process puts back
/// its weights and optimizer state: the store holds the checkpoint's
/// weights under a new, higher version, and the next step gives the same
/// weights as a fresh trainer resumed from that checkpoint. A rollback to
/// the model the run started from is a fresh trainer's first step.
#[test]
fn rolling_back_to_a_checkpoint_equals_resuming_from_it() {
    let OneStep {
        mut a,
        base,
        data,
        cfg,
        dir,
        ck,
    } = one_step_checkpointed("rollback");
    let at_checkpoint = a.store().read().clone();
    a.sft_step(&batch_for_step(&data, 1, 2)).unwrap();
    a.sft_step(&batch_for_step(&data, 2, 2)).unwrap();
    let before = a.store().weight_version();
    assert_eq!(a.dev.optimizer.step, 3);

    let version = a.restore(&RestorePoint::Checkpoint(ck.clone())).unwrap();
    assert!(version > before, "version {version} after {before}");
    assert_eq!(a.store().weight_version(), version);
    assert_eq!(a.dev.optimizer.step, 1);
    assert_same_params(&a.store().read(), &at_checkpoint, "restored");
    a.sft_step(&batch_for_step(&data, 1, 2)).unwrap();

    let mut b = Trainer::new(store_of(Qwen3_5::load(&ck).unwrap()), cfg.clone()).unwrap();
    b.load_optimizer(&ck).unwrap();
    b.sft_step(&batch_for_step(&data, 1, 2)).unwrap();
    assert_same_trainers(
        &a,
        &b,
        "a step after the rollback against one after a resume",
    );

    // Back to the model the run started from: its weights, and the
    // optimizer before any step; the next step is a fresh trainer's first.
    let before = a.store().weight_version();
    let version = a.restore(&RestorePoint::Start(base.clone())).unwrap();
    assert!(version > before, "version {version} after {before}");
    assert_eq!(a.dev.optimizer.step, 0);
    a.sft_step(&batch_for_step(&data, 0, 2)).unwrap();
    let mut c = Trainer::new(store_of(Qwen3_5::load(&base).unwrap()), cfg).unwrap();
    c.sft_step(&batch_for_step(&data, 0, 2)).unwrap();
    assert_same_trainers(
        &a,
        &c,
        "a step after a rollback to the start against a first step",
    );

    // A checkpoint that is not there is an error, and the trainer keeps
    // what it had.
    let kept = a.store().weight_version();
    assert!(a
        .restore(&RestorePoint::Checkpoint(dir.join("missing")))
        .is_err());
    assert_eq!(a.store().weight_version(), kept);
    let _ = std::fs::remove_dir_all(&dir);
}
