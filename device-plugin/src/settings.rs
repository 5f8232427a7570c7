//! Flags over the config file: the `[device_plugin]` section of
//! `/etc/kiwi/config.toml` gives defaults, every flag given wins.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kiwi_config::DevicePluginConfig;

use crate::devices::DeviceListStrategy;
use crate::server::{validate_resource_name, Settings};

/// The flags as given (`None`: not given).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub resource_name: Option<String>,
    pub vgpus_per_gpu: Option<u32>,
    pub kubelet_dir: Option<PathBuf>,
    pub device_list_strategy: Option<DeviceListStrategy>,
    pub gpu_list: Option<PathBuf>,
    pub metrics_addr: Option<SocketAddr>,
    pub health_interval_ms: Option<u64>,
}

/// Merges; the error is one line naming the bad key or flag.
pub fn merge(file: &DevicePluginConfig, flags: Overrides) -> Result<Settings, String> {
    let strategy = match flags.device_list_strategy {
        Some(s) => s,
        None => file
            .device_list_strategy
            .parse()
            .map_err(|e| format!("device_plugin.device_list_strategy: {e}"))?,
    };
    let metrics_addr = match flags.metrics_addr {
        Some(a) => Some(a),
        None => match &file.metrics_addr {
            Some(text) => Some(text.parse::<SocketAddr>().map_err(|_| {
                format!(
                    "device_plugin.metrics_addr: {text:?} is not an address like 127.0.0.1:9401"
                )
            })?),
            None => None,
        },
    };
    let vgpus_per_gpu = flags.vgpus_per_gpu.unwrap_or(file.vgpus_per_gpu);
    if vgpus_per_gpu == 0 {
        return Err("--vgpus-per-gpu must be at least 1".into());
    }
    let health_interval_ms = flags.health_interval_ms.unwrap_or(file.health_interval_ms);
    if health_interval_ms == 0 {
        return Err("--health-interval-ms must be at least 1".into());
    }
    let resource_name = flags
        .resource_name
        .unwrap_or_else(|| file.resource_name.clone());
    validate_resource_name(&resource_name)?;
    Ok(Settings {
        resource_name,
        vgpus_per_gpu,
        kubelet_dir: flags
            .kubelet_dir
            .unwrap_or_else(|| file.kubelet_dir.clone()),
        strategy,
        gpu_list: flags.gpu_list.or_else(|| file.gpu_list.clone()),
        metrics_addr,
        health_interval: Duration::from_millis(health_interval_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn file(text: &str) -> DevicePluginConfig {
        kiwi_config::Config::from_str_at(text, Path::new("c.toml"))
            .unwrap()
            .device_plugin
    }

    #[test]
    fn defaults() {
        let s = merge(&DevicePluginConfig::default(), Overrides::default()).unwrap();
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn file_then_flags() {
        let f = file(
            "[device_plugin]\nresource_name = \"example.com/vgpu\"\nvgpus_per_gpu = 4\nkubelet_dir = \"/k\"\n\
             device_list_strategy = \"cdi-cri\"\ngpu_list = \"/etc/kiwi/gpus\"\nmetrics_addr = \"127.0.0.1:9401\"\n\
             health_interval_ms = 250\n",
        );
        let s = merge(&f, Overrides::default()).unwrap();
        assert_eq!(s.resource_name, "example.com/vgpu");
        assert_eq!(s.vgpus_per_gpu, 4);
        assert_eq!(s.kubelet_dir, PathBuf::from("/k"));
        assert_eq!(s.strategy, DeviceListStrategy::CdiCri);
        assert_eq!(s.gpu_list, Some(PathBuf::from("/etc/kiwi/gpus")));
        assert_eq!(s.metrics_addr, Some("127.0.0.1:9401".parse().unwrap()));
        assert_eq!(s.health_interval, Duration::from_millis(250));
        let s = merge(
            &f,
            Overrides {
                vgpus_per_gpu: Some(7),
                device_list_strategy: Some(DeviceListStrategy::Envvar),
                kubelet_dir: Some("/x".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(s.vgpus_per_gpu, 7);
        assert_eq!(s.strategy, DeviceListStrategy::Envvar);
        assert_eq!(s.kubelet_dir, PathBuf::from("/x"));
        assert_eq!(s.resource_name, "example.com/vgpu");
    }

    #[test]
    fn bad_values_name_the_key() {
        let e = merge(
            &file("[device_plugin]\ndevice_list_strategy = \"mounts\"\n"),
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.contains("device_list_strategy"), "{e}");
        let e = merge(
            &file("[device_plugin]\nmetrics_addr = \"nowhere\"\n"),
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.contains("metrics_addr"), "{e}");
        let e = merge(
            &file("[device_plugin]\nresource_name = \"gpu\"\n"),
            Overrides::default(),
        )
        .unwrap_err();
        assert!(e.contains("resource name"), "{e}");
        let e = merge(
            &DevicePluginConfig::default(),
            Overrides {
                vgpus_per_gpu: Some(0),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.contains("vgpus-per-gpu"), "{e}");
    }
}
