//! The run loop: every device set up (with the exchange and the IPC pair), the
//! `ready` line, the wait for the start, the phases, the final verification and
//! the teardown.

use std::time::Duration;

use crate::cu;
use crate::driver::Cuda;
use crate::exchange::Exchange;
use crate::ipc::{self, Role};
use crate::memory;

use super::device::{grow, make_current, open_device, retain_primary, Device};
use super::phases::{self, host_work, Phase};
use super::report::Report;
use super::step::burst;
use super::verify::verify_all;
use super::{discard, monotonic_ns, shared, Failure, Options};

/// Runs the whole program; prints as it goes.
pub fn run(cuda: &Cuda, o: &Options) -> Result<(), Failure> {
    let rep = Report::new(o);
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
    let shared = shared::open(cuda, o, &mut devs)?;
    if o.discard {
        discard::start_discarding(&o.name, devs.iter().filter_map(|d| d.tail).collect());
    }
    let allocations: usize = devs.iter().map(|d| d.allocs.len()).sum();
    let ordinals = o
        .devices
        .iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    rep.ready(
        o,
        devs.len(),
        ex.as_ref(),
        shared.as_ref(),
        allocations,
        &ordinals,
    );

    wait_for_start(o)?;
    let mut b: u32 = 0;
    let mut step_ms: Vec<f64> = Vec::new();
    for phase in phases::planned(o) {
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
        rep.phase(phase.kind(), start_ns);
    }
    let verified = verify_all(cuda, &devs);
    rep.verified(allocations, devs.len(), &ordinals, verified.is_ok());
    verified?;
    shared::finish(cuda, o, &devs)?;
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
    rep.end(ex.is_some(), &step_ms);
    Ok(())
}

/// `--start-at-ns` or `--start-on-stdin`: sleeps until the agreed CLOCK_MONOTONIC
/// nanosecond (read from standard input first with the latter).
fn wait_for_start(o: &Options) -> Result<(), Failure> {
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
    Ok(())
}
