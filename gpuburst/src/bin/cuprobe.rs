//! `cuprobe`: scripted driver-API scenarios, run against whatever `libcuda.so.1` the
//! loader finds (the simulator in tests). Each scenario checks its own expectations,
//! prints one line per step and `PASS <scenario>` at the end; a broken expectation
//! prints `FAIL ...` and exits 1, a failed CUDA call exits 2.
//!
//! ```text
//! cuprobe vmm                        VMM map/unmap/access/illegal address
//! cuprobe alloc --mib N [--hold-ms M] allocate N MiB, print "allocated", hold
//! cuprobe copy --mib N               time an N MiB HtoD and DtoH copy
//! cuprobe spin --ms N --count K      K kernels of N ms each
//! cuprobe procaddr                   cuGetProcAddress resolution rules
//! cuprobe launch-rate --count N      host cost of an async launch and of cuCtxGetCurrent
//! cuprobe streams                    stream order, events, cross-context waits
//! cuprobe nvml --mib N [--hold-ms M]  allocate N MiB, then print what NVML and CUDA say
//! ```

use std::ffi::c_void;
use std::time::{Duration, Instant};

use gpuburst::burst::retain_primary;
use gpuburst::cu;
use gpuburst::driver::{
    resolve, CUdeviceptr, CUmemLocation, Cuda, CudaError, Handle, MemAccessDesc, MemAllocationProp,
};
use gpuburst::kernels::Ptx;
use kiwi_cuda::sys::{
    CUuuid, CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_READY, CUDA_SUCCESS, CU_GET_PROC_ADDRESS_DEFAULT,
    CU_GET_PROC_ADDRESS_LEGACY_STREAM, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
};

macro_rules! expect {
    ($cond:expr, $($msg:tt)*) => {
        if !$cond {
            println!("FAIL {}", format!($($msg)*));
            std::process::exit(1);
        }
    };
}

struct Probe {
    cuda: Cuda,
    fill: Handle,
    checksum: Handle,
    spin: Handle,
}

impl Probe {
    fn new() -> Result<Probe, CudaError> {
        let cuda = Cuda::load().unwrap_or_else(|e| {
            println!("FAIL {e}");
            std::process::exit(1);
        });
        cu!(cuda, init, "cuInit", 0)?;
        let (_, ctx) = retain_primary(&cuda, 0)?;
        cu!(cuda, ctx_set_current, "cuCtxSetCurrent", ctx)?;
        let ptx = Ptx::load(&cuda, false)?;
        Ok(Probe {
            fill: ptx.kernel(&cuda, c"kiwi_fill")?,
            checksum: ptx.kernel(&cuda, c"kiwi_checksum")?,
            spin: ptx.kernel(&cuda, c"kiwi_spin")?,
            cuda,
        })
    }

    /// Launches a kernel (one thread) on the legacy stream; returns the raw launch
    /// result.
    fn launch(&self, f: Handle, args: &mut [*mut c_void]) -> u32 {
        self.launch_on(f, std::ptr::null_mut(), args)
    }

    /// Launches a kernel (one thread) on `stream`; returns the raw launch result.
    fn launch_on(&self, f: Handle, stream: Handle, args: &mut [*mut c_void]) -> u32 {
        // SAFETY: a resolved cuLaunchKernel; argument pointers live for the call.
        unsafe {
            (self.cuda.launch_kernel)(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }

    fn fill(&self, ptr: CUdeviceptr, value: u32, words: u64) -> u32 {
        let (mut p, mut v, mut w) = (ptr, value, words);
        self.launch(
            self.fill,
            &mut [
                (&mut p as *mut u64).cast(),
                (&mut v as *mut u32).cast(),
                (&mut w as *mut u64).cast(),
            ],
        )
    }

    fn checksum(&self, ptr: CUdeviceptr, words: u64, out: CUdeviceptr) -> Result<u64, CudaError> {
        cu!(self.cuda, memset_d32, "cuMemsetD32", out, 0, 2)?;
        let (mut p, mut w, mut o) = (ptr, words, out);
        let r = self.launch(
            self.checksum,
            &mut [
                (&mut p as *mut u64).cast(),
                (&mut w as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
            ],
        );
        self.cuda.check("cuLaunchKernel", r)?;
        let mut got = 0u64;
        cu!(
            self.cuda,
            memcpy_dtoh,
            "cuMemcpyDtoH",
            (&mut got as *mut u64).cast(),
            out,
            8
        )?;
        Ok(got)
    }

    fn sync(&self) -> u32 {
        // SAFETY: resolved entry point, no arguments.
        unsafe { (self.cuda.ctx_synchronize)() }
    }

    fn free_mem(&self) -> Result<u64, CudaError> {
        let (mut f, mut t) = (0usize, 0usize);
        cu!(self.cuda, mem_get_info, "cuMemGetInfo", &mut f, &mut t)?;
        Ok(f as u64)
    }
}

fn step(s: &str) {
    println!("ok {s}");
}

fn vmm(p: &Probe) -> Result<(), CudaError> {
    let c = &p.cuda;
    let prop = MemAllocationProp::device(0);
    let mut g = 0usize;
    cu!(
        c,
        mem_get_allocation_granularity,
        "cuMemGetAllocationGranularity",
        &mut g,
        &prop,
        0
    )?;
    expect!(g == 2 << 20, "granularity {g}");
    let g = g as u64;
    let words = g / 4;
    let mut out = 0;
    cu!(c, mem_alloc, "cuMemAlloc", &mut out, 8)?;
    let free0 = p.free_mem()?;
    // The scenario's handles: pinned memory on device 0, mapped read-write there.
    let create = |bytes: u64| -> Result<u64, CudaError> {
        let mut h = 0u64;
        cu!(
            c,
            mem_create,
            "cuMemCreate",
            &mut h,
            bytes as usize,
            &prop,
            0
        )?;
        Ok(h)
    };
    let map =
        |at: u64, bytes: u64, h: u64| cu!(c, mem_map, "cuMemMap", at, bytes as usize, 0, h, 0);
    let rw = MemAccessDesc {
        location: CUmemLocation::device(0),
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let set_rw = |at: u64, bytes: u64| {
        cu!(
            c,
            mem_set_access,
            "cuMemSetAccess",
            at,
            bytes as usize,
            &rw,
            1
        )
    };

    let mut va = 0;
    cu!(
        c,
        mem_address_reserve,
        "cuMemAddressReserve",
        &mut va,
        (4 * g) as usize,
        0,
        0,
        0
    )?;
    expect!(p.free_mem()? == free0, "reserving VA must not use memory");
    let h1 = create(2 * g)?;
    expect!(
        p.free_mem()? == free0 - 2 * g,
        "cuMemCreate accounts physical memory"
    );
    // SAFETY: a resolved driver entry point; integer arguments.
    let r = unsafe { (c.mem_map)(va, (2 * g) as usize, 4096, h1, 0) };
    expect!(r == CUDA_ERROR_INVALID_VALUE, "map with offset != 0 -> {r}");
    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.mem_map)(va, g as usize + 4096, 0, h1, 0) };
    expect!(
        r == CUDA_ERROR_INVALID_VALUE,
        "map of a non-granular size -> {r}"
    );
    map(va, 2 * g, h1)?;
    step("map");
    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.mem_map)(va + g, g as usize, 0, h1, 0) };
    expect!(r != CUDA_SUCCESS, "overlapping map must fail");
    // Before cuMemSetAccess the range is not accessible.
    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.memset_d32)(va, 1, words as usize) };
    expect!(
        r == CUDA_ERROR_INVALID_VALUE,
        "memset before cuMemSetAccess -> {r}"
    );
    set_rw(va, 2 * g)?;
    expect!(p.fill(va, 3, 2 * words) == CUDA_SUCCESS, "fill launch");
    expect!(p.sync() == CUDA_SUCCESS, "fill after set access");
    expect!(
        p.checksum(va, 2 * words, out)? == 3 * 2 * words,
        "checksum after fill"
    );
    step("set-access fill checksum");

    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.mem_unmap)(va, g as usize) };
    expect!(
        r == CUDA_ERROR_INVALID_VALUE,
        "unmap of half a mapping -> {r}"
    );
    // Release before unmap: the memory stays while mapped.
    cu!(c, mem_release, "cuMemRelease", h1)?;
    expect!(
        p.free_mem()? == free0 - 2 * g,
        "released but mapped memory stays allocated"
    );
    expect!(
        p.checksum(va, 2 * words, out)? == 6 * words,
        "data survives release while mapped"
    );
    step("release-before-unmap");

    // A second handle mapped right after the first: one kernel spans both.
    let h2 = create(2 * g)?;
    map(va + 2 * g, 2 * g, h2)?;
    set_rw(va + 2 * g, 2 * g)?;
    expect!(
        p.fill(va, 5, 4 * words) == CUDA_SUCCESS,
        "spanning fill launch"
    );
    expect!(p.sync() == CUDA_SUCCESS, "spanning fill");
    expect!(
        p.checksum(va, 4 * words, out)? == 5 * 4 * words,
        "spanning checksum"
    );
    step("kernel across two mappings");

    // Unmap both mappings in one call: h1's memory is freed (no handle left), h2's
    // is not (its handle is alive).
    cu!(c, mem_unmap, "cuMemUnmap", va, (4 * g) as usize)?;
    expect!(
        p.free_mem()? == free0 - 2 * g,
        "unmap frees the released handle only"
    );
    // Map h2 again at the start of the same VA: contents are kept.
    map(va, 2 * g, h2)?;
    set_rw(va, 2 * g)?;
    expect!(
        p.checksum(va, 2 * words, out)? == 5 * 2 * words,
        "remapped data kept"
    );
    step("remap keeps contents");
    cu!(c, mem_unmap, "cuMemUnmap", va, (2 * g) as usize)?;
    cu!(c, mem_release, "cuMemRelease", h2)?;
    expect!(p.free_mem()? == free0, "everything freed");

    // A mapping without access in a second context: illegal address there only.
    let h3 = create(g)?;
    map(va, g, h3)?;
    let mut ctx2: Handle = std::ptr::null_mut();
    let mut primary: Handle = std::ptr::null_mut();
    cu!(c, ctx_get_current, "cuCtxGetCurrent", &mut primary)?;
    cu!(c, ctx_create, "cuCtxCreate", &mut ctx2, 0, 0)?;
    expect!(p.fill(va, 1, words) == CUDA_SUCCESS, "launch is accepted");
    let r = p.sync();
    expect!(
        r == CUDA_ERROR_ILLEGAL_ADDRESS,
        "kernel on a mapping without access -> {r}"
    );
    let mut x = 0;
    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.mem_alloc)(&mut x, 4096) };
    expect!(
        r == CUDA_ERROR_ILLEGAL_ADDRESS,
        "the error is sticky in that context -> {r}"
    );
    cu!(c, ctx_destroy, "cuCtxDestroy", ctx2)?;
    cu!(c, ctx_set_current, "cuCtxSetCurrent", primary)?;
    expect!(p.sync() == CUDA_SUCCESS, "other contexts are unaffected");
    step("no access -> illegal address");

    // Unmapped memory (a shim that forgot to swap back in): illegal address.
    cu!(c, mem_unmap, "cuMemUnmap", va, g as usize)?;
    cu!(c, mem_release, "cuMemRelease", h3)?;
    expect!(p.fill(va, 1, words) == CUDA_SUCCESS, "launch is accepted");
    let r = p.sync();
    expect!(
        r == CUDA_ERROR_ILLEGAL_ADDRESS,
        "kernel on unmapped memory -> {r}"
    );
    let r = p.sync();
    expect!(r == CUDA_ERROR_ILLEGAL_ADDRESS, "sticky: still {r}");
    step("unmapped -> illegal address (sticky)");
    // SAFETY: a resolved driver entry point; integer and live-pointer arguments.
    let r = unsafe { (c.mem_address_free)(va, (4 * g) as usize) };
    expect!(r == CUDA_SUCCESS, "address free -> {r}");
    Ok(())
}

/// `mib` MiB allocated and written (so they are resident).
fn alloc_touched(p: &Probe, mib: u64) -> Result<CUdeviceptr, CudaError> {
    let mut d = 0;
    cu!(
        p.cuda,
        mem_alloc,
        "cuMemAlloc_v2",
        &mut d,
        (mib << 20) as usize
    )?;
    expect!(
        p.fill(d, 1, (mib << 20) / 4) == CUDA_SUCCESS,
        "touching the memory"
    );
    expect!(p.sync() == CUDA_SUCCESS, "fill");
    Ok(d)
}

/// Prints `line` at once, then holds everything for `hold_ms`.
fn say_and_hold(line: &str, hold_ms: u64) {
    println!("{line}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_millis(hold_ms));
}

fn alloc(p: &Probe, mib: u64, hold_ms: u64) -> Result<(), CudaError> {
    alloc_touched(p, mib)?;
    say_and_hold(&format!("allocated {mib} MiB"), hold_ms);
    Ok(())
}

/// What NVML says of this process's GPU next to what CUDA says, in one line:
/// `nvml free F cuda free C pid P processes PID:BYTES,...` (issue #39: under Kiwi the
/// two agree and the list holds only this tenant's processes). NVML is reached as
/// most tools reach it: `dlopen("libnvidia-ml.so.1")` and `dlsym` by name.
fn nvml(p: &Probe, mib: u64, hold_ms: u64) -> Result<(), CudaError> {
    use std::ffi::{c_char, c_uint, c_void};
    #[repr(C)]
    struct Memory {
        total: u64,
        free: u64,
        used: u64,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Process {
        pid: c_uint,
        used: u64,
        gpu_instance: c_uint,
        compute_instance: c_uint,
    }
    alloc_touched(p, mib)?;
    let mut uuid = CUuuid::default();
    cu!(p.cuda, device_get_uuid, "cuDeviceGetUuid", &mut uuid, 0)?;
    let uuid = format!("{}\0", kiwi_cuda::format_uuid(&uuid));
    let cuda_free = p.free_mem()?;
    // SAFETY: dlopen and dlsym with NUL-terminated names; each symbol is used with
    // its nvml.h signature.
    let (free, list) = unsafe {
        let lib = libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW);
        expect!(!lib.is_null(), "dlopen libnvidia-ml.so.1");
        let sym = |name: &std::ffi::CStr| {
            let f = libc::dlsym(lib, name.as_ptr());
            expect!(!f.is_null(), "dlsym {name:?}");
            f
        };
        let init: unsafe extern "C" fn() -> c_uint = std::mem::transmute(sym(c"nvmlInit_v2"));
        let by_uuid: unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_uint =
            std::mem::transmute(sym(c"nvmlDeviceGetHandleByUUID"));
        let memory: unsafe extern "C" fn(*mut c_void, *mut Memory) -> c_uint =
            std::mem::transmute(sym(c"nvmlDeviceGetMemoryInfo"));
        let processes: unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut Process) -> c_uint =
            std::mem::transmute(sym(c"nvmlDeviceGetComputeRunningProcesses_v3"));
        expect!(init() == CUDA_SUCCESS, "nvmlInit_v2");
        let mut dev = std::ptr::null_mut();
        expect!(
            by_uuid(uuid.as_ptr().cast(), &mut dev) == 0,
            "nvmlDeviceGetHandleByUUID {uuid}"
        );
        let mut m = Memory {
            total: 0,
            free: 0,
            used: 0,
        };
        expect!(
            memory(dev, &mut m) == CUDA_SUCCESS,
            "nvmlDeviceGetMemoryInfo"
        );
        let mut list = [Process::default(); 64];
        let mut n: c_uint = 64;
        expect!(
            processes(dev, &mut n, list.as_mut_ptr()) == 0,
            "nvmlDeviceGetComputeRunningProcesses_v3"
        );
        (m.free, list[..n as usize].to_vec())
    };
    let listed: Vec<String> = list
        .iter()
        .map(|p| format!("{}:{}", p.pid, p.used))
        .collect();
    let line = format!(
        "nvml free {free} cuda free {cuda_free} pid {} processes {}",
        std::process::id(),
        listed.join(",")
    );
    say_and_hold(&line, hold_ms);
    Ok(())
}

fn copy(p: &Probe, mib: u64) -> Result<(), CudaError> {
    let n = (mib << 20) as usize;
    let host = vec![7u8; n];
    let mut back = vec![1u8; n]; // touched, so page faults are not timed
    let mut d = 0;
    cu!(p.cuda, mem_alloc, "cuMemAlloc_v2", &mut d, n)?;
    let t = Instant::now();
    cu!(
        p.cuda,
        memcpy_htod,
        "cuMemcpyHtoD",
        d,
        host.as_ptr().cast(),
        n
    )?;
    let htod = t.elapsed().as_secs_f64();
    let t = Instant::now();
    cu!(
        p.cuda,
        memcpy_dtoh,
        "cuMemcpyDtoH",
        back.as_mut_ptr().cast(),
        d,
        n
    )?;
    let dtoh = t.elapsed().as_secs_f64();
    expect!(back == host, "copied bytes differ");
    println!("copy bytes={n} htod_s={htod:.6} dtoh_s={dtoh:.6}");
    Ok(())
}

fn spin(p: &Probe, ms: u64, count: u32) -> Result<(), CudaError> {
    for _ in 0..count {
        let mut ns = ms * 1_000_000;
        let r = p.launch(p.spin, &mut [(&mut ns as *mut u64).cast()]);
        p.cuda.check("cuLaunchKernel", r)?;
    }
    let r = p.sync();
    p.cuda.check("cuCtxSynchronize", r)?;
    println!("spun {count} x {ms} ms");
    Ok(())
}

fn procaddr(p: &Probe) -> Result<(), CudaError> {
    let c = &p.cuda;
    let gpa = c.get_proc_address;
    let sym = |n: &str| c.dlsym(n);
    for (base, symbol) in [
        ("cuMemAlloc", "cuMemAlloc_v2"),
        ("cuCtxDestroy", "cuCtxDestroy_v2"),
        ("cuMemcpyHtoD", "cuMemcpyHtoD_v2"),
        ("cuLaunchKernel", "cuLaunchKernel"),
        ("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2"),
        ("cuGetProcAddress", "cuGetProcAddress_v2"),
        ("cuStreamBeginCapture", "cuStreamBeginCapture_v2"),
        ("cuGraphLaunch", "cuGraphLaunch"),
    ] {
        let got = resolve(gpa, base, 12000, CU_GET_PROC_ADDRESS_DEFAULT);
        expect!(got.is_some() && got == sym(symbol), "{base} -> {symbol}");
    }
    step("base names resolve to the newest version");
    // An old CUDA version gets the old symbol (cuDevicePrimaryCtxRelease v1 in 10.x).
    let got = resolve(
        gpa,
        "cuDevicePrimaryCtxRelease",
        10020,
        CU_GET_PROC_ADDRESS_DEFAULT,
    );
    expect!(
        got == sym("cuDevicePrimaryCtxRelease"),
        "version-limited lookup"
    );
    expect!(
        resolve(gpa, "cuMemAlloc", 3000, CU_GET_PROC_ADDRESS_DEFAULT).is_none(),
        "too old a version"
    );
    step("versions honoured");
    for (base, symbol) in [
        ("cuLaunchKernel", "cuLaunchKernel_ptsz"),
        ("cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"),
        ("cuMemcpyAsync", "cuMemcpyAsync_ptsz"),
        ("cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2_ptsz"),
        ("cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2_ptsz"),
        ("cuMemsetD8Async", "cuMemsetD8Async_ptsz"),
        ("cuMemsetD32Async", "cuMemsetD32Async_ptsz"),
        ("cuStreamSynchronize", "cuStreamSynchronize_ptsz"),
        ("cuEventRecord", "cuEventRecord_ptsz"),
        ("cuLaunchHostFunc", "cuLaunchHostFunc_ptsz"),
        ("cuMemcpy", "cuMemcpy_ptds"),
        ("cuMemcpyHtoD", "cuMemcpyHtoD_v2_ptds"),
        ("cuMemcpyDtoH", "cuMemcpyDtoH_v2_ptds"),
        ("cuMemcpyDtoD", "cuMemcpyDtoD_v2_ptds"),
        ("cuMemsetD8", "cuMemsetD8_v2_ptds"),
        ("cuMemsetD32", "cuMemsetD32_v2_ptds"),
        ("cuGraphLaunch", "cuGraphLaunch_ptsz"),
        ("cuStreamBeginCapture", "cuStreamBeginCapture_v2_ptsz"),
        ("cuMemcpy2D", "cuMemcpy2D_v2_ptds"),
        ("cuMemcpy2DAsync", "cuMemcpy2DAsync_v2_ptsz"),
        ("cuMemsetD2D32Async", "cuMemsetD2D32Async_ptsz"),
    ] {
        let got = resolve(
            gpa,
            base,
            12000,
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
        );
        expect!(
            got.is_some() && got == sym(symbol),
            "per-thread {base} -> {symbol}"
        );
        let legacy = resolve(gpa, base, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
        expect!(
            legacy != got,
            "legacy {base} must not be the per-thread variant"
        );
    }
    // Per-thread variants follow the requested version too.
    expect!(
        resolve(
            gpa,
            "cuMemPrefetchAsync",
            12000,
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
        ) == sym("cuMemPrefetchAsync_ptsz"),
        "cuMemPrefetchAsync per-thread at 12.0"
    );
    expect!(
        resolve(
            gpa,
            "cuMemPrefetchAsync",
            12040,
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
        ) == sym("cuMemPrefetchAsync_v2_ptsz"),
        "cuMemPrefetchAsync per-thread at 12.4"
    );
    // Calls without a per-thread variant give the ordinary symbol.
    expect!(
        resolve(
            gpa,
            "cuMemAlloc",
            12000,
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
        ) == sym("cuMemAlloc_v2"),
        "no ptds variant"
    );
    step("per-thread default stream variants");
    let name = c"cuNoSuchFunction";
    let mut pfn: *mut c_void = std::ptr::dangling_mut::<c_void>();
    let mut status = -1;
    // SAFETY: valid arguments for cuGetProcAddress_v2.
    let r = unsafe {
        gpa(
            name.as_ptr(),
            &mut pfn,
            12000,
            CU_GET_PROC_ADDRESS_DEFAULT,
            &mut status,
        )
    };
    expect!(
        r == CUDA_ERROR_NOT_FOUND
            && pfn.is_null()
            && status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        "unknown name -> {r}, status {status}"
    );
    step("unknown names");
    Ok(())
}

/// Host-side cost of queuing a launch (the executor busy with a long kernel, so
/// nothing but the submission is measured) and of `cuCtxGetCurrent`.
fn launch_rate(p: &Probe, count: u32) -> Result<(), CudaError> {
    let count = count.clamp(1, 1000); // below the 1024-deep queue: no back-pressure
    let mut long = 2_000_000_000u64 / 1000; // 2 ms: keeps the executor busy
    let r = p.launch(p.spin, &mut [(&mut long as *mut u64).cast()]);
    p.cuda.check("cuLaunchKernel", r)?;
    let t = Instant::now();
    for _ in 0..count {
        let mut ns = 0u64;
        let r = p.launch(p.spin, &mut [(&mut ns as *mut u64).cast()]);
        p.cuda.check("cuLaunchKernel", r)?;
    }
    let launch_ns = t.elapsed().as_nanos() as f64 / f64::from(count);
    let r = p.sync();
    p.cuda.check("cuCtxSynchronize", r)?;
    let mut ctx: Handle = std::ptr::null_mut();
    let n = 100_000;
    let t = Instant::now();
    for _ in 0..n {
        cu!(p.cuda, ctx_get_current, "cuCtxGetCurrent", &mut ctx)?;
    }
    let current_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!("launch_ns={launch_ns:.0} ctx_get_current_ns={current_ns:.1} launches={count}");
    Ok(())
}

fn streams(p: &Probe) -> Result<(), CudaError> {
    let c = &p.cuda;
    let mut primary: Handle = std::ptr::null_mut();
    cu!(c, ctx_get_current, "cuCtxGetCurrent", &mut primary)?;
    let mut buf = 0;
    cu!(c, mem_alloc, "cuMemAlloc", &mut buf, 4096)?;
    cu!(c, memset_d32, "cuMemsetD32", buf, 0, 1024)?;
    let (mut s1, mut e0, mut e1): (Handle, Handle, Handle) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    cu!(c, stream_create, "cuStreamCreate", &mut s1, 1)?;
    cu!(c, event_create, "cuEventCreate", &mut e0, 0)?;
    cu!(c, event_create, "cuEventCreate", &mut e1, 0)?;

    // Stream order and events on one stream.
    cu!(c, event_record, "cuEventRecord", e0, s1)?;
    let mut ns = 40_000_000u64;
    let r = p.launch_on(p.spin, s1, &mut [(&mut ns as *mut u64).cast()]);
    c.check("cuLaunchKernel", r)?;
    cu!(c, memset_d32_async, "cuMemsetD32Async", buf, 7, 1024, s1)?;
    cu!(c, event_record, "cuEventRecord", e1, s1)?;
    // SAFETY: resolved entry points with live handles.
    let (q, eq) = unsafe { ((c.stream_query)(s1), (c.event_query)(e1)) };
    expect!(
        q == CUDA_ERROR_NOT_READY && eq == CUDA_ERROR_NOT_READY,
        "pending work is NOT_READY ({q}, {eq})"
    );
    step("query while pending");

    // Another context's stream waits for e1, then reads the buffer.
    let mut ctx2: Handle = std::ptr::null_mut();
    cu!(c, ctx_create, "cuCtxCreate", &mut ctx2, 0, 0)?;
    let mut s2: Handle = std::ptr::null_mut();
    cu!(c, stream_create, "cuStreamCreate", &mut s2, 1)?;
    cu!(c, stream_wait_event, "cuStreamWaitEvent", s2, e1, 0)?;
    let mut host = vec![0u32; 1024];
    cu!(
        c,
        memcpy_dtoh_async,
        "cuMemcpyDtoHAsync",
        host.as_mut_ptr().cast(),
        buf,
        4096,
        s2
    )?;
    cu!(c, stream_synchronize, "cuStreamSynchronize", s2)?;
    expect!(
        host.iter().all(|&w| w == 7),
        "the copy ran before the event it waited for: {}",
        host[0]
    );
    step("cross-context stream wait");
    cu!(c, ctx_destroy, "cuCtxDestroy", ctx2)?;
    cu!(c, ctx_set_current, "cuCtxSetCurrent", primary)?;

    cu!(c, event_synchronize, "cuEventSynchronize", e1)?;
    let mut ms = 0f32;
    cu!(c, event_elapsed_time, "cuEventElapsedTime", &mut ms, e0, e1)?;
    expect!(
        (39.0..400.0).contains(&ms),
        "elapsed {ms} ms for a 40 ms kernel"
    );
    step("event elapsed time");
    Ok(())
}

fn arg(args: &[String], name: &str) -> Option<u64> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().cloned() else {
        eprintln!("usage: cuprobe vmm|alloc --mib N [--hold-ms M]|nvml --mib N [--hold-ms M]|copy --mib N|spin --ms N --count K|procaddr|launch-rate [--count N]|streams");
        std::process::exit(1);
    };
    let need = |name: &str| {
        arg(&args, name).unwrap_or_else(|| {
            eprintln!("cuprobe {cmd}: {name} N is required");
            std::process::exit(1);
        })
    };
    let p = match Probe::new() {
        Ok(p) => p,
        Err(e) => {
            println!("CUDA {e}");
            std::process::exit(2);
        }
    };
    let r = match cmd.as_str() {
        "vmm" => vmm(&p),
        "alloc" => alloc(&p, need("--mib"), arg(&args, "--hold-ms").unwrap_or(0)),
        "nvml" => nvml(&p, need("--mib"), arg(&args, "--hold-ms").unwrap_or(0)),
        "copy" => copy(&p, need("--mib")),
        "spin" => spin(&p, need("--ms"), need("--count") as u32),
        "procaddr" => procaddr(&p),
        "streams" => streams(&p),
        "launch-rate" => launch_rate(&p, arg(&args, "--count").unwrap_or(1000) as u32),
        other => {
            eprintln!("cuprobe: unknown scenario {other:?}");
            std::process::exit(1);
        }
    };
    match r {
        Ok(()) => println!("PASS {cmd}"),
        Err(e) => {
            println!("CUDA {e}");
            std::process::exit(2);
        }
    }
}
