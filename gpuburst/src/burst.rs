//! gpuburst's program: allocate and fill memory, alternate CPU phases with GPU
//! bursts of real kernels, and verify every byte with `kiwi_checksum` against a
//! host-side model.
//!
//! Memory is `--mem` bytes in allocations of at most 256 MiB plus three small ones
//! (so allocators with size classes are exercised). Each allocation holds one u32
//! value in every word: `kiwi_fill` sets it from the seed, each burst's `kiwi_add`
//! adds a per-(burst, allocation) delta, and the host model tracks the value, so
//! the expected checksum of an allocation is `words × value`.
//!
//! The wait before a burst: the burst starts with a 1 ms `kiwi_spin` that the
//! program waits for; wait = (time from submitting it to its completion) − 1 ms.
//! Under Kiwi this is the time spent waiting for the GPU.
//!
//! `--device 1,0` uses several GPUs: `--mem` is allocated on each, and every burst
//! does its part on each device in the listed order (its context made current),
//! then synchronizes them all; verification covers every device.
//!
//! `--exchange FILE:RANK` ([`crate::exchange`]) ends every burst (a step) on each
//! device with a write of the step into its rank's slot and a wait for the peer's,
//! enqueued on the legacy stream after the step's work; the step's synchronization
//! then polls `cuStreamQuery` so that a peer that never comes fails the program
//! after `--exchange-timeout-ms` instead of hanging it.
//!
//! `--alloc device|vmm|managed` ([`crate::memory`]) says how the memory is
//! allocated: `cuMemAlloc`, the application's own virtual memory as PyTorch's
//! `expandable_segments` manages it, or managed memory (also read back on the host
//! at every verification). `--ipc export:FILE` / `--ipc import:FILE`
//! ([`crate::ipc`]) make two programs a CUDA IPC pair: the exporter shares one more
//! allocation, the importer opens it, and both verify it, read only. A verification
//! that fails names the device, the allocation and the first wrong word.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use crate::cu;
use crate::driver::IpcMemHandle;
use crate::driver::{CUdevice, CUdeviceptr, Cuda, CudaError, Handle};
use crate::driver::{CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS};
use crate::exchange::{self, Exchange, ExchangeSpec};
use crate::ipc::{self, IpcSpec, Role};
use crate::kernels::{BLOCK, GRID, PTX};
use crate::memory::{self, AllocMode, Expandable, Source};

/// Command-line options.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub mem: u64,
    pub bursts: u32,
    pub gpu_ms: u64,
    pub cpu_ms: u64,
    pub idle_ms: u64,
    pub verify: bool,
    pub json: bool,
    /// `--device 0` or `--device 1,0`: the GPUs to use, in order (distinct
    /// ordinals). `--mem` is allocated on each; every burst runs on each in turn.
    pub devices: Vec<i32>,
    pub name: String,
    pub seed: u64,
    /// Test aid: after the first burst, add to one allocation behind the host
    /// model's back, so verification must fail (exit 3).
    pub inject_fault: bool,
    /// `--script cpu:1500,gpu:6000,idle:500,grow:1536`: the phases to run instead
    /// of `--bursts` × (GPU burst, CPU, idle). Used to replay a notebook's day;
    /// `grow:MIB` allocates and fills MIB more on the first device (a notebook whose
    /// working set grew), verified with the rest.
    pub script: Option<Vec<Phase>>,
    /// `--start-at-ns N`: once ready, wait until CLOCK_MONOTONIC reaches N, so
    /// several programs can start their phases together.
    pub start_at_ns: Option<u64>,
    /// `--start-on-stdin`: once ready, read one line from standard input holding the
    /// CLOCK_MONOTONIC nanosecond to start at (as `--start-at-ns`), so a driver can
    /// pick the start once every program is ready.
    pub start_on_stdin: bool,
    /// `--kernel-us N`: length of the spin kernels a burst is made of (default 5000):
    /// short ones make an app that queues thousands of kernels.
    pub kernel_us: u64,
    /// `--queue-ms N`: at most this much GPU work queued ahead before waiting for it,
    /// as a training loop that reads its loss every step (default 100; 0: queue the
    /// whole burst).
    pub queue_ms: u64,
    /// `--prealloc 0.75`: allocate, as JAX does, one buffer of this fraction of the
    /// free memory `cuMemGetInfo` reports (at least `--mem`) and keep the `--mem`
    /// bytes at its start; the rest is never touched.
    pub prealloc: Option<f64>,
    /// `--discard`: answer Kiwi's questions (`kiwi_hint_wait`) with `kiwiMemDiscard`
    /// of the untouched part of the preallocation: a swap-out then leaves it behind.
    pub discard: bool,
    /// `--library`: load the kernels as a library (`cuLibraryLoadData`, CUDA 12's
    /// context-independent loading, as the runtime does) and launch them by their
    /// `CUkernel` handles: with lazy loading their code is loaded at the first launch.
    pub library: bool,
    /// `--exchange FILE:RANK` (RANK 0, 1 or `both` with two devices): every burst
    /// is a step that ends only once the peer rank has reached it too.
    pub exchange: Option<ExchangeSpec>,
    /// `--exchange-timeout-ms N` (default 60000): a step whose synchronization
    /// takes longer fails the program (exit code 4).
    pub exchange_timeout_ms: u64,
    /// `--alloc device|vmm|managed`: how `--mem` (and `grow:`) is allocated.
    pub alloc: AllocMode,
    /// `--ipc export:FILE | import:FILE`: one side of a CUDA IPC pair (one device).
    pub ipc: Option<IpcSpec>,
    /// `--ipc-mem SIZE` (exporter; default 32MiB): the bytes it shares.
    pub ipc_mem: u64,
    /// `--ipc-timeout-ms N` (default 60000): how long the importer waits for FILE
    /// and the exporter for the importer's close (exit code 4 past it).
    pub ipc_timeout_ms: u64,
}

/// One step of a `--script`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Cpu(u64),
    Gpu(u64),
    Idle(u64),
    /// MiB allocated and filled on the first device.
    Grow(u64),
}

impl Phase {
    fn kind(self) -> &'static str {
        match self {
            Phase::Cpu(_) => "cpu",
            Phase::Gpu(_) => "gpu",
            Phase::Idle(_) => "idle",
            Phase::Grow(_) => "grow",
        }
    }
}

/// Parses `cpu:1500,gpu:6000,idle:500,grow:1536` (milliseconds; MiB for `grow`).
pub fn parse_script(s: &str) -> Result<Vec<Phase>, String> {
    let mut out = Vec::new();
    for step in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (kind, ms) = step
            .split_once(':')
            .ok_or_else(|| format!("--script: {step:?} is not kind:ms"))?;
        let ms: u64 = ms
            .parse()
            .map_err(|_| format!("--script: {ms:?} is not a whole number of ms"))?;
        out.push(match kind {
            "cpu" => Phase::Cpu(ms),
            "gpu" if ms >= 1 => Phase::Gpu(ms),
            "gpu" => return Err("--script: a gpu phase needs at least 1 ms".into()),
            "idle" => Phase::Idle(ms),
            "grow" if ms >= 1 => Phase::Grow(ms),
            "grow" => return Err("--script: a grow phase needs at least 1 MiB".into()),
            other => {
                return Err(format!(
                    "--script: unknown phase {other:?} (cpu, gpu, idle, grow)"
                ))
            }
        });
    }
    if out.is_empty() {
        return Err("--script: no phases".into());
    }
    Ok(out)
}

/// Parses `--device`: one ordinal or a comma-separated list of distinct ordinals
/// (`0`, `1,0`). Empty items, non-numbers and duplicates are refused.
pub fn parse_devices(s: &str) -> Result<Vec<i32>, String> {
    let mut out: Vec<i32> = Vec::new();
    for item in s.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!(
                "--device: empty item in {s:?} (a device ordinal or a list like 0,1)"
            ));
        }
        let d = item
            .parse::<u32>()
            .ok()
            .and_then(|d| i32::try_from(d).ok())
            .ok_or_else(|| format!("--device: not a device ordinal: {item:?}"))?;
        if out.contains(&d) {
            return Err(format!("--device: device {d} is listed twice in {s:?}"));
        }
        out.push(d);
    }
    Ok(out)
}

/// CLOCK_MONOTONIC in ns (the arbiter's and the simulator's clock).
pub use kiwi_protocol::monotonic_ns;

pub const USAGE: &str = "usage: gpuburst [--mem 700MiB] [--bursts 5] [--gpu-ms 400] [--cpu-ms 300] [--idle-ms 0] [--script cpu:MS,gpu:MS,idle:MS,...] [--start-at-ns N | --start-on-stdin] [--kernel-us 5000] [--queue-ms 100] [--prealloc 0.75 [--discard]] [--library] [--verify] [--json] [--device 0[,1,...]] [--exchange FILE:0|1|both [--exchange-timeout-ms 60000]] [--alloc device|vmm|managed] [--ipc export:FILE [--ipc-mem 32MiB] | --ipc import:FILE] [--ipc-timeout-ms 60000] [--name LABEL] [--seed 1]";

impl Options {
    /// Parses arguments (without the program name).
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            mem: 256 << 20,
            bursts: 5,
            gpu_ms: 400,
            cpu_ms: 300,
            idle_ms: 0,
            verify: false,
            json: false,
            devices: vec![0],
            name: format!("gpuburst-{}", std::process::id()),
            seed: 1,
            inject_fault: false,
            script: None,
            start_at_ns: None,
            start_on_stdin: false,
            kernel_us: 5000,
            queue_ms: 100,
            prealloc: None,
            discard: false,
            library: false,
            exchange: None,
            exchange_timeout_ms: exchange::DEFAULT_TIMEOUT_MS,
            alloc: AllocMode::Device,
            ipc: None,
            ipc_mem: ipc::DEFAULT_IPC_MEM,
            ipc_timeout_ms: ipc::DEFAULT_TIMEOUT_MS,
        };
        let mut exchange_timeout_given = false;
        let (mut ipc_mem_given, mut ipc_timeout_given) = (false, false);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let (flag, inline) = match a.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (a.as_str(), None),
            };
            let mut value = || -> Result<String, String> {
                inline
                    .clone()
                    .or_else(|| it.next().cloned())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            let num = |v: String| -> Result<u64, String> {
                v.parse::<u64>()
                    .map_err(|_| format!("{flag}: not a whole number: {v:?}"))
            };
            match flag {
                "--mem" => {
                    let v = value()?;
                    o.mem = kiwi_config::parse_size(&v).map_err(|e| format!("--mem: {e}"))?;
                    if o.mem < 4096 {
                        return Err("--mem must be at least 4KiB".into());
                    }
                }
                "--bursts" => o.bursts = num(value()?)? as u32,
                "--gpu-ms" => o.gpu_ms = num(value()?)?,
                "--cpu-ms" => o.cpu_ms = num(value()?)?,
                "--idle-ms" => o.idle_ms = num(value()?)?,
                "--device" => o.devices = parse_devices(&value()?)?,
                "--seed" => o.seed = num(value()?)?,
                "--name" => o.name = value()?,
                "--verify" => o.verify = true,
                "--json" => o.json = true,
                "--inject-fault" => o.inject_fault = true,
                "--script" => o.script = Some(parse_script(&value()?)?),
                "--start-at-ns" => o.start_at_ns = Some(num(value()?)?),
                "--start-on-stdin" => o.start_on_stdin = true,
                "--queue-ms" => o.queue_ms = num(value()?)?,
                "--prealloc" => {
                    let v = value()?;
                    let f = v
                        .parse::<f64>()
                        .ok()
                        .filter(|f| *f > 0.0 && *f <= 1.0)
                        .ok_or_else(|| format!("--prealloc: a fraction in (0, 1], not {v:?}"))?;
                    o.prealloc = Some(f);
                }
                "--discard" => o.discard = true,
                "--library" => o.library = true,
                "--exchange" => o.exchange = Some(exchange::parse_exchange(&value()?)?),
                "--exchange-timeout-ms" => {
                    o.exchange_timeout_ms = num(value()?)?;
                    exchange_timeout_given = true;
                    if o.exchange_timeout_ms == 0 {
                        return Err("--exchange-timeout-ms must be at least 1".into());
                    }
                }
                "--alloc" => o.alloc = AllocMode::parse(&value()?)?,
                "--ipc" => o.ipc = Some(ipc::parse_ipc(&value()?)?),
                "--ipc-mem" => {
                    let v = value()?;
                    o.ipc_mem =
                        kiwi_config::parse_size(&v).map_err(|e| format!("--ipc-mem: {e}"))?;
                    if o.ipc_mem < 4096 {
                        return Err("--ipc-mem must be at least 4KiB".into());
                    }
                    o.ipc_mem = o.ipc_mem / 4 * 4;
                    ipc_mem_given = true;
                }
                "--ipc-timeout-ms" => {
                    o.ipc_timeout_ms = num(value()?)?;
                    ipc_timeout_given = true;
                    if o.ipc_timeout_ms == 0 {
                        return Err("--ipc-timeout-ms must be at least 1".into());
                    }
                }
                "--kernel-us" => {
                    o.kernel_us = num(value()?)?;
                    if o.kernel_us == 0 {
                        return Err("--kernel-us must be at least 1".into());
                    }
                }
                "-h" | "--help" => return Err(USAGE.into()),
                _ => return Err(format!("unknown argument {a:?}; {USAGE}")),
            }
        }
        if o.gpu_ms < 1 {
            return Err("--gpu-ms must be at least 1".into());
        }
        if o.discard && o.prealloc.is_none() {
            return Err(
                "--discard needs --prealloc (it discards the preallocation's untouched part)"
                    .into(),
            );
        }
        if o.prealloc.is_some() && o.alloc != AllocMode::Device {
            return Err(format!(
                "--prealloc allocates with cuMemAlloc: not with --alloc {}",
                o.alloc.name()
            ));
        }
        match &o.ipc {
            Some(_) if o.devices.len() != 1 => {
                return Err(format!(
                    "--ipc: a pair shares memory on one device, not {}",
                    o.devices.len()
                ))
            }
            Some(x) if ipc_mem_given && x.role != Role::Export => {
                return Err("--ipc-mem is the exporter's (--ipc export:FILE)".into())
            }
            None if ipc_mem_given || ipc_timeout_given => {
                return Err("--ipc-mem and --ipc-timeout-ms need --ipc".into())
            }
            _ => {}
        }
        match &o.exchange {
            Some(x) => x.check_devices(&o.devices)?,
            None if exchange_timeout_given => {
                return Err("--exchange-timeout-ms needs --exchange".into())
            }
            None => {}
        }
        Ok(o)
    }
}

/// How gpuburst ended badly.
#[derive(Debug)]
pub enum Failure {
    /// A driver call failed (exit code 2).
    Cuda(CudaError),
    /// Device memory did not hold what the program wrote (exit code 3).
    Mismatch(String),
    /// Bad input at run time (`--start-on-stdin` got no start time, an unusable
    /// `--exchange` file or a driver without its entry points; exit code 1).
    Input(String),
    /// An `--exchange` step did not finish within `--exchange-timeout-ms` (exit
    /// code 4).
    Timeout(String),
}

impl From<CudaError> for Failure {
    fn from(e: CudaError) -> Self {
        Failure::Cuda(e)
    }
}

/// splitmix64: the per-(burst, allocation) values derived from the seed.
pub fn mix(seed: u64, a: u64, b: u64) -> u32 {
    let mut z = seed
        .wrapping_add(a.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(b.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// Allocation sizes for `mem` bytes: three small ones, the rest in ≤ 256 MiB chunks
/// (all multiples of 4).
pub fn plan_allocations(mem: u64) -> Vec<u64> {
    const CHUNK: u64 = 256 << 20;
    const SMALL: u64 = 64 << 10;
    let mem = mem / 4 * 4;
    let mut out = Vec::new();
    let mut left = mem;
    if mem >= 4 * SMALL {
        out.extend(std::iter::repeat_n(SMALL, 3));
        left -= 3 * SMALL;
    }
    while left > 0 {
        let n = left.min(CHUNK);
        out.push(n);
        left -= n;
    }
    out
}

struct Kernels {
    fill: Handle,
    add: Handle,
    checksum: Handle,
    spin: Handle,
}

struct Allocation {
    ptr: CUdeviceptr,
    words: u64,
    value: u32,
    source: Source,
}

/// Output sink: human lines or JSON lines.
struct Report {
    json: bool,
    name: String,
    t0: Instant,
}

impl Report {
    fn ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e3
    }

    fn line(&self, human: String, json: String) {
        if self.json {
            println!("{json}");
        } else {
            println!("[{}] {human}", self.name);
        }
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
}

fn launch(
    cuda: &Cuda,
    f: Handle,
    grid: u32,
    block: u32,
    args: &mut [*mut c_void],
) -> Result<(), CudaError> {
    cu!(
        cuda,
        launch_kernel,
        "cuLaunchKernel",
        f,
        grid,
        1,
        1,
        block,
        1,
        1,
        0,
        std::ptr::null_mut(),
        args.as_mut_ptr(),
        std::ptr::null_mut()
    )
}

fn spin(cuda: &Cuda, k: &Kernels, ns: u64) -> Result<(), CudaError> {
    let mut ns = ns;
    launch(cuda, k.spin, 1, 1, &mut [(&mut ns as *mut u64).cast()])
}

fn mem_kernel(cuda: &Cuda, f: Handle, a: &Allocation, value: u32) -> Result<(), CudaError> {
    let mut ptr = a.ptr;
    let mut v = value;
    let mut words = a.words;
    launch(
        cuda,
        f,
        GRID,
        BLOCK,
        &mut [
            (&mut ptr as *mut u64).cast(),
            (&mut v as *mut u32).cast(),
            (&mut words as *mut u64).cast(),
        ],
    )
}

/// Checksums every allocation of one device on the GPU and compares with the host
/// model. The device's context must be current.
fn verify(cuda: &Cuda, d: &Device) -> Result<(), Failure> {
    for (i, a) in d.allocs.iter().enumerate() {
        let out = d.sums + 8 * i as u64;
        // kiwi_checksum adds into *out: start from zero.
        cu!(
            cuda,
            memset_d32_async,
            "cuMemsetD32Async",
            out,
            0,
            2,
            std::ptr::null_mut()
        )?;
        let (mut ptr, mut words, mut o) = (a.ptr, a.words, out);
        launch(
            cuda,
            d.k.checksum,
            GRID,
            BLOCK,
            &mut [
                (&mut ptr as *mut u64).cast(),
                (&mut words as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
            ],
        )?;
    }
    let mut got = vec![0u64; d.allocs.len()];
    cu!(
        cuda,
        memcpy_dtoh,
        "cuMemcpyDtoH",
        got.as_mut_ptr().cast(),
        d.sums,
        8 * d.allocs.len()
    )?;
    for (i, (a, g)) in d.allocs.iter().zip(&got).enumerate() {
        let want = a.words * u64::from(a.value);
        let what = || {
            format!(
                "device {}, allocation {i} ({} bytes at {:#x}, {})",
                d.ordinal,
                a.words * 4,
                a.ptr,
                a.source.name()
            )
        };
        if *g != want {
            // Where: the first wrong word, read back.
            let at = match memory::locate(cuda, a.ptr, a.words, a.value)? {
                Some((w, got)) => format!(
                    "first wrong word {w} (byte offset {:#x}) holds {got:#x}, expected {:#x}",
                    4 * w,
                    a.value
                ),
                None => "every word reads back as expected (a checksum kernel's fault?)".into(),
            };
            return Err(Failure::Mismatch(format!(
                "{}: checksum {g}, expected {want}; {at}",
                what()
            )));
        }
        if a.source == Source::Managed {
            // SAFETY: a live managed allocation of this process; the synchronous
            // cuMemcpyDtoH above ran after every kernel of the (only, legacy) stream,
            // so nothing writes it now.
            if let Some((w, got)) = unsafe { memory::host_mismatch(a.ptr, a.words, a.value) } {
                return Err(Failure::Mismatch(format!(
                    "{}, read on the host: word {w} (byte offset {:#x}) holds {got:#x}, expected {:#x}",
                    what(),
                    4 * w,
                    a.value
                )));
            }
        }
    }
    Ok(())
}

/// Verifies every device, in the listed order (the first mismatch is the error).
fn verify_all(cuda: &Cuda, devs: &[Device]) -> Result<(), Failure> {
    for d in devs {
        make_current(cuda, devs, d)?;
        verify(cuda, d)?;
    }
    Ok(())
}

/// Busy host work for `d` (a CPU phase that really uses the CPU).
fn host_work(d: Duration) {
    let end = Instant::now() + d;
    let mut x = 0x1234_5678u64;
    while Instant::now() < end {
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
        }
        std::hint::black_box(x);
    }
}

/// One GPU in use: its primary context, its copy of the module, its memory and
/// the host model of that memory.
struct Device {
    ordinal: i32,
    dev: CUdevice,
    ctx: Handle,
    k: Kernels,
    allocs: Vec<Allocation>,
    sums: CUdeviceptr,
    /// `--prealloc`: the part of the preallocation past `--mem` (never touched).
    tail: Option<(CUdeviceptr, u64)>,
    /// `--alloc vmm`: the device's application-managed address range.
    space: Option<Expandable>,
}

/// Makes `d`'s context current. With one device it is current from the start
/// and stays so: no call is made (the single-device program is unchanged).
fn make_current(cuda: &Cuda, devs: &[Device], d: &Device) -> Result<(), CudaError> {
    if devs.len() > 1 {
        cu!(cuda, ctx_set_current, "cuCtxSetCurrent", d.ctx)?;
    }
    Ok(())
}

/// `ordinal`'s device and a reference on its primary context.
fn retain_primary(cuda: &Cuda, ordinal: i32) -> Result<(CUdevice, Handle), CudaError> {
    let mut dev = 0;
    cu!(cuda, device_get, "cuDeviceGet", &mut dev, ordinal)?;
    let mut ctx: Handle = std::ptr::null_mut();
    cu!(
        cuda,
        primary_ctx_retain,
        "cuDevicePrimaryCtxRetain",
        &mut ctx,
        dev
    )?;
    Ok((dev, ctx))
}

/// Retains `ordinal`'s primary context, makes it current, loads the module and
/// allocates and fills `--mem` bytes there. The allocations' values are numbered
/// from `first_index` (the allocations of earlier devices), so no two allocations
/// of the program hold the same value sequence.
fn open_device(
    cuda: &Cuda,
    o: &Options,
    ordinal: i32,
    first_index: usize,
) -> Result<Device, CudaError> {
    let (dev, ctx) = retain_primary(cuda, ordinal)?;
    cu!(cuda, ctx_set_current, "cuCtxSetCurrent", ctx)?;
    let mut module: Handle = std::ptr::null_mut();
    if o.library {
        cu!(
            cuda,
            library_load_data,
            "cuLibraryLoadData",
            &mut module,
            PTX.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0
        )?;
    } else {
        cu!(
            cuda,
            module_load_data,
            "cuModuleLoadData",
            &mut module,
            PTX.as_ptr().cast()
        )?;
    }
    // A kernel handle (`--library`) is launched as a function: the driver takes it.
    let get = |name: &std::ffi::CStr| -> Result<Handle, CudaError> {
        let mut f: Handle = std::ptr::null_mut();
        if o.library {
            cu!(
                cuda,
                library_get_kernel,
                "cuLibraryGetKernel",
                &mut f,
                module,
                name.as_ptr()
            )?;
        } else {
            cu!(
                cuda,
                module_get_function,
                "cuModuleGetFunction",
                &mut f,
                module,
                name.as_ptr()
            )?;
        }
        Ok(f)
    };
    let k = Kernels {
        fill: get(c"kiwi_fill")?,
        add: get(c"kiwi_add")?,
        checksum: get(c"kiwi_checksum")?,
        spin: get(c"kiwi_spin")?,
    };
    let mut tail = None;
    let pre = match o.prealloc {
        Some(f) => {
            let (mut free, mut total) = (0usize, 0usize);
            cu!(cuda, mem_get_info, "cuMemGetInfo_v2", &mut free, &mut total)?;
            let size = ((free as f64 * f) as u64 / 256 * 256).max(o.mem);
            let mut ptr = 0;
            cu!(cuda, mem_alloc, "cuMemAlloc_v2", &mut ptr, size as usize)?;
            tail = (size > o.mem).then(|| (ptr + o.mem, size - o.mem));
            vec![(ptr, o.mem)]
        }
        None => Vec::new(),
    };
    let planned = if pre.is_empty() {
        plan_allocations(o.mem)
    } else {
        Vec::new()
    };
    let mut space = match o.alloc {
        AllocMode::Vmm => Some(Expandable::new(cuda, ordinal, dev)?),
        _ => None,
    };
    let mut allocs = Vec::with_capacity(pre.len() + planned.len());
    for (i, &(ptr, bytes)) in pre.iter().enumerate() {
        allocs.push(Allocation {
            ptr,
            words: bytes / 4,
            value: mix(o.seed, 0, (first_index + i) as u64),
            source: Source::Device,
        });
    }
    for (i, &bytes) in planned.iter().enumerate() {
        let (ptr, source) = memory::allocate(cuda, o.alloc, space.as_mut(), bytes)?;
        allocs.push(Allocation {
            ptr,
            words: bytes / 4,
            value: mix(o.seed, 0, (first_index + i) as u64),
            source,
        });
    }
    let mut sums = 0;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut sums,
        8 * allocs.len()
    )?;
    for a in &allocs {
        mem_kernel(cuda, k.fill, a, a.value)?;
    }
    Ok(Device {
        ordinal,
        dev,
        ctx,
        k,
        allocs,
        sums,
        tail,
        space,
    })
}

/// `--script grow:MIB`: `bytes` more on the first device, allocated in the chunks
/// of `--mem` and filled (each with its own value, checked by every verification);
/// the checksums' buffer grows with them.
fn grow(cuda: &Cuda, o: &Options, devs: &mut [Device], bytes: u64) -> Result<(), CudaError> {
    let Some(first) = devs.first() else {
        return Ok(());
    };
    make_current(cuda, devs, first)?;
    let first_index: usize = devs.iter().map(|d| d.allocs.len()).sum();
    let d = &mut devs[0];
    for (index, chunk) in (first_index..).zip(plan_allocations(bytes)) {
        let (ptr, source) = memory::allocate(cuda, o.alloc, d.space.as_mut(), chunk)?;
        let a = Allocation {
            ptr,
            words: chunk / 4,
            value: mix(o.seed, 0, index as u64),
            source,
        };
        mem_kernel(cuda, d.k.fill, &a, a.value)?;
        d.allocs.push(a);
    }
    resize_sums(cuda, d)?;
    cu!(cuda, ctx_synchronize, "cuCtxSynchronize")
}

/// A new checksums' buffer for `d`'s allocations, which grew. Its context is current.
fn resize_sums(cuda: &Cuda, d: &mut Device) -> Result<(), CudaError> {
    cu!(cuda, mem_free, "cuMemFree_v2", d.sums)?;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut d.sums,
        8 * d.allocs.len()
    )
}

/// The value index of an exporter's shared allocation: past any of its own.
const SHARED_INDEX: u64 = 1 << 32;

/// `--ipc export:`: one more `cuMemAlloc` of `--ipc-mem` on `d` (its context
/// current), filled with its value and synchronized, its handle published in FILE.
fn export_shared(
    cuda: &Cuda,
    o: &Options,
    d: &mut Device,
    spec: &IpcSpec,
) -> Result<ipc::Published, Failure> {
    let mut ptr = 0;
    cu!(
        cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut ptr,
        o.ipc_mem as usize
    )?;
    let a = Allocation {
        ptr,
        words: o.ipc_mem / 4,
        value: mix(o.seed, 0, SHARED_INDEX),
        source: Source::Exported,
    };
    mem_kernel(cuda, d.k.fill, &a, a.value)?;
    cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
    let mut handle = IpcMemHandle { reserved: [0; 64] };
    cu!(
        cuda,
        ipc_get_mem_handle,
        "cuIpcGetMemHandle",
        &mut handle,
        ptr
    )?;
    let p = ipc::Published {
        pid: std::process::id(),
        bytes: a.words * 4,
        value: a.value,
        handle,
    };
    d.allocs.push(a);
    resize_sums(cuda, d)?;
    ipc::publish(&spec.path, &p).map_err(Failure::Input)?;
    Ok(p)
}

/// `--ipc import:`: waits for the exporter's FILE, opens its memory on `d` (its
/// context current) as an allocation of `d` that keeps the exporter's value, and
/// verifies `d` at once.
fn import_shared(
    cuda: &Cuda,
    o: &Options,
    d: &mut Device,
    spec: &IpcSpec,
) -> Result<ipc::Published, Failure> {
    let timeout = Duration::from_millis(o.ipc_timeout_ms);
    let p = ipc::wait_published(&spec.path, timeout).map_err(|e| match e {
        ipc::WaitError::Timeout(m) => Failure::Timeout(m),
        ipc::WaitError::Bad(m) => Failure::Input(m),
    })?;
    let mut ptr = 0;
    cu!(
        cuda,
        ipc_open_mem_handle,
        "cuIpcOpenMemHandle",
        &mut ptr,
        p.handle,
        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    )?;
    d.allocs.push(Allocation {
        ptr,
        words: p.bytes / 4,
        value: p.value,
        source: Source::Imported,
    });
    resize_sums(cuda, d)?;
    verify(cuda, d)?;
    Ok(p)
}

/// One GPU burst of `gpu_ms` per device. On each device in turn (its context made
/// current): a 1 ms probe kernel (its wait is the time the GPU kept us waiting),
/// `kiwi_add` over every allocation, then short spin kernels queued asynchronously
/// until the burst's GPU time on that device is made up (with `--exchange`, then
/// the step's write and wait on the peer). Then every device's context is
/// synchronized (and verified with `--verify`). Returns the step's time in ms:
/// from the first submission to the end of the synchronization.
fn burst(
    cuda: &Cuda,
    o: &Options,
    rep: &Report,
    devs: &mut [Device],
    ex: Option<&Exchange>,
    b: u32,
    gpu_ms: u64,
) -> Result<f64, Failure> {
    const FIRST_NS: u64 = 1_000_000;
    let start_ms = rep.ms();
    let submit = Instant::now();
    let mut waits = Vec::with_capacity(devs.len());
    // Allocation indices run on across devices (the values' numbering).
    let mut index = 0usize;
    for di in 0..devs.len() {
        make_current(cuda, devs, &devs[di])?;
        let d = &mut devs[di];
        let probe = Instant::now();
        spin(cuda, &d.k, FIRST_NS)?;
        cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
        let first = probe.elapsed();
        waits.push((first.as_secs_f64() * 1e3 - FIRST_NS as f64 / 1e6).max(0.0));
        // Shared memory (`--ipc`) keeps its value: the importer only reads it.
        for a in d.allocs.iter_mut().filter(|a| !a.source.fixed()) {
            let delta = mix(o.seed, u64::from(b) + 1, index as u64) | 1;
            mem_kernel(cuda, d.k.add, a, delta)?;
            a.value = a.value.wrapping_add(delta);
            index += 1;
        }
        let mut left_ns = (gpu_ms * 1_000_000).saturating_sub(FIRST_NS);
        let mut queued_ns = 0;
        while left_ns > 0 {
            let ns = left_ns.min(o.kernel_us * 1000);
            spin(cuda, &d.k, ns)?;
            left_ns -= ns;
            queued_ns += ns;
            if o.queue_ms > 0 && queued_ns >= o.queue_ms * 1_000_000 {
                cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
                queued_ns = 0;
            }
        }
        // --inject-fault: on the first device only.
        if o.inject_fault && b == 0 && di == 0 {
            if let Some(a) = d.allocs.iter().rev().find(|a| !a.source.fixed()) {
                mem_kernel(cuda, d.k.add, a, 1)?;
            }
        }
        if let Some(x) = ex {
            x.enqueue_step(cuda, di, b + 1)?;
        }
    }
    if let Some(x) = ex {
        let timeout = Duration::from_millis(o.exchange_timeout_ms);
        if !sync_within(cuda, devs, timeout)? {
            return Err(Failure::Timeout(
                x.timeout_message(b + 1, o.exchange_timeout_ms),
            ));
        }
    }
    for d in devs.iter() {
        make_current(cuda, devs, d)?;
        cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
    }
    let step_ms = submit.elapsed().as_secs_f64() * 1e3;
    if o.verify {
        verify_all(cuda, devs)?;
    }
    let wait_ms: f64 = waits.iter().sum();
    let dur_ms = submit.elapsed().as_secs_f64() * 1e3;
    let per_device = devs
        .iter()
        .zip(&waits)
        .map(|(d, w)| format!("device {}: {w:.1} ms", d.ordinal))
        .collect::<Vec<_>>()
        .join(", ");
    let human_waits = if devs.len() > 1 {
        format!(" ({per_device})")
    } else {
        String::new()
    };
    let json_waits = waits
        .iter()
        .map(|w| format!("{w:.3}"))
        .collect::<Vec<_>>()
        .join(",");
    let human_step = if ex.is_some() {
        format!(", step {step_ms:.1} ms")
    } else {
        String::new()
    };
    rep.line(
        format!("burst {b}: start {start_ms:.1} ms, duration {dur_ms:.1} ms, wait {wait_ms:.1} ms{human_waits}{human_step}"),
        format!(
            "{{\"event\":\"burst\",\"name\":\"{}\",\"index\":{b},\"start_ms\":{start_ms:.3},\"duration_ms\":{dur_ms:.3},\"step_ms\":{step_ms:.3},\"wait_ms\":{wait_ms:.3},\"device_wait_ms\":[{json_waits}]}}",
            o.name
        ),
    );
    Ok(step_ms)
}

/// Waits until every device's legacy stream is idle, polling `cuStreamQuery` (with a
/// short sleep) so the wait can end: `false` when `timeout` passed first.
fn sync_within(cuda: &Cuda, devs: &[Device], timeout: Duration) -> Result<bool, CudaError> {
    let deadline = Instant::now() + timeout;
    let mut pending: Vec<usize> = (0..devs.len()).collect();
    loop {
        let mut still = Vec::with_capacity(pending.len());
        for &i in &pending {
            make_current(cuda, devs, &devs[i])?;
            // SAFETY: cuStreamQuery takes a stream handle; NULL is the legacy stream
            // of the current context.
            let r = unsafe { (cuda.stream_query)(std::ptr::null_mut()) };
            match r {
                CUDA_SUCCESS => {}
                CUDA_ERROR_NOT_READY => still.push(i),
                e => cuda.check("cuStreamQuery", e)?,
            }
        }
        if still.is_empty() {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        pending = still;
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs the whole program; prints as it goes.
/// `--discard`: a thread that answers Kiwi's questions about dead memory (found with
/// `dlsym`, as any application would: without Kiwi there is nothing to answer) by
/// discarding `tails`, the preallocations' untouched parts.
fn start_discarding(name: &str, tails: Vec<(CUdeviceptr, u64)>) {
    type Discard = unsafe extern "C" fn(CUdeviceptr, usize) -> i32;
    type Wait = unsafe extern "C" fn(i32) -> i64;
    type Done = unsafe extern "C" fn(i64);
    let sym = |n: &std::ffi::CStr| {
        // SAFETY: dlsym over the process's global scope with a valid C string.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, n.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (Some(d), Some(w), Some(f)) = (
        sym(c"kiwiMemDiscard"),
        sym(c"kiwi_hint_wait"),
        sym(c"kiwi_hint_done"),
    ) else {
        eprintln!("gpuburst [{name}]: --discard: not running under Kiwi, nothing to discard");
        return;
    };
    // SAFETY: libkiwi.so exports these with these C signatures (docs/shim.md).
    let (discard, wait, done) = unsafe {
        (
            std::mem::transmute::<*mut c_void, Discard>(d),
            std::mem::transmute::<*mut c_void, Wait>(w),
            std::mem::transmute::<*mut c_void, Done>(f),
        )
    };
    std::thread::spawn(move || loop {
        // SAFETY: plain values; the shim checks the ranges.
        let id = unsafe { wait(1000) };
        if id > 0 {
            for &(ptr, bytes) in &tails {
                // SAFETY: as above. A refusal (the range freed at exit) is harmless.
                let _ = unsafe { discard(ptr, bytes as usize) };
            }
            // SAFETY: as above.
            unsafe { done(id) };
        }
    });
}

pub fn run(cuda: &Cuda, o: &Options) -> Result<(), Failure> {
    let rep = Report {
        json: o.json,
        name: o.name.clone(),
        t0: Instant::now(),
    };
    // The exchange's file and entry points first: a bad file or a driver without
    // stream memory operations fails before any GPU work.
    let mut ex = match &o.exchange {
        Some(spec) => Some(Exchange::open(cuda, spec).map_err(Failure::Input)?),
        None => None,
    };
    if let Some(spec) = o.ipc.as_ref().filter(|x| x.role == Role::Export) {
        ipc::check_fresh(&spec.path).map_err(Failure::Input)?;
    }
    cu!(cuda, init, "cuInit", 0)?;
    // Several GPUs: a context on each before any work, as a program that sets up all
    // its devices first does. Under Kiwi every GPU is then registered before the first
    // turn is taken, so turns are taken in one order from the start (a GPU first used
    // later makes the process give back the turns after it, draining their work).
    let mut claimed = Vec::new();
    if o.devices.len() > 1 {
        for &ordinal in &o.devices {
            claimed.push(retain_primary(cuda, ordinal)?.0);
        }
    }
    let mut devs: Vec<Device> = Vec::with_capacity(o.devices.len());
    let mut index = 0;
    for &ordinal in &o.devices {
        let d = open_device(cuda, o, ordinal, index)?;
        index += d.allocs.len();
        devs.push(d);
    }
    for dev in claimed {
        cu!(cuda, primary_ctx_release, "cuDevicePrimaryCtxRelease", dev)?;
    }
    for d in &devs {
        make_current(cuda, &devs, d)?;
        cu!(cuda, ctx_synchronize, "cuCtxSynchronize")?;
    }
    if let Some(x) = ex.as_mut() {
        // Registered once (portable), its device address looked up in each context.
        make_current(cuda, &devs, &devs[0])?;
        x.register(cuda)?;
        for (d, rank) in devs.iter().zip(x.spec.device_ranks()) {
            make_current(cuda, &devs, d)?;
            x.add_device(cuda, rank)?;
        }
    }
    // One device with --ipc (checked by the options).
    let shared = match &o.ipc {
        Some(spec) if spec.role == Role::Export => {
            Some(export_shared(cuda, o, &mut devs[0], spec)?)
        }
        Some(spec) => Some(import_shared(cuda, o, &mut devs[0], spec)?),
        None => None,
    };
    if o.discard {
        start_discarding(&o.name, devs.iter().filter_map(|d| d.tail).collect());
    }
    let allocations: usize = devs.iter().map(|d| d.allocs.len()).sum();
    let ordinals = o
        .devices
        .iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let pid = std::process::id();
    let human_devices = if devs.len() > 1 {
        format!(" on each of devices {ordinals}")
    } else {
        String::new()
    };
    let (human_exchange, json_exchange) = match &ex {
        Some(x) => {
            let ranks = (0..devs.len())
                .map(|i| x.rank_of(i).to_string())
                .collect::<Vec<_>>()
                .join(",");
            (
                format!(", exchange rank {ranks} via {}", x.file.path().display()),
                format!(",\"exchange_ranks\":[{ranks}]"),
            )
        }
        None => (String::new(), String::new()),
    };
    let (human_ipc, json_ipc) = match (&o.ipc, &shared) {
        (Some(spec), Some(p)) => {
            let human = match spec.role {
                Role::Export => format!(", {} bytes exported", p.bytes),
                Role::Import => format!(", {} bytes imported from pid {}", p.bytes, p.pid),
            };
            (
                format!("{human} via {}", spec.path.display()),
                format!(
                    ",\"ipc\":\"{}\",\"ipc_bytes\":{},\"ipc_exporter_pid\":{}",
                    spec.role.name(),
                    p.bytes,
                    p.pid
                ),
            )
        }
        _ => (String::new(), String::new()),
    };
    let human_alloc = match o.alloc {
        AllocMode::Device => String::new(),
        m => format!(" ({})", m.name()),
    };
    rep.line(
        format!(
            "ready: pid {pid}, {} bytes{human_alloc}{human_devices} in {allocations} allocations{human_exchange}{human_ipc}, at {:.1} ms",
            o.mem,
            rep.ms()
        ),
        format!(
            "{{\"event\":\"ready\",\"name\":\"{}\",\"pid\":{pid},\"mem_bytes\":{},\"alloc\":\"{}\",\"allocations\":{allocations},\"t_ms\":{:.3},\"devices\":{},\"device_ordinals\":[{ordinals}]{json_exchange}{json_ipc}}}",
            o.name,
            o.mem,
            o.alloc.name(),
            rep.ms(),
            devs.len()
        ),
    );

    let mut start_at = o.start_at_ns;
    if o.start_on_stdin {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map_err(|e| {
            Failure::Input(format!("--start-on-stdin: cannot read standard input: {e}"))
        })?;
        let at = line.trim().parse::<u64>().map_err(|_| {
            Failure::Input(format!(
                "--start-on-stdin: expected a CLOCK_MONOTONIC nanosecond count, got {line:?}"
            ))
        })?;
        start_at = Some(at);
    }
    if let Some(at) = start_at {
        let now = monotonic_ns();
        if at > now {
            std::thread::sleep(Duration::from_nanos(at - now));
        }
    }
    let phases: Vec<Phase> = match &o.script {
        Some(p) => p.clone(),
        None => {
            let mut p = Vec::new();
            for b in 0..o.bursts {
                p.push(Phase::Gpu(o.gpu_ms));
                if b + 1 < o.bursts {
                    p.push(Phase::Cpu(o.cpu_ms));
                    if o.idle_ms > 0 {
                        p.push(Phase::Idle(o.idle_ms));
                    }
                }
            }
            p
        }
    };
    let mut b: u32 = 0;
    let mut step_ms: Vec<f64> = Vec::new();
    for phase in phases {
        let start_ns = monotonic_ns();
        match phase {
            Phase::Cpu(ms) => host_work(Duration::from_millis(ms)),
            Phase::Idle(ms) => std::thread::sleep(Duration::from_millis(ms)),
            Phase::Grow(mib) => grow(cuda, o, &mut devs, mib << 20)?,
            Phase::Gpu(ms) => {
                step_ms.push(burst(cuda, o, &rep, &mut devs, ex.as_ref(), b, ms)?);
                b += 1;
            }
        }
        if o.json {
            rep.line(
                String::new(),
                format!(
                    "{{\"event\":\"phase\",\"name\":\"{}\",\"kind\":\"{}\",\"start_ns\":{start_ns},\"end_ns\":{}}}",
                    o.name,
                    phase.kind(),
                    monotonic_ns()
                ),
            );
        }
    }
    let verified = verify_all(cuda, &devs);
    let ok = verified.is_ok();
    rep.line(
        format!(
            "verify: {allocations} allocations{}, {}",
            if devs.len() > 1 {
                format!(" on devices {ordinals}")
            } else {
                String::new()
            },
            if ok {
                "all bytes as expected"
            } else {
                "MISMATCH"
            }
        ),
        format!(
            "{{\"event\":\"verify\",\"name\":\"{}\",\"ok\":{ok},\"allocations\":{allocations},\"devices\":{}}}",
            o.name,
            devs.len()
        ),
    );
    verified?;
    match &o.ipc {
        Some(spec) if spec.role == Role::Import => {
            for a in devs[0]
                .allocs
                .iter()
                .filter(|a| a.source == Source::Imported)
            {
                cu!(cuda, ipc_close_mem_handle, "cuIpcCloseMemHandle", a.ptr)?;
            }
            ipc::mark_closed(&spec.path).map_err(Failure::Input)?;
        }
        Some(spec) => {
            // The exporter stays, its memory shared, until the importer closed it.
            if !ipc::wait_closed(&spec.path, Duration::from_millis(o.ipc_timeout_ms)) {
                return Err(Failure::Timeout(format!(
                    "--ipc export: the importer did not close {} within {} ms",
                    spec.path.display(),
                    o.ipc_timeout_ms
                )));
            }
            // Closed, the shared memory may have been swapped meanwhile: once more.
            verify_all(cuda, &devs)?;
        }
        None => {}
    }
    if let Some(x) = ex.as_mut() {
        // Every stream is idle: the last step was synchronized.
        x.unregister(cuda)?;
    }
    for i in 0..devs.len() {
        make_current(cuda, &devs, &devs[i])?;
        let d = &mut devs[i];
        for a in &d.allocs {
            memory::free(cuda, a.ptr, a.source)?;
        }
        if let Some(s) = d.space.as_mut() {
            s.free(cuda)?;
        }
        cu!(cuda, mem_free, "cuMemFree_v2", d.sums)?;
    }
    for d in &devs {
        cu!(
            cuda,
            primary_ctx_release,
            "cuDevicePrimaryCtxRelease",
            d.dev
        )?;
    }
    let p50 = exchange::percentile(&step_ms, 50.0);
    let max = exchange::percentile(&step_ms, 100.0);
    let json_ms = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.3}"));
    let human_steps = match (&ex, p50, max) {
        (Some(_), Some(p50), Some(max)) => {
            format!(
                ", {} steps: p50 {p50:.1} ms, max {max:.1} ms",
                step_ms.len()
            )
        }
        _ => String::new(),
    };
    rep.line(
        format!("done in {:.1} ms{human_steps}", rep.ms()),
        format!(
            "{{\"event\":\"end\",\"name\":\"{}\",\"total_ms\":{:.3},\"step_ms\":[{}],\"step_p50_ms\":{},\"step_max_ms\":{}}}",
            o.name,
            rep.ms(),
            step_ms
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(","),
            json_ms(p50),
            json_ms(max)
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options_parse() {
        let o = Options::parse(&args(
            "--mem 700MiB --bursts 3 --gpu-ms 50 --cpu-ms=20 --idle-ms 5 --verify --json --name a --seed 9",
        ))
        .unwrap();
        assert_eq!(o.mem, 700 << 20);
        assert_eq!((o.bursts, o.gpu_ms, o.cpu_ms, o.idle_ms), (3, 50, 20, 5));
        assert!(o.verify && o.json);
        assert_eq!((o.name.as_str(), o.seed), ("a", 9));
        assert_eq!((o.prealloc, o.discard), (None, false));
    }

    #[test]
    fn preallocation_options_parse() {
        let o = Options::parse(&args("--mem 64MiB --prealloc 0.75 --discard")).unwrap();
        assert_eq!((o.prealloc, o.discard), (Some(0.75), true));
        for bad in [
            "--prealloc 0",
            "--prealloc 1.5",
            "--prealloc most",
            "--discard",
        ] {
            assert!(Options::parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn scripts_parse() {
        let o =
            Options::parse(&args("--script cpu:1500,gpu:6000,idle:5 --start-at-ns 42")).unwrap();
        assert_eq!(
            o.script,
            Some(vec![Phase::Cpu(1500), Phase::Gpu(6000), Phase::Idle(5)])
        );
        assert_eq!(o.start_at_ns, Some(42));
        assert_eq!(
            parse_script("grow:1536,gpu:10"),
            Ok(vec![Phase::Grow(1536), Phase::Gpu(10)])
        );
        for bad in [
            "--script gpu",
            "--script gpu:0",
            "--script grow:0",
            "--script nap:5",
            "--script ,",
            "--script cpu:x",
        ] {
            assert!(Options::parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_options_are_refused() {
        for a in [
            "--mem lots",
            "--bursts",
            "--gpu-ms x",
            "--frobnicate",
            "--gpu-ms 0",
            "--mem 1",
        ] {
            assert!(Options::parse(&args(a)).is_err(), "{a}");
        }
    }

    #[test]
    fn device_lists_parse() {
        assert_eq!(Options::parse(&[]).unwrap().devices, vec![0]);
        assert_eq!(
            Options::parse(&args("--device 3")).unwrap().devices,
            vec![3]
        );
        assert_eq!(
            Options::parse(&args("--device 1,0")).unwrap().devices,
            vec![1, 0]
        );
        assert_eq!(
            Options::parse(&args("--device=0,2,1")).unwrap().devices,
            vec![0, 2, 1]
        );
        for bad in [
            "--device 0,0",
            "--device 1,0,1",
            "--device 0,",
            "--device ,0",
            "--device 0,,1",
            "--device=",
            "--device x",
            "--device 0,x",
            "--device -1",
            "--device 99999999999",
            "--device",
        ] {
            let e = Options::parse(&args(bad)).unwrap_err();
            assert!(e.starts_with("--device"), "{bad}: {e}");
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn exchange_options_parse() {
        let o = Options::parse(&[]).unwrap();
        assert_eq!(o.exchange, None);
        assert_eq!(o.exchange_timeout_ms, exchange::DEFAULT_TIMEOUT_MS);
        let o = Options::parse(&args("--exchange /dev/shm/job:1 --device 2")).unwrap();
        let x = o.exchange.unwrap();
        assert_eq!(x.path, std::path::PathBuf::from("/dev/shm/job"));
        assert_eq!(x.ranks, exchange::Ranks::One(1));
        let o = Options::parse(&args(
            "--exchange=f:both --device 0,1 --exchange-timeout-ms 2000",
        ))
        .unwrap();
        assert_eq!(o.exchange.unwrap().ranks, exchange::Ranks::Both);
        assert_eq!(o.exchange_timeout_ms, 2000);
        assert_eq!(
            Options::parse(&args("--exchange f:0")).unwrap().devices,
            vec![0]
        );
        for bad in [
            "--exchange",
            "--exchange f",
            "--exchange f:2",
            "--exchange f:",
            "--exchange :0",
            "--exchange f:both",
            "--exchange f:both --device 0",
            "--exchange f:both --device 0,1,2",
            "--exchange f:0 --device 0,1",
            "--exchange f:0 --exchange-timeout-ms 0",
            "--exchange f:0 --exchange-timeout-ms soon",
            "--exchange-timeout-ms 100",
        ] {
            let e = Options::parse(&args(bad)).unwrap_err();
            assert!(e.starts_with("--exchange"), "{bad}: {e}");
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn alloc_and_ipc_options_parse() {
        let o = Options::parse(&[]).unwrap();
        assert_eq!((o.alloc, o.ipc.clone()), (AllocMode::Device, None));
        assert_eq!(o.ipc_mem, ipc::DEFAULT_IPC_MEM);
        assert_eq!(o.ipc_timeout_ms, ipc::DEFAULT_TIMEOUT_MS);
        assert_eq!(
            Options::parse(&args("--alloc vmm --device 0,1"))
                .unwrap()
                .alloc,
            AllocMode::Vmm
        );
        assert_eq!(
            Options::parse(&args("--alloc=managed")).unwrap().alloc,
            AllocMode::Managed
        );
        let o = Options::parse(&args(
            "--ipc export:/tmp/p --ipc-mem 8MiB --ipc-timeout-ms 500 --alloc vmm",
        ))
        .unwrap();
        let x = o.ipc.unwrap();
        assert_eq!((x.role, x.path), (Role::Export, "/tmp/p".into()));
        assert_eq!((o.ipc_mem, o.ipc_timeout_ms), (8 << 20, 500));
        assert_eq!(
            Options::parse(&args("--ipc import:/tmp/p"))
                .unwrap()
                .ipc
                .unwrap()
                .role,
            Role::Import
        );
        for bad in [
            "--alloc",
            "--alloc host",
            "--alloc vmm --prealloc 0.5",
            "--alloc managed --prealloc 0.5 --discard",
            "--ipc",
            "--ipc export",
            "--ipc peer:/tmp/p",
            "--ipc export:/tmp/p --device 0,1",
            "--ipc import:/tmp/p --ipc-mem 8MiB",
            "--ipc export:/tmp/p --ipc-mem 1",
            "--ipc export:/tmp/p --ipc-timeout-ms 0",
            "--ipc-mem 8MiB",
            "--ipc-timeout-ms 100",
        ] {
            let e = Options::parse(&args(bad)).unwrap_err();
            assert!(
                e.starts_with("--alloc") || e.starts_with("--ipc") || e.starts_with("--prealloc"),
                "{bad}: {e}"
            );
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn allocations_cover_the_memory() {
        for mem in [4096u64, 1 << 20, 700 << 20, (256 << 20) + 4] {
            let p = plan_allocations(mem);
            assert_eq!(p.iter().sum::<u64>(), mem / 4 * 4, "{mem}");
            assert!(p.iter().all(|&s| s <= 256 << 20 && s % 4 == 0 && s > 0));
        }
        assert_eq!(plan_allocations(700 << 20).len(), 6);
    }
}
