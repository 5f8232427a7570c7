//! What a context costs on a device, as memory no swap frees: measured on twin
//! contexts made and destroyed at once ([`context_cost`], its tries settled against
//! other processes' traffic), or taken from NVML's looks around the process's own
//! creation ([`creation_cost`]); free memory as the driver and NVML tell it.

use super::*;

/// Free memory on GPU `uuid` now, as NVML counts it (it needs no context, which a
/// process whose first context was refused does not have); `None` where NVML does
/// not load.
pub(crate) fn nvml_free(uuid: &str) -> Option<u64> {
    let nvml = nvml()?;
    let dev = nvml.handle_by_uuid(uuid).ok()?;
    nvml.memory(dev).ok().map(|m| m.free)
}

/// NVML, loaded once; `None` where it does not load.
fn nvml() -> Option<&'static kiwi_nvml::Nvml> {
    static NVML: std::sync::OnceLock<Option<kiwi_nvml::Nvml>> = std::sync::OnceLock::new();
    // Inside the shim: its lookups get the driver's functions, not the view's
    // (`crate::nvml`).
    NVML.get_or_init(|| crate::ffi::inside(|| kiwi_nvml::Nvml::load(kiwi_nvml::NVML_LIBRARY).ok()))
        .as_ref()
}

/// GPU `uuid` as NVML sees it at one moment: free memory, and each process's
/// memory (`(pid, bytes)`; `None` where NVML cannot list them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NvmlLook {
    pub free: u64,
    pub procs: Option<Vec<(u32, u64)>>,
}

/// [`NvmlLook`] of GPU `uuid` now.
pub(crate) fn nvml_look(uuid: &str) -> Option<NvmlLook> {
    let nvml = nvml()?;
    let dev = nvml.handle_by_uuid(uuid).ok()?;
    let free = nvml.memory(dev).ok()?.free;
    Some(NvmlLook {
        free,
        procs: nvml.compute_processes(dev).ok(),
    })
}

/// What this process's context creation (process `me`) took, from NVML's looks
/// before and after it: its own growth where NVML lists it under `me`; else (a pid
/// namespace of its own) the least growth of the processes that appeared or grew
/// meanwhile, one of which is this one; never more than the drop in free memory.
/// Newcomers starting together each counted the others' contexts as their own
/// before (a notebook refused for a holder it would not have blocked).
pub(crate) fn creation_cost(before: &NvmlLook, after: &NvmlLook, me: u32) -> u64 {
    let drop = before.free.saturating_sub(after.free);
    let (Some(b), Some(a)) = (&before.procs, &after.procs) else {
        return drop;
    };
    let was = |pid: u32| b.iter().find(|p| p.0 == pid).map_or(0, |p| p.1);
    if let Some(&(_, mine)) = a.iter().find(|p| p.0 == me) {
        return mine.saturating_sub(was(me)).min(drop);
    }
    a.iter()
        .map(|&(pid, bytes)| bytes.saturating_sub(was(pid)))
        .filter(|&g| g > 0)
        .min()
        .map_or(drop, |g| g.min(drop))
}

/// The drop in free memory (NVML's) around the process's first context creation on
/// each device: what [`context_cost`] counts where no twin fits (0: none seen).
static CREATION_DROP: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

/// Most a creation's drop is believed: more is others' memory that arrived meanwhile
/// (an H100's contexts cost 300–600 MiB).
const CREATION_DROP_MAX: u64 = 2 << 30;

/// What the process's first context creation on device `d` took from free memory.
pub(crate) fn note_creation_drop(d: usize, bytes: u64) {
    if let Some(c) = CREATION_DROP.get(d) {
        c.store(bytes, Ordering::Release);
    }
}

/// Device memory free now, as the driver sees it from the calling thread's context.
pub(crate) fn free_memory() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    call!(cuMemGetInfo_v2: fn(*mut usize, *mut usize)(&mut free, &mut total)).ok()?;
    Some(free as u64)
}

/// What a context costs on device `d`, where the application has context `ctx`:
/// the drop in free memory (`cuMemGetInfo`) while the shim holds a context of its own
/// there, made and destroyed at once. Other processes allocating or freeing
/// meanwhile (their own probes, swaps) move free memory too: see [`settle_cost`]
/// for which of at most [`COST_TRIES`] tries count. The application's own context
/// was made before the shim could look (the CUDA runtime makes its primary context
/// through a private entry point), so its cost is measured on a twin. 0 when it
/// cannot be measured (no room for a second context) and the application's own
/// creation was not seen to take memory ([`note_creation_drop`]): the arbiter's
/// reserve then covers it.
pub(crate) fn context_cost(d: usize, ctx: CUcontext) -> u64 {
    let destroy = crate::real::lookup(c"cuCtxDestroy_v2");
    if ctx.is_null() || destroy.is_null() {
        return 0;
    }
    // SAFETY: the driver's cuCtxDestroy_v2, with cuda.h's signature.
    let destroy = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(CUcontext) -> CUresult>(destroy)
    };
    crate::ffi::inside(|| {
        let previous = current_context();
        if call!(cuCtxSetCurrent: fn(CUcontext)(ctx)).is_err() {
            return 0;
        }
        // Free memory as the driver tells it in the application's context, or, where
        // that context cannot answer yet (NVIDIA's runtime 13 makes its primary
        // context before it can: seen on an H100 and an H200, driver 580), as NVML
        // counts it, which needs no context. One source for every reading.
        let uuid = device_uuid(d);
        let use_nvml = free_memory().is_none();
        let free_memory = || {
            if use_nvml {
                uuid.as_deref().and_then(nvml_free)
            } else {
                free_memory()
            }
        };
        let mut tries: Vec<CostTry> = Vec::new();
        while tries.len() < COST_TRIES {
            std::thread::sleep(try_jitter(tries.len()));
            let Some(before) = free_memory() else {
                crate::kdebug!("GPU {d}: free memory unknown: no context cost");
                break;
            };
            let mut twin: CUcontext = null_mut();
            if let Err(e) = call!(cuCtxCreate_v2: fn(*mut CUcontext, Uint, CUdevice)(&mut twin, 0, d as CUdevice))
            {
                crate::kdebug!(
                    "GPU {d}: a twin context was refused (CUDA error {e}): no context cost"
                );
                break;
            }
            let with_twin = free_memory();
            // SAFETY: destroying the context made just above (it pops it: `ctx` is
            // current again).
            unsafe { destroy(twin) };
            let _ = call!(cuCtxSetCurrent: fn(CUcontext)(ctx));
            let (Some(with_twin), Some(after)) = (with_twin, free_memory()) else {
                break;
            };
            tries.push(CostTry {
                before,
                with_twin,
                after,
            });
            if settle_cost(&tries).is_some_and(|(_, agreed)| agreed) {
                break;
            }
        }
        let _ = call!(cuCtxSetCurrent: fn(CUcontext)(previous));
        let Some((cost, agreed)) = settle_cost(&tries) else {
            // No room for a twin (a newcomer beside a tenant that fills the GPU):
            // what the process's own creation took, if it was seen.
            let drop = CREATION_DROP[d].load(Ordering::Acquire);
            if drop > 0 && drop <= CREATION_DROP_MAX {
                crate::kinfo!(
                    "GPU {d}: no room for a second context to measure one by; counting the {} MiB its creation took",
                    drop >> 20
                );
                return drop;
            }
            crate::kinfo!("GPU {d}: could not measure what a context costs; counting none");
            return 0;
        };
        crate::kdebug!(
            "GPU {d}: a context costs {cost} bytes ({} tries{})",
            tries.len(),
            if agreed {
                ""
            } else {
                ", not settled: the least"
            }
        );
        cost
    })
}

/// Most twin contexts [`context_cost`] makes.
const COST_TRIES: usize = 6;

/// Free device memory around one twin context: before making it, while it lived,
/// after destroying it.
#[derive(Debug, Clone, Copy)]
struct CostTry {
    before: u64,
    with_twin: u64,
    after: u64,
}

/// The context cost the tries show, and whether two agreed.
///
/// - A try is calm when free memory came back to where it was (within 1 MiB) once
///   the twin was destroyed. A try during another process's swap-out (64 MiB freed
///   every few ms) is not calm: it measured the cost short by what was freed, down
///   to 0; two such tries agreed, and the arbiter then counted room that was not
///   there.
/// - A calm try can still be disturbed, upward in practice: another process's
///   short-lived memory — its own twin, when Kiwi processes start together — taken
///   and given back between this try's reads. Two processes measuring at once on a
///   loaded machine each counted both twins (600 MiB for a 300 MiB context), and two
///   notebooks that fit side by side were made to take turns. So the smallest calm
///   try counts, settled once another calm try agrees with it (within 1 MiB); tries
///   are spaced by a jitter ([`try_jitter`]) so two processes fall out of step.
/// - Else the smallest bound the disturbed tries give: others that only freed (or
///   only allocated) meanwhile moved free memory one way, so the larger of the drop
///   with the twin measured from before and from after (`max(before, after) −
///   with_twin`) is at least what the twin took.
fn settle_cost(tries: &[CostTry]) -> Option<(u64, bool)> {
    const NEAR: u64 = 1 << 20;
    let cost = |t: &CostTry| t.before.saturating_sub(t.with_twin);
    let calm: Vec<u64> = tries
        .iter()
        .filter(|t| t.after.abs_diff(t.before) <= NEAR)
        .map(cost)
        .collect();
    if let Some(least) = calm.iter().copied().min() {
        let near = calm.iter().filter(|&&c| c.abs_diff(least) <= NEAR).count();
        return Some((least, near >= 2));
    }
    let bound = |t: &CostTry| t.before.max(t.after).saturating_sub(t.with_twin);
    Some((tries.iter().map(bound).min()?, false))
}

/// How long to wait before twin try `n` (none before the first): 1–8 ms, drawn from
/// the clock and the process id, so two processes measuring at once fall out of step.
fn try_jitter(n: usize) -> std::time::Duration {
    if n == 0 {
        return std::time::Duration::ZERO;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mix = (u64::from(nanos) ^ u64::from(std::process::id()).wrapping_mul(0x9E37_79B9))
        .wrapping_mul(0x2545_F491_4F6C_DD1D);
    std::time::Duration::from_micros(1000 + (mix >> 40) % 7000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A context's creation cost from NVML's looks: the process's own growth where
    /// NVML lists it; else the least growth among processes that grew (another
    /// newcomer's context made at the same moment is not counted as its own);
    /// capped by the drop in free memory.
    #[test]
    fn a_creation_costs_its_own_processes_growth() {
        let look = |free: u64, procs: &[(u32, u64)]| NvmlLook {
            free: free * MIB,
            procs: Some(procs.iter().map(|&(p, b)| (p, b * MIB)).collect()),
        };
        let before = look(4000, &[(10, 1000)]);
        // Alone: its pid appears with its context.
        let after = look(3700, &[(10, 1000), (42, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // Another newcomer's context at the same moment: not its own.
        let after = look(3400, &[(10, 1000), (42, 300), (43, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // Listed under another pid (its own pid namespace): the least growth.
        let after = look(3350, &[(10, 1050), (900, 300), (901, 310)]);
        assert_eq!(creation_cost(&before, &after, 42), 50 * MIB);
        let after = look(3700, &[(10, 1000), (900, 300)]);
        assert_eq!(creation_cost(&before, &after, 42), 300 * MIB);
        // No process list: the drop in free memory, as before.
        let bare = |free: u64| NvmlLook {
            free: free * MIB,
            procs: None,
        };
        assert_eq!(creation_cost(&bare(4000), &bare(3400), 42), 600 * MIB);
    }

    const MIB: u64 = 1 << 20;

    /// A try with `ctx` MiB for the twin, others freeing `freed` MiB while it lived
    /// (negative: allocating).
    fn try_(ctx: u64, freed: i64) -> CostTry {
        let before = 1000 * MIB;
        let others = |b: u64| b.saturating_add_signed(freed * MIB as i64);
        CostTry {
            before,
            with_twin: others(before - ctx * MIB),
            after: others(before),
        }
    }

    #[test]
    fn two_calm_tries_that_agree_settle_the_cost() {
        let tries = [try_(300, 128), try_(300, 0), try_(300, 0)];
        assert_eq!(settle_cost(&tries[..2]), Some((300 * MIB, false)));
        assert_eq!(settle_cost(&tries), Some((300 * MIB, true)));
    }

    /// Another process swapping out freed more than the context costs during both
    /// tries: each measured 0, and the two zeros used to agree.
    #[test]
    fn tries_disturbed_by_frees_never_agree_on_a_short_cost() {
        let tries = [try_(300, 320), try_(300, 384)];
        assert_eq!(tries[0].before.saturating_sub(tries[0].with_twin), 0);
        // No calm try: the bound from after the twin, never short.
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
        // Freed half before and half after free memory was read with the twin.
        let split = CostTry {
            before: 1000 * MIB,
            with_twin: (1000 - 300 + 64) * MIB,
            after: (1000 + 128) * MIB,
        };
        assert_eq!(settle_cost(&[split]), Some((364 * MIB, false)));
        // Others allocating meanwhile: measured from before, also never short.
        assert_eq!(settle_cost(&[try_(300, -64)]), Some((364 * MIB, false)));
        let tries = [try_(300, 320), try_(300, 384), try_(300, 0)];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
    }

    /// Without agreement, the smallest calm try: calm tries are disturbed upward.
    #[test]
    fn without_agreement_the_smallest_calm_try_counts() {
        let tries = [try_(300, -64), try_(310, 0), try_(290, 0)];
        assert_eq!(settle_cost(&tries), Some((290 * MIB, false)));
        assert_eq!(settle_cost(&[]), None);
    }

    /// Another process's twin, made and destroyed between a try's reads, looks calm
    /// and doubles the cost; two such tries agreed, and the GPU was believed full.
    #[test]
    fn calm_tries_doubled_by_anothers_twin_do_not_settle_the_cost() {
        let doubled = try_(600, 0);
        let tries = [doubled, doubled];
        assert_eq!(settle_cost(&tries), Some((600 * MIB, true)));
        let tries = [doubled, try_(300, 0), doubled];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, false)));
        let tries = [doubled, try_(300, 0), doubled, try_(300, 0)];
        assert_eq!(settle_cost(&tries), Some((300 * MIB, true)));
    }

    #[test]
    fn tries_are_spaced_apart_except_the_first() {
        assert_eq!(try_jitter(0), std::time::Duration::ZERO);
        for n in 1..50 {
            let j = try_jitter(n);
            assert!((1000..8000).contains(&(j.as_micros() as u64)), "{j:?}");
        }
    }
}
