//! What a simulated GPU answers beyond its memory and processes (which come from the
//! machine segment): the sensors, clocks, links and modes of an idle A100 SXM4, the
//! board the CUDA stand-in describes (compute capability 8.0, `CU_DEVICE_ATTRIBUTE_
//! CLOCK_RATE` 1755 MHz, memory clock 1593 MHz, PCI device id 0x20b0). Plain values,
//! no C: the exports in `crate::telemetry` and `crate::modes` write them out.
//!
//! The simulator does not sample kernel activity, so every GPU reads as an idle one
//! (0 % utilization, idle clocks and power) whatever runs on it; the process lists
//! and memory are live.

/// GPU die temperature, °C.
pub(crate) const TEMPERATURE_C: u32 = 30;

/// An SXM board is cooled by the chassis: it has no fan of its own, so
/// `nvmlDeviceGetFanSpeed` is `NOT_SUPPORTED` (`None`, as every `Option` here) and
/// `nvmlDeviceGetNumFans` 0.
pub(crate) const FAN_SPEED_PERCENT: Option<u32> = None;
pub(crate) const FANS: u32 = 0;

/// Power draw and limits, milliwatts (an A100 SXM4 idles near 50 W of its 400 W).
pub(crate) const POWER_DRAW_MW: u32 = 52_000;
pub(crate) const POWER_LIMIT_MW: u32 = 400_000;
pub(crate) const POWER_LIMIT_MIN_MW: u32 = 100_000;
const _: () = assert!(POWER_LIMIT_MIN_MW <= POWER_LIMIT_MW && POWER_DRAW_MW < POWER_LIMIT_MW);

/// Percent of the last sample period a kernel ran / device memory was read or
/// written, and the encoder's and decoder's (the simulator samples none of them).
pub(crate) const GPU_UTILIZATION_PERCENT: u32 = 0;
pub(crate) const MEMORY_UTILIZATION_PERCENT: u32 = 0;
pub(crate) const CODEC_UTILIZATION_PERCENT: u32 = 0;
/// The sample period the encoder and decoder utilizations are over, microseconds.
pub(crate) const CODEC_SAMPLING_PERIOD_US: u32 = 167_000;

/// (current, maximum) clock in MHz of each `nvmlClockType_t`: graphics, SM, memory,
/// video. Idle: the core clocks are down; HBM runs at its one speed.
pub(crate) const CLOCKS_MHZ: [(u32, u32); 4] =
    [(210, 1755), (210, 1755), (1593, 1593), (585, 1440)];

/// PCIe link: generation 4, 16 lanes, both as trained now and as the maximum.
pub(crate) const PCIE_GENERATION: u32 = 4;
pub(crate) const PCIE_WIDTH: u32 = 16;
/// PCIe traffic over the last sample period, KB/s (not sampled).
pub(crate) const PCIE_THROUGHPUT_KBPS: u32 = 0;

/// CUDA compute capability, as `cuDeviceGetAttribute` reports it.
pub(crate) const COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Modes of a datacenter GPU as shipped: persistence on (the daemon keeps the driver
/// loaded), ECC on with no errors counted, no display attached, MIG capable but
/// off, compute mode default.
pub(crate) const PERSISTENCE_MODE_ENABLED: bool = true;
pub(crate) const ECC_ENABLED: bool = true;
pub(crate) const ECC_ERRORS: u64 = 0;
pub(crate) const DISPLAY_ATTACHED: bool = false;

/// The driver model (WDDM/TCC/MCDM) exists on Windows only: `NOT_SUPPORTED` on Linux.
pub(crate) const DRIVER_MODEL: Option<u32> = None;

/// The name `nvmlSystemGetProcessName` gives a process: the first word of its
/// command line (`/proc/<pid>/cmdline`), or its `comm` for one without (a kernel
/// thread, a zombie); `None` when there is no such process.
pub(crate) fn process_name(pid: u32) -> Option<String> {
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    if let Ok(cmdline) = std::fs::read(proc_dir.join("cmdline")) {
        let first = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        if !first.is_empty() {
            return Some(String::from_utf8_lossy(first).into_owned());
        }
    }
    std::fs::read_to_string(proc_dir.join("comm"))
        .ok()
        .map(|c| c.trim_end_matches('\n').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_clocks_are_at_most_the_maximum() {
        for (current, max) in CLOCKS_MHZ {
            assert!(current > 0 && current <= max, "{current} > {max}");
        }
    }

    #[test]
    fn a_process_is_named_by_its_command_line() {
        let me = process_name(std::process::id()).expect("this process has a name");
        let exe = std::env::args().next().unwrap();
        assert_eq!(me, exe);
        assert_eq!(process_name(u32::MAX), None, "no such process");
    }
}
