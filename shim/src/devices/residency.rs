//! [`DeviceResidency`]: the [`Residency`] the client swaps and drains a device
//! through, over its allocator, with the application's context current and the
//! application's managed memory moved along.

use super::*;

/// [`Residency`] over device `.0`'s allocator; drives the driver from the shim's thread.
pub(super) struct DeviceResidency(pub(super) usize);

impl DeviceResidency {
    fn with<T>(&self, default: T, f: impl FnOnce(&mut Memory<RealDriver>) -> T) -> T {
        let mut guard = mem_lock(self.0);
        match guard.as_mut() {
            Some(m) => crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                // Pinning swap buffers is a potentially unsafe call: relaxed, it never
                // invalidates the application's captures.
                let _relaxed = crate::capture::Relaxed::enter();
                f(m)
            }),
            None => default,
        }
    }
}

impl DeviceResidency {
    /// Moves the application's managed memory on this device to the host or back
    /// ([`crate::managed`]), with its context current, adding to `swap`.
    fn migrate_managed(&self, to_host: bool, swap: &mut Swap) -> Result<(), CUresult> {
        let (bytes, took) = crate::ffi::inside(|| {
            let _ctx = AppContext::enter(self.0);
            let _relaxed = crate::capture::Relaxed::enter();
            crate::managed::migrate(self.0, to_host)
        })?;
        swap.bytes += bytes;
        swap.moved += bytes;
        swap.duration += took;
        Ok(())
    }
}

impl Residency for DeviceResidency {
    /// The allocator's figures, with the application's managed memory on this device
    /// counted as working set (resident unless a swap-out moved it to the host).
    fn figures(&self) -> Figures {
        let mut f = mem_lock(self.0)
            .as_ref()
            .map(|m| m.figures())
            .unwrap_or_default();
        let (managed, on_gpu) = crate::managed::bytes(self.0);
        f.working_set += managed;
        f.resident += on_gpu;
        f
    }
    fn set_limit(&self, limit: u64) {
        if let Some(m) = mem_lock(self.0).as_mut() {
            m.set_limit(limit);
        }
    }
    fn set_backing_allowed(&self, allowed: bool) {
        if let Some(m) = mem_lock(self.0).as_mut() {
            m.set_backing_allowed(allowed);
        }
    }
    fn all_resident(&self) -> bool {
        mem_lock(self.0).as_ref().is_none_or(|m| m.all_resident())
            && crate::managed::resident(self.0)
    }
    // Swap copies run on the legacy stream, which a capture on a blocking stream
    // forbids: they wait for such captures to end (the swap is refused, never forced
    // through a capture, when one outlasts the wait).
    fn swap_in_all(&self) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut swap = self.with(Ok(Swap::default()), |m| m.swap_in_all())?;
        self.migrate_managed(false, &mut swap)?;
        Ok(swap)
    }
    fn swap_in_waiting(&self, until: std::time::Instant) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut swap = self.with(Ok(Swap::default()), |m| m.swap_in_until(Some(until)))?;
        self.migrate_managed(false, &mut swap)?;
        Ok(swap)
    }
    /// Asks the application which of its memory is dead first ([`crate::hint`]), when
    /// the gate is closed (its work drained, nothing new can run): bytes it declared
    /// dead since its last submission are not copied.
    fn evict(&self, need: u64) -> Result<Swap, CUresult> {
        if !crate::capture::legacy_usable(crate::capture::CAPTURE_WAIT) {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let gate = &crate::gate::GATE;
        if need > 0 && !gate.is_open() {
            crate::hint::request(gate.token(), crate::hint::wait());
        }
        let mut swap = self.with(Ok(Swap::default()), |m| {
            m.evict_live(need, Some(gate.token()))
        })?;
        // Managed memory goes when what the allocator freed is not enough (the
        // driver pages it; a prefetch to the host frees its device memory at once).
        if need > swap.moved {
            self.migrate_managed(true, &mut swap)?;
        }
        Ok(swap)
    }
    /// Registers outside the allocator's lock, one segment's buffer at a time (a swap-in
    /// that meets a buffer being registered copies from it as pageable memory; one its
    /// segment let go meanwhile is freed when the registration ends).
    fn register_swapped(&self, budget: u64) -> Result<u64, CUresult> {
        let mut done = 0;
        while done < budget {
            let Some((drv, (ptr, cap))) = mem_lock(self.0)
                .as_mut()
                .and_then(|m| Some((*m.driver(), m.register_next()?)))
            else {
                break;
            };
            let r = crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                let _relaxed = crate::capture::Relaxed::enter();
                drv.host_register(ptr, cap)
            });
            if let Some(m) = mem_lock(self.0).as_mut() {
                m.finish_register(ptr, r.is_ok());
            }
            r?;
            done += cap;
        }
        Ok(done)
    }
    /// Pins outside the allocator's lock (page-locking runs at a few GB/s): a swap,
    /// an allocation or a release never waits behind it.
    fn prepare_swap_out(&self, need: u64, budget: u64) -> Result<u64, CUresult> {
        let Some((drv, missing)) = mem_lock(self.0)
            .as_ref()
            .map(|m| (*m.driver(), m.swap_out_shortfall(need)))
        else {
            return Ok(0);
        };
        let mut done = 0;
        for size in missing {
            if done > 0 && done + size > budget {
                break;
            }
            let p = crate::ffi::inside(|| {
                let _ctx = AppContext::enter(self.0);
                let _relaxed = crate::capture::Relaxed::enter();
                drv.host_alloc(size)
            })?;
            match mem_lock(self.0).as_mut() {
                // SAFETY: `p` is a fresh buffer of `size` bytes from this allocator's
                // driver, owned by nobody else.
                Some(m) => unsafe { m.add_spare(p, size) },
                None => drv.host_free(p, size),
            }
            done += size;
        }
        Ok(done)
    }
    fn trim_spare_buffers(&self) -> u64 {
        self.with(0, |m| m.release_spares())
    }
    /// One buffer per hold of the allocator's lock: a swap-in waits for one spill at
    /// most.
    fn spill(&self, budget: u64) -> u64 {
        let mut done = 0;
        while done < budget {
            let n = self.with(0, |m| m.spill_one());
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    }
    fn locked(&self, f: &mut dyn FnMut(bool) -> bool) -> bool {
        let guard = mem_lock(self.0);
        f(guard.as_ref().is_none_or(|m| m.all_resident()))
    }
    /// Waits for the context's queued work. While a stream captures the driver refuses
    /// that (and invalidates the capture), so a drain waits for the captures to end
    /// first: a drop that arrives during a capture is answered when it ends, within
    /// [`crate::capture::CAPTURE_WAIT`]. The idle detector drains with the gate open:
    /// for it a capture in progress is work in progress, and the drain returns after
    /// [`crate::capture::IDLE_PROBE`], which it reads as busy.
    /// [`Self::drain`], waiting at most `limit` for the context's queue (on the
    /// device's drainer lane, which goes on waiting in the background): `Ok(false)`
    /// when it did not finish in time, or a capture did not end within
    /// [`crate::capture::CAPTURE_WAIT`].
    fn drain_within(&self, limit: std::time::Duration) -> Result<bool, CUresult> {
        crate::ffi::inside(|| match AppContext::enter(self.0) {
            Some(_ctx) => {
                let ctx = current_context();
                let app = APP_CTX[self.0].load(Ordering::Acquire);
                let done = std::cell::Cell::new(false);
                let sync = || {
                    let whole = drainer::drain(self.0, ctx, limit)
                        .unwrap_or_else(|| call!(cuCtxSynchronize: fn()()).map(|()| true))?;
                    if whole {
                        synchronize_others(self.0, app)?;
                    }
                    done.set(whole);
                    Ok(())
                };
                match crate::capture::sync_when_quiet(crate::capture::CAPTURE_WAIT, sync) {
                    Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) => Ok(false),
                    r => r.map(|()| done.get()),
                }
            }
            None => Ok(true),
        })
    }
    fn drain(&self) -> Result<(), CUresult> {
        crate::ffi::inside(|| match AppContext::enter(self.0) {
            Some(_ctx) => {
                let probing = crate::gate::GATE.is_open();
                let patience = if probing {
                    crate::capture::IDLE_PROBE
                } else {
                    crate::capture::CAPTURE_WAIT
                };
                let app = APP_CTX[self.0].load(Ordering::Acquire);
                let sync = || {
                    call!(cuCtxSynchronize: fn()())?;
                    synchronize_others(self.0, app)
                };
                match crate::capture::sync_when_quiet(patience, sync) {
                    Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) if probing => Ok(()),
                    r => r,
                }
            }
            None => Ok(()),
        })
    }
}
