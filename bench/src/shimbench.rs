//! The shim's figures: `launch-overhead` (what `cuLaunchKernel` costs through
//! `libkiwi.so` while the GPU is ours, against the driver called directly), `swap`
//! (swap throughput against the pinned copy bandwidth measured in the same run) and
//! `drop-latency` (a drop to the release, for apps that queue thousands of kernels).
//! All on the GPU simulator; the driver-facing parts run in child processes so the
//! simulator's `libcuda.so.1` is found through `LD_LIBRARY_PATH`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Result};
use kiwi_cuda::sys::CUmemAllocationProp;
use kiwi_protocol::blocking::Connection;
use kiwi_protocol::{ControlReply, ControlRequest, Event, EventKind};

use crate::jobs::{job_mem, spawn_job_args, wait_all, Build, Job, Sim, GPU};
use crate::procs::ArbiterProc;
use crate::report::{percentile, Figure};

type Launch = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

pub(crate) fn open(path: &CStr, flags: c_int) -> Result<*mut c_void> {
    // SAFETY: dlopen with a NUL-terminated path.
    let h = unsafe { libc::dlopen(path.as_ptr(), flags) };
    if h.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message after a failure.
        let e = unsafe { CStr::from_ptr(libc::dlerror()) };
        bail!("dlopen {path:?}: {e:?}");
    }
    Ok(h)
}

/// # Safety
/// `T` must be the function-pointer type of `name` in the loaded library.
pub(crate) unsafe fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> Result<T> {
    // SAFETY: dlsym on a live handle with a NUL-terminated name.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    if p.is_null() {
        bail!("{name:?} not found");
    }
    // SAFETY: the caller promises T is this symbol's function-pointer type, which has
    // the size of a pointer.
    Ok(unsafe { std::mem::transmute_copy(&p) })
}

pub(crate) fn check(r: c_int, what: &str) -> Result<()> {
    if r != 0 {
        bail!("{what} failed with CUDA error {r}");
    }
    Ok(())
}

/// Child role: launches through the driver and through the shim (loaded
/// `RTLD_LOCAL`, so it does not interpose here; its exported wrapper is called
/// directly, running unmanaged: the same open-gate path a holder takes). Prints
/// `direct_ns through_ns` medians.
pub fn launch_overhead_role(shim: &Path) -> Result<()> {
    std::env::set_var("KIWI_ARBITER_TIMEOUT", "0");
    std::env::set_var("KIWI_SOCKET_DIR", "/nonexistent-kiwi-bench");
    std::env::set_var("KIWI_LOG", "error");
    let cuda = open(c"libcuda.so.1", libc::RTLD_NOW | libc::RTLD_GLOBAL)?;
    let cshim = CString::new(shim.as_os_str().as_encoded_bytes())?;
    let kiwi = open(&cshim, libc::RTLD_NOW | libc::RTLD_LOCAL)?;
    // cuInit through the shim, so it initializes too.
    make_context(cuda, kiwi)?;
    // SAFETY: the types below are those of cuda.h for these entry points.
    let (load, get_fn, sync, direct, through) = unsafe {
        (
            sym::<unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int>(
                cuda,
                c"cuModuleLoadData",
            )?,
            sym::<unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int>(
                cuda,
                c"cuModuleGetFunction",
            )?,
            sym::<unsafe extern "C" fn() -> c_int>(cuda, c"cuCtxSynchronize")?,
            sym::<Launch>(cuda, c"cuLaunchKernel")?,
            sym::<Launch>(kiwi, c"cuLaunchKernel")?,
        )
    };
    let ptx =
        c".version 7.0\n.target sm_52\n.address_size 64\n.visible .entry kiwi_spin() { ret; }\n";
    let (mut module, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: driver calls with valid out-pointers, in a current context.
    unsafe {
        check(load(&mut module, ptx.as_ptr().cast()), "cuModuleLoadData")?;
        check(
            get_fn(&mut f, module, c"kiwi_spin".as_ptr()),
            "cuModuleGetFunction",
        )?;
    }
    let mut ns: u64 = 0;
    let mut params = [&mut ns as *mut u64 as *mut c_void];
    const BATCH: usize = 200;
    let rounds: usize = std::env::var("KIWI_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut per = |launch: Launch| -> Result<f64> {
        let t = Instant::now();
        for _ in 0..BATCH {
            // SAFETY: a valid function and parameter array; null stream and extra.
            let r = unsafe {
                launch(
                    f,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check(r, "cuLaunchKernel")?;
        }
        let e = t.elapsed().as_nanos() as f64 / BATCH as f64;
        // SAFETY: plain synchronize, outside the timed part: keeps the queue short.
        check(unsafe { sync() }, "cuCtxSynchronize")?;
        Ok(e)
    };
    let (mut d, mut s) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        per(direct)?;
        per(through)?;
    }
    for _ in 0..rounds {
        d.push(per(direct)?);
        s.push(per(through)?);
    }
    println!("{} {}", percentile(&mut d, 50.0), percentile(&mut s, 50.0));
    Ok(())
}

/// Copies of `bytes` each way the copy-bandwidth baseline times (after one warm-up).
const BASELINE_ROUNDS: usize = 4;

/// Opens the simulator's `libcuda.so.1` and makes a context on device 0 current on
/// this thread: what every driver-side child role starts with.
fn driver_with_context() -> Result<*mut c_void> {
    let cuda = open(c"libcuda.so.1", libc::RTLD_NOW | libc::RTLD_GLOBAL)?;
    make_context(cuda, cuda)?;
    Ok(cuda)
}

/// Makes a context on device 0 current on this thread: `cuInit` from `init_from`
/// (the driver, or the shim to initialize it too), the rest from the driver `cuda`.
fn make_context(cuda: *mut c_void, init_from: *mut c_void) -> Result<()> {
    // SAFETY: cuda.h's types for these entry points.
    let (init, dev_get, ctx_create) = unsafe {
        (
            sym::<unsafe extern "C" fn(c_uint) -> c_int>(init_from, c"cuInit")?,
            sym::<unsafe extern "C" fn(*mut c_int, c_int) -> c_int>(cuda, c"cuDeviceGet")?,
            sym::<unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int>(
                cuda,
                c"cuCtxCreate_v2",
            )?,
        )
    };
    let (mut ordinal, mut ctx) = (0, std::ptr::null_mut());
    // SAFETY: driver calls with valid out-pointers.
    unsafe {
        check(init(0), "cuInit")?;
        check(dev_get(&mut ordinal, 0), "cuDeviceGet")?;
        check(ctx_create(&mut ctx, 0, ordinal), "cuCtxCreate")?;
    }
    Ok(())
}

/// A context, `bytes` of device memory and as much pinned host memory, touched once
/// (as the shim's reused swap buffers are), and the copy entry points.
struct CopyRig {
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
    htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
    dev: u64,
    host: *mut c_void,
    bytes: usize,
}

impl CopyRig {
    fn new(bytes: usize) -> Result<CopyRig> {
        let cuda = driver_with_context()?;
        // SAFETY: cuda.h's types for these entry points.
        let (alloc, host_alloc, dtoh, htod) = unsafe {
            (
                sym::<unsafe extern "C" fn(*mut u64, usize) -> c_int>(cuda, c"cuMemAlloc_v2")?,
                sym::<unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int>(
                    cuda,
                    c"cuMemAllocHost_v2",
                )?,
                sym::<unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int>(
                    cuda,
                    c"cuMemcpyDtoH_v2",
                )?,
                sym::<unsafe extern "C" fn(u64, *const c_void, usize) -> c_int>(
                    cuda,
                    c"cuMemcpyHtoD_v2",
                )?,
            )
        };
        let (mut dev, mut host) = (0u64, std::ptr::null_mut());
        // SAFETY: driver calls with valid out-pointers and a buffer of `bytes` both sides.
        unsafe {
            check(alloc(&mut dev, bytes), "cuMemAlloc")?;
            check(host_alloc(&mut host, bytes), "cuMemAllocHost")?;
            check(dtoh(host, dev, bytes), "cuMemcpyDtoH")?;
        }
        Ok(CopyRig {
            dtoh,
            htod,
            dev,
            host,
            bytes,
        })
    }

    /// One copy of all the bytes, device to host or host to device; its seconds.
    fn copy(&self, to_host: bool) -> Result<f64> {
        let t = Instant::now();
        // SAFETY: both buffers hold `bytes` (made in `new`).
        unsafe {
            if to_host {
                check((self.dtoh)(self.host, self.dev, self.bytes), "cuMemcpyDtoH")?;
            } else {
                check((self.htod)(self.dev, self.host, self.bytes), "cuMemcpyHtoD")?;
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Child role: pinned device↔host copy bandwidth (GB/s) on the simulator. Prints the
/// bytes over the time of [`BASELINE_ROUNDS`] copies each way (alternating): one
/// 256 MiB copy takes ~20 ms, a single sample on a machine whose copy rate wanders by
/// ±30% from one to the next, while the swap figures it is compared with add up
/// twenty swaps of ~600 MiB each.
///
/// With `one_way` (`to_host`, start and end on CLOCK_MONOTONIC): copies in that
/// direction only, from `start_ns` until `end_ns`, and prints that direction's GB/s.
/// Two of these at once, one each way in two processes, measure what this host's
/// copies give both directions together (a pipelined hand-off's case).
pub fn copy_bandwidth_role(bytes: usize, one_way: Option<(bool, u64, u64)>) -> Result<()> {
    let rig = CopyRig::new(bytes)?;
    if let Some((to_host, start_ns, end_ns)) = one_way {
        let now = crate::procs::monotonic_ns();
        if now >= start_ns {
            bail!(
                "ready {} ms after the agreed start",
                (now - start_ns) / 1_000_000
            );
        }
        std::thread::sleep(std::time::Duration::from_nanos(start_ns - now));
        let (mut n, mut secs) = (0usize, 0.0);
        while crate::procs::monotonic_ns() < end_ns {
            secs += rig.copy(to_host)?;
            n += 1;
        }
        println!("{}", (n * bytes) as f64 / secs / 1e9);
        return Ok(());
    }
    let (mut a, mut b) = (0.0, 0.0);
    for _ in 0..BASELINE_ROUNDS {
        a += rig.copy(true)?;
        b += rig.copy(false)?;
    }
    let total = (bytes * BASELINE_ROUNDS) as f64;
    println!("{} {}", total / a / 1e9, total / b / 1e9);
    Ok(())
}

/// Child role: the rate (GB/s) at which `cuMemCreate` makes physical memory in
/// handles of `segment` bytes, `bytes` in all (after one round to warm up, released
/// each time; releases not timed): what a swap-in pays for the memory it copies into,
/// as the shim makes it (`shim/src/mem.rs`, `SEGMENT_MAX`).
pub fn create_rate_role(bytes: usize, segment: usize) -> Result<()> {
    let cuda = driver_with_context()?;
    type Create = unsafe extern "C" fn(*mut u64, usize, *const CUmemAllocationProp, u64) -> c_int;
    // SAFETY: cuda.h's types for these entry points.
    let (create, release) = unsafe {
        (
            sym::<Create>(cuda, c"cuMemCreate")?,
            sym::<unsafe extern "C" fn(u64) -> c_int>(cuda, c"cuMemRelease")?,
        )
    };
    // Pinned device memory on device 0, no shareable handle type.
    let prop = CUmemAllocationProp::device(0);
    let n = (bytes / segment).max(1);
    let mut secs = 0.0;
    for round in 0..2 {
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let mut h = 0u64;
            let t = Instant::now();
            // SAFETY: a valid out-pointer and a prop laid out as cuda.h's.
            check(unsafe { create(&mut h, segment, &prop, 0) }, "cuMemCreate")?;
            if round == 1 {
                secs += t.elapsed().as_secs_f64();
            }
            handles.push(h);
        }
        for h in handles {
            // SAFETY: a handle cuMemCreate just made, released once.
            check(unsafe { release(h) }, "cuMemRelease")?;
        }
    }
    println!("{}", (n * segment) as f64 / secs / 1e9);
    Ok(())
}

/// GB/s of `cuMemCreate` on `sim`, in the shim's segments (see [`create_rate_role`]).
pub fn create_rate(b: &Build, sim: &Sim) -> Result<f64> {
    let out = child(
        &["__create-rate", "268435456", &SEGMENT_BYTES.to_string()],
        b,
        sim,
    )?;
    out.parse()
        .map_err(|_| anyhow::anyhow!("unexpected output {out:?}"))
}

/// The shim's largest segment (`shim/src/mem.rs`, `SEGMENT_MAX`): the unit a swap-in
/// creates memory in.
const SEGMENT_BYTES: u64 = 64 << 20;

/// The pinned copy rates (GB/s: device to host, host to device) on `sim` with one
/// copy each way at once, in two processes, for the same 600 ms.
/// The pinned copy rates (device-to-host, host-to-device) on `sim`, GB/s, one way
/// at a time, 256 MiB each.
pub fn pinned_copy_rates(b: &Build, sim: &Sim) -> Result<(f64, f64)> {
    two_numbers(&child(&["__copy-bandwidth", "268435456"], b, sim)?)
}

pub fn duplex_copy_rates(b: &Build, sim: &Sim) -> Result<(f64, f64)> {
    // Time for both to start (a context, 256 MiB of each memory, pinning included).
    let start = crate::procs::monotonic_ns() + 3_000_000_000;
    let end = start + 600_000_000;
    let spawn = |dir: &str| -> Result<std::process::Child> {
        let mut cmd = Command::new(std::env::current_exe()?);
        sim.apply(b, &mut cmd);
        Ok(cmd
            .args(["__copy-bandwidth", "268435456", "--dir", dir])
            .args([
                "--start-ns",
                &start.to_string(),
                "--end-ns",
                &end.to_string(),
            ])
            .env_remove("LD_PRELOAD")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?)
    };
    let (out, inn) = (spawn("d2h")?, spawn("h2d")?);
    let rate = |c: std::process::Child, dir: &str| -> Result<f64> {
        let o = c.wait_with_output()?;
        let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if !o.status.success() {
            bail!("kiwi-bench __copy-bandwidth --dir {dir} failed");
        }
        s.parse()
            .map_err(|_| anyhow::anyhow!("unexpected output {s:?}"))
    };
    Ok((rate(out, "d2h")?, rate(inn, "h2d")?))
}

fn child(role: &[&str], b: &Build, sim: &Sim) -> Result<String> {
    let mut cmd = Command::new(std::env::current_exe()?);
    sim.apply(b, &mut cmd);
    let out = cmd
        .args(role)
        .env_remove("LD_PRELOAD")
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("kiwi-bench {} failed", role.join(" "));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn two_numbers(s: &str) -> Result<(f64, f64)> {
    let mut it = s.split_whitespace().map(str::parse::<f64>);
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) => Ok((a, b)),
        _ => bail!("unexpected output {s:?}"),
    }
}

pub fn launch_overhead(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let sim = Sim::new("launch", 1 << 30);
    let out = Command::new(std::env::current_exe()?)
        .arg("__launch-overhead")
        .arg(&b.shim)
        .env("LD_LIBRARY_PATH", &b.sim_dir)
        .env("KIWI_SIM_NAME", &sim.name)
        .env("KIWI_BENCH_ROUNDS", if quick { "60" } else { "300" })
        .env_remove("LD_PRELOAD")
        .output()?;
    if !out.status.success() {
        bail!(
            "launch-overhead child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (direct, through) = two_numbers(&String::from_utf8_lossy(&out.stdout))?;
    Ok(vec![
        Figure::new("launch-overhead", "launch_through_shim", through, "ns")
            .against(direct, "cuLaunchKernel on the driver directly"),
        Figure::new(
            "launch-overhead",
            "added_per_launch",
            through - direct,
            "ns",
        )
        .goal("<= 50 ns, no lock, no allocation"),
    ])
}

/// Every event of a live arbiter.
pub fn arbiter_events(arb: &ArbiterProc) -> Result<Vec<Event>> {
    events_at(arb.socket_dir())
}

/// The whole event log of the arbiter serving `socket_dir`.
pub fn events_at(socket_dir: &std::path::Path) -> Result<Vec<Event>> {
    let mut c: Connection<ControlRequest, ControlReply> =
        Connection::connect(&kiwi_config::control_socket(socket_dir))?;
    Ok(c.events(None, 0)?.0)
}

/// The status of the arbiter serving `socket_dir`; `None` when it does not answer.
pub fn status_at(socket_dir: &std::path::Path) -> Option<kiwi_protocol::StatusReport> {
    let mut c: Connection<ControlRequest, ControlReply> =
        Connection::connect(&kiwi_config::control_socket(socket_dir)).ok()?;
    match c.call(&ControlRequest::Status { gpu: None }).ok()? {
        ControlReply::Status(s) => Some(s),
        _ => None,
    }
}

/// Two apps of 70% of the GPU under Kiwi, taking turns, with `env`; the arbiter's log.
fn contend(b: &Build, job: Job, tq: f64, env: &[(&str, &str)]) -> Result<Vec<Event>> {
    let sim = Sim::populated("swap", GPU)?;
    let arb = ArbiterProc::start(tq, &[])?;
    let kids = vec![
        spawn_job_args(b, &sim, job, 1, Some(arb.socket_dir()), env, &[])?,
        spawn_job_args(b, &sim, job, 2, Some(arb.socket_dir()), env, &[])?,
    ];
    let (ok, why) = wait_all(kids, std::time::Instant::now() + job.limit())?;
    if !ok {
        bail!("a job failed: {why}");
    }
    arbiter_events(&arb)
}

pub fn swap(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    let sim = Sim::new("copy", GPU);
    // The baseline is measured before and after the swaps and pooled (equal bytes each
    // time: the harmonic mean of the rates), so it samples the machine over the same
    // stretch of time as the swaps do.
    let copy_bw = || two_numbers(&child(&["__copy-bandwidth", "268435456"], &b, &sim)?);
    let before = copy_bw()?;
    let create = create_rate(&b, &sim)?;
    // Between bursts the notebooks sit idle (sleep) rather than compute: the simulator's
    // copy engine is a CPU copy, and on a 2-core machine an application computing beside
    // it slows it down, which no DMA engine suffers; the figure is about the swap path.
    let job = Job {
        mem: job_mem(70),
        bursts: if quick { 3 } else { 6 },
        gpu_ms: 300,
        cpu_ms: 0,
        idle_ms: 300,
        kernel_us: 5000,
    };
    // Not pipelined: each swap has the link (and the host's memory bandwidth, which
    // the simulator's copies are bound by) to itself, so the figure is the swap
    // path's rate. A pipelined hand-off overlaps a swap-out with a swap-in, each then
    // slower, the whole faster: `handoff-swap` measures that.
    let events = contend(&b, job, 5.0, &[("KIWI_PIPELINED", "0")])?;
    let after = copy_bw()?;
    let pooled = |x: f64, y: f64| 2.0 / (1.0 / x + 1.0 / y);
    let (d2h, h2d) = (pooled(before.0, after.0), pooled(before.1, after.1));
    // A client's first swap-out also pins its host buffers (allocated once, then
    // reused): steady state is every swap-out after the first.
    let (mut ob, mut od, mut ib, mut id, mut sb, mut sd) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut fresh_n, mut fresh_d) = (0u64, 0u64);
    let mut seen = std::collections::HashSet::new();
    for e in &events {
        match e.kind {
            EventKind::SwapOut { bytes, duration_ns } => {
                ob += bytes;
                od += duration_ns;
                if !seen.insert(e.client) {
                    sb += bytes;
                    sd += duration_ns;
                }
            }
            // A swap-in that copied nothing backed memory that had no contents yet
            // (a notebook's allocations before its first grant): counted apart.
            EventKind::SwapIn {
                bytes: 0,
                duration_ns,
            } => {
                fresh_n += 1;
                fresh_d += duration_ns;
            }
            EventKind::SwapIn { bytes, duration_ns } => {
                ib += bytes;
                id += duration_ns;
            }
            _ => {}
        }
    }
    if od == 0 || id == 0 {
        bail!("no swaps happened");
    }
    let gbps = |b: u64, ns: u64| b as f64 / ns.max(1) as f64;
    let mut figs = vec![Figure::new("swap", "swap_out_all", gbps(ob, od), "GB/s")
        .against(d2h, "pinned device-to-host copy")
        .goal(">= 95% of the copy bandwidth")];
    if sd > 0 {
        figs.push(
            Figure::new("swap", "swap_out_steady", gbps(sb, sd), "GB/s")
                .against(d2h, "pinned device-to-host copy")
                .goal(">= 95% of the copy bandwidth"),
        );
    }
    figs.push(
        Figure::new("swap", "swap_in", gbps(ib, id), "GB/s")
            .against(h2d, "pinned host-to-device copy")
            .goal(">= 95% of the copy bandwidth"),
    );
    // A swap-in makes the memory it copies into (the previous holder's until it
    // left), each segment's while the one before is copied: at best the slower of
    // the two rates.
    figs.push(
        Figure::new("swap", "swap_in_vs_creation", gbps(ib, id), "GB/s").against(
            h2d.min(create),
            &format!(
                "the slower of the pinned host-to-device copy and cuMemCreate in {} MiB handles ({create:.1} GB/s), same run",
                SEGMENT_BYTES >> 20
            ),
        ),
    );
    if fresh_n > 0 {
        // Backing a notebook's memory the first time costs this host its page
        // tables (4 KiB entries of the GPU's memory file, mapped first in this
        // process); the H100 creates such memory at about 15 µs a 64 MiB handle.
        figs.push(
            Figure::new(
                "swap",
                "first_backing",
                fresh_d as f64 / fresh_n as f64 / 1e6,
                "ms",
            )
            .against(
                job.mem as f64 / (h2d * 1e6),
                &format!(
                    "a pinned host-to-device copy of the notebook's {} MiB; {fresh_n} swap-ins that copied nothing",
                    job.mem >> 20
                ),
            ),
        );
    }
    figs.push(Figure::new(
        "swap",
        "bytes_swapped_out",
        ob as f64 / (1u64 << 20) as f64,
        "MiB",
    ));
    Ok(figs)
}

pub fn drop_latency(quick: bool) -> Result<Vec<Figure>> {
    let b = Build::find()?;
    // Always wanting the GPU, bursts of 10,000 kernels of 20 µs: every hand-off is
    // a drop at TQ with a deep queue to drain. The TQ is above a swap (with real
    // hardware's costs, hundreds of ms): it counts from the grant, swap-in
    // included, and a holder dropped before its swap-in is done runs no work.
    let job = Job {
        mem: job_mem(70),
        bursts: if quick { 3 } else { 6 },
        gpu_ms: 200,
        cpu_ms: 0,
        idle_ms: 0,
        kernel_us: 20,
    };
    let events = contend(&b, job, 1.0, &[])?;
    // Drop → the same client's release, less the swap-out it reported in between.
    let mut lat = Vec::new();
    let mut swaps = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if !matches!(e.kind, EventKind::Drop { .. }) {
            continue;
        }
        let mut swap = 0;
        for f in &events[i + 1..] {
            if f.client != e.client {
                continue;
            }
            match f.kind {
                EventKind::SwapOut { duration_ns, .. } => swap += duration_ns,
                EventKind::Release { .. } => {
                    let total = f.t_ns - e.t_ns;
                    lat.push(total.saturating_sub(swap) as f64 / 1e6);
                    swaps.push(swap as f64 / 1e6);
                    break;
                }
                EventKind::Exit | EventKind::Revoke => break,
                _ => {}
            }
        }
    }
    if lat.is_empty() {
        bail!("no drop was answered by a release");
    }
    let n = lat.len();
    Ok(vec![
        Figure::new(
            "drop-latency",
            "drop_to_release_minus_swap_p50",
            percentile(&mut lat, 50.0),
            "ms",
        )
        .against(
            percentile(&mut swaps, 50.0),
            "the swap-out in the same hand-off",
        )
        .goal("< 250 ms plus swap time"),
        Figure::new(
            "drop-latency",
            "drop_to_release_minus_swap_max",
            percentile(&mut lat, 100.0),
            "ms",
        ),
        Figure::new("drop-latency", "drops_measured", n as f64, "n"),
    ])
}
