//! A GPU phase: one step of GPU work on every device, its wait measured, with
//! `--exchange` the step's write and wait on the peer, and its `burst` line.

use std::time::{Duration, Instant};

use crate::cu;
use crate::driver::{Cuda, CudaError, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use crate::exchange::Exchange;

use super::device::{make_current, mem_kernel, mix, spin, Device};
use super::report::Report;
use super::verify::verify_all;
use super::{Failure, Options};

/// One GPU burst of `gpu_ms` per device. On each device in turn (its context made
/// current): a 1 ms probe kernel (its wait is the time the GPU kept us waiting),
/// `kiwi_add` over every allocation, then short spin kernels queued asynchronously
/// until the burst's GPU time on that device is made up (with `--exchange`, then
/// the step's write and wait on the peer). Then every device's context is
/// synchronized (and verified with `--verify`). Returns the step's time in ms:
/// from the first submission to the end of the synchronization.
pub(super) fn burst(
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
