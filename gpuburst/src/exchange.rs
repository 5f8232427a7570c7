//! `--exchange FILE:RANK`: two ranks that wait on each other every step without
//! kernels, as NCCL ranks do, so a "2-GPU job" (two processes with one GPU each, or
//! one process with two GPUs) can be run and timed.
//!
//! FILE is a small shared file (4096 bytes, created or extended as needed) that
//! every rank maps `MAP_SHARED` and registers with the driver as mapped, portable
//! host memory. Slot `r` is the u32 at byte `64 * r`. At the end of step `s`
//! (counted from 1) rank `r` enqueues, on its device's stream after the step's
//! work, `cuStreamWriteValue32(slot r, s)` then `cuStreamWaitValue32(slot 1 - r >=
//! s)`: its stream finishes the step only once the peer's reached it too.
//!
//! This module owns the option's syntax, the shared file and the two stream
//! operations; the program's loop (`burst`) decides when they happen and polls
//! the stream against `--exchange-timeout-ms`.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::driver::{CUdeviceptr, Cuda, CudaError, ExchangeApi, Handle};
// The flags the exchange passes: the host page is registered in every context with a
// device address; a wait is `(int32_t)(*addr - value) >= 0`; a write is ordered
// after earlier work.
use kiwi_cuda::sys::{
    CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE, CU_STREAM_WAIT_VALUE_GEQ,
    CU_STREAM_WRITE_VALUE_DEFAULT,
};

/// Bytes of the shared file that are mapped (one page).
pub const FILE_BYTES: usize = 4096;
/// Bytes between two ranks' slots (a cache line each).
pub const SLOT_STRIDE: u64 = 64;
/// `--exchange-timeout-ms` when not given.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;

/// Which ranks this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// One rank (0 or 1) on the program's one device.
    One(u32),
    /// Both ranks: the first listed device is rank 0, the second rank 1.
    Both,
}

/// A parsed `--exchange FILE:RANK`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeSpec {
    pub path: PathBuf,
    pub ranks: Ranks,
}

impl ExchangeSpec {
    /// The rank of each device, in the listed order.
    pub fn device_ranks(&self) -> Vec<u32> {
        match self.ranks {
            Ranks::One(r) => vec![r],
            Ranks::Both => vec![0, 1],
        }
    }

    /// Refuses a device list this spec cannot use: one rank runs on one device,
    /// `both` on exactly two.
    pub fn check_devices(&self, devices: &[i32]) -> Result<(), String> {
        match self.ranks {
            Ranks::One(r) if devices.len() != 1 => Err(format!(
                "--exchange: rank {r} runs on one device, not {} (use FILE:both with two devices)",
                devices.len()
            )),
            Ranks::Both if devices.len() != 2 => Err(format!(
                "--exchange: FILE:both needs exactly two devices (--device 0,1), not {}",
                devices.len()
            )),
            _ => Ok(()),
        }
    }
}

/// Parses `FILE:RANK` (RANK `0`, `1` or `both`). The rank follows the last colon,
/// so FILE may hold colons.
pub fn parse_exchange(s: &str) -> Result<ExchangeSpec, String> {
    let (path, rank) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("--exchange: {s:?} is not FILE:RANK (RANK 0, 1 or both)"))?;
    if path.is_empty() {
        return Err(format!("--exchange: {s:?} names no file (FILE:RANK)"));
    }
    let ranks = match rank {
        "0" => Ranks::One(0),
        "1" => Ranks::One(1),
        "both" => Ranks::Both,
        other => return Err(format!("--exchange: rank {other:?} is not 0, 1 or both")),
    };
    Ok(ExchangeSpec {
        path: PathBuf::from(path),
        ranks,
    })
}

/// The device address of rank `rank`'s slot in a mapping at `base`.
pub fn slot_address(base: CUdeviceptr, rank: u32) -> CUdeviceptr {
    base + SLOT_STRIDE * u64::from(rank)
}

/// The other rank.
pub fn peer(rank: u32) -> u32 {
    1 - rank
}

/// The shared file's first page, mapped `MAP_SHARED` (unmapped on drop).
pub struct SharedFile {
    ptr: *mut c_void,
    path: PathBuf,
}

impl SharedFile {
    /// Opens `path` for reading and writing (created if missing, extended to
    /// [`FILE_BYTES`] if shorter) and maps its first page.
    pub fn open(path: &Path) -> Result<SharedFile, String> {
        use std::os::fd::AsRawFd;
        let shown = path.display();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("--exchange: cannot open {shown} for writing: {e}"))?;
        let len = f
            .metadata()
            .map_err(|e| format!("--exchange: cannot stat {shown}: {e}"))?
            .len();
        // Both ranks may get here at once: extending to the same length is
        // idempotent and leaves a slot the peer already wrote as it is.
        if len < FILE_BYTES as u64 {
            f.set_len(FILE_BYTES as u64).map_err(|e| {
                format!("--exchange: cannot extend {shown} to {FILE_BYTES} bytes: {e}")
            })?;
        }
        // SAFETY: a fresh shared mapping of an open file descriptor at least
        // FILE_BYTES long; the mapping outlives the descriptor, which is closed
        // when `f` drops.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "--exchange: cannot map {shown}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(SharedFile {
            ptr,
            path: path.to_path_buf(),
        })
    }

    /// The mapping's host address.
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rank `rank`'s slot, as the host sees it (the GPUs and the peer write it).
    pub fn slot(&self, rank: u32) -> &AtomicU32 {
        assert!(rank < 2, "rank {rank}");
        // SAFETY: the mapping is page-aligned and FILE_BYTES long, so the slot is
        // aligned for a u32 and inside it; it lives as long as `self`. Other
        // writers (the peer process, the GPUs) only store whole aligned u32s.
        unsafe { AtomicU32::from_ptr(self.ptr.cast::<u8>().add(64 * rank as usize).cast()) }
    }

    /// The value in rank `rank`'s slot.
    pub fn step_of(&self, rank: u32) -> u32 {
        self.slot(rank).load(Ordering::Acquire)
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping `open` made, exactly once.
        unsafe { libc::munmap(self.ptr, FILE_BYTES) };
    }
}

/// An exchange in use: the shared file, registered with the driver, and each
/// device's rank and device address of the mapping (in the listed order).
pub struct Exchange {
    pub api: ExchangeApi,
    pub file: SharedFile,
    pub spec: ExchangeSpec,
    registered: bool,
    /// Per device, in the listed order: (rank, device address of the mapping).
    lanes: Vec<(u32, CUdeviceptr)>,
}

impl Exchange {
    /// Resolves the driver's entry points and maps the file; no driver call is
    /// made yet. Errors are one line, for exit code 1.
    pub fn open(cuda: &Cuda, spec: &ExchangeSpec) -> Result<Exchange, String> {
        let api = cuda
            .exchange_api()
            .map_err(|e| format!("--exchange needs stream memory operations: {e}"))?;
        let file = SharedFile::open(&spec.path)?;
        for rank in spec.device_ranks() {
            let v = file.step_of(rank);
            if v != 0 {
                return Err(format!(
                    "--exchange: slot {rank} of {} already holds step {v} (left by an earlier run?): use a fresh file per job",
                    spec.path.display()
                ));
            }
        }
        Ok(Exchange {
            api,
            file,
            spec: spec.clone(),
            registered: false,
            lanes: Vec::new(),
        })
    }

    /// Registers the mapping as portable, device-mapped host memory. A context must
    /// be current.
    pub fn register(&mut self, cuda: &Cuda) -> Result<(), CudaError> {
        // SAFETY: a live, page-aligned mapping of FILE_BYTES owned by `self.file`,
        // which is unregistered (`unregister`) before it is unmapped or the process
        // ends.
        let r = unsafe {
            (self.api.mem_host_register)(
                self.file.as_ptr(),
                FILE_BYTES,
                CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        cuda.check("cuMemHostRegister_v2", r)?;
        self.registered = true;
        Ok(())
    }

    /// Adds the next device (its context current) as `rank`: looks up the
    /// mapping's device address in that context.
    pub fn add_device(&mut self, cuda: &Cuda, rank: u32) -> Result<(), CudaError> {
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: a valid out-pointer and the registered mapping's host address.
        let r = unsafe { (self.api.mem_host_get_device_pointer)(&mut dptr, self.file.as_ptr(), 0) };
        cuda.check("cuMemHostGetDevicePointer_v2", r)?;
        self.lanes.push((rank, dptr));
        Ok(())
    }

    /// The rank of the `i`-th listed device.
    pub fn rank_of(&self, i: usize) -> u32 {
        self.lanes[i].0
    }

    /// Enqueues the end of `step` for the `i`-th listed device (its context
    /// current) on its legacy stream, where gpuburst queues all its work: write the
    /// step into its rank's slot, then wait until the peer's slot holds at least
    /// `step`.
    pub fn enqueue_step(&self, cuda: &Cuda, i: usize, step: u32) -> Result<(), CudaError> {
        let stream: Handle = std::ptr::null_mut();
        let (rank, base) = self.lanes[i];
        // SAFETY: the slot's device address in this context, inside the registered
        // mapping, which stays registered and mapped until the stream is idle.
        let r = unsafe {
            (self.api.stream_write_value32)(
                stream,
                slot_address(base, rank),
                step,
                CU_STREAM_WRITE_VALUE_DEFAULT,
            )
        };
        cuda.check("cuStreamWriteValue32_v2", r)?;
        // SAFETY: as above, for the peer's slot.
        let r = unsafe {
            (self.api.stream_wait_value32)(
                stream,
                slot_address(base, peer(rank)),
                step,
                CU_STREAM_WAIT_VALUE_GEQ,
            )
        };
        cuda.check("cuStreamWaitValue32_v2", r)
    }

    /// The one-line error of a step that did not finish in `timeout_ms`, naming
    /// where each rank of this process stands and what it waits for.
    pub fn timeout_message(&self, step: u32, timeout_ms: u64) -> String {
        let waits = self
            .spec
            .device_ranks()
            .into_iter()
            .map(|r| {
                let p = peer(r);
                format!(
                    "rank {r} at step {}, waiting for rank {p} (at step {})",
                    self.file.step_of(r),
                    self.file.step_of(p)
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        format!(
            "--exchange {}: step {step} did not finish within {timeout_ms} ms ({waits}): is the peer running?",
            self.file.path().display()
        )
    }

    /// Unregisters the mapping (every stream using it must be idle).
    pub fn unregister(&mut self, cuda: &Cuda) -> Result<(), CudaError> {
        if !std::mem::take(&mut self.registered) {
            return Ok(());
        }
        // SAFETY: the host address registered by `register`; no work uses it now.
        let r = unsafe { (self.api.mem_host_unregister)(self.file.as_ptr()) };
        cuda.check("cuMemHostUnregister", r)
    }
}

/// The nearest-rank percentile `p` (0 < p <= 100) of `values`; `None` when empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(
            parse_exchange("/tmp/x:0"),
            Ok(ExchangeSpec {
                path: "/tmp/x".into(),
                ranks: Ranks::One(0)
            })
        );
        assert_eq!(parse_exchange("x:1").unwrap().ranks, Ranks::One(1));
        assert_eq!(parse_exchange("x:both").unwrap().ranks, Ranks::Both);
        // The rank follows the last colon.
        assert_eq!(parse_exchange("a:b:1").unwrap().path, PathBuf::from("a:b"));
        for bad in ["x", "x:2", "x:", ":0", "x:-1", "x:BOTH", "x:0,1", ""] {
            let e = parse_exchange(bad).unwrap_err();
            assert!(e.starts_with("--exchange"), "{bad}: {e}");
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn ranks_map_to_devices() {
        let one = parse_exchange("f:1").unwrap();
        assert_eq!(one.device_ranks(), vec![1]);
        assert!(one.check_devices(&[3]).is_ok());
        assert!(one.check_devices(&[0, 1]).is_err());
        let both = parse_exchange("f:both").unwrap();
        assert_eq!(both.device_ranks(), vec![0, 1]);
        assert!(both.check_devices(&[1, 0]).is_ok());
        assert!(both.check_devices(&[0]).is_err());
        assert!(both.check_devices(&[0, 1, 2]).is_err());
        assert_eq!(slot_address(0x1000, 0), 0x1000);
        assert_eq!(slot_address(0x1000, 1), 0x1040);
        assert_eq!((peer(0), peer(1)), (1, 0));
    }

    fn temp_path(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "gpuburst-exchange-{tag}-{}-{}",
            std::process::id(),
            crate::burst::monotonic_ns()
        ))
    }

    #[test]
    fn the_file_is_created_or_extended_and_shared() {
        let p = temp_path("shared");
        let a = SharedFile::open(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), FILE_BYTES as u64);
        let b = SharedFile::open(&p).unwrap();
        a.slot(1).store(7, Ordering::Release);
        assert_eq!(b.step_of(1), 7);
        assert_eq!(b.step_of(0), 0);
        // The value is in the file at byte 64 (little-endian u32).
        drop((a, b));
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[64..68], &7u32.to_le_bytes());
        // A shorter file is extended, its bytes kept; a longer one is left alone.
        std::fs::write(&p, [1u8, 0, 0, 0]).unwrap();
        let c = SharedFile::open(&p).unwrap();
        assert_eq!((c.step_of(0), c.step_of(1)), (1, 0));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), FILE_BYTES as u64);
        drop(c);
        std::fs::write(&p, vec![0u8; 3 * FILE_BYTES]).unwrap();
        drop(SharedFile::open(&p).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 3 * FILE_BYTES as u64);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn an_unusable_file_is_a_one_line_error() {
        let dir = temp_path("dir");
        std::fs::create_dir(&dir).unwrap();
        for p in [dir.clone(), dir.join("missing-dir/f")] {
            let e = SharedFile::open(&p).err().expect("refused");
            assert!(e.starts_with("--exchange: cannot open"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[5.0, 1.0, 3.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[5.0, 1.0, 3.0], 100.0), Some(5.0));
    }
}
