//! The CUDA backend, behind the `cuda` feature: kernel sources, their NVRTC
//! compilation to CUBIN with an on-disk cache, and (in [`device`]) the
//! device context that loads them and launches each op.
//!
//! Every kernel is a `.cu` file in this folder, embedded with
//! `include_str!` and compiled at run time for the GPU at hand, to CUBIN
//! rather than PTX: PTX from an NVRTC newer than the driver is refused at
//! load, CUBIN for the device's own architecture is not. NVRTC ships no CUDA
//! headers, so sources are self-contained: `prelude.cuh` (bf16 as raw bits,
//! warp and block reductions) is prepended to each module. The NVRTC log
//! travels in the error. Compiled modules are cached on disk, keyed by a
//! SHA-256 of the source, the options, the NVRTC version and the
//! architecture.
//!
//! Every op has its CPU reference in `crate::cpu` under the same name; the
//! GPU tests compare the two at odd shapes. What runs without a GPU: the
//! compilation of every module for sm_90 and sm_100 (CI does it with the
//! NVRTC library from PyPI's CUDA wheels). cudarc panics when a CUDA library
//! is missing, so every entry point checks that the library is present
//! first and returns `Error::NoDevice` otherwise.
//!
//! Not for: model code (it calls ops through the device-dispatching layer),
//! GEMMs (cuBLAS), or anything that needs CUDA headers.

pub mod device;
mod index_cache;

/// The CUDA bindings the backend is built on, for callers that hold its
/// buffers.
pub use cudarc;

use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// Prepended to every module.
pub const PRELUDE: &str = include_str!("prelude.cuh");

/// One kernel source file: a module of related kernels.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    /// The `extern "C"` kernels it defines, loaded by name.
    pub kernels: &'static [&'static str],
}

/// Every module of the backend.
pub const MODULES: &[Module] = &[
    Module {
        name: "norm",
        source: include_str!("norm.cu"),
        kernels: &[
            "rmsnorm_forward",
            "add_rmsnorm_forward",
            "gated_rmsnorm_forward",
            "l2norm_forward",
            "rmsnorm_backward",
            "gated_rmsnorm_backward",
            "rmsnorm_weight_grad",
            "gated_rmsnorm_weight_grad",
            "l2norm_backward",
        ],
    },
    Module {
        name: "activation",
        source: include_str!("activation.cu"),
        kernels: &[
            "silu_mul_forward",
            "sigmoid_gate_forward",
            "silu_forward",
            "gated_delta_gating_forward",
            "silu_backward",
            "silu_mul_backward",
            "sigmoid_gate_backward",
            "gated_delta_gating_backward",
            "gated_delta_gating_param_grad",
            "add_assign",
            "copy_block",
            "copy_within",
            "zero_range",
            "gather_rows",
            "copy_into",
            "scatter_rows",
        ],
    },
    Module {
        name: "embedding",
        source: include_str!("embedding.cu"),
        kernels: &[
            "embedding_forward_f32",
            "embedding_forward_bf16",
            "f32_to_bf16_copy",
            "embedding_backward",
        ],
    },
    Module {
        name: "rope",
        source: include_str!("rope.cu"),
        kernels: &["qk_norm_rope_forward", "qk_norm_rope_backward"],
    },
    Module {
        name: "conv1d",
        source: include_str!("conv1d.cu"),
        kernels: &[
            "conv1d_update",
            "conv1d_forward",
            "conv1d_state_advance",
            "conv1d_varlen_forward",
            "conv1d_varlen_state_advance",
            "conv1d_backward_input",
            "conv1d_backward_weight",
        ],
    },
    Module {
        name: "gated_delta",
        source: include_str!("gated_delta.cu"),
        kernels: &[
            "gated_delta_decode",
            "gated_delta_prefill",
            "gated_delta_chunk_prep",
            "gated_delta_chunk_scan",
            "gated_delta_chunk_dscan",
            "gated_delta_chunk_grads",
            "gated_delta_backward",
            "gated_delta_backward_reduce",
        ],
    },
    Module {
        name: "attention",
        source: include_str!("attention.cu"),
        kernels: &[
            "paged_kv_write",
            "paged_attention_decode",
            "attention_split_merge",
            "varlen_attention_prefill",
            "paged_attention_prefill",
            "attention_backward_dq",
            "attention_backward_dkv",
        ],
    },
    Module {
        name: "matmul",
        source: include_str!("matmul.cu"),
        kernels: &["matmul_invariant"],
    },
    Module {
        name: "logsoftmax",
        source: include_str!("logsoftmax.cu"),
        kernels: &[
            "logprob_gather_forward",
            "argmax_forward",
            "logprob_gather_backward",
            "sample_rows",
            "entropy_forward",
            "entropy_backward",
        ],
    },
    Module {
        name: "optim",
        source: include_str!("optim.cu"),
        kernels: &["adamw_update", "scale_f32", "sum_squares_partial"],
    },
];

/// The module defining `kernel`.
pub fn module_of(kernel: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.kernels.contains(&kernel))
}

impl Module {
    /// The text NVRTC compiles: the prelude, then the module.
    pub fn full_source(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }
}

/// NVRTC options for compute capability `arch` (90 for sm_90).
pub fn nvrtc_options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
    ]
}

/// Whether the NVRTC library can be loaded (checked before any call, since
/// cudarc panics on a missing library).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(Error::NoDevice(
            "the NVRTC library (libnvrtc.so.13) is not on the loader path; \
             install the CUDA 13 runtime compiler (e.g. PyPI's nvidia-cuda-nvrtc) \
             and add its lib folder to LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters, library present.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Compile {
            module: "(version)".into(),
            log: format!("{e:?}"),
        })?;
    Ok((major, minor))
}

/// An NVRTC program, destroyed on drop.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe {
            let _ = cudarc::nvrtc::sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

/// Compiles `module` to CUBIN for compute capability `arch`, with no cache.
/// A compile error carries NVRTC's log.
pub fn compile_cubin(module: &Module, arch: u32) -> Result<Vec<u8>> {
    compile(module, arch, &[]).map(|(cubin, _)| cubin)
}

/// Compiles `module` for `arch` with `extra` options after the usual ones:
/// the CUBIN and NVRTC's log.
fn compile(module: &Module, arch: u32, extra: &[&str]) -> Result<(Vec<u8>, String)> {
    use cudarc::nvrtc::sys;
    require_nvrtc()?;
    let err = |log: String| Error::Compile {
        module: module.name.to_string(),
        log,
    };
    let src = CString::new(module.full_source()).map_err(|e| err(e.to_string()))?;
    let name = CString::new(format!("{}.cu", module.name)).map_err(|e| err(e.to_string()))?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: src and name outlive the program (dropped at the end of this
    // function, before them); no headers.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    }
    .result()
    .map_err(|e| err(format!("creating the program: {e:?}")))?;
    let prog = Program(raw);
    let opts: Vec<CString> = nvrtc_options(arch)
        .into_iter()
        .chain(extra.iter().map(|o| o.to_string()))
        .map(|o| CString::new(o).map_err(|e| err(e.to_string())))
        .collect::<Result<_>>()?;
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: the program is live; ptrs point into `opts`, alive here.
    let compiled = unsafe { sys::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if compiled.result().is_err() {
        return Err(err(program_log(&prog)));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; the buffer is sized by NVRTC's answer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| err(format!("CUBIN size: {e:?}")))?;
    let mut cubin = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(|e| err(format!("CUBIN: {e:?}")))?;
    Ok((cubin, program_log(&prog)))
}

/// Most registers a block holds (sm_90 and sm_100), the unit a warp's
/// registers are allocated in, most threads a block, and the shared memory
/// a block gets without opting in (`cuFuncSetAttribute`, which no launch
/// here uses).
const BLOCK_REGISTERS: u32 = 64 * 1024;
const WARP_REGISTER_UNIT: u32 = 256;
const BLOCK_THREADS: u32 = 1024;
const BLOCK_SHARED: u32 = 48 * 1024;

/// What ptxas gave one kernel for one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Shared memory declared in the kernel (the launch adds its dynamic
    /// part).
    pub static_shared: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_bytes: u32,
}

impl KernelResources {
    /// Why a block of `threads` threads with `dynamic_shared` bytes of
    /// dynamic shared memory cannot launch this kernel, or None when it
    /// can: the driver refuses such a launch
    /// (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`) only on a GPU, this says so
    /// from the compiler's report alone.
    pub fn launch_refusal(&self, threads: u32, dynamic_shared: u32) -> Option<String> {
        let k = &self.kernel;
        if threads == 0 || threads > BLOCK_THREADS {
            return Some(format!(
                "{k}: a block of {threads} threads (1 to {BLOCK_THREADS})"
            ));
        }
        let per_warp = (self.registers * 32).div_ceil(WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT;
        let registers = threads.div_ceil(32) * per_warp;
        if registers > BLOCK_REGISTERS {
            return Some(format!(
                "{k}: {threads} threads of {} registers need {registers} registers, \
                 a block has {BLOCK_REGISTERS}",
                self.registers
            ));
        }
        let shared = self.static_shared + dynamic_shared;
        if shared > BLOCK_SHARED {
            return Some(format!(
                "{k}: {} bytes of static and {dynamic_shared} of dynamic shared memory, \
                 a block gets {BLOCK_SHARED}",
                self.static_shared
            ));
        }
        None
    }
}

/// Every kernel of `module` compiled for `arch`, with the registers, shared
/// memory and spills ptxas reports (`--ptxas-options=-v`; the CUBIN is the
/// one [`compile_cubin`] makes).
pub fn kernel_resources(module: &Module, arch: u32) -> Result<Vec<KernelResources>> {
    let (_, log) = compile(module, arch, &["--ptxas-options=-v"])?;
    parse_ptxas_report(&log).map_err(|why| Error::Compile {
        module: module.name.to_string(),
        log: format!("reading ptxas's report: {why}\n{log}"),
    })
}

/// The kernels of a ptxas `-v` report: "Function properties for K", then
/// "N bytes spill stores", then "Used R registers, ..., S bytes smem" (no
/// smem part when the kernel declares none).
fn parse_ptxas_report(log: &str) -> std::result::Result<Vec<KernelResources>, String> {
    fn number_before(line: &str, unit: &str) -> Option<u32> {
        let end = line.find(unit)?;
        line[..end].split_whitespace().last()?.parse().ok()
    }
    let mut out = Vec::new();
    let mut current: Option<(String, u32)> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some((rest.trim().to_string(), 0));
        } else if line.contains("bytes spill stores") {
            let (name, spill) = current
                .as_mut()
                .ok_or(format!("spills before a kernel: {line}"))?;
            *spill = number_before(line, " bytes spill stores")
                .ok_or(format!("{name}: no spill count in {line}"))?;
        } else if line.contains("Used ") && line.contains(" registers") {
            let (kernel, spill_bytes) = current
                .take()
                .ok_or(format!("registers before a kernel: {line}"))?;
            let registers = number_before(line, " registers")
                .ok_or(format!("{kernel}: no register count in {line}"))?;
            let static_shared = if line.contains(" bytes smem") {
                number_before(line, " bytes smem")
                    .ok_or(format!("{kernel}: no shared memory size in {line}"))?
            } else {
                0
            };
            out.push(KernelResources {
                kernel,
                registers,
                static_shared,
                spill_bytes,
            });
        }
    }
    Ok(out)
}

fn program_log(prog: &Program) -> String {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    // SAFETY: live program; the buffer is sized by NVRTC's answer.
    if unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut size) }
        .result()
        .is_err()
        || size == 0
    {
        return "(no log)".into();
    }
    let mut buf = vec![0u8; size];
    if unsafe { sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .is_err()
    {
        return "(no log)".into();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned())
}

/// Compiled modules on disk: `DIR/NAME-smARCH-HASH.cubin`.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// `$ARCTICD_KERNEL_CACHE`, else `$XDG_CACHE_HOME/arcticd/kernels`, else
    /// `~/.cache/arcticd/kernels`.
    pub fn default_dir() -> PathBuf {
        if let Some(d) = std::env::var_os("ARCTICD_KERNEL_CACHE") {
            return PathBuf::from(d);
        }
        crate::host::cache_dir("kernels")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache file of `module` for `arch` under NVRTC `version`.
    pub fn path(&self, module: &Module, arch: u32, version: (i32, i32)) -> PathBuf {
        let mut h = Sha256::new();
        h.update(module.full_source().as_bytes());
        for o in nvrtc_options(arch) {
            h.update([0u8]);
            h.update(o.as_bytes());
        }
        h.update(format!("\0nvrtc {}.{}\0sm_{arch}", version.0, version.1).as_bytes());
        let digest = h.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        self.dir
            .join(format!("{}-sm{arch}-{hex}.cubin", module.name))
    }

    /// The CUBIN of `module` for `arch`: from the cache, else compiled and
    /// stored (written to a temporary name and renamed, so a reader never
    /// sees half a file). An unwritable cache only costs the compile.
    pub fn get_or_compile(&self, module: &Module, arch: u32) -> Result<Vec<u8>> {
        let path = self.path(module, arch, nvrtc_version()?);
        if let Ok(bytes) = std::fs::read(&path) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
        let cubin = compile_cubin(module, arch)?;
        if std::fs::create_dir_all(&self.dir).is_ok() {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() && std::fs::rename(&tmp, &path).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Ok(cubin)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// CI sets this (with NVRTC installed): a missing library is then a
    /// failure, not a skip.
    pub(crate) fn nvrtc_or_skip() -> bool {
        if nvrtc_available() {
            return true;
        }
        assert!(
            std::env::var_os("ARCTICD_REQUIRE_NVRTC").is_none(),
            "ARCTICD_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
        );
        eprintln!("skipped: NVRTC is not on the loader path");
        false
    }

    #[test]
    fn every_module_compiles_to_cubin_for_hopper_and_blackwell() {
        if !nvrtc_or_skip() {
            return;
        }
        for arch in [90, 100] {
            for m in MODULES {
                let cubin = compile_cubin(m, arch)
                    .unwrap_or_else(|e| panic!("{} for sm_{arch}: {e}", m.name));
                // An ELF image.
                assert_eq!(&cubin[..4], b"\x7fELF", "{} sm_{arch}", m.name);
                for k in m.kernels {
                    assert!(
                        cubin.windows(k.len()).any(|w| w == k.as_bytes()),
                        "{}: kernel {k} is not in the image",
                        m.name
                    );
                }
            }
        }
    }

    #[test]
    fn a_syntax_error_is_an_error_with_the_log() {
        if !nvrtc_or_skip() {
            return;
        }
        let bad = Module {
            name: "bad",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = undeclared; }",
            kernels: &["k"],
        };
        let e = compile_cubin(&bad, 90).unwrap_err().to_string();
        assert!(e.contains("bad") && e.contains("undeclared"), "{e}");
    }

    /// ptxas's report as NVRTC 13.0 writes it: an entry with shared memory
    /// and spills, one with none, and a device function's properties (no
    /// "Used" line) between them.
    #[test]
    fn the_ptxas_report_gives_each_kernel_its_resources() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
ptxas         .     48 bytes stack frame, 44 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 48 bytes cumulative stack size, 2176 bytes smem
ptxas info    : Function properties for helper
ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
";
        let r = parse_ptxas_report(log).unwrap();
        let k = |kernel: &str, registers, static_shared, spill_bytes| KernelResources {
            kernel: kernel.into(),
            registers,
            static_shared,
            spill_bytes,
        };
        assert_eq!(r, vec![k("a", 128, 2176, 44), k("b", 16, 0, 0)]);
        assert!(parse_ptxas_report("ptxas info    : Used 16 registers\n").is_err());
    }

    /// A block fits when its warps' registers (allocated in 256s), its
    /// threads and its shared memory fit.
    #[test]
    fn a_launch_is_refused_past_the_registers_threads_or_shared_memory() {
        let k = |registers, static_shared| KernelResources {
            kernel: "k".into(),
            registers,
            static_shared,
            spill_bytes: 0,
        };
        assert_eq!(k(64, 0).launch_refusal(1024, 0), None);
        // 65 registers round up to 72 a thread: 1024 threads need 73,728.
        let e = k(65, 0).launch_refusal(1024, 0).unwrap();
        assert!(e.contains("73728") && e.contains("65536"), "{e}");
        assert_eq!(k(65, 0).launch_refusal(896, 0), None);
        assert_eq!(k(128, 0).launch_refusal(512, 0), None);
        assert!(k(168, 0).launch_refusal(512, 0).is_some());
        assert!(k(16, 0)
            .launch_refusal(1056, 0)
            .unwrap()
            .contains("1056 threads"));
        assert!(k(16, 0).launch_refusal(0, 0).is_some());
        assert_eq!(k(16, 40_000).launch_refusal(256, 9_152), None);
        let e = k(16, 40_000).launch_refusal(256, 9_153).unwrap();
        assert!(e.contains("40000") && e.contains("9153"), "{e}");
    }

    #[test]
    fn the_cache_stores_once_and_keys_on_source_and_arch() {
        if !nvrtc_or_skip() {
            return;
        }
        let d = std::env::temp_dir().join(format!("arcticd-kcache-{}", std::process::id()));
        let cache = KernelCache::new(&d);
        let m = &MODULES[1];
        let a = cache.get_or_compile(m, 90).unwrap();
        let files = std::fs::read_dir(&d).unwrap().count();
        assert_eq!(files, 1);
        let b = cache.get_or_compile(m, 90).unwrap();
        assert_eq!(a, b);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        cache.get_or_compile(m, 100).unwrap();
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
        let v = nvrtc_version().unwrap();
        assert_ne!(cache.path(m, 90, v), cache.path(&MODULES[0], 90, v));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The kernels a source defines: the names after `__global__ void`,
    /// past a `__launch_bounds__(..)`.
    fn defined_kernels(source: &str) -> Vec<&str> {
        source
            .split("__global__ void ")
            .skip(1)
            .map(|part| {
                let part = part.trim_start();
                let part = match part.strip_prefix("__launch_bounds__(") {
                    Some(rest) => &rest[rest.find(')').map_or(0, |i| i + 1)..],
                    None => part,
                };
                part.split('(').next().unwrap_or_default().trim()
            })
            .collect()
    }

    #[test]
    fn every_kernel_name_belongs_to_one_module() {
        let mut seen = std::collections::HashSet::new();
        for m in MODULES {
            let defined = defined_kernels(m.source);
            for k in m.kernels {
                assert!(seen.insert(*k), "{k} defined twice");
                assert!(defined.contains(k), "{k} not in {}.cu", m.name);
            }
            // And every kernel a source defines is listed (so it gets loaded).
            for name in defined {
                assert!(
                    m.kernels.contains(&name),
                    "{name} in {}.cu is not listed",
                    m.name
                );
            }
        }
        assert_eq!(module_of("gated_delta_decode").unwrap().name, "gated_delta");
    }

    /// The body of kernel `name` in `source`: from its name to the next
    /// kernel (or the end).
    fn kernel_body<'a>(source: &'a str, name: &str) -> Option<&'a str> {
        let at = source.find(&format!("{name}("))?;
        let rest = &source[at..];
        Some(&rest[..rest[1..].find("__global__").map_or(rest.len(), |i| i + 1)])
    }

    /// Splits `text` (inside brackets) at its top-level commas.
    fn top_level_items(text: &str) -> Vec<&str> {
        let (mut depth, mut start, mut items) = (0i32, 0, Vec::new());
        for (i, ch) in text.char_indices() {
            match ch {
                '(' | '[' | '{' | '<' => depth += 1,
                ')' | ']' | '}' | '>' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(text[start..i].trim());
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(text[start..].trim());
        items.retain(|s| !s.is_empty());
        items
    }

    /// The text of the call opened at `open` (the index of its `(`), to
    /// the matching `)`, exclusive.
    fn bracketed(text: &str, open: usize) -> &str {
        let mut depth = 0;
        for (i, ch) in text[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        return &text[open + 1..open + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unclosed call at {open}")
    }

    /// The launchers' `launch!` calls: every kernel gets as many arguments
    /// as it has parameters, and a device buffer exactly where it takes a
    /// pointer (an integer or float value where it takes one). A kernel's
    /// arguments travel untyped, so nothing else would catch a parameter
    /// added on one side only before a GPU ran it.
    #[test]
    fn every_launch_passes_its_kernels_parameters() {
        let launchers = [
            include_str!("device.rs"),
            include_str!("device/backward.rs"),
        ];
        // Values the launchers pass by name: the kernels' int, long long,
        // float and null-pointer scalars.
        let scalar = |arg: &str| {
            let a = arg.trim_start_matches('&');
            let short_int =
                a.len() <= 3 && a.ends_with('i') && a.chars().all(|c| c.is_ascii_lowercase());
            ["ints[", "a[", "sc["].iter().any(|p| a.starts_with(p))
                || short_int
                || ["scale", "s", "n", "nl", "inv_temp", "eps", "theta"].contains(&a)
        };
        // The launchers' naming: sizes through `int(..)` are i32 (`ints`,
        // `n`, `ni`, ...), element counts and offsets for the elementwise
        // kernels i64 (`nl`, `a`), factors f32.
        let value_type = |arg: &str| {
            let a = arg.trim_start_matches('&');
            if a == "nl" || a.starts_with("a[") {
                "long long"
            } else if a.starts_with("sc[")
                || ["scale", "s", "inv_temp", "eps", "theta"].contains(&a)
            {
                "float"
            } else {
                "int"
            }
        };
        let param_type = |param: &str| {
            let words: Vec<&str> = param.split_whitespace().collect();
            words[..words.len() - 1].join(" ")
        };
        let (mut checked, mut wrong) = (0, Vec::new());
        for src in launchers {
            for (at, _) in src.match_indices("launch!(self, ") {
                let call = bracketed(src, at + "launch!".len());
                let (head, args) = call
                    .split_once(';')
                    .expect("launch!(dev, kernel, cfg; args)");
                let kernel = head.split(',').nth(1).unwrap().trim();
                let names: Vec<String> = match kernel.strip_prefix('"') {
                    Some(k) => vec![k.trim_end_matches('"').to_string()],
                    // `embedding`'s caller names one of the two lookups.
                    None if kernel == "kernel" => {
                        vec![
                            "embedding_forward_f32".into(),
                            "embedding_forward_bf16".into(),
                        ]
                    }
                    None => {
                        let set = src[..at].rfind("let op = \"").expect("op");
                        vec![src[set + 10..].split('"').next().unwrap().to_string()]
                    }
                };
                for name in names {
                    let m = module_of(&name).unwrap_or_else(|| panic!("{name} in no module"));
                    let def = m
                        .source
                        .find(&format!(" {name}("))
                        .or_else(|| m.source.find(&format!("\n{name}(")))
                        .unwrap_or_else(|| panic!("{name}'s definition"));
                    let open = def + m.source[def..].find('(').unwrap();
                    let params = top_level_items(bracketed(m.source, open));
                    let args = top_level_items(args);
                    assert_eq!(
                        args.len(),
                        params.len(),
                        "{name}: {} arguments for {} parameters\n{args:?}\n{params:?}",
                        args.len(),
                        params.len()
                    );
                    for (arg, param) in args.iter().zip(&params) {
                        let pointer = param.contains('*');
                        // NULL is the null pointer, passed for an optional buffer.
                        let passes_value = scalar(arg) && *arg != "&NULL";
                        if !(*arg == "&NULL" || pointer != passes_value) {
                            wrong.push(format!("{name}: argument {arg} for parameter `{param}`"));
                        } else if passes_value && value_type(arg) != param_type(param) {
                            // A value's width must be the parameter's: an
                            // i32 read as a long long takes garbage high bits.
                            wrong.push(format!(
                                "{name}: argument {arg} ({}) for parameter `{param}`",
                                value_type(arg)
                            ));
                        }
                    }
                    checked += 1;
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert!(checked >= 60, "{checked} launches checked");
    }

    /// `elems` caps a launch at 65,535 blocks of 256 threads, so every
    /// kernel the launchers start with it must stride over the grid, or
    /// the elements past 16.8M are never computed (the conv kernels did
    /// not: a prefill of 2,731 tokens of the 0.8B model's 6,144 conv
    /// channels lost its last rows).
    #[test]
    fn kernels_launched_over_elements_stride_over_the_grid() {
        let launchers = [
            include_str!("device.rs"),
            include_str!("device/backward.rs"),
        ];
        let mut checked = 0;
        for src in launchers {
            for (at, _) in src.match_indices(", elems(") {
                let line_start = src[..at].rfind("launch!(").expect("a launch");
                let launch = &src[line_start..at];
                let name = match launch.split('"').nth(1) {
                    Some(name) => name.to_string(),
                    // `launch!(self, op, ...)`: the op's name, set above.
                    None => {
                        let set = src[..line_start].rfind("let op = \"").expect("op");
                        src[set + 10..].split('"').next().unwrap().to_string()
                    }
                };
                let m = module_of(&name).unwrap_or_else(|| panic!("{name} in no module"));
                let body = kernel_body(m.source, &name).expect("the kernel's body");
                assert!(
                    body.contains("gridDim.x"),
                    "{name} is launched with elems() but does not stride over the grid"
                );
                checked += 1;
            }
        }
        assert!(checked >= 20, "{checked} launches found");
    }
}
