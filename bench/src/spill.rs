//! `spill`: the swap pool's disk tier against the plain disk, in the same run.
//!
//! When host memory runs short, the arbiter's swap pool moves swapped-out GPU memory
//! that a client no longer maps to disk ([`Pool::spill`]): each 64 MiB memfd slice is
//! written to a nameless `O_TMPFILE` of its own in the spill directory (`pwrite` from
//! a read-only shared mapping of the slice, `fdatasync`, `POSIX_FADV_DONTNEED`), and
//! the client is sent read-only descriptors, from which it reads its data back at
//! swap-in the way the shim does (`shim/src/pool.rs`, `read_back`: a read-only
//! `MAP_POPULATE` mapping of each file, copied out, then `DONTNEED`).
//!
//! Both directions are disk-bound, so the right yardstick is what this disk does for a
//! program that simply writes and reads a file, not the memory copy the swap path is
//! otherwise measured against: the figures are
//!
//! - `spill_out`: the throughput of `Pool::spill` over 512 MiB of filled slices (256
//!   MiB with `--quick`), against a plain `write` + `fdatasync` + `DONTNEED` of the
//!   same bytes from an ordinary buffer to one new file in the same directory;
//! - `spill_out_vs_preallocated`: the same spills against the same plain write to a
//!   file allocated first (`fallocate`, as the pool allocates every spill file): on
//!   ext4 a buffered write into blocks not yet allocated (delayed allocation) can be
//!   several times slower than the disk, which would flatter the tier;
//! - `spill_in`: the throughput of reading those spill files back as the shim does,
//!   into a preallocated, already-touched buffer (the bytes are checked: a difference
//!   fails the run), against a plain sequential `read` of the baseline file into the
//!   same buffer, after its pages were dropped from the page cache.
//!
//! The ratio says what the tier's own mechanics (one file per slice, `fallocate`, the
//! faults of the mappings, the `/proc` reopen, the pool's bookkeeping) cost over the
//! disk itself. The disk is shared with whatever else the machine does, so every
//! measurement is repeated (interleaved with its baselines, which goes first turning
//! with each round) and the median is reported, with every round's range. Everything happens in a fresh subdirectory of
//! `--dir` (default: the temp dir), removed at the end.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use kiwi_arbiter::pool::{Lent, Pool, PoolConfig, SpillConfig, Spilled};
use kiwi_cuda::filemap::{self, FilePart};

use crate::report::{percentile, Figure};

const SCEN: &str = "spill";
const MIB: u64 = 1 << 20;
/// The pool's slices (its default).
const SLICE: u64 = 64 * MIB;
/// The one client of the pool here.
const OWNER: u64 = 1;
const TENANT: &str = "bench";
/// Measurements of each kind (the median is reported).
const ROUNDS: usize = 3;

/// The scenario: figures as the module doc says. `parent`: where the spill directory
/// is made (default: [`std::env::temp_dir`]).
pub fn spill(quick: bool, parent: Option<&Path>) -> Result<Vec<Figure>> {
    let bytes: u64 = if quick { 256 * MIB } else { 512 * MIB };
    let len = usize::try_from(bytes)?;
    let parent = parent.map_or_else(std::env::temp_dir, Path::to_path_buf);
    let dir = tempfile::Builder::new()
        .prefix("kiwi-bench-spill-")
        .tempdir_in(&parent)
        .with_context(|| format!("cannot make a spill directory in {}", parent.display()))?;
    let fs = fs_name(dir.path());

    let pool = Pool::start(PoolConfig::new(2 * bytes)).context("starting the swap pool")?;
    pool.enable_spill(SpillConfig {
        dir: dir.path().to_path_buf(),
        budget: None,
    })
    .context("enabling the disk tier")?;

    let mut src = vec![0u8; len];
    // Preallocated and touched once here (and cleared before every read, which keeps
    // it touched): no read below faults in its destination.
    let mut dst = vec![0u8; len];
    dst.fill(0xa5);

    let (mut out_pool, mut out_plain, mut out_prealloc) = (Vec::new(), Vec::new(), Vec::new());
    let (mut in_pool, mut in_plain) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        fill_pattern(&mut src, round as u64 + 1);

        // The pool's side: slices lent and filled through shared mappings (untimed),
        // then the spill of all of them (timed).
        let lent = pool
            .take(OWNER, TENANT, bytes)
            .context("taking slices from the pool")?;
        let ids: Vec<u64> = lent.iter().map(|l| l.id).collect();
        fill_slices(&lent, &src)?;
        let plain_path = dir.path().join(format!("plain-{round}"));
        let prealloc_path = dir.path().join(format!("preallocated-{round}"));

        // The three writes take turns at going first.
        let mut spilled = Vec::new();
        for turn in (0..3).map(|k| (round + k) % 3) {
            if turn == 0 {
                let t = Instant::now();
                spilled = pool
                    .spill(OWNER, TENANT, &ids)
                    .context("spilling the slices")?;
                out_pool.push(gbps(bytes, t.elapsed().as_nanos()));
                // As the arbiter does once its answer is sent: the slices are taken
                // back, scrubbed on the pool's thread, not beside the next
                // measurement.
                pool.spill_sent(OWNER);
                pool.settle(std::time::Duration::from_secs(10));
                check_spilled(&spilled, &lent, bytes)?;
            } else if turn == 1 {
                out_plain.push(gbps(bytes, plain_write(&plain_path, &src, false)?));
            } else {
                out_prealloc.push(gbps(bytes, plain_write(&prealloc_path, &src, true)?));
            }
        }
        drop(lent);
        // Only written: its blocks are freed before the reads.
        std::fs::remove_file(&prealloc_path)
            .with_context(|| format!("cannot remove {}", prealloc_path.display()))?;

        // Both files' pages are clean (synced) and were dropped from the page cache
        // when written; they are dropped again here so that both reads start alike.
        // DONTNEED does not evict dirty pages, which is why it comes only after the
        // fdatasync. On some filesystems (and below a VM's virtual disk, the host's
        // cache) part of a read may still be served from a cache: both sides get the
        // same treatment, so the ratio stands.
        let plain = File::open(&plain_path)
            .with_context(|| format!("cannot open {}", plain_path.display()))?;
        drop_cache(plain.as_fd(), bytes);
        for s in &spilled {
            drop_cache(s.fd.as_fd(), s.bytes);
        }
        let pool_first = round % 2 == 0;
        for pool_turn in [pool_first, !pool_first] {
            dst.fill(0);
            if pool_turn {
                let t = Instant::now();
                read_back(&spilled, &mut dst)?;
                in_pool.push(gbps(bytes, t.elapsed().as_nanos()));
                verify(&dst, &src, "read back from the spill files")?;
            } else {
                let t = Instant::now();
                plain_read(&plain, &mut dst)?;
                in_plain.push(gbps(bytes, t.elapsed().as_nanos()));
                verify(&dst, &src, "read back from the plain file")?;
            }
        }

        // Everything back: the spill ids to the pool (it closes its descriptors), ours
        // closed (the files' blocks are freed), the plain file removed.
        let spill_ids: Vec<u64> = spilled.iter().map(|s| s.id).collect();
        pool.give(OWNER, &spill_ids);
        drop(spilled);
        drop(plain);
        std::fs::remove_file(&plain_path)
            .with_context(|| format!("cannot remove {}", plain_path.display()))?;
    }
    let stats = pool.stats();
    ensure!(
        stats.lent == 0 && stats.spilled == 0 && stats.spill_files == 0,
        "the pool still holds {} bytes lent and {} bytes in {} spill files",
        stats.lent,
        stats.spilled,
        stats.spill_files
    );
    let page_mode = stats.page_mode;
    pool.shutdown();
    drop(pool);
    dir.close().context("removing the spill directory")?;

    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{lo:.2}-{hi:.2}")
    };
    let out_text = format!(
        "plain write + fdatasync + DONTNEED of the same bytes from a buffer to one new file, \
         same directory ({fs}); median of {ROUNDS}, interleaved; rounds: spill {} GB/s, \
         plain {} GB/s; {} MiB slices, {page_mode} pages",
        range(&out_pool),
        range(&out_plain),
        SLICE / MIB
    );
    let prealloc_text = format!(
        "the same plain write to a new file allocated first (fallocate, as every spill \
         file is), same directory; median of {ROUNDS}, interleaved; rounds: {} GB/s",
        range(&out_prealloc)
    );
    let in_text = format!(
        "plain sequential read of that file, dropped from the page cache, into the same \
         buffer; median of {ROUNDS}, interleaved; rounds: spill {} GB/s, plain {} GB/s; \
         bytes checked",
        range(&in_pool),
        range(&in_plain)
    );
    Ok(vec![
        Figure::new(SCEN, "spill_out", percentile(&mut out_pool, 50.0), "GB/s")
            .against(percentile(&mut out_plain, 50.0), &out_text)
            .goal("ratio >= 0.7"),
        Figure::new(
            SCEN,
            "spill_out_vs_preallocated",
            percentile(&mut out_pool, 50.0),
            "GB/s",
        )
        .against(percentile(&mut out_prealloc, 50.0), &prealloc_text)
        .goal("ratio >= 0.7"),
        Figure::new(SCEN, "spill_in", percentile(&mut in_pool, 50.0), "GB/s")
            .against(percentile(&mut in_plain, 50.0), &in_text)
            .goal("ratio >= 0.7"),
        Figure::new(SCEN, "spilled_per_round", (bytes / MIB) as f64, "MiB"),
        Figure::new(SCEN, "rounds", ROUNDS as f64, "n"),
    ])
}

/// Bytes per nanosecond: GB/s.
fn gbps(bytes: u64, ns: u128) -> f64 {
    bytes as f64 / ns.max(1) as f64
}

/// Non-zero data, different in every round (`seed`): every byte has its low bit set.
fn fill_pattern(buf: &mut [u8], seed: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let x = (i as u64 ^ seed.rotate_left(40)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        w.copy_from_slice(&(x | 0x0101_0101_0101_0101).to_le_bytes());
    }
}

/// Copies `src` into the lent slices, in order, through a read-write shared mapping
/// of each (as a client's swap-out does).
fn fill_slices(lent: &[Lent], src: &[u8]) -> Result<()> {
    let total: u64 = lent.iter().map(|l| l.bytes).sum();
    ensure!(
        total == src.len() as u64,
        "the pool lent {total} bytes for {}",
        src.len()
    );
    let mut at = 0usize;
    for l in lent {
        let n = usize::try_from(l.bytes)?;
        // SAFETY: a new shared read-write mapping of a descriptor we hold, at an
        // address of the kernel's choosing; nothing else is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                l.fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            bail!("mmap of a lent slice: {}", std::io::Error::last_os_error());
        }
        // SAFETY: `p` is our own writable mapping of `n` bytes (the slice is sealed
        // against shrinking, so every page is there), `src[at..at + n]` is in bounds
        // (the lengths sum to `src.len()`), and the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), p.cast::<u8>(), n) };
        // SAFETY: the mapping made above, not referenced after this.
        unsafe { libc::munmap(p, n) };
        at += n;
    }
    Ok(())
}

/// The spill answered one file per slice, in order, each of the slice's size.
fn check_spilled(spilled: &[Spilled], lent: &[Lent], bytes: u64) -> Result<()> {
    ensure!(
        spilled.len() == lent.len()
            && spilled
                .iter()
                .zip(lent)
                .all(|(s, l)| s.from == l.id && s.bytes == l.bytes),
        "the spill answered {} files for {} slices",
        spilled.len(),
        lent.len()
    );
    let total: u64 = spilled.iter().map(|s| s.bytes).sum();
    ensure!(total == bytes, "{total} bytes spilled of {bytes}");
    Ok(())
}

/// The baseline write: `src` to a new file at `path` with `write`, then `fdatasync`
/// and `DONTNEED`, as the pool treats a spill file; `preallocate`: the file's blocks
/// are allocated first (`fallocate`, as the pool does). Returns the nanoseconds taken
/// (creating the file included, as the spill's time includes its files').
fn plain_write(path: &Path, src: &[u8], preallocate: bool) -> Result<u128> {
    let t = Instant::now();
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    if preallocate {
        let len = libc::off_t::try_from(src.len())?;
        // SAFETY: plain syscall on a descriptor we own; no memory is passed.
        if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len) } != 0 {
            let e = std::io::Error::last_os_error();
            bail!("fallocate of {}: {e}", path.display());
        }
    }
    f.write_all(src)
        .with_context(|| format!("writing {}", path.display()))?;
    f.sync_data()
        .with_context(|| format!("syncing {}", path.display()))?;
    drop_cache(f.as_fd(), src.len() as u64);
    Ok(t.elapsed().as_nanos())
}

/// The baseline read: `f` from its start into `dst` with `read`, then `DONTNEED`
/// (the same treatment as [`read_back`]).
fn plain_read(f: &File, dst: &mut [u8]) -> Result<()> {
    let mut r = f;
    r.read_exact(dst).context("reading the plain file")?;
    drop_cache(f.as_fd(), dst.len() as u64);
    Ok(())
}

/// Reads the spill files back into `dst` as the shim does (`shim/src/pool.rs`,
/// `read_back`), through the same code ([`filemap::read_files`]): each file mapped
/// read-only with `MAP_POPULATE` side by side at one address, the whole copied out,
/// unmapped, then each file's pages dropped.
fn read_back(spilled: &[Spilled], dst: &mut [u8]) -> Result<()> {
    let len = dst.len();
    let files: Vec<FilePart> = spilled
        .iter()
        .map(|s| Ok(FilePart::whole(s.fd.as_raw_fd(), usize::try_from(s.bytes)?)))
        .collect::<Result<_>>()?;
    let held: usize = files.iter().map(|f| f.len).sum();
    ensure!(
        held == len,
        "the spill files hold {held} bytes, not the {len} bytes spilled"
    );
    filemap::read_files(&files, |base, n| {
        // SAFETY: `base..base + n` is the read-only mappings of the spill files
        // (`n == len`), which nothing writes (the pool's descriptor is not used until
        // they are given back); `dst` is our own buffer, apart from them.
        unsafe { std::ptr::copy_nonoverlapping(base, dst.as_mut_ptr(), n) }
    })
    .context("mapping the spill files")
}

/// `POSIX_FADV_DONTNEED` over the first `bytes` of `fd`: its clean cached pages go
/// (advice: dirty pages stay, and a failure changes nothing but the timing).
fn drop_cache(fd: BorrowedFd<'_>, bytes: u64) {
    let len = libc::off_t::try_from(bytes).unwrap_or(libc::off_t::MAX);
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let _ = unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, len, libc::POSIX_FADV_DONTNEED) };
}

/// Fails at the first byte of `got` that differs from `want`.
fn verify(got: &[u8], want: &[u8], what: &str) -> Result<()> {
    if got == want {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    bail!(
        "{what}: byte {at} differs ({:#04x}, written {:#04x}); {} and {} bytes",
        got.get(at).copied().unwrap_or(0),
        want.get(at).copied().unwrap_or(0),
        got.len(),
        want.len()
    )
}

/// The filesystem `dir` is on, by its magic number (for the figure's text).
fn fs_name(dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return "unknown filesystem".into();
    };
    // SAFETY: an all-zero `statfs` is a valid value to be overwritten.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a valid out-pointer,
    // both alive for the call.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return "unknown filesystem".into();
    }
    // `f_type` is signed on some targets, unsigned on others: the cast is not
    // needless everywhere; magic numbers are 32 bits.
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as u64 & 0xffff_ffff;
    match magic {
        0xef53 => "ext2/3/4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683e => "btrfs".into(),
        0x0102_1994 => "tmpfs: memory, not a disk".into(),
        0x794c_7630 => "overlayfs".into(),
        0x2fc1_2fc1 => "zfs".into(),
        m => format!("filesystem {m:#x}"),
    }
}
