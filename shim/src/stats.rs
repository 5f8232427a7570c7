//! Debug counters, written as `key value` lines to the file named by `KIWI_STATS` when
//! the process exits. Tests use them to prove a path went through the shim. A leaf:
//! the two figures that are not counters here (submissions, the client's mode) come
//! from whoever registers the exit hook ([`register_exit_hook`]).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

pub static SLOW_SUBMITS: AtomicU64 = AtomicU64::new(0);
pub static GRANTS: AtomicU64 = AtomicU64::new(0);
pub static RELEASES: AtomicU64 = AtomicU64::new(0);
pub static EARLY_RELEASES: AtomicU64 = AtomicU64::new(0);
pub static SWAP_OUT_BYTES: AtomicU64 = AtomicU64::new(0);
pub static SWAP_IN_BYTES: AtomicU64 = AtomicU64::new(0);
pub static ALLOCS: AtomicU64 = AtomicU64::new(0);
pub static DLSYM_WRAPPED: AtomicU64 = AtomicU64::new(0);
pub static PROCADDR_WRAPPED: AtomicU64 = AtomicU64::new(0);
pub static RECONNECTS: AtomicU64 = AtomicU64::new(0);
/// GPUs this process holds turns on (registered with the arbiter).
pub static GPUS: AtomicU64 = AtomicU64::new(0);
/// Pinned swap buffers allocated ahead of a drop (off the release's critical path).
pub static PINNED_AHEAD_BYTES: AtomicU64 = AtomicU64::new(0);
/// Swapped-out contents copied into pageable buffers (no pinned one was ready) and
/// page-locked in place afterwards by the pinning thread.
pub static REGISTERED_IN_PLACE_BYTES: AtomicU64 = AtomicU64::new(0);
/// Swap pool memory given back when the arbiter asked (`pool_reclaim`): spare
/// buffers and swapped-out contents moved to the pool's disk tier.
pub static SPILLED_BYTES: AtomicU64 = AtomicU64::new(0);
/// Calls that load code, or may (`modules.rs`): which ones a runtime makes tells where
/// its kernels' code comes from (NVIDIA's runtime 12.x and 13.x differ).
pub static MODULE_LOADS: AtomicU64 = AtomicU64::new(0);
pub static LIBRARY_LOADS: AtomicU64 = AtomicU64::new(0);
pub static MODULE_GET_FUNCTIONS: AtomicU64 = AtomicU64::new(0);
pub static LIBRARY_GET_MODULES: AtomicU64 = AtomicU64::new(0);
pub static LIBRARY_GET_KERNELS: AtomicU64 = AtomicU64::new(0);
pub static KERNEL_GET_FUNCTIONS: AtomicU64 = AtomicU64::new(0);
/// Device memory those calls were measured to take (memory no swap frees).
pub static CODE_BYTES: AtomicU64 = AtomicU64::new(0);

/// What the exit report reads besides the counters: the gate's submissions so far and
/// the client's mode.
pub type Figures = fn() -> (u32, &'static str);

static FIGURES: std::sync::OnceLock<Figures> = std::sync::OnceLock::new();

/// The counters as text, with `submissions` and `mode`.
pub fn render(submissions: u32, mode: &str) -> String {
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    format!(
        "submissions {}\nslow_submits {}\ngrants {}\nreleases {}\nearly_releases {}\n\
         swap_out_bytes {}\nswap_in_bytes {}\nallocs {}\ndlsym_wrapped {}\n\
         procaddr_wrapped {}\nreconnects {}\ngpus {}\npinned_ahead_bytes {}\n\
         registered_in_place_bytes {}\nmodule_loads {}\nlibrary_loads {}\n\
         module_get_functions {}\nlibrary_get_modules {}\nlibrary_get_kernels {}\n\
         kernel_get_functions {}\ncode_bytes {}\nspilled_bytes {}\nmode {}\n",
        submissions,
        g(&SLOW_SUBMITS),
        g(&GRANTS),
        g(&RELEASES),
        g(&EARLY_RELEASES),
        g(&SWAP_OUT_BYTES),
        g(&SWAP_IN_BYTES),
        g(&ALLOCS),
        g(&DLSYM_WRAPPED),
        g(&PROCADDR_WRAPPED),
        g(&RECONNECTS),
        g(&GPUS),
        g(&PINNED_AHEAD_BYTES),
        g(&REGISTERED_IN_PLACE_BYTES),
        g(&MODULE_LOADS),
        g(&LIBRARY_LOADS),
        g(&MODULE_GET_FUNCTIONS),
        g(&LIBRARY_GET_MODULES),
        g(&LIBRARY_GET_KERNELS),
        g(&KERNEL_GET_FUNCTIONS),
        g(&CODE_BYTES),
        g(&SPILLED_BYTES),
        mode,
    )
}

extern "C" fn write_at_exit() {
    let Some(path) = std::env::var_os("KIWI_STATS") else {
        return;
    };
    let _ = std::panic::catch_unwind(|| {
        if let Ok(mut f) = std::fs::File::create(&path) {
            let (submissions, mode) = FIGURES.get().map_or((0, "unstarted"), |f| f());
            let _ = f.write_all(render(submissions, mode).as_bytes());
        }
    });
}

/// Registers the exit hook once (when `KIWI_STATS` is set); `figures` gives the
/// report's submissions and mode.
pub fn register_exit_hook(figures: Figures) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = FIGURES.set(figures);
        if std::env::var_os("KIWI_STATS").is_some() {
            // SAFETY: registering a plain extern "C" function with no arguments.
            unsafe { libc::atexit(write_at_exit) };
        }
    });
}
