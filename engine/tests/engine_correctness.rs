//! Correctness of the engine against the model run directly: greedy decode
//! equals the argmax of a full-sequence forward at every step; engine
//! log-probs match `Qwen3_5::score`; a prefix-cache hit is bit-for-bit a cold
//! run; preemption by recompute gives the same tokens as no preemption; a
//! weight update mid-generation continues exactly as a fresh engine with the
//! new weights would; a collected request gets a streamed request's events,
//! all at its end. The two engine ablations of the recipe (bf16 state, caches
//! kept across an update) move the log-probs off `score`, by design. A
//! prompt's scores equal the log-probs the engine gave the same tokens when
//! it generated them. All on the tiny preset.

use arcticd_engine::engine::{self, Choice, EngineConfig, FinishReason, Request, StateDtype};
use arcticd_engine::model::PrefillForm;
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{ParamStore, Qwen3_5, SeqInput};
use std::path::PathBuf;
use std::sync::Arc;

/// A tiny model directory, removed when dropped.
struct TinyModel(PathBuf);

impl std::ops::Deref for TinyModel {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl Drop for TinyModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny_model(tag: &str, seed: u64) -> TinyModel {
    let dir = std::env::temp_dir().join(format!("arcticd-engine-{tag}-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, seed).unwrap();
    TinyModel(dir)
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97) >> 7) % 900 + 10)
        .collect()
}

fn small_config() -> EngineConfig {
    EngineConfig {
        cache_memory: 8 << 20,
        max_num_seqs: 16,
        max_batched_tokens: 256,
        max_model_len: 4096,
        ..Default::default()
    }
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-probs of `tokens[prompt_len..]` computed the engine's way, with the
/// model's own contiguous cache: the prompt in segments that stop at
/// multiples of `unit`, then one token at a time.
fn incremental_logprobs(
    model: &Qwen3_5,
    tokens: &[u32],
    prompt_len: usize,
    unit: usize,
) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut pos = 0;
    let mut out = Vec::new();
    let h = model.config.hidden_size;
    while pos < tokens.len() - 1 {
        let end = if pos < prompt_len {
            ((pos / unit + 1) * unit).min(prompt_len)
        } else {
            pos + 1
        };
        let hidden = model
            .forward(&mut [SeqInput {
                tokens: &tokens[pos..end],
                cache: &mut cache,
            }])
            .unwrap();
        pos = end;
        if pos >= prompt_len {
            let logits = model.logits(&hidden[hidden.len() - h..]).unwrap();
            let lse = {
                let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                m + (logits
                    .iter()
                    .map(|&x| ((x - m) as f64).exp())
                    .sum::<f64>()
                    .ln() as f32)
            };
            out.push(logits[tokens[pos] as usize] - lse);
        }
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn greedy_equals_full_forward_argmax_and_logprobs_match_score() {
    let dir = tiny_model("greedy", 1);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model.clone());
    let eng = engine::start(store, None, small_config()).unwrap();
    let mut worst_score = 0.0f32;
    let mut worst_incremental = 0.0f32;
    // Prompts shorter than, equal to and longer than one prefill unit.
    for (len, salt) in [(5usize, 1u32), (64, 2), (150, 3)] {
        let p = prompt(len, salt);
        let out = eng.generate_blocking(greedy(p.clone(), 24)).unwrap();
        let c = &out[0];
        assert_eq!(c.tokens.len(), 24);
        assert_eq!(c.finish_reason, Some(FinishReason::Length));
        let mut full = p.clone();
        for (t, &tok) in c.tokens.iter().enumerate() {
            let mut cache = model.new_cache();
            let hidden = model
                .forward(&mut [SeqInput {
                    tokens: &full,
                    cache: &mut cache,
                }])
                .unwrap();
            let h = model.config.hidden_size;
            let logits = model.logits(&hidden[hidden.len() - h..]).unwrap();
            assert_eq!(tok, argmax(&logits), "prompt {len}, step {t}");
            full.push(tok);
        }
        let scored = model.score(std::slice::from_ref(&full)).unwrap();
        let reference: Vec<f32> = scored[0][len..].iter().map(|x| x.unwrap()).collect();
        worst_score = worst_score.max(max_abs_diff(&c.logprobs, &reference));
        let inc = incremental_logprobs(&model, &full, len, 64);
        worst_incremental = worst_incremental.max(max_abs_diff(&c.logprobs, &inc));
    }
    eprintln!(
        "engine vs score: max |dlogprob| = {worst_score:.3e}; engine vs same-path reference: {worst_incremental:.3e}"
    );
    // Every kernel gives a position the same bits however the sequence is
    // cut into calls (prefill, prefix hit, decode), so the engine's
    // log-probs are the one-call forward's exactly.
    assert_eq!(worst_score, 0.0, "engine vs score");
    assert_eq!(worst_incremental, 0.0);
}

/// A prompt's scores (`echo` with `logprobs`) are the model's own: on a
/// prompt that is an earlier generation, each token's log-prob and
/// alternatives are, bit for bit, what the engine reported when it
/// generated it, and the prompt's part is `score`'s. A prompt sent while
/// the engine is paused for a weight update waits for the resume.
#[test]
fn prompt_scores_equal_the_generated_tokens_log_probs() {
    let dir = tiny_model("prompt-scores", 9);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model.clone());
    let eng = engine::start(store, None, small_config()).unwrap();
    let p = prompt(70, 4);
    let mut ask = greedy(p.clone(), 16);
    ask.params.top_logprobs = 3;
    let c = eng.generate_blocking(ask).unwrap().remove(0);
    let mut full = p.clone();
    full.extend(&c.tokens);
    let scores = eng.score_prompt_blocking(full.clone(), 3).unwrap();
    assert_eq!(scores.weight_version, c.weight_versions[0]);
    assert_eq!(scores.tokens.len(), full.len() - 1);
    for (i, sc) in scores.tokens.iter().enumerate() {
        assert_eq!(sc.token, full[i + 1], "position {}", i + 1);
        assert_eq!(sc.top.len(), 3);
        assert!(sc.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    let generated = &scores.tokens[p.len() - 1..];
    let lps: Vec<f32> = generated.iter().map(|s| s.logprob).collect();
    assert_eq!(lps, c.logprobs, "prompt scores vs the engine's own");
    let tops: Vec<Vec<(u32, f32)>> = generated.iter().map(|s| s.top.clone()).collect();
    assert_eq!(tops, c.top_logprobs);
    // Greedy tokens are each their row's most likely.
    assert!(generated.iter().all(|s| s.top[0].0 == s.token));
    let reference = model.score(std::slice::from_ref(&full)).unwrap();
    let prompt_part: Vec<Option<f32>> = scores.tokens[..p.len() - 1]
        .iter()
        .map(|s| Some(s.logprob))
        .collect();
    assert_eq!(prompt_part, reference[0][1..p.len()].to_vec());

    // Bad input is the caller's: said, and the engine goes on.
    for (tokens, top, says) in [
        (vec![], 1, "empty"),
        (vec![1, 1_000_000], 1, "vocabulary"),
        (vec![1, 2], 21, "at most 20"),
        (vec![1; 5000], 0, "maximum context length"),
    ] {
        let e = eng.score_prompt_blocking(tokens, top).unwrap_err();
        assert!(
            matches!(
                e,
                arcticd_engine::Error::Input(_) | arcticd_engine::Error::ContextLength(_)
            ) && e.to_string().contains(says),
            "{e}"
        );
    }
    // A one-token prompt has nothing to score.
    assert!(eng
        .score_prompt_blocking(vec![7], 2)
        .unwrap()
        .tokens
        .is_empty());

    eng.pause().unwrap();
    let mut waiting = eng.submit_score(p.clone(), 0).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(waiting.try_recv().is_err(), "scored while paused");
    eng.resume();
    let later = waiting.blocking_recv().unwrap().unwrap();
    assert_eq!(later.tokens.len(), p.len() - 1);
    assert!(later.tokens.iter().all(|s| s.top.is_empty()));
}

/// The model's `max_position_embeddings` bounds prompt plus completion
/// even when the engine is configured for more, and the refusal says
/// where the bound comes from; a stop token id past the vocabulary is
/// refused, not ignored.
#[test]
fn the_models_positions_bound_the_context() {
    let dir = tiny_model("max-positions", 4);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 64.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let eng = engine::start(store, None, small_config()).unwrap();
    assert_eq!(eng.info().max_model_len, 64);
    assert!(eng.info().limit_is_model);
    let out = eng.generate_blocking(greedy(prompt(40, 1), 24)).unwrap();
    assert_eq!(out[0].tokens.len(), 24);
    let e = eng
        .generate_blocking(greedy(prompt(40, 1), 25))
        .unwrap_err();
    assert!(
        matches!(e, arcticd_engine::Error::ContextLength(_))
            && e.to_string()
                .contains("64 tokens (the model's max_position_embeddings)"),
        "{e}"
    );
    let vocab = eng.info().vocab_size as u32;
    let mut stop_past = greedy(prompt(8, 2), 4);
    stop_past.params.stop_token_ids = vec![3, vocab];
    let e = eng.generate_blocking(stop_past).unwrap_err();
    assert!(
        matches!(e, arcticd_engine::Error::Input(_))
            && e.to_string().contains(&format!("stop token id {vocab}")),
        "{e}"
    );
    // A config without the field bounds nothing beyond the engine's limit.
    cfg.as_object_mut()
        .unwrap()
        .remove("max_position_embeddings");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let eng = engine::start(store, None, small_config()).unwrap();
    assert_eq!(eng.info().max_model_len, 4096);
    assert!(!eng.info().limit_is_model);
}

fn run_all(eng: &engine::EngineHandle, reqs: &[Request]) -> Vec<Choice> {
    let subs: Vec<_> = reqs
        .iter()
        .map(|r| eng.submit(r.clone()).unwrap())
        .collect();
    subs.into_iter()
        .map(|mut s| {
            let mut ch = vec![Choice::default()];
            while engine::apply_event(&mut ch, s.events.blocking_recv().unwrap()).unwrap() == 0 {}
            ch.pop().unwrap()
        })
        .collect()
}

#[test]
fn prefix_hit_is_bit_identical_to_cold() {
    prefix_hit_against_cold("prefix", PrefillForm::Recurrent);
}

/// The chunked prefill keeps the prefix cache's guarantee (segments start
/// at multiples of the chunk, so a hit chunks the same tokens the same
/// way), and stays within rounding of the recurrent form without being it.
#[test]
fn chunked_prefill_keeps_prefix_hits_exact_and_stays_near_recurrent() {
    prefix_hit_against_cold("prefix-chunked", PrefillForm::Chunked);
    let dir = tiny_model("chunked", 4);
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let engine_with = |prefill| {
        engine::start(
            store.clone(),
            None,
            EngineConfig {
                prefill,
                ..small_config()
            },
        )
        .unwrap()
    };
    let (rec, chunked) = (
        engine_with(PrefillForm::Recurrent),
        engine_with(PrefillForm::Chunked),
    );
    let mut worst = 0.0f32;
    // Shorter than a chunk, one chunk and a token, several chunks and a tail.
    for (len, salt) in [(5usize, 1u32), (65, 2), (230, 3)] {
        let a = rec
            .generate_blocking(greedy(prompt(len, salt), 16))
            .unwrap();
        let b = chunked
            .generate_blocking(greedy(prompt(len, salt), 16))
            .unwrap();
        assert_eq!(a[0].tokens, b[0].tokens, "prompt {len}");
        worst = worst.max(max_abs_diff(&a[0].logprobs, &b[0].logprobs));
    }
    eprintln!("chunked vs recurrent prefill: max |dlogprob| = {worst:.3e}");
    assert!(worst < 1e-4, "{worst}");
    assert!(worst > 0.0, "the chunked form was not taken");
}

fn prefix_hit_against_cold(tag: &str, prefill: PrefillForm) {
    let dir = tiny_model(tag, 2);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model);
    let config = EngineConfig {
        prefill,
        ..small_config()
    };
    let cold_eng = engine::start(
        store.clone(),
        None,
        EngineConfig {
            enable_prefix_cache: false,
            ..config.clone()
        },
    )
    .unwrap();
    let eng = engine::start(store, None, config).unwrap();
    let shared = prompt(200, 5);
    let mut reqs = Vec::new();
    for (i, tail) in [0usize, 1, 7, 64, 70].iter().enumerate() {
        let mut p = shared.clone();
        p.extend(prompt(*tail, 100 + i as u32));
        reqs.push(Request {
            prompt: p,
            params: SamplingParams {
                temperature: 0.8,
                seed: Some(i as u64),
                max_tokens: 12,
                ignore_eos: true,
                top_logprobs: 2,
                ..Default::default()
            },
        });
    }
    let cold = run_all(&cold_eng, &reqs);
    // Warm the cache with the shared part, then run everything twice:
    // concurrently (hits packed with other work) and one by one.
    eng.generate_blocking(greedy(shared.clone(), 1)).unwrap();
    let warm = run_all(&eng, &reqs);
    let one_by_one: Vec<Choice> = reqs
        .iter()
        .map(|r| eng.generate_blocking(r.clone()).unwrap().remove(0))
        .collect();
    let m = eng.metrics();
    let hit = m
        .prefix_hit_tokens
        .load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("prefix-hit tokens: {hit}");
    assert!(hit >= 10 * 192, "{hit}");
    for (i, c) in cold.iter().enumerate() {
        for other in [&warm[i], &one_by_one[i]] {
            assert_eq!(c.tokens, other.tokens, "request {i}");
            let a: Vec<u32> = c.logprobs.iter().map(|x| x.to_bits()).collect();
            let b: Vec<u32> = other.logprobs.iter().map(|x| x.to_bits()).collect();
            assert_eq!(a, b, "request {i}: log-probs differ");
            assert_eq!(c.top_logprobs, other.top_logprobs);
        }
    }
}

#[test]
fn preemption_gives_the_same_tokens() {
    let dir = tiny_model("preempt", 3);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model);
    let roomy = engine::start(store.clone(), None, small_config()).unwrap();
    // Room for about 320 positions: eight 100-token sequences cannot all fit.
    let tight_cfg = EngineConfig {
        cache_memory: 0,
        prefix_snapshots: 2,
        enable_prefix_cache: false,
        ..small_config()
    };
    let layout = arcticd_engine::kv_cache::CacheLayout::new(&store.read().config);
    let tight_cfg = EngineConfig {
        cache_memory: layout.slot_bytes() * (tight_cfg.max_num_seqs + 2)
            + layout.block_bytes(16) * 20,
        ..tight_cfg
    };
    let tight = engine::start(store, None, tight_cfg).unwrap();
    let reqs: Vec<Request> = (0..8)
        .map(|i| greedy(prompt(40 + 7 * i, i as u32), 60))
        .collect();
    let a = run_all(&roomy, &reqs);
    let b = run_all(&tight, &reqs);
    let pre = tight
        .metrics()
        .preemptions
        .load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("preemptions: {pre}");
    assert!(pre > 0);
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
        worst = worst.max(max_abs_diff(&x.logprobs, &y.logprobs));
    }
    eprintln!("preempted vs not: max |dlogprob| = {worst:.3e}");
    assert!(worst < 1e-4);
}

/// A cache that holds fewer state slots than `max_num_seqs` asks for runs
/// fewer sequences at once, says so in its info, and gives the same tokens;
/// one that cannot hold a single sequence is a clear error.
#[test]
fn a_small_cache_runs_fewer_sequences_with_the_same_tokens() {
    let dir = tiny_model("fit", 4);
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let layout = arcticd_engine::kv_cache::CacheLayout::new(&store.read().config);
    let roomy = engine::start(store.clone(), None, small_config()).unwrap();
    assert_eq!(roomy.info().max_num_seqs, 16);
    let cfg = EngineConfig {
        cache_memory: layout.slot_bytes() * 6 + layout.block_bytes(16) * 40,
        ..small_config()
    };
    let small = engine::start(store.clone(), None, cfg).unwrap();
    let info = small.info();
    eprintln!(
        "fitted: {} running, {} snapshots",
        info.max_num_seqs, info.prefix_snapshots
    );
    assert!((1..16).contains(&info.max_num_seqs));
    let reqs: Vec<Request> = (0..6)
        .map(|i| greedy(prompt(30 + 5 * i, i as u32), 20))
        .collect();
    let a = run_all(&roomy, &reqs);
    let b = run_all(&small, &reqs);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
    }
    let none = EngineConfig {
        cache_memory: layout.slot_bytes() / 2,
        ..small_config()
    };
    let err = engine::start(store, None, none).unwrap_err().to_string();
    assert!(err.contains("cannot hold one sequence"), "{err}");
}

/// Greedy 40 tokens after a 90-token prompt, with the weights updated
/// (version 0 -> 1) once 10 tokens are out. Returns the prompt, the choice
/// and the store. The update is applied when this thread has read the
/// 10th token; on a loaded machine the engine can finish all 40 before
/// that, and then the attempt is made again (at most 5 times).
fn generate_across_an_update(
    tag: &str,
    config: EngineConfig,
) -> (Vec<u32>, Choice, Arc<ParamStore>) {
    for attempt in 1..=5 {
        let (p, c, store) = try_generate_across_an_update(tag, config.clone());
        if c.weight_versions.contains(&1) {
            return (p, c, store);
        }
        eprintln!("attempt {attempt}: the generation ended before the update; again");
    }
    panic!("in 5 attempts the weight update never landed inside the generation");
}

fn try_generate_across_an_update(
    tag: &str,
    config: EngineConfig,
) -> (Vec<u32>, Choice, Arc<ParamStore>) {
    let dir = tiny_model(tag, 4);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model);
    let eng = engine::start(store.clone(), None, config).unwrap();
    let p = prompt(90, 9);
    let mut sub = eng.submit(greedy(p.clone(), 40)).unwrap();
    let mut ch = vec![Choice::default()];
    let mut updated = false;
    loop {
        let ev = sub.events.blocking_recv().unwrap();
        if engine::apply_event(&mut ch, ev).unwrap() == 1 {
            break;
        }
        if !updated && ch[0].tokens.len() == 10 {
            eng.pause().unwrap();
            store.update(|m| {
                for (i, (_, t)) in m.named_params_mut().into_iter().enumerate() {
                    if let Ok(w) = t.as_f32_mut() {
                        for (j, x) in w.iter_mut().enumerate() {
                            *x += 0.01 * (((i * 31 + j * 7) % 13) as f32 - 6.0) / 6.0;
                        }
                    }
                }
            });
            eng.resume();
            updated = true;
        }
    }
    (p, ch.pop().unwrap(), store)
}

/// Max |engine log-prob - score under the store's current weights| over the
/// choice's tokens from `from` on.
fn diff_from_score(store: &ParamStore, p: &[u32], c: &Choice, from: usize) -> f32 {
    let mut full = p.to_vec();
    full.extend_from_slice(&c.tokens);
    let scored = store.read().score(&[full]).unwrap();
    let reference: Vec<f32> = scored[0][p.len() + from..]
        .iter()
        .map(|x| x.unwrap())
        .collect();
    max_abs_diff(&c.logprobs[from..], &reference)
}

#[test]
fn weight_update_mid_generation_matches_a_fresh_engine() {
    let (p, c, store) = generate_across_an_update("update", small_config());
    assert_eq!(c.tokens.len(), 40);
    let split = c.weight_versions.iter().position(|&v| v == 1).unwrap();
    assert!(split >= 10);
    assert!(c.weight_versions[..split].iter().all(|&v| v == 0));
    assert!(c.weight_versions[split..].iter().all(|&v| v == 1));

    let mut prefix = p.clone();
    prefix.extend_from_slice(&c.tokens[..split]);
    let fresh = engine::start(store.clone(), None, small_config()).unwrap();
    let f = fresh
        .generate_blocking(greedy(prefix.clone(), 40 - split))
        .unwrap()
        .remove(0);
    assert_eq!(f.tokens, c.tokens[split..]);
    let a: Vec<u32> = f.logprobs.iter().map(|x| x.to_bits()).collect();
    let b: Vec<u32> = c.logprobs[split..].iter().map(|x| x.to_bits()).collect();
    assert_eq!(a, b);
    let d = diff_from_score(&store, &p, &c, split);
    eprintln!("after update: engine vs score under new weights: max |dlogprob| = {d:.3e} (split at {split})");
    assert!(d <= 1e-5);
}

/// The `rebuild_caches = false` ablation: the caches the old weights made
/// stay, so the tokens after the update (tagged with the new version) no
/// longer match a forward under the new weights; before it they still
/// match the old ones.
#[test]
fn without_rebuilt_caches_tokens_after_an_update_disagree_with_their_version() {
    let config = EngineConfig {
        rebuild_caches: false,
        ..small_config()
    };
    let (p, c, store) = generate_across_an_update("norebuild", config);
    let split = c.weight_versions.iter().position(|&v| v == 1).unwrap();
    assert!(c.weight_versions[split..].iter().all(|&v| v == 1));
    let after = diff_from_score(&store, &p, &c, split);
    eprintln!("rebuild_caches = false: engine vs score under new weights after the update: max |dlogprob| = {after:.3e}");
    assert!(after > 1e-3, "{after}");
}

/// The `state_dtype = "bf16"` ablation: the engine's log-probs leave
/// `score` (fp32 state, the trainer's); with the default they do not.
#[test]
fn bf16_state_moves_engine_logprobs_off_score_and_f32_does_not() {
    let dir = tiny_model("bf16state", 6);
    let model = Qwen3_5::load(&dir).unwrap();
    let store = ParamStore::new(model);
    let mut worst = Vec::new();
    for state_dtype in [StateDtype::F32, StateDtype::Bf16] {
        let config = EngineConfig {
            state_dtype,
            ..small_config()
        };
        let eng = engine::start(store.clone(), None, config).unwrap();
        let p = prompt(150, 5);
        let c = eng
            .generate_blocking(greedy(p.clone(), 32))
            .unwrap()
            .remove(0);
        worst.push(diff_from_score(&store, &p, &c, 0));
    }
    eprintln!(
        "engine vs score, max |dlogprob|: f32 state {:.3e}, bf16 state {:.3e}",
        worst[0], worst[1]
    );
    assert!(worst[0] <= 1e-5, "{worst:?}");
    assert!(
        worst[1] > 1e-4 && worst[1] > 100.0 * worst[0].max(1e-7),
        "{worst:?}"
    );
}

#[test]
fn sampling_options_seed_n_stop_and_errors() {
    let dir = tiny_model("options", 5);
    let model = Qwen3_5::load(&dir).unwrap();
    let tok = Arc::new(arcticd_engine::tokenizer::Tokenizer::from_dir(&dir).unwrap());
    let store = ParamStore::new(model);
    let eng = engine::start(store, Some(tok.clone()), small_config()).unwrap();
    let p = prompt(30, 11);
    let sampled = |seed, n| Request {
        prompt: p.clone(),
        params: SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 50,
            seed: Some(seed),
            n,
            max_tokens: 10,
            ignore_eos: true,
            ..Default::default()
        },
    };
    let a = eng.generate_blocking(sampled(3, 3)).unwrap();
    let b = eng.generate_blocking(sampled(3, 3)).unwrap();
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
    }
    assert!(a[0].tokens != a[1].tokens || a[1].tokens != a[2].tokens);

    // Stop token ids: stop at the 4th greedy token.
    let g = eng
        .generate_blocking(greedy(p.clone(), 10))
        .unwrap()
        .remove(0);
    let mut req = greedy(p.clone(), 10);
    req.params.stop_token_ids = vec![g.tokens[3]];
    let s = eng.generate_blocking(req).unwrap().remove(0);
    let first = g.tokens.iter().position(|&t| t == g.tokens[3]).unwrap();
    assert_eq!(s.tokens, g.tokens[..=first]);
    assert_eq!(
        s.finish_reason,
        Some(FinishReason::Stop { stop_string: None })
    );

    // Stop strings: the text of tokens 2..4 of the greedy output.
    let text = tok.decode(&g.tokens[2..5], false).unwrap();
    if !text.trim().is_empty() {
        let mut req = greedy(p.clone(), 10);
        req.params.stop = vec![text.clone()];
        let s = eng.generate_blocking(req).unwrap().remove(0);
        assert!(s.tokens.len() <= 5, "{:?}", s.tokens);
        assert!(matches!(
            s.finish_reason,
            Some(FinishReason::Stop {
                stop_string: Some(_)
            })
        ));
    }

    // Bad requests are refused before they reach the engine.
    assert!(eng.submit(greedy(vec![], 4)).is_err());
    assert!(eng.submit(greedy(vec![5000], 4)).is_err());
    assert!(eng.submit(greedy(prompt(10, 1), 100_000)).is_err());
}

#[test]
fn n_choices_share_one_prefill_and_equal_separate_requests() {
    let dir = tiny_model("fork", 6);
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let cfg = EngineConfig {
        enable_prefix_cache: false,
        ..small_config()
    };
    let eng = engine::start(store, None, cfg).unwrap();
    // 150 tokens: the fork copies a partial block (150 % 16 != 0).
    let p = prompt(150, 21);
    let params = |seed, n| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        n,
        max_tokens: 12,
        ignore_eos: true,
        top_logprobs: 1,
        ..Default::default()
    };
    let forked = eng
        .generate_blocking(Request {
            prompt: p.clone(),
            params: params(40, 4),
        })
        .unwrap();
    let m = eng.metrics();
    let admitted = m.prompt_tokens.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(admitted, 150, "the prompt was prefilled more than once");
    for (i, c) in forked.iter().enumerate() {
        let alone = eng
            .generate_blocking(Request {
                prompt: p.clone(),
                params: params(40 + i as u64, 1),
            })
            .unwrap()
            .remove(0);
        assert_eq!(c.tokens, alone.tokens, "choice {i}");
        let a: Vec<u32> = c.logprobs.iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> = alone.logprobs.iter().map(|x| x.to_bits()).collect();
        assert_eq!(a, b, "choice {i}");
    }
    assert!(forked[0].tokens != forked[1].tokens || forked[1].tokens != forked[2].tokens);
}

/// A collected request sends nothing per token: each choice's token events
/// come together just before its `Finished`, and they are the events a
/// streamed request of the same prompt gets. A receiver dropped meanwhile
/// frees the request.
#[test]
fn collected_requests_get_the_same_events_at_the_end() {
    let dir = tiny_model("collected", 4);
    let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
    let eng = engine::start(store, None, small_config()).unwrap();
    let req = greedy(prompt(20, 9), 12);
    let streamed = run_all(&eng, std::slice::from_ref(&req));
    let generated = |e: &engine::EngineHandle| {
        e.metrics()
            .generated_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = generated(&eng);
    let mut sub = eng.submit_collected(req.clone()).unwrap();
    let mut events = Vec::new();
    loop {
        let ev = sub.events.blocking_recv().unwrap();
        if events.is_empty() {
            // All twelve tokens were made before the first event came.
            assert_eq!(generated(&eng) - before, 12);
        }
        let done = matches!(ev, engine::Event::Finished { .. });
        events.push(ev);
        if done {
            break;
        }
    }
    assert_eq!(events.len(), 13);
    let mut ch = vec![Choice::default()];
    for ev in events {
        engine::apply_event(&mut ch, ev).unwrap();
    }
    assert_eq!(ch[0].tokens, streamed[0].tokens);
    assert_eq!(ch[0].logprobs, streamed[0].logprobs);
    assert_eq!(ch[0].finish_reason, Some(FinishReason::Length));

    // Dropped before it finishes: the engine lets it go.
    let long = greedy(prompt(20, 10), 4000);
    let sub = eng.submit_collected(long).unwrap();
    drop(sub);
    let start = std::time::Instant::now();
    while eng.load() > 0 {
        assert!(
            start.elapsed().as_secs() < 20,
            "the dropped request was not freed"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
