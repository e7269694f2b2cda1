//! The model commands end to end through the real binary: `init-model`
//! writes a loadable checkpoint, `score` keeps its exact output contract and
//! agrees with the library, `generate` runs, and bad input gives a clear
//! error and a non-zero exit, never a panic.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn arcticd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(args)
        .output()
        .expect("run arcticd")
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("arcticd-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn init_tiny(dir: &Path) {
    let out = arcticd(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "panic reached the user: {stderr}"
    );
    assert!(
        stderr.contains(needle),
        "error should mention {needle:?}: {stderr}"
    );
}

#[test]
fn init_score_generate_and_bad_input() {
    let dir = tmpdir("model");
    init_tiny(&dir);
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let model = arcticd_engine::Qwen3_5::load(&dir).unwrap();
    let params: usize = model.named_params().iter().map(|(_, t)| t.numel()).sum();
    assert!(params < 1_000_000, "tiny preset has {params} parameters");

    // score: exact contract, and the same numbers as the library.
    let seqs = vec![vec![5u32, 17, 300, 2], vec![9], vec![1; 70]];
    let input = dir.join("in.json");
    std::fs::write(&input, serde_json::json!({ "sequences": seqs }).to_string()).unwrap();
    let m = dir.to_str().unwrap();
    let out = arcticd(&["score", "--model", m, "--input", input.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let score_stdout = out.stdout.clone();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let obj = v.as_object().unwrap();
    assert_eq!(obj.keys().collect::<Vec<_>>(), vec!["logprobs"]);
    let lps = v["logprobs"].as_array().unwrap();
    let lib = model.score(&seqs).unwrap();
    assert_eq!(lps.len(), 3);
    for (row, (got, want)) in lps.iter().zip(&lib).enumerate() {
        let got = got.as_array().unwrap();
        assert_eq!(got.len(), seqs[row].len());
        assert!(got[0].is_null());
        for (g, w) in got.iter().zip(want).skip(1) {
            let g = g.as_f64().unwrap();
            assert!(g < 0.0);
            assert_eq!(g as f32, w.unwrap());
        }
    }

    // generate through the chat template; `--device cpu` is the default.
    let gen = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            m,
            "--prompt",
            "def add(a, b):",
            "--max-tokens",
            "5",
        ];
        a.extend_from_slice(extra);
        arcticd(&a)
    };
    let out = gen(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(gen(&["--device", "cpu"]).stdout, out.stdout);
    assert_clean_error(&gen(&["--device", "cuda:0"]), "cuda:0");
    assert_clean_error(&gen(&["--device", "tpu"]), "expected cpu, cuda or cuda:N");

    // Bad input: each a clear error and a non-zero exit.
    let bad = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        arcticd(&["score", "--model", m, "--input", p.to_str().unwrap()])
    };
    assert_clean_error(
        &bad("oob.json", r#"{"sequences": [[1, 99999]]}"#),
        "vocabulary size",
    );
    assert_clean_error(&bad("empty.json", r#"{"sequences": [[]]}"#), "empty");
    assert_clean_error(&bad("shape.json", r#"{"seqs": [[1]]}"#), "sequences");
    assert_clean_error(&bad("neg.json", r#"{"sequences": [[-1]]}"#), "sequences");
    assert_clean_error(
        &bad("neg2.json", r#"{"sequences": [[1, -3]]}"#),
        "expected a whole number from 0 to 4294967295",
    );
    let inp = input.to_str().unwrap();
    assert_clean_error(
        &arcticd(&["score", "--model", m, "--input", inp, "--device", "gpu"]),
        "expected cpu, cuda or cuda:N",
    );
    // No GPU on this machine (and, without the feature, no CUDA backend):
    // a clear error either way, never a panic.
    assert_clean_error(
        &arcticd(&["score", "--model", m, "--input", inp, "--device", "cuda:0"]),
        "cuda:0",
    );
    assert_clean_error(
        &arcticd(&["serve", "--model", m, "--port", "0", "--device", "cuda:0"]),
        "cuda:0",
    );
    assert_clean_error(
        &arcticd(&["score", "--model", m, "--input", inp, "--weights", "fp8"]),
        "expected bf16 or f32",
    );
    // Serve settings no request could use: refused at start, not per
    // request (a server that started with them rejected every request).
    for (flag, value, says) in [
        ("--replicas", "0", "--replicas"),
        ("--default-max-tokens", "0", "--default-max-tokens"),
        ("--max-model-len", "0", "--max-model-len"),
        ("--max-model-len", "40000", "max_position_embeddings"),
        ("--served-model-name", "", "a name is needed"),
        ("--max-batched-tokens", "0", "--max-batched-tokens"),
        ("--max-batched-tokens", "100", "64 + 64 = 128"),
        ("--max-num-seqs", "0", "--max-num-seqs"),
        ("--cache-memory", "0", "--cache-memory"),
        ("--cache-memory", "100000000000", "more than"),
        ("--cache-memory", "18446744073709551615", "--cache-memory"),
        ("--cache-memory", "1tb", "whole number of MiB"),
    ] {
        assert_clean_error(
            &arcticd(&["serve", "--model", m, "--port", "0", flag, value]),
            says,
        );
    }
    let on_cpu = arcticd(&["score", "--model", m, "--input", inp, "--device", "cpu"]);
    assert_eq!(on_cpu.stdout, score_stdout);
    assert_clean_error(
        &arcticd(&["score", "--model", m, "--input", "/nonexistent/in.json"]),
        "/nonexistent/in.json",
    );
    assert_clean_error(
        &arcticd(&[
            "score",
            "--model",
            "/nonexistent-model",
            "--input",
            input.to_str().unwrap(),
        ]),
        "config.json",
    );
    // Unsupported model_type and a mis-shaped tensor.
    let other = tmpdir("bad-model");
    for f in std::fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, other.join(p.file_name().unwrap())).unwrap();
        }
    }
    let cfg_path = other.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let o = other.to_str().unwrap();
    // A model trained for 16 positions: generate refuses more, as serve
    // does; score scores the 70-token sequence and says it is past them.
    let mut short = cfg.clone();
    short["max_position_embeddings"] = Value::from(16);
    std::fs::write(&cfg_path, short.to_string()).unwrap();
    assert_clean_error(
        &arcticd(&[
            "generate",
            "--model",
            o,
            "--prompt",
            "hi",
            "--max-tokens",
            "20",
        ]),
        "past the 16 positions",
    );
    let scored = arcticd(&["score", "--model", o, "--input", input.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&scored.stderr);
    assert!(scored.status.success(), "{err}");
    assert!(
        err.contains("a sequence of 70 tokens is past the 16 positions"),
        "{err}"
    );
    assert_eq!(scored.stdout, score_stdout);
    cfg["model_type"] = Value::from("llama");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_clean_error(
        &arcticd(&["score", "--model", o, "--input", input.to_str().unwrap()]),
        "llama",
    );
    cfg["model_type"] = Value::from("qwen3_5_text");
    cfg["intermediate_size"] = Value::from(100);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_clean_error(
        &arcticd(&["score", "--model", o, "--input", input.to_str().unwrap()]),
        "shape",
    );
    std::fs::write(other.join("model.safetensors"), b"not a safetensors file").unwrap();
    assert_clean_error(
        &arcticd(&["score", "--model", o, "--input", input.to_str().unwrap()]),
        "model.safetensors",
    );
    assert_clean_error(
        &arcticd(&["init-model", "--preset", "huge", "--out", o]),
        "huge",
    );
    // A folder that holds a model is not written over.
    assert_clean_error(
        &arcticd(&["init-model", "--preset", "tiny", "--out", o]),
        "is not empty",
    );
    assert_eq!(
        std::fs::read(other.join("model.safetensors")).unwrap(),
        b"not a safetensors file"
    );
    let m = dir.to_str().unwrap();
    // Counts of 0 and numbers that are not finite are refused when read,
    // not clamped or run; a device name that names none says so.
    for (args, says) in [
        (
            vec![
                "generate",
                "--model",
                m,
                "--prompt",
                "hi",
                "--max-tokens",
                "0",
            ],
            "0 is not a whole number of at least 1",
        ),
        (
            vec!["bench-decode", "--model", m, "--hbm-tb-s", "NaN"],
            "NaN is not a finite number above 0",
        ),
        (
            vec!["score", "--model", m, "--input", "x", "--device", "gpu"],
            "\"gpu\" is not a device: expected cpu, cuda or cuda:N",
        ),
    ] {
        assert_clean_error(&arcticd(&args), says);
    }
    // A forward far past memory is refused before it allocates.
    for (n, says) in [("100000", "memory available"), ("10000000000", "too large")] {
        assert_clean_error(
            &arcticd(&["bench-forward", "--model", m, "--batch", n, "--seq-len", n]),
            says,
        );
    }

    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&other).ok();
}

/// A checkpoint whose final norm holds NaN: `score` refuses it and says
/// where, instead of printing its NaN log-probs as JSON nulls (which read
/// like the first token's "no log-prob").
#[test]
fn score_refuses_non_finite_log_probs() {
    let dir = tmpdir("nan");
    init_tiny(&dir);
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (name, info) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.ends_with("norm.weight") && !k.contains("layers."))
        .expect("a final norm");
    let offsets = &info["data_offsets"];
    let (a, b) = (
        offsets[0].as_u64().unwrap() as usize,
        offsets[1].as_u64().unwrap() as usize,
    );
    // All-ones bits are a NaN in bf16 and in f32 alike.
    bytes[8 + n + a..8 + n + b].fill(0xFF);
    std::fs::write(&path, bytes).unwrap();
    let input = dir.join("in.json");
    std::fs::write(&input, r#"{"sequences": [[5, 17, 300]]}"#).unwrap();
    let out = arcticd(&[
        "score",
        "--model",
        dir.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert_clean_error(
        &out,
        "sequence 0, token 1: the model gives the log-prob NaN",
    );
    assert!(
        out.stdout.is_empty(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `arcticd plan`: Qwen3.5-4B at 32k tokens on one 141 GB GPU fits only
/// with layer recomputation; a plan that does not fit is a clean error
/// that names the biggest use; bad input is refused.
#[test]
fn plan_sizes_a_real_shape_and_refuses_what_does_not_fit() {
    let base = [
        "plan",
        "--preset",
        "qwen3.5-4b",
        "--placement",
        "gpu",
        "--memory-gb",
        "141",
    ];
    let out = arcticd(&[&base[..], &["--recompute-layers"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("bf16") && text.contains("fits:"), "{text}");
    let out = arcticd(&base);
    assert_clean_error(&out, "activations kept (32768 tokens)");
    // What to change is said in this command's flags, not recipe keys.
    assert_clean_error(&out, "--recompute-layers");
    assert_clean_error(&arcticd(&["plan", "--preset", "qwen9"]), "unknown preset");
    // Without a shape, both ways to give one are named.
    assert_clean_error(&arcticd(&["plan"]), "--preset");
    assert_clean_error(
        &arcticd(&["plan", "--preset", "tiny", "--placement", "gpu"]),
        "--memory-gb",
    );
    assert_clean_error(
        &arcticd(&["plan", "--preset", "tiny", "--memory-gb", "1e300"]),
        "not a memory size",
    );
    // Byte counts that would wrap (it said "fits" for 2^64 - 1 tokens).
    assert_clean_error(
        &arcticd(&[
            "plan",
            "--preset",
            "tiny",
            "--tokens",
            "18446744073709551615",
        ]),
        "at most 1073741824 tokens",
    );
    assert_clean_error(
        &arcticd(&[
            "tasks",
            "toy",
            "--count",
            "100000000000",
            "--out",
            "/nonexistent/toy",
        ]),
        "count must be from 1 to 1000000",
    );
    // An empty task file is said to be one (it printed nothing, exit 0).
    let empty = std::env::temp_dir().join(format!("arcticd-empty-{}.jsonl", std::process::id()));
    std::fs::write(&empty, "").unwrap();
    assert_clean_error(
        &arcticd(&["tasks", "validate", "--tasks", empty.to_str().unwrap()]),
        "holds no tasks",
    );
    std::fs::remove_file(&empty).ok();
}

/// Output into a pipe whose reader has gone (`arcticd ... | head`) ends
/// the command quietly with 141, the status of a program SIGPIPE ended:
/// not a panic (it was exit 101 with "failed printing to stdout").
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = tmpdir("closed-stdout");
    init_tiny(&dir);
    let m = dir.to_str().unwrap();
    let input = dir.join("score.json");
    std::fs::write(&input, r#"{"sequences": [[1, 2, 3]]}"#).unwrap();
    for args in [
        vec![
            "bench-forward",
            "--model",
            m,
            "--batch",
            "1",
            "--seq-len",
            "4",
            "--iters",
            "1",
        ],
        vec!["score", "--model", m, "--input", input.to_str().unwrap()],
    ] {
        // The read end is closed before the command starts: its first
        // write fails, whenever it comes.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
            .args(&args)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("error"),
            "{args:?}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `arcticd bench-decode`: one JSON line per batch size, every sequence's
/// tokens generated; bad arguments are clean errors.
#[test]
fn bench_decode_reports_each_batch_size() {
    let dir = tmpdir("bench-decode");
    init_tiny(&dir);
    let o = dir.to_str().unwrap();
    let out = arcticd(&[
        "bench-decode",
        "--model",
        o,
        "--batch",
        "1,3",
        "--new-tokens",
        "4",
        "--cache-memory",
        "16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (line, batch) in lines.iter().zip([1, 3]) {
        assert_eq!(line["batch"], batch);
        assert_eq!(line["new_tokens"], 4);
        assert!(line["tokens_per_s"].as_f64().unwrap() > 0.0, "{line}");
        // The time to the batch's last first token is part of the run's;
        // the decode rate where the run went on after it.
        let prefill = line["prefill_seconds"].as_f64().unwrap();
        assert!(
            prefill > 0.0 && prefill <= line["seconds"].as_f64().unwrap(),
            "{line}"
        );
        if let Some(r) = line.get("decode_tokens_per_s") {
            assert!(r.as_f64().unwrap() > 0.0, "{line}");
        }
    }
    assert_clean_error(
        &arcticd(&["bench-decode", "--model", o, "--batch", "0"]),
        "positive",
    );
    // MiB whose bytes would wrap (it ran with a 1 MiB cache).
    assert_clean_error(
        &arcticd(&[
            "bench-decode",
            "--model",
            o,
            "--cache-memory",
            "17592186044417",
        ]),
        "whole number of MiB from 1 to",
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `arcticd bench-train`: one JSON line for the timed steps, its counts
/// those asked for (sequences cut at `--seq-len`, micro-batches of
/// `--micro-batch-tokens`), with and without recomputed layers; bad
/// arguments are clean errors.
#[test]
fn bench_train_reports_one_line() {
    let dir = tmpdir("bench-train");
    init_tiny(&dir);
    let o = dir.to_str().unwrap();
    for recompute in [false, true] {
        let mut args = vec![
            "bench-train",
            "--model",
            o,
            "--tokens",
            "200",
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--micro-batch-tokens",
            "128",
            "--peak-tflops",
            "1",
        ];
        if recompute {
            args.push("--recompute-layers");
        }
        let out = arcticd(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        assert_eq!(line["tokens_per_step"], 200);
        assert_eq!(line["seq_len"], 64);
        assert_eq!(line["micro_batch_tokens"], 128);
        assert_eq!(line["recompute_layers"], recompute);
        assert!(line["tokens_per_s"].as_f64().unwrap() > 0.0, "{line}");
        assert!(line["mfu"].as_f64().unwrap() > 0.0, "{line}");
    }
    assert_clean_error(
        &arcticd(&["bench-train", "--model", o, "--steps", "0"]),
        "positive",
    );
    // Sizes past what the plan can count are refused, not planned (it
    // panicked on a capacity overflow, or aborted allocating).
    for tokens in ["18446744073709551615", "1000000000000"] {
        assert_clean_error(
            &arcticd(&[
                "bench-train",
                "--model",
                o,
                "--tokens",
                tokens,
                "--seq-len",
                "8",
            ]),
            "at most 1073741824 tokens",
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
