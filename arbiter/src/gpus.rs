//! What the arbiter knows about the node's GPUs, and the rule a registration's claim
//! (GPU UUID and total memory) must pass before it creates or joins a GPU entry.
//!
//! With NVML (`libnvidia-ml.so.1`, loaded with `dlopen` at start through the shared
//! `kiwi-nvml` crate, as the device plugin does) the arbiter knows each GPU's UUID and
//! memory itself: a registration for another UUID, or claiming more memory than the
//! GPU has, is refused. Without NVML the first registration of a UUID sets its size,
//! a later different size is refused, and the table holds at most [`MAX_GPUS`].
//! The server owns the table itself (`server::state::State::gpus`); this module decides.

use kiwi_nvml::{LoadError, Nvml, NvmlError, NVML_LIBRARY};

/// Most GPU entries the arbiter keeps; registrations for more GPUs are refused.
pub const MAX_GPUS: usize = 64;

/// How far below NVML's total a client's total may be: CUDA's `cuDeviceTotalMem`
/// leaves out memory the driver reserves for itself (a few hundred MiB, under 1% on
/// current GPUs), which NVML's `total` counts.
pub const NVML_TOTAL_SLACK_DIVISOR: u64 = 16;

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownGpu {
    pub index: u32,
    pub uuid: String,
    pub total_bytes: u64,
}

/// Where the truth about GPUs comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GpuTruth {
    /// No NVML: the first registration of a UUID sets its size.
    #[default]
    Claims,
    /// NVML's GPUs: nothing else exists.
    Nvml(Vec<KnownGpu>),
}

/// `--nvml` / `[arbiter] nvml`: where to find NVML, parsed once by the settings
/// (`kiwi_config::Nvml`).
pub use kiwi_config::Nvml as NvmlSetting;

/// Why the GPU table could not be read from NVML.
#[derive(Debug, thiserror::Error)]
pub enum GpusError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("NVML: {0}")]
    Call(#[from] NvmlError),
}

/// A GPU's memory in use, as the driver counts it (every process's, Kiwi's clients and
/// others alike): the evidence a holder's `no_room` is checked against.
pub trait UsedMemory: Send + Sync + std::fmt::Debug {
    /// Bytes in use on the GPU with this UUID now; `None`: not known.
    fn used_bytes(&self, uuid: &str) -> Option<u64>;

    /// Each process with memory on that GPU and how much (`(host pid, bytes)`);
    /// `None`: not known.
    fn process_bytes(&self, _uuid: &str) -> Option<Vec<(u32, u64)>> {
        None
    }
}

/// [`UsedMemory`] from NVML (`nvmlDeviceGetMemoryInfo`,
/// `nvmlDeviceGetComputeRunningProcesses_v3`).
pub struct NvmlUsed(Nvml);

impl std::fmt::Debug for NvmlUsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlUsed")
    }
}

impl UsedMemory for NvmlUsed {
    fn used_bytes(&self, uuid: &str) -> Option<u64> {
        let d = self.0.handle_by_uuid(uuid).ok()?;
        self.0.memory(d).ok().map(|m| m.used)
    }

    fn process_bytes(&self, uuid: &str) -> Option<Vec<(u32, u64)>> {
        let d = self.0.handle_by_uuid(uuid).ok()?;
        self.0.compute_processes(d).ok()
    }
}

/// What [`load`] found: the GPU table's source, a line saying which, and NVML for
/// used-memory questions when it loaded.
#[derive(Debug)]
pub struct Loaded {
    pub truth: GpuTruth,
    pub line: String,
    pub used: Option<std::sync::Arc<dyn UsedMemory>>,
}

/// Reads the node's GPUs from the NVML at `library`.
pub fn from_nvml(library: &str) -> Result<Vec<KnownGpu>, GpusError> {
    Ok(open_nvml(library)?.1)
}

/// Loads NVML and reads its GPUs; the library stays loaded in the first half.
fn open_nvml(library: &str) -> Result<(Nvml, Vec<KnownGpu>), GpusError> {
    let nvml = Nvml::load(library)?;
    let mut gpus = Vec::new();
    for i in 0..nvml.device_count()? {
        let d = nvml.handle_by_index(i)?;
        gpus.push(KnownGpu {
            index: nvml.index(d).unwrap_or(i),
            uuid: nvml.uuid(d)?,
            total_bytes: nvml.memory(d)?.total,
        });
    }
    Ok((nvml, gpus))
}

/// The GPU table's source for `setting`, and a line saying which it is.
/// `Auto` falls back to [`GpuTruth::Claims`] when NVML cannot be loaded or read;
/// an explicit path must work.
pub fn load(setting: &NvmlSetting) -> Result<Loaded, GpusError> {
    let describe = |gpus: &[KnownGpu], lib: &str| {
        let list: Vec<String> = gpus
            .iter()
            .map(|g| format!("{} = {} ({} MiB)", g.index, g.uuid, g.total_bytes >> 20))
            .collect();
        format!("GPUs from NVML ({lib}): {}", list.join(", "))
    };
    let found = |nvml: Nvml, gpus: Vec<KnownGpu>, lib: &str| Loaded {
        line: describe(&gpus, lib),
        truth: GpuTruth::Nvml(gpus),
        used: Some(std::sync::Arc::new(NvmlUsed(nvml))),
    };
    let claims = |line: String| Loaded {
        truth: GpuTruth::Claims,
        line,
        used: None,
    };
    match setting {
        NvmlSetting::Off => Ok(claims(
            "NVML off: each GPU's size comes from its first registration".into(),
        )),
        NvmlSetting::Path(p) => {
            let lib = p.display().to_string();
            let (nvml, gpus) = open_nvml(&lib)?;
            Ok(found(nvml, gpus, &lib))
        }
        NvmlSetting::Auto => match open_nvml(NVML_LIBRARY) {
            Ok((nvml, gpus)) => Ok(found(nvml, gpus, NVML_LIBRARY)),
            Err(e) => Ok(claims(format!(
                "no NVML ({e}): each GPU's size comes from its first registration"
            ))),
        },
    }
}

/// Why a registration is refused (the text goes to the client as is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("GPU {uuid} is not on this node (NVML knows: {known})")]
    UnknownGpu { uuid: String, known: String },
    #[error("GPU {uuid} has {actual} bytes of memory ({source_of_truth}), not {claimed}")]
    WrongTotal {
        uuid: String,
        claimed: u64,
        actual: u64,
        source_of_truth: &'static str,
    },
    #[error("GPU {uuid} would be past the arbiter's limit of {max} GPUs")]
    TooManyGpus { uuid: String, max: usize },
}

/// A registration that passed: join the existing entry, or create one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Join the GPU's entry; `raise_to`: a total larger than the entry's, still
    /// within NVML's, which the entry should take.
    Join { raise_to: Option<u64> },
    /// Create the entry with this index and total.
    Create { index: u32, total: u64 },
}

/// The entries the server has: UUID → (index, total).
pub trait Entries {
    fn entry(&self, uuid: &str) -> Option<(u32, u64)>;
    fn count(&self) -> usize;
    fn index_used(&self, index: u32) -> bool;
}

impl GpuTruth {
    /// Whether the table's entries stay when their last client leaves (NVML's GPUs
    /// do; without NVML an empty entry is dropped, so made-up UUIDs do not pile up).
    pub fn keeps_empty_entries(&self) -> bool {
        matches!(self, GpuTruth::Nvml(_))
    }

    /// Checks a registration for `uuid` claiming `claimed` bytes of GPU memory.
    pub fn check(
        &self,
        entries: &impl Entries,
        uuid: &str,
        claimed: u64,
    ) -> Result<Admit, Refusal> {
        let existing = entries.entry(uuid);
        match self {
            GpuTruth::Nvml(known) => {
                let Some(g) = known.iter().find(|g| g.uuid == uuid) else {
                    return Err(Refusal::UnknownGpu {
                        uuid: uuid.to_string(),
                        known: if known.is_empty() {
                            "no GPUs".into()
                        } else {
                            known
                                .iter()
                                .map(|g| g.uuid.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        },
                    });
                };
                let low = g.total_bytes - g.total_bytes / NVML_TOTAL_SLACK_DIVISOR;
                if !(low..=g.total_bytes).contains(&claimed) {
                    return Err(Refusal::WrongTotal {
                        uuid: uuid.to_string(),
                        claimed,
                        actual: g.total_bytes,
                        source_of_truth: "NVML",
                    });
                }
                Ok(match existing {
                    Some((_, total)) => Admit::Join {
                        raise_to: (claimed > total).then_some(claimed),
                    },
                    None => Admit::Create {
                        index: g.index,
                        total: claimed,
                    },
                })
            }
            GpuTruth::Claims => match existing {
                Some((_, total)) if total != claimed => Err(Refusal::WrongTotal {
                    uuid: uuid.to_string(),
                    claimed,
                    actual: total,
                    source_of_truth: "as first registered",
                }),
                Some(_) => Ok(Admit::Join { raise_to: None }),
                None if entries.count() >= MAX_GPUS => Err(Refusal::TooManyGpus {
                    uuid: uuid.to_string(),
                    max: MAX_GPUS,
                }),
                None => Ok(Admit::Create {
                    index: (0..).find(|&i| !entries.index_used(i)).unwrap_or(0),
                    total: claimed,
                }),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const GIB: u64 = 1 << 30;

    struct Table(BTreeMap<String, (u32, u64)>);

    impl Entries for Table {
        fn entry(&self, uuid: &str) -> Option<(u32, u64)> {
            self.0.get(uuid).copied()
        }
        fn count(&self) -> usize {
            self.0.len()
        }
        fn index_used(&self, index: u32) -> bool {
            self.0.values().any(|&(i, _)| i == index)
        }
    }

    fn nvml() -> GpuTruth {
        GpuTruth::Nvml(vec![
            KnownGpu {
                index: 0,
                uuid: "GPU-a".into(),
                total_bytes: 16 * GIB,
            },
            KnownGpu {
                index: 1,
                uuid: "GPU-b".into(),
                total_bytes: 16 * GIB,
            },
        ])
    }

    #[test]
    fn nvml_refuses_unknown_gpus_and_inflated_totals() {
        let t = Table(BTreeMap::new());
        let e = nvml().check(&t, "GPU-made-up", 16 * GIB).unwrap_err();
        assert!(matches!(e, Refusal::UnknownGpu { .. }), "{e}");
        assert!(e.to_string().contains("GPU-a, GPU-b"), "{e}");
        let e = nvml().check(&t, "GPU-a", u64::MAX).unwrap_err();
        assert!(e.to_string().contains("NVML"), "{e}");
        // Far below is refused too: it would shrink the GPU for everyone.
        assert!(nvml().check(&t, "GPU-a", GIB).is_err());
        assert_eq!(
            nvml().check(&t, "GPU-b", 16 * GIB),
            Ok(Admit::Create {
                index: 1,
                total: 16 * GIB
            })
        );
        // CUDA's total, a little under NVML's, is the honest answer on real GPUs.
        let cuda = 16 * GIB - 470 * (1 << 20);
        assert!(nvml().check(&t, "GPU-a", cuda).is_ok());
    }

    #[test]
    fn nvml_raises_an_entry_to_a_larger_honest_total() {
        let mut t = Table(BTreeMap::new());
        t.0.insert("GPU-a".into(), (0, 15 * GIB));
        assert_eq!(
            nvml().check(&t, "GPU-a", 16 * GIB),
            Ok(Admit::Join {
                raise_to: Some(16 * GIB)
            })
        );
        assert_eq!(
            nvml().check(&t, "GPU-a", 15 * GIB),
            Ok(Admit::Join { raise_to: None })
        );
    }

    #[test]
    fn without_nvml_the_first_total_stands() {
        let mut t = Table(BTreeMap::new());
        assert_eq!(
            GpuTruth::Claims.check(&t, "GPU-x", 16 * GIB),
            Ok(Admit::Create {
                index: 0,
                total: 16 * GIB
            })
        );
        t.0.insert("GPU-x".into(), (0, 16 * GIB));
        let e = GpuTruth::Claims.check(&t, "GPU-x", u64::MAX).unwrap_err();
        assert!(e.to_string().contains("as first registered"), "{e}");
        assert_eq!(
            GpuTruth::Claims.check(&t, "GPU-x", 16 * GIB),
            Ok(Admit::Join { raise_to: None })
        );
        // Indexes of dropped entries are reused, lowest first.
        assert_eq!(
            GpuTruth::Claims.check(&t, "GPU-y", GIB),
            Ok(Admit::Create {
                index: 1,
                total: GIB
            })
        );
    }

    #[test]
    fn without_nvml_the_table_is_capped() {
        let mut t = Table(BTreeMap::new());
        for i in 0..MAX_GPUS as u32 {
            t.0.insert(format!("GPU-{i}"), (i, GIB));
        }
        let e = GpuTruth::Claims.check(&t, "GPU-new", GIB).unwrap_err();
        assert!(e.to_string().contains("limit of 64 GPUs"), "{e}");
        assert!(GpuTruth::Claims.check(&t, "GPU-3", GIB).is_ok());
    }

    #[test]
    fn auto_without_the_library_falls_back_and_a_path_must_load() {
        // No NVML on this path: explicit is an error, naming the library.
        let e = load(&NvmlSetting::Path("/nonexistent/libnvidia-ml.so.1".into())).unwrap_err();
        assert!(
            e.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
            "{e}"
        );
        let l = load(&NvmlSetting::Off).unwrap();
        assert_eq!(l.truth, GpuTruth::Claims);
        assert!(l.used.is_none());
        assert!(l.line.contains("NVML off"), "{}", l.line);
    }
}
