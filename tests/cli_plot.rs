//! `arcticd plot` end to end through the real binary: two synthetic runs
//! overlay into every figure, each a real, non-blank PNG of the documented
//! size; figures without data are skipped; bad input (a missing run, an
//! empty file, a non-JSON line in the middle) fails with a message naming the
//! file and line, never a panic.

use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIGURES: [&str; 6] = [
    "reward.png",
    "mismatch.png",
    "staleness.png",
    "time.png",
    "replica_load.png",
    "memory.png",
];
const SIZE: (u32, u32) = (1200, 900);

fn arcticd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(args)
        .output()
        .expect("run arcticd")
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("arcticd-plot-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A deterministic noise in [-1, 1).
fn noise(seed: u64, i: u64) -> f64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % 2000) as f64 / 1000.0 - 1.0
}

/// A run of `steps` updates with the fields the RL loop logs; `replicas`
/// engine replicas; every 10th step has an eval, every 25th a recheck; the
/// file ends in a torn line when `torn`.
fn write_run(dir: &Path, seed: u64, steps: u64, replicas: usize, torn: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let mut text = String::new();
    for i in 0..steps {
        let step = i + 1;
        let t = step as f64 / steps as f64;
        let n = |k: u64| noise(seed * 16 + k, step);
        let mut row = json!({
            "step": step,
            "weight_version": step,
            "elapsed_s": step as f64 * 3.0,
            "reward_mean": (0.2 + 0.5 * t + 0.1 * n(0)).clamp(-1.0, 1.0),
            "pass_rate": (0.1 + 0.6 * t + 0.15 * n(1)).clamp(0.0, 1.0),
            "mismatch_same_version_mean": 0.0,
            "mismatch_same_version_max": 0.0,
            "lag_divergence_mean": 1e-3 * (1.0 + 0.5 * n(2)) * (1.0 + seed as f64),
            "staleness_mean": 1.0 + 0.5 * n(3).abs(),
            "staleness_max": 2 + (n(4).abs() * 3.0) as u64,
            "stale_dropped": (n(5).abs() * 4.0) as u64,
            "time_wait_s": 0.5 + 0.3 * n(6).abs(),
            "time_train_s": 2.0 + 0.2 * n(7),
            "time_update_s": 0.1 + 0.02 * n(8).abs(),
            "rss_mib": 300.0 + 40.0 * t + 5.0 * n(9),
            "rss_peak_mib": 360.0 + 40.0 * t,
            "replica_load": (0..replicas)
                .map(|r| 100.0 + 20.0 * noise(seed * 100 + r as u64, step))
                .collect::<Vec<_>>(),
        });
        let obj = row.as_object_mut().unwrap();
        if step % 10 == 0 {
            obj.insert("eval_pass_at_1".into(), json!(0.1 + 0.5 * t));
        }
        if step % 25 == 0 {
            obj.insert("recheck_reward".into(), json!(0.15 + 0.45 * t));
        }
        if step % 7 == 0 {
            // Fields are simply absent on some steps.
            obj.remove("lag_divergence_mean");
            obj.remove("time_wait_s");
        }
        text.push_str(&row.to_string());
        text.push('\n');
    }
    if torn {
        text.push_str("{\"step\": 999, \"reward_me");
    }
    std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
}

/// Width, height and whether the image is more than one colour, from a PNG
/// file (checked signature and IHDR, then fully decoded).
fn png_info(path: &Path) -> (u32, u32, bool) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut buf).unwrap();
    let pixels = &buf[..frame.buffer_size()];
    let px = frame.color_type.samples();
    let first = &pixels[..px];
    let varied = pixels.chunks(px).any(|p| p != first);
    (w, h, varied)
}

fn assert_clean_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "panic reached the user: {stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "error should mention {needle:?}: {stderr}"
        );
    }
}

#[test]
fn two_runs_overlay_into_every_figure() {
    let root = tmpdir("overlay");
    let (a, b) = (root.join("run-a"), root.join("run-b"));
    write_run(&a, 1, 80, 4, true);
    write_run(&b, 2, 55, 2, false);
    let out = root.join("figs");
    let res = arcticd(&[
        "plot",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--smooth",
        "5",
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    for name in FIGURES {
        let path = out.join(name);
        assert!(
            stdout.lines().any(|l| Path::new(l) == path),
            "{name} not printed: {stdout}"
        );
        let (w, h, varied) = png_info(&path);
        assert_eq!((w, h), SIZE, "{name}");
        assert!(varied, "{name} is a single colour");
    }
    assert_eq!(stdout.lines().count(), FIGURES.len(), "{stdout}");
}

#[test]
fn default_out_and_skipped_figures() {
    let root = tmpdir("partial");
    let run = root.join("only-reward");
    std::fs::create_dir_all(&run).unwrap();
    let lines: String = (1..=30)
        .map(|s| format!("{}\n", json!({"step": s, "reward_mean": s as f64 / 30.0})))
        .collect();
    std::fs::write(run.join("metrics.jsonl"), lines).unwrap();
    let res = arcticd(&["plot", run.to_str().unwrap()]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let plots = run.join("plots");
    assert!(plots.join("reward.png").exists());
    for name in &FIGURES[1..] {
        assert!(!plots.join(name).exists(), "{name} has no data");
    }
    let (w, h, varied) = png_info(&plots.join("reward.png"));
    assert_eq!((w, h), SIZE);
    assert!(varied);
}

/// A diverged run's metrics (values near f64's largest) plot and end: a
/// range whose width overflowed to infinity kept plotters searching for
/// ticks forever.
#[test]
fn diverged_values_plot_and_end() {
    let root = tmpdir("huge");
    let run = root.join("diverged");
    std::fs::create_dir_all(&run).unwrap();
    let lines = [
        json!({"step": 1, "reward_mean": 1e308, "time_wait_s": 1.7976931348623157e308}),
        json!({"step": 2, "reward_mean": -1e308, "time_wait_s": 1.0}),
        json!({"step": 3, "reward_mean": 0.5, "time_wait_s": 2.0}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(run.join("metrics.jsonl"), text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["plot", run.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("arcticd plot still running after 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(status.success());
    assert!(run.join("plots/reward.png").exists());
}

#[test]
fn bad_input_is_a_clear_error() {
    let root = tmpdir("bad");
    let missing = root.join("no-such-run");
    let res = arcticd(&["plot", missing.to_str().unwrap()]);
    assert_clean_error(&res, &["no-such-run", "does not exist"]);

    let no_metrics = root.join("no-metrics");
    std::fs::create_dir_all(&no_metrics).unwrap();
    let res = arcticd(&["plot", no_metrics.to_str().unwrap()]);
    assert_clean_error(&res, &["metrics.jsonl", "no such file"]);
    // The metrics file itself, not its folder.
    let metrics = no_metrics.join("metrics.jsonl");
    std::fs::write(&metrics, "{\"step\": 1, \"reward_mean\": 0.1}\n").unwrap();
    let res = arcticd(&["plot", metrics.to_str().unwrap()]);
    assert_clean_error(&res, &["is a file", "holds metrics.jsonl"]);
    std::fs::remove_file(&metrics).unwrap();

    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("metrics.jsonl"), "").unwrap();
    let res = arcticd(&["plot", empty.to_str().unwrap()]);
    assert_clean_error(&res, &["metrics.jsonl", "empty"]);

    let bad = root.join("bad-line");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(
        bad.join("metrics.jsonl"),
        "{\"step\": 1, \"reward_mean\": 0.1}\nnot json at all\n{\"step\": 3}\n",
    )
    .unwrap();
    let good = root.join("good");
    write_run(&good, 3, 5, 1, false);
    // The bad run is named even after a good one.
    let res = arcticd(&["plot", good.to_str().unwrap(), bad.to_str().unwrap()]);
    assert_clean_error(&res, &["bad-line", "metrics.jsonl:2", "not valid JSON"]);

    // Nothing any figure shows: an error, and no empty plots/ left behind.
    let nothing = root.join("nothing");
    std::fs::create_dir_all(&nothing).unwrap();
    std::fs::write(
        nothing.join("metrics.jsonl"),
        "{\"step\": 1, \"unplotted\": 2}\n",
    )
    .unwrap();
    let res = arcticd(&["plot", nothing.to_str().unwrap()]);
    assert_clean_error(&res, &["any field that a figure shows"]);
    assert!(!nothing.join("plots").exists());

    let res = arcticd(&["plot"]);
    assert_clean_error(&res, &["RUN_DIR"]);
}
