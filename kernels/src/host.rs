//! Process-wide settings of the host the kernels run on, and where arcticd
//! keeps its caches.
//!
//! Not for: anything numeric.

/// Keep freed heap memory for reuse instead of handing it back to the OS.
///
/// A training step allocates and frees activation and gradient buffers of
/// several MiB per op. glibc serves blocks above its mmap threshold with a
/// fresh mapping and unmaps them on free, and trims the heap top above its
/// trim threshold, so every step page-faults and zeroes the same memory
/// again (about a fifth of a `small` training step on 2 cores, measured
/// with `perf`). This raises the mmap threshold to its ceiling (32 MiB),
/// turns trimming off and pads heap growth, so freed blocks are reused.
/// Call it once at start-up, before threads start; a no-op off glibc.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; called before other
    // threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// The folder `arcticd/NAME` under the user's cache directory:
/// `$XDG_CACHE_HOME`, else `~/.cache`, else the temporary directory. Where
/// arcticd caches what it builds once (the demo's inputs, compiled CUDA
/// kernels).
pub fn cache_dir(name: &str) -> std::path::PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("arcticd")
        .join(name)
}
