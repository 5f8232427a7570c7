//! NVIDIA's own CUDA runtime on the simulator: C programs compiled against the
//! runtime wheel's `cuda_runtime_api.h` and linked against its `libcudart.so.12`
//! (fetched once by `scripts/fetch-cuda-runtime.sh`; needs `gcc` and `pip`, a
//! failure under `CI=true`, a loud skip otherwise) run on the simulator's
//! `libcuda.so.1` and verify every byte they move.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiwi_sim_core::harness::{CudaRuntime, SimMachine};

fn c_source(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(name)
}

/// Compiles `src` into the machine's temp dir and runs it there with `args`.
fn run(rt: &CudaRuntime, m: &SimMachine, src: &str, args: &[&str]) -> Output {
    let exe = m.trace.with_file_name(src.trim_end_matches(".c"));
    rt.compile(&c_source(src), &exe)
        .unwrap_or_else(|e| panic!("{e}"));
    m.apply_with_runtime(&mut Command::new(&exe), rt)
        .args(args)
        .output()
        .expect("running the program")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn assert_ok(o: &Output) {
    assert!(o.status.success(), "{}", text(o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).lines().last(),
        Some("OK"),
        "{}",
        text(o)
    );
}

/// The runtime initializes (its private tables and integrity check answered as the
/// real driver answers them) and its memory, copy, stream and event paths work.
#[test]
fn the_real_cuda_runtime_initializes_and_moves_every_byte() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudart smoke") else {
        return;
    };
    let m = SimMachine::new("cudart", 2, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let o = run(&rt, &m, "cudart_smoke.c", &["2", &(1u64 << 30).to_string()]);
    assert_ok(&o);
}

/// Memcpy and memset work captured into a graph through the runtime does not run
/// at capture; the graph, launched again and again, runs it every time.
#[test]
fn runtime_graphs_of_copies_and_memsets_run_only_when_launched() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudart graphs") else {
        return;
    };
    let m = SimMachine::new("cudart-graph", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let o = run(&rt, &m, "cudart_graph.c", &["16", "5"]);
    assert_ok(&o);
}

/// `cudaMallocAsync`/`cudaFreeAsync` on a non-blocking stream, memory pools,
/// pointer attributes, limits and memory advice through the runtime.
#[test]
fn runtime_stream_ordered_memory_and_pools() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudart stream-ordered memory") else {
        return;
    };
    let m = SimMachine::new("cudart-async", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    let o = run(&rt, &m, "cudart_async_alloc.c", &[]);
    assert_ok(&o);
}

/// Kernels launched through the runtime (a registered fatbin, `cudaLaunchKernel`):
/// the runtime 12.x loads them through `cuLibraryLoadData`, and with lazy loading
/// their code takes device memory at the first launch, which fails with out of
/// memory when it does not fit and works once there is room; with
/// `CUDA_MODULE_LOADING=EAGER` the first launch takes nothing.
#[test]
fn runtime_kernels_load_their_code_at_the_first_launch() {
    let Some(rt) = CudaRuntime::fetch_or_skip("cudart kernels") else {
        return;
    };
    let code = (64u64 << 20).to_string();
    for (mode, eager) in [("lazy", false), ("eager", true), ("full", false)] {
        let m = SimMachine::new(&format!("cudart-kernels-{mode}"), 1, 1 << 30)
            .unwrap_or_else(|e| panic!("{e}"))
            .with_env("KIWI_SIM_MODULE_MEMORY", &code);
        let m = if eager {
            m.with_env("CUDA_MODULE_LOADING", "EAGER")
        } else {
            m
        };
        let o = run(&rt, &m, "cudart_kernels.c", &[mode, &code]);
        assert_ok(&o);
    }
    let m = SimMachine::new("cudart-kernels-run", 1, 1 << 30).unwrap_or_else(|e| panic!("{e}"));
    assert_ok(&run(&rt, &m, "cudart_kernels.c", &["run", "256"]));
}
