//! gpuburst's command line: [`Options`] and their parsing, the checks between
//! options, and `--device`'s list. What each option does is the run's (see
//! [`super::run()`]); a `--script`'s phases are [`super::phases`]'s.

use crate::exchange::{self, ExchangeSpec};
use crate::ipc::{self, IpcSpec, Role};
use crate::memory::AllocMode;

use super::phases::{parse_script, Phase};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::Role;

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
}
