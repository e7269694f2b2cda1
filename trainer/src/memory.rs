//! The training memory plan: what a run will hold, computed from the model
//! config before anything is allocated, printed at the start of a run, and
//! refused with a clear error when it cannot fit.
//!
//! On the CPU every buffer is f32: the weights the engines and the trainer
//! read (one copy, the parameter store), the AdamW master weights and two
//! moments, the gradients, the activations a micro-batch keeps
//! ([`planned_floats`], the same count the forward's trace measures), and a
//! backward's working set (the gradients of one layer's activations, the
//! recomputed layer with `recompute_layers`, and a chunk of logits with its
//! gradient). A run of `arcticd train` adds the engines' caches.
//!
//! On a GPU ([`Placement::Gpu`], the device trainer's design; planned with
//! `arcticd plan` before it exists) the weights the engine reads are bf16
//! and everything else as on the CPU.

use crate::{Error, Result};
use arcticd_engine::config::ModelConfig;
use arcticd_engine::model::{logit_rows_per_chunk, planned_floats, planned_layer_floats, Keep};
use arcticd_engine::Qwen3_5;
use std::fmt;

/// Resident and peak resident memory of this process in bytes, from
/// `/proc/self/status` (`None` where there is no such file): what the plan
/// is checked against, and what a long run logs each update so that a
/// buffer that grows shows as a rising line.
pub fn process_resident() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb << 10)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// The C allocator's view of the heap, in bytes: what live allocations
/// hold, and what it keeps free inside its arenas (glibc's `mallinfo2`;
/// `None` with another C library, or a glibc older than 2.33). Logged
/// beside the resident set: a resident set that rises while the live
/// bytes stay level is memory freed but not returned (fragmentation), a
/// rise in the live bytes is something kept.
pub fn heap_usage() -> Option<(u64, u64)> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        type Mallinfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
        // Looked up, not linked: a binary built here still starts on a
        // glibc that lacks it.
        static FN: std::sync::OnceLock<Option<Mallinfo2>> = std::sync::OnceLock::new();
        let f = FN.get_or_init(|| {
            // SAFETY: dlsym with a NUL-terminated name; a non-null result
            // is glibc's `mallinfo2`, whose signature is the one above.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
            (!p.is_null())
                .then(|| unsafe { std::mem::transmute::<*mut libc::c_void, Mallinfo2>(p) })
        });
        // SAFETY: mallinfo2 takes no arguments and only reads the
        // allocator's statistics under its locks.
        let info = unsafe { (*f)?() };
        let live = info.uordblks as u64 + info.hblkhd as u64;
        Some((live, info.fordblks as u64))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// What the trainer's micro-batches look like, for the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanShape {
    /// The most tokens a micro-batch holds.
    pub tokens: usize,
    /// The most sequences a micro-batch holds (each sequence's recurrent
    /// state is checkpointed on its own).
    pub sequences: usize,
    pub recompute_layers: bool,
}

/// Where the trainer's buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Host memory, every buffer f32 (the trainer today).
    Host,
    /// One GPU, the design of the device trainer: bf16 weights that the
    /// engine reads, written from fp32 masters at the end of each step;
    /// fp32 moments, gradients and activations.
    Gpu,
}

/// Named byte counts, largest use first as they were added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Where the plan must fit ("host memory", a GPU).
    pub device: String,
    pub items: Vec<(String, u64)>,
}

impl MemoryPlan {
    /// The trainer's memory for `config` at `shape`, on the CPU.
    pub fn training(config: &ModelConfig, shape: PlanShape) -> Self {
        Self::training_on(config, shape, Placement::Host)
    }

    /// The trainer's memory for `config` at `shape`, placed as `placement`
    /// says.
    pub fn training_on(config: &ModelConfig, shape: PlanShape, placement: Placement) -> Self {
        let params = Qwen3_5::plan(config.clone()).parameters();
        let f = |floats: usize| floats as u64 * 4;
        let per = shape.tokens.div_ceil(shape.sequences.max(1)).max(1);
        let lens = vec![per; shape.sequences.max(1)];
        let keep = if shape.recompute_layers {
            Keep::Inputs
        } else {
            Keep::All
        };
        let layer = (0..config.layer_types.len())
            .map(|li| planned_layer_floats(config, li, &lens))
            .max()
            .unwrap_or(0);
        // The gradients of one layer's activations, and the recomputed
        // layer itself when only inputs are kept.
        let working = layer * if shape.recompute_layers { 2 } else { 1 };
        let rows = logit_rows_per_chunk(config.vocab_size).min(shape.tokens.max(1));
        let logits = 2 * rows * config.vocab_size;
        let mut plan = MemoryPlan {
            device: match placement {
                Placement::Host => "host memory".into(),
                Placement::Gpu => "GPU memory".into(),
            },
            items: Vec::new(),
        };
        match placement {
            Placement::Host => plan.add(format!("weights, f32 ({params} parameters)"), params * 4),
            Placement::Gpu => plan.add(
                format!("weights the engine reads, bf16 ({params} parameters)"),
                params * 2,
            ),
        }
        plan.add("AdamW master weights, f32", params * 4);
        plan.add("AdamW moments, f32 (two)", params * 8);
        plan.add("gradients, f32", params * 4);
        plan.add(
            format!(
                "activations kept ({} tokens{})",
                shape.tokens,
                if shape.recompute_layers {
                    ", layer inputs only"
                } else {
                    ""
                }
            ),
            f(planned_floats(config, &lens, keep)),
        );
        plan.add("backward working set (one layer)", f(working));
        let linear = config
            .layer_types
            .contains(&arcticd_engine::config::LayerType::LinearAttention);
        if placement == Placement::Gpu && linear {
            plan.add(
                "gated-delta backward scratch (chunked, one layer)",
                f(
                    arcticd_kernels::cpu::gated_delta::chunked_backward_scratch_floats(
                        shape.tokens,
                        shape.sequences.max(1),
                        config.delta_heads(),
                    ),
                ),
            );
        }
        plan.add(
            format!("logits and their gradient ({rows} rows)"),
            f(logits),
        );
        plan
    }

    /// Adds `replicas` engines reading the one weight copy: each one's
    /// cache (K/V blocks and state slots, `cache_bytes`) and, where the CPU
    /// packs weights for its matrix product (AVX-512 or AVX2), the one packed copy
    /// they share (counted in f32: weights that are all bf16 values, as
    /// loaded from a bf16 checkpoint, pack in half that); with `frozen`, the
    /// frozen copy of the weights and its engine that evaluations use while
    /// they run.
    pub fn add_engines(
        &mut self,
        config: &ModelConfig,
        replicas: usize,
        cache_bytes: usize,
        frozen: bool,
    ) {
        let plan = Qwen3_5::plan(config.clone());
        let params = plan.parameters();
        let r = replicas as u64;
        self.add(
            format!("engine caches ({replicas} x {})", mib(cache_bytes as u64)),
            r * cache_bytes as u64,
        );
        // Every matrix that is multiplied (the embedding table only when it
        // is also the output head), packed once per weight copy.
        let packed: u64 = if arcticd_kernels::cpu::sgemm::available() {
            plan.named()
                .iter()
                .filter(|(n, s)| {
                    s.len() == 2
                        && (config.tie_word_embeddings || !n.ends_with("embed_tokens.weight"))
                })
                .map(|(_, s)| s.iter().product::<usize>() as u64 * 4)
                .sum()
        } else {
            0
        };
        if packed > 0 {
            self.add("packed weights (shared by the engines)", packed);
        }
        if frozen {
            self.add(
                "evaluation: frozen weights, their packed copy and one engine cache",
                params * 4 + packed + cache_bytes as u64,
            );
        }
    }

    /// Adds one named use.
    pub fn add(&mut self, what: impl Into<String>, bytes: u64) {
        self.items.push((what.into(), bytes));
    }

    pub fn total(&self) -> u64 {
        self.items.iter().map(|(_, b)| b).sum()
    }

    /// Fails, with the plan and `fix` (what to change, in the caller's
    /// terms: recipe keys or flags), when it needs more than `available`
    /// bytes; passes when `available` is unknown.
    pub fn check(&self, available: Option<u64>, fix: &str) -> Result<()> {
        match available {
            Some(a) if self.total() > a => Err(Error::Memory(format!(
                "the run needs {} of {} but {} is available:\n{self}\n{fix}",
                mib(self.total()),
                self.device,
                mib(a)
            ))),
            _ => Ok(()),
        }
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (None where there is none).
pub fn host_memory_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (what, bytes) in &self.items {
            writeln!(f, "  {:>12}  {what}", mib(*bytes))?;
        }
        write!(f, "  {:>12}  in all, of {}", mib(self.total()), self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arcticd_engine::init::{init_model, TINY};

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn heap_usage_counts_a_live_allocation() {
        // 1 GiB reserved, not touched (no resident memory), against a
        // margin of 256 MiB for what the tests beside this one allocate.
        let (before, _) = heap_usage().expect("glibc has mallinfo2");
        let block: Vec<u8> = std::hint::black_box(Vec::with_capacity(1 << 30));
        let (during, _) = heap_usage().unwrap();
        assert!(during >= before + (3 << 28), "{before} -> {during}");
        drop(block);
        let (after, _) = heap_usage().unwrap();
        assert!(after + (3 << 28) <= during, "{during} -> {after}");
    }

    fn tiny_config() -> ModelConfig {
        let dir = std::env::temp_dir().join(format!("arcticd-memplan-{}", std::process::id()));
        init_model(TINY, &dir, 1).unwrap();
        let c = ModelConfig::from_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        c
    }

    /// The 4B model on one 141 GB GPU (issue sizes): 18 bytes per
    /// parameter of weights and optimizer state; at 32k tokens the
    /// activations fit only when layers are recomputed.
    #[test]
    fn qwen3_5_4b_on_one_h200() {
        let c = arcticd_engine::init::preset_config(&arcticd_engine::init::QWEN3_5_4B).unwrap();
        let params = Qwen3_5::plan(c.clone()).parameters();
        assert!((4_000_000_000..5_500_000_000).contains(&params), "{params}");
        let h200 = 141_000_000_000;
        let at = |recompute_layers| {
            MemoryPlan::training_on(
                &c,
                PlanShape {
                    tokens: 32_768,
                    sequences: 1,
                    recompute_layers,
                },
                Placement::Gpu,
            )
        };
        let (full, recompute) = (at(false), at(true));
        let state: u64 = full.items[..4].iter().map(|(_, b)| b).sum();
        assert_eq!(state, params * 18);
        // The chunked gated-delta backward's scratch at 32k tokens, 32 heads
        // of 128: 8.6 GB (counted on a GPU only).
        let scratch = full
            .items
            .iter()
            .find(|(n, _)| n.starts_with("gated-delta backward scratch"))
            .map(|(_, b)| *b)
            .unwrap();
        assert_eq!(scratch, 4 * 2_151_940_096, "{scratch}");
        assert!(full.check(Some(h200), "").is_err(), "{full}");
        assert!(recompute.check(Some(h200), "").is_ok(), "{recompute}");
        assert!(recompute.total() < full.total());
    }

    #[test]
    fn the_plan_counts_every_buffer_and_refuses_what_does_not_fit() {
        let c = tiny_config();
        let shape = PlanShape {
            tokens: 512,
            sequences: 4,
            recompute_layers: false,
        };
        let plan = MemoryPlan::training(&c, shape);
        assert!(
            !plan.items.iter().any(|(n, _)| n.contains("scratch")),
            "{plan}"
        );
        let params = Qwen3_5::plan(c.clone()).parameters();
        // Weights, masters, two moments, gradients: 5 f32 copies.
        let state: u64 = plan.items[..4].iter().map(|(_, b)| b).sum();
        assert_eq!(state, params * 20);
        let acts = plan.items[4].1;
        assert_eq!(acts, 4 * planned_floats(&c, &[128; 4], Keep::All) as u64);
        // Recomputing layers keeps less.
        let small = MemoryPlan::training(
            &c,
            PlanShape {
                recompute_layers: true,
                ..shape
            },
        );
        assert!(small.items[4].1 < acts / 4, "{small}");
        assert!(plan.check(None, "").is_ok());
        assert!(plan.check(Some(plan.total()), "").is_ok());
        let err = plan
            .check(Some(plan.total() - 1), "lower --tokens")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("AdamW moments") && err.ends_with("lower --tokens"),
            "{err}"
        );
        println!("{plan}");
    }
}
