//! `arcticd sft` end to end: N steps from a transformers-written checkpoint
//! give the weights of N steps of torch.optim.AdamW on the same data
//! (tests/fixtures/grads/sft_adamw, made by tests/ref/make_grad_fixtures.py),
//! and bad data lines are errors naming the line.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tmpdir(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("arcticd-sft-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn read_f32(path: &Path) -> Vec<(String, Vec<f32>)> {
    arcticd_trainer::checkpoint::read_safetensors_f32(path)
        .unwrap()
        .into_iter()
        .map(|(n, _, d)| (n, d))
        .collect()
}

fn sft(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .arg("sft")
        .args(["--model", model.to_str().unwrap()])
        .args(["--data", data.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn sft_matches_pytorch_adamw_steps() {
    let fx = root().join("tests/fixtures/grads");
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("sft_adamw/expected.json")).unwrap())
            .unwrap();
    let a = &exp["args"];
    let s = |k: &str| a[k].to_string();
    let dir = tmpdir("parity");
    let out = dir.join("ckpt");
    let res = sft(
        &fx.join("gqa_untied"),
        &fx.join("sft_adamw/data.jsonl"),
        &out,
        &[
            "--steps",
            &s("steps"),
            "--batch-size",
            &s("batch_size"),
            "--lr",
            &s("lr"),
            "--weight-decay",
            &s("weight_decay"),
            "--beta1",
            &s("beta1"),
            "--beta2",
            &s("beta2"),
            "--eps",
            &s("eps"),
            "--grad-clip",
            &s("grad_clip"),
        ],
    );
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(!String::from_utf8_lossy(&res.stderr).contains("more than the"));
    let stdout = String::from_utf8(res.stdout).unwrap();
    let losses: Vec<f64> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 3);
    for (got, want) in losses.iter().zip(exp["losses"].as_array().unwrap()) {
        let want = want.as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-4 * want.abs(),
            "loss {got} vs {want}"
        );
    }
    let got = read_f32(&out.join("model.safetensors"));
    let want = read_f32(&fx.join("sft_adamw/final.safetensors"));
    assert_eq!(got.len(), want.len());
    for ((n, g), (m, w)) in got.iter().zip(&want) {
        assert_eq!(n, m);
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (x, y) in g.iter().zip(w) {
            num += (*x as f64 - *y as f64).powi(2);
            den += (*y as f64).powi(2);
        }
        let e = (num / den).sqrt();
        assert!(e <= 1e-4, "{n}: relative error {e:e}");
    }
    for f in [
        "config.json",
        "generation_config.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_data_lines_are_named() {
    let fx = root().join("tests/fixtures/grads");
    let dir = tmpdir("bad");
    for (line, want) in [
        (
            "{\"tokens\":[1,2,999],\"loss_mask\":[0,1,1]}",
            "data.jsonl:2: token id 999",
        ),
        (
            "{\"tokens\":[1,2],\"loss_mask\":[0]}",
            "data.jsonl:2: 2 tokens but 1 loss_mask",
        ),
        (
            "{\"tokens\":[1,2],\"loss_mask\":[1,0]}",
            "data.jsonl:2: no target tokens",
        ),
        ("not json", "data.jsonl:2: invalid JSON"),
    ] {
        let data = dir.join("data.jsonl");
        std::fs::write(
            &data,
            format!("{{\"tokens\":[1,2],\"loss_mask\":[0,1]}}\n{line}\n"),
        )
        .unwrap();
        let res = sft(
            &fx.join("mqa_tied"),
            &data,
            &dir.join("out"),
            &["--steps", "1", "--batch-size", "1", "--lr", "0.1"],
        );
        assert!(!res.status.success());
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(err.contains(want), "{err} lacks {want}");
        assert!(!dir.join("out").exists());
    }
    // No GPU here (and, without the feature, no CUDA backend): a clear
    // error naming the device, no checkpoint.
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"tokens\":[1,2],\"loss_mask\":[0,1]}\n").unwrap();
    let res = sft(
        &fx.join("mqa_tied"),
        &data,
        &dir.join("out"),
        &[
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--lr",
            "0.1",
            "--device",
            "cuda:0",
        ],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success() && err.contains("cuda:0"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!dir.join("out").exists());
    // A batch larger than the data runs, and says that it repeats examples.
    let res = sft(
        &fx.join("mqa_tied"),
        &data,
        &dir.join("out"),
        &["--steps", "1", "--batch-size", "3", "--lr", "0.1"],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("--batch-size 3 is more than the 1 examples"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir.join("out"));
    // A learning rate of 0 would write the model back unchanged.
    let res = sft(
        &fx.join("mqa_tied"),
        &data,
        &dir.join("out"),
        &["--steps", "1", "--batch-size", "1", "--lr", "0"],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        !res.status.success() && err.contains("--lr 0 is not a learning rate"),
        "{err}"
    );
    assert!(!dir.join("out").exists());
    // A warmup as long as the run: it runs, and says the rate never peaks.
    let res = sft(
        &fx.join("mqa_tied"),
        &data,
        &dir.join("out"),
        &[
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--lr",
            "0.1",
            "--warmup",
            "4",
        ],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("warmup 4 is not shorter than steps 2") && err.contains("2.5e-2"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir.join("out"));
    // A rate so high that the weights diverge: the steps after the first
    // are skipped, and the run ends in an error, though the weights are
    // kept for a look.
    let res = sft(
        &fx.join("mqa_tied"),
        &data,
        &dir.join("out"),
        &["--steps", "3", "--batch-size", "1", "--lr", "1e30"],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("the last step had a non-finite loss or gradient") && err.contains("diverged"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM (or Ctrl-C) mid-run: the step under way ends, the checkpoint of
/// the steps done is written and loads, and the status is the signal's
/// (the run was killed with nothing written before).
#[test]
fn a_signal_mid_run_writes_the_steps_done() {
    use std::io::{BufRead, BufReader};
    let fx = root().join("tests/fixtures/grads");
    let dir = tmpdir("signal");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"tokens\":[1,2,3,4],\"loss_mask\":[0,1,1,1]}\n").unwrap();
    let out = dir.join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .arg("sft")
        .args(["--model", fx.join("mqa_tied").to_str().unwrap()])
        .args(["--data", data.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .args(["--steps", "100000", "--batch-size", "1", "--lr", "1e-3"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("\"step\":1"), "{first}");
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let steps = lines.map_while(|l| l.ok()).count() + 1;
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(143), "{err}");
    assert!(
        err.contains(&format!("stopped after {steps} of 100000 steps")),
        "{steps}: {err}"
    );
    arcticd_engine::Qwen3_5::load(&out).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
