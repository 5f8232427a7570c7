//! The vGPU inventory: IDs `<GPU-UUID>::<n>`, the device list the kubelet sees, what
//! `Allocate` puts into a container, and the preferred-allocation policy.
//!
//! Pure functions of the GPU list, the health flags and the request: no I/O, no
//! gRPC plumbing (that is [`crate::plugin`]).

use std::collections::HashMap;
use std::fmt;

use crate::api;
use kiwi_nvml::Gpu;

/// The claim environment variable (DESIGN.md).
pub const VISIBLE_DEVICES_ENV: &str = "KIWI_VISIBLE_DEVICES";
/// Separator between the GPU UUID and the replica number in a vGPU ID.
pub const ID_SEPARATOR: &str = "::";
/// The kubelet's limit on device ID length.
pub const MAX_ID_LEN: usize = 63;
/// Health strings of the API.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
/// The CDI kind of `kiwictl cdi generate`'s spec, whose devices are named by GPU UUID
/// (and index); fixed, whatever the resource name.
pub const CDI_KIND: &str = "kiwi.dev/gpu";
/// The plugin name in CDI annotation keys (`cdi.k8s.io/<name>_<id>`).
pub const CDI_ANNOTATION_PLUGIN: &str = "kiwi-device-plugin";

/// How `Allocate` names devices to the runtime, besides `KIWI_VISIBLE_DEVICES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceListStrategy {
    /// The environment variable only.
    #[default]
    Envvar,
    /// Also CDI device names in the response's `cdi_devices` (kubelet ≥ 1.28 with the
    /// `DevicePluginCDIDevices` gate, GA in 1.31).
    CdiCri,
    /// Also CDI device names in a `cdi.k8s.io/…` container annotation.
    CdiAnnotations,
}

impl std::str::FromStr for DeviceListStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "envvar" => Ok(DeviceListStrategy::Envvar),
            "cdi-cri" => Ok(DeviceListStrategy::CdiCri),
            "cdi-annotations" => Ok(DeviceListStrategy::CdiAnnotations),
            other => Err(format!(
                "device list strategy must be envvar, cdi-cri or cdi-annotations, not {other:?}"
            )),
        }
    }
}

impl fmt::Display for DeviceListStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceListStrategy::Envvar => "envvar",
            DeviceListStrategy::CdiCri => "cdi-cri",
            DeviceListStrategy::CdiAnnotations => "cdi-annotations",
        })
    }
}

/// A request the plugin refuses; becomes an `InvalidArgument` status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("unknown device ID {0:?}")]
    UnknownDevice(String),
    #[error("container request {0} names no device")]
    EmptyRequest(usize),
    #[error("the request has no container")]
    NoContainers,
    #[error("allocation size {size} is smaller than the {must} devices that must be included")]
    SizeBelowMustInclude { size: i32, must: usize },
    #[error("allocation size {0} is not positive")]
    BadSize(i32),
    #[error("device {0:?} must be included but is not available")]
    MustIncludeUnavailable(String),
}

/// Errors building the inventory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    #[error("vGPUs per GPU must be at least 1")]
    NoReplicas,
    #[error("device ID {0:?} is longer than the kubelet's limit of 63 characters")]
    IdTooLong(String),
    #[error("GPU {0} is listed twice")]
    Duplicate(String),
}

/// `<uuid>::<n>`.
pub fn vgpu_id(uuid: &str, n: u32) -> String {
    format!("{uuid}{ID_SEPARATOR}{n}")
}

/// Splits `<uuid>::<n>`.
pub fn parse_vgpu_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, n) = id.rsplit_once(ID_SEPARATOR)?;
    if uuid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((uuid, n.parse().ok()?))
}

/// The GPUs and their vGPUs, fixed for the plugin's life.
#[derive(Debug, Clone)]
pub struct Inventory {
    gpus: Vec<Gpu>,
    vgpus_per_gpu: u32,
    by_uuid: HashMap<String, usize>,
}

impl Inventory {
    pub fn new(gpus: Vec<Gpu>, vgpus_per_gpu: u32) -> Result<Inventory, InventoryError> {
        if vgpus_per_gpu == 0 {
            return Err(InventoryError::NoReplicas);
        }
        let mut by_uuid = HashMap::with_capacity(gpus.len());
        for (pos, gpu) in gpus.iter().enumerate() {
            let longest = vgpu_id(&gpu.uuid, vgpus_per_gpu - 1);
            if longest.len() > MAX_ID_LEN {
                return Err(InventoryError::IdTooLong(longest));
            }
            if by_uuid.insert(gpu.uuid.clone(), pos).is_some() {
                return Err(InventoryError::Duplicate(gpu.uuid.clone()));
            }
        }
        Ok(Inventory {
            gpus,
            vgpus_per_gpu,
            by_uuid,
        })
    }

    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    pub fn vgpus_per_gpu(&self) -> u32 {
        self.vgpus_per_gpu
    }

    /// Number of vGPUs advertised.
    pub fn vgpu_count(&self) -> usize {
        self.gpus.len() * self.vgpus_per_gpu as usize
    }

    /// The position in [`Self::gpus`] of the GPU behind a vGPU ID.
    pub fn gpu_of(&self, id: &str) -> Result<usize, RequestError> {
        let unknown = || RequestError::UnknownDevice(id.to_string());
        let (uuid, n) = parse_vgpu_id(id).ok_or_else(unknown)?;
        if n >= self.vgpus_per_gpu {
            return Err(unknown());
        }
        self.by_uuid.get(uuid).copied().ok_or_else(unknown)
    }

    /// The device list for `ListAndWatch`; `healthy[i]` is GPU `i`'s health.
    pub fn device_list(&self, healthy: &[bool]) -> api::ListAndWatchResponse {
        let mut devices = Vec::with_capacity(self.vgpu_count());
        for (pos, gpu) in self.gpus.iter().enumerate() {
            let health = if healthy.get(pos).copied().unwrap_or(true) {
                HEALTHY
            } else {
                UNHEALTHY
            };
            let topology = gpu.numa_node.map(|node| api::TopologyInfo {
                nodes: vec![api::NumaNode { id: node }],
            });
            for n in 0..self.vgpus_per_gpu {
                devices.push(api::Device {
                    id: vgpu_id(&gpu.uuid, n),
                    health: health.to_string(),
                    topology: topology.clone(),
                });
            }
        }
        api::ListAndWatchResponse { devices }
    }

    /// What one container gets for `ids`: `KIWI_VISIBLE_DEVICES` with each GPU once,
    /// in GPU index order, plus CDI names if the strategy asks for them.
    pub fn allocate(
        &self,
        ids: &[String],
        strategy: DeviceListStrategy,
        cdi_kind: &str,
    ) -> Result<api::ContainerAllocateResponse, RequestError> {
        let mut positions: Vec<usize> = Vec::with_capacity(ids.len());
        for id in ids {
            let pos = self.gpu_of(id)?;
            if !positions.contains(&pos) {
                positions.push(pos);
            }
        }
        positions.sort_by_key(|&p| (self.gpus[p].index, p));
        let uuids: Vec<&str> = positions
            .iter()
            .map(|&p| self.gpus[p].uuid.as_str())
            .collect();
        let mut resp = api::ContainerAllocateResponse::default();
        resp.envs
            .insert(VISIBLE_DEVICES_ENV.to_string(), uuids.join(","));
        let cdi_names = || uuids.iter().map(|u| format!("{cdi_kind}={u}"));
        match strategy {
            DeviceListStrategy::Envvar => {}
            DeviceListStrategy::CdiCri => {
                resp.cdi_devices = cdi_names().map(|name| api::CdiDevice { name }).collect();
            }
            DeviceListStrategy::CdiAnnotations => {
                // The key's name part must be unique per container and at most 63
                // characters: the first GPU's UUID (≤ 44 characters) does both, as a
                // container's GPUs are distinct.
                let key = format!("cdi.k8s.io/{CDI_ANNOTATION_PLUGIN}_{}", uuids[0]);
                resp.annotations
                    .insert(key, cdi_names().collect::<Vec<_>>().join(","));
            }
        }
        Ok(resp)
    }

    /// The preferred `allocation_size` vGPUs out of `available`, keeping
    /// `must_include`: each next vGPU comes from the GPU this container uses least,
    /// then a healthy one, then the least loaded (fewest vGPUs taken, counting those
    /// not offered as taken), then the lowest index. So k vGPUs land on k distinct
    /// GPUs whenever k GPUs have a free vGPU, spread over the least-used GPUs.
    pub fn preferred(
        &self,
        available: &[String],
        must_include: &[String],
        allocation_size: i32,
        healthy: &[bool],
    ) -> Result<Vec<String>, RequestError> {
        if allocation_size <= 0 {
            return Err(RequestError::BadSize(allocation_size));
        }
        let size = allocation_size as usize;
        if size < must_include.len() {
            return Err(RequestError::SizeBelowMustInclude {
                size: allocation_size,
                must: must_include.len(),
            });
        }
        // free[g]: vGPU IDs of GPU g offered and not yet chosen.
        let mut free: Vec<Vec<&str>> = vec![Vec::new(); self.gpus.len()];
        for id in available {
            let pos = self.gpu_of(id)?;
            if !free[pos].contains(&id.as_str()) {
                free[pos].push(id);
            }
        }
        let mut load: Vec<usize> = free
            .iter()
            .map(|f| (self.vgpus_per_gpu as usize).saturating_sub(f.len()))
            .collect();
        let mut mine = vec![0usize; self.gpus.len()];
        let mut chosen: Vec<String> = Vec::with_capacity(size);
        for id in must_include {
            let pos = self.gpu_of(id)?;
            if chosen.contains(id) {
                continue;
            }
            match free[pos].iter().position(|f| f == id) {
                Some(i) => {
                    free[pos].remove(i);
                }
                None => return Err(RequestError::MustIncludeUnavailable(id.clone())),
            }
            load[pos] += 1;
            mine[pos] += 1;
            chosen.push(id.clone());
        }
        // Highest replica first, so pop() takes the lowest: stable, readable answers.
        for f in &mut free {
            f.sort_by_key(|id| parse_vgpu_id(id).map(|(_, n)| n).unwrap_or(u32::MAX));
            f.reverse();
        }
        while chosen.len() < size {
            let best = (0..self.gpus.len())
                .filter(|&g| !free[g].is_empty())
                .min_by_key(|&g| {
                    let sick = !healthy.get(g).copied().unwrap_or(true);
                    (mine[g], sick, load[g], self.gpus[g].index)
                });
            let Some(g) = best else { break };
            let id = free[g].pop().expect("filtered on non-empty");
            load[g] += 1;
            mine[g] += 1;
            chosen.push(id.to_string());
        }
        Ok(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiwi_nvml::{fake_uuid, FakeGpus};

    fn inv(gpus: u32, per: u32) -> Inventory {
        Inventory::new(FakeGpus::new(gpus).gpus(), per).unwrap()
    }

    fn id(g: u32, n: u32) -> String {
        vgpu_id(&fake_uuid(g), n)
    }

    fn all_ids(inv: &Inventory) -> Vec<String> {
        inv.device_list(&[])
            .devices
            .into_iter()
            .map(|d| d.id)
            .collect()
    }

    fn gpu_positions(inv: &Inventory, ids: &[String]) -> Vec<usize> {
        ids.iter().map(|i| inv.gpu_of(i).unwrap()).collect()
    }

    #[test]
    fn ids_round_trip_and_fit_the_kubelet_limit() {
        let uuid = "GPU-8f6a0c5e-7b1d-4c2e-9a3f-1d2e3f4a5b6c";
        let id = vgpu_id(uuid, 63);
        assert_eq!(parse_vgpu_id(&id), Some((uuid, 63)));
        assert!(id.len() <= MAX_ID_LEN);
        assert_eq!(parse_vgpu_id("GPU-x"), None);
        assert_eq!(parse_vgpu_id("GPU-x::"), None);
        assert_eq!(parse_vgpu_id("::3"), None);
        assert_eq!(parse_vgpu_id("GPU-x::-1"), None);
        assert_eq!(parse_vgpu_id("GPU-x::+1"), None);
    }

    #[test]
    fn inventory_refuses_long_ids_and_duplicates() {
        let long = Gpu::new(0, format!("GPU-{}", "a".repeat(60)));
        assert!(matches!(
            Inventory::new(vec![long], 1),
            Err(InventoryError::IdTooLong(_))
        ));
        let g = Gpu::new(0, fake_uuid(0));
        assert!(matches!(
            Inventory::new(vec![g.clone(), g], 1),
            Err(InventoryError::Duplicate(_))
        ));
        assert_eq!(
            Inventory::new(vec![], 0).unwrap_err(),
            InventoryError::NoReplicas
        );
    }

    #[test]
    fn device_list_has_every_vgpu_with_health_and_numa() {
        let inv = inv(2, 3);
        let list = inv.device_list(&[true, false]).devices;
        assert_eq!(list.len(), 6);
        assert_eq!(list[0].id, id(0, 0));
        assert_eq!(list[5].id, id(1, 2));
        assert!(list[..3].iter().all(|d| d.health == HEALTHY));
        assert!(list[3..].iter().all(|d| d.health == UNHEALTHY));
        assert_eq!(list[4].topology.as_ref().unwrap().nodes[0].id, 1);
    }

    #[test]
    fn unknown_ids_are_refused() {
        let inv = inv(2, 3);
        for bad in [
            "nonsense".to_string(),
            id(5, 0),
            id(0, 3),
            format!("{}::x", fake_uuid(0)),
        ] {
            assert_eq!(
                inv.allocate(
                    std::slice::from_ref(&bad),
                    DeviceListStrategy::Envvar,
                    "kiwi.dev/gpu"
                ),
                Err(RequestError::UnknownDevice(bad))
            );
        }
    }

    #[test]
    fn allocate_counts_a_gpu_once_in_index_order() {
        let inv = inv(3, 4);
        let r = inv
            .allocate(
                &[id(2, 1), id(0, 3), id(2, 0)],
                DeviceListStrategy::Envvar,
                "kiwi.dev/gpu",
            )
            .unwrap();
        assert_eq!(
            r.envs[VISIBLE_DEVICES_ENV],
            format!("{},{}", fake_uuid(0), fake_uuid(2))
        );
        assert!(r.cdi_devices.is_empty());
        assert!(r.annotations.is_empty());
    }

    #[test]
    fn allocate_cdi_strategies() {
        let inv = inv(2, 4);
        let ids = [id(1, 0), id(0, 2)];
        let cri = inv
            .allocate(&ids, DeviceListStrategy::CdiCri, "kiwi.dev/gpu")
            .unwrap();
        let names: Vec<_> = cri.cdi_devices.iter().map(|d| d.name.clone()).collect();
        assert_eq!(
            names,
            vec![
                format!("kiwi.dev/gpu={}", fake_uuid(0)),
                format!("kiwi.dev/gpu={}", fake_uuid(1))
            ]
        );
        assert!(cri.envs.contains_key(VISIBLE_DEVICES_ENV));
        let ann = inv
            .allocate(&ids, DeviceListStrategy::CdiAnnotations, "kiwi.dev/gpu")
            .unwrap();
        let (key, value) = ann.annotations.iter().next().unwrap();
        assert_eq!(
            key,
            &format!("cdi.k8s.io/kiwi-device-plugin_{}", fake_uuid(0))
        );
        assert!(key.len() - "cdi.k8s.io/".len() <= 63);
        assert_eq!(value, &names.join(","));
    }

    #[test]
    fn strategy_parses() {
        assert_eq!("cdi-cri".parse(), Ok(DeviceListStrategy::CdiCri));
        assert_eq!("envvar".parse(), Ok(DeviceListStrategy::Envvar));
        assert!("volume-mounts".parse::<DeviceListStrategy>().is_err());
    }

    #[test]
    fn preferred_gives_distinct_gpus() {
        let inv = inv(4, 8);
        let all = all_ids(&inv);
        let pick = inv.preferred(&all, &[], 3, &[]).unwrap();
        let mut gpus = gpu_positions(&inv, &pick);
        gpus.sort();
        gpus.dedup();
        assert_eq!(gpus.len(), 3, "{pick:?}");
        // More than there are GPUs: every GPU once, then again.
        let pick = inv.preferred(&all, &[], 6, &[]).unwrap();
        let gpus = gpu_positions(&inv, &pick);
        for g in 0..4 {
            let n = gpus.iter().filter(|&&x| x == g).count();
            assert!((1..=2).contains(&n), "{gpus:?}");
        }
    }

    #[test]
    fn preferred_spreads_over_least_loaded() {
        let inv = inv(3, 4);
        // GPU 0 has one vGPU taken, GPU 1 three, GPU 2 none.
        let available: Vec<String> = all_ids(&inv)
            .into_iter()
            .filter(|i| ![id(0, 0), id(1, 0), id(1, 1), id(1, 2)].contains(i))
            .collect();
        let pick = inv.preferred(&available, &[], 1, &[]).unwrap();
        assert_eq!(gpu_positions(&inv, &pick), vec![2]);
        let pick = inv.preferred(&available, &[], 2, &[]).unwrap();
        assert_eq!(gpu_positions(&inv, &pick), vec![2, 0]);
        // Healthy before unhealthy.
        let pick = inv
            .preferred(&available, &[], 1, &[true, true, false])
            .unwrap();
        assert_eq!(gpu_positions(&inv, &pick), vec![0]);
    }

    #[test]
    fn preferred_keeps_must_include_and_avoids_its_gpu() {
        let inv = inv(3, 4);
        let all = all_ids(&inv);
        let pick = inv.preferred(&all, &[id(1, 2)], 2, &[]).unwrap();
        assert_eq!(pick[0], id(1, 2));
        assert_ne!(inv.gpu_of(&pick[1]).unwrap(), 1);
        assert!(matches!(
            inv.preferred(&all, &[id(0, 0), id(0, 1)], 1, &[]),
            Err(RequestError::SizeBelowMustInclude { .. })
        ));
        assert!(matches!(
            inv.preferred(&all, &[], 0, &[]),
            Err(RequestError::BadSize(0))
        ));
        assert!(matches!(
            inv.preferred(&all[1..], &[id(0, 0)], 1, &[]),
            Err(RequestError::MustIncludeUnavailable(_))
        ));
        assert!(matches!(
            inv.preferred(&["bogus".into()], &[], 1, &[]),
            Err(RequestError::UnknownDevice(_))
        ));
    }

    #[test]
    fn preferred_never_exceeds_what_is_offered() {
        let inv = inv(2, 2);
        let offered = vec![id(0, 1), id(1, 0)];
        let pick = inv.preferred(&offered, &[], 5, &[]).unwrap();
        assert_eq!(pick.len(), 2);
        assert!(pick.iter().all(|p| offered.contains(p)));
    }

    mod properties {
        use super::*;
        use proptest::collection::vec;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn preferred_allocation_invariants(
                gpus in 1u32..6,
                per in 1u32..6,
                taken in vec(any::<bool>(), 36),
                must_mask in vec(any::<bool>(), 36),
                size in 1i32..12,
            ) {
                let inv = inv(gpus, per);
                let all = all_ids(&inv);
                let available: Vec<String> = all
                    .iter()
                    .zip(&taken)
                    .filter(|(_, t)| !**t)
                    .map(|(i, _)| i.clone())
                    .collect();
                let must: Vec<String> = available
                    .iter()
                    .zip(&must_mask)
                    .filter(|(_, m)| **m)
                    .map(|(i, _)| i.clone())
                    .take(size as usize)
                    .collect();
                let pick = inv.preferred(&available, &must, size, &[]).unwrap();
                // Must-include first, then only offered IDs, no repeats, as many as possible.
                prop_assert_eq!(&pick[..must.len()], &must[..]);
                prop_assert!(pick.iter().all(|p| available.contains(p)));
                let mut unique = pick.clone();
                unique.sort();
                unique.dedup();
                prop_assert_eq!(unique.len(), pick.len());
                prop_assert_eq!(pick.len(), (size as usize).min(available.len()));
                let mut free = vec![0usize; gpus as usize];
                for a in &available {
                    free[inv.gpu_of(a).unwrap()] += 1;
                }
                let gpus_with_free = free.iter().filter(|f| **f > 0).count();
                if must.is_empty() && pick.len() <= gpus_with_free {
                    // k vGPUs on k distinct GPUs.
                    let mut g = gpu_positions(&inv, &pick);
                    g.sort();
                    g.dedup();
                    prop_assert_eq!(g.len(), pick.len());
                }
                if must.is_empty() && !pick.is_empty() {
                    // The first pick is on a least-loaded GPU.
                    let most_free = *free.iter().max().unwrap();
                    prop_assert_eq!(free[inv.gpu_of(&pick[0]).unwrap()], most_free);
                }
            }
        }
    }
}
