//! `[arbiter]`: the Kiwi Scheduler's settings, declared once.
//!
//! Each field is a config key (serde) and, where the arbiter has one, the flag of the
//! same name (clap), typed at that edge: a bad value is refused where it is read,
//! with one message, and nothing downstream checks it again. The file gives the
//! defaults' replacements, the command line wins: [`ArbiterConfig::flags`] adds the
//! flags to the arbiter's command, [`ArbiterConfig::merge`] lays the flags given over
//! the section read from the file. Adding a setting is adding a field (and its
//! default).
//!
//! Where a flag and its key differ in unit (`--swap-budget 64GiB` beside
//! `swap_budget_mib = 65536`), both are fields and one accessor (`swap_budget_bytes`)
//! gives the value, the flag's first.

use std::fmt;
use std::path::PathBuf;

use clap::{ArgMatches, Args, Command, FromArgMatches};
use serde::{Deserialize, Deserializer, Serialize};

use crate::quantum::Quantum;
use crate::value::{at_least_one, positive_size_arg, size_arg, ValueError};
use crate::SchedulerMode;

const MIB: u64 = 1 << 20;

/// `[arbiter]`: the Kiwi Scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
// The field docs are the flags' help too, where `[arbiter] key` names a key, no link.
#[allow(rustdoc::broken_intra_doc_links)]
pub struct ArbiterConfig {
    /// Time quantum in seconds (default 30; config: [arbiter] tq_seconds).
    #[arg(long = "tq", value_name = "TQ")]
    pub tq_seconds: Quantum,
    /// Start with the scheduler on or off.
    #[arg(long, value_enum)]
    pub scheduler: SchedulerMode,
    /// How long a holder may ignore a drop before the GPU is taken from it, in ms.
    #[arg(long)]
    pub grace_ms: u64,
    /// On an oversubscribed GPU, ask a client that neither holds nor waits to swap
    /// out in the background after this many idle seconds (default 30; 0: never;
    /// config: [arbiter] idle_evict_seconds).
    #[arg(
        long,
        value_name = "SECONDS",
        allow_hyphen_values = true,
        value_parser = parse_idle_evict_arg
    )]
    #[serde(deserialize_with = "idle_evict_seconds")]
    pub idle_evict_seconds: f64,
    /// GPU memory reserved for contexts, in MiB (default: 1536, at most 1/8 of the GPU).
    #[arg(long)]
    pub reserve_mib: Option<u64>,
    /// Events kept per GPU.
    #[arg(long)]
    pub event_log_capacity: usize,
    /// Serve Prometheus metrics on this address, e.g. 127.0.0.1:9400.
    #[arg(long)]
    pub metrics_addr: Option<String>,
    /// Host RAM this node lends as GPU swap, over all GPUs and clients, e.g. 64GiB or
    /// 512MiB (config: [arbiter] swap_budget_mib). A client whose working set would
    /// push the node's swap need (the GPU memory that does not fit, summed over GPUs)
    /// past it is refused the allocation. 0 or absent: what the swap pool and its
    /// disk tier hold (unlimited with --swap-pool off); a budget set is bounded by
    /// that.
    #[arg(
        long,
        value_name = "SIZE",
        allow_hyphen_values = true,
        value_parser = size_arg
    )]
    #[serde(skip)]
    pub swap_budget: Option<u64>,
    /// `--swap-budget` in the file, in MiB. `None`: none set (with a swap pool, what
    /// the pool and its disk tier hold is the budget).
    #[arg(skip)]
    pub swap_budget_mib: Option<u64>,
    /// The node's swap pool (config: [arbiter] swap_pool): host memory the arbiter
    /// owns, populates ahead and lends to clients for their swap-outs, so a pod's
    /// memory limit never pays for its GPU's idle memory. auto (half the host's
    /// available memory), off (clients swap into their own memory), or a size; it
    /// bounds a swap budget set beside it.
    #[arg(long, value_name = "auto|off|SIZE")]
    pub swap_pool: SwapPool,
    /// Bytes of the swap pool populated at start and kept ready (config: [arbiter]
    /// swap_pool_floor_mib; default 0: populated ahead as working sets grow).
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    #[serde(skip)]
    pub swap_pool_floor: Option<u64>,
    /// `--swap-pool-floor` in the file, in MiB.
    #[arg(skip)]
    pub swap_pool_floor_mib: Option<u64>,
    /// The swap pool's disk tier (config: [arbiter] spill_dir): a directory on local
    /// disk where the swapped-out memory of the processes idle longest moves when the
    /// pool runs short. Absent: no disk tier.
    #[arg(long, value_name = "DIR")]
    pub spill_dir: Option<PathBuf>,
    /// The most the disk tier holds (config: [arbiter] spill_budget_mib). Absent:
    /// the disk's free space, less a reserve of 5% (at most 1 GiB).
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    #[serde(skip)]
    pub spill_budget: Option<u64>,
    /// `--spill-budget` in the file, in MiB.
    #[arg(skip)]
    pub spill_budget_mib: Option<u64>,
    /// Where to learn each GPU's UUID and memory (config: [arbiter] nvml): auto
    /// (libnvidia-ml.so.1 if it loads), off (a GPU's first registration sets its size),
    /// or the path of an NVML library, which must load. With NVML, registrations for
    /// other GPUs or other sizes are refused.
    #[arg(long, value_name = "auto|off|PATH")]
    pub nvml: Nvml,
    /// Whole-process eviction (config: [arbiter] checkpoint): auto (the driver's
    /// checkpoint API, driver 570 or later, when libcuda.so.1 loads and has it; idle
    /// clients' whole processes, contexts included, are then checkpointed to host
    /// memory when paging cannot make enough room) or off.
    #[arg(long, value_name = "auto|off")]
    pub checkpoint: Checkpoint,
    /// Most client connections (default 4096; never above RLIMIT_NOFILE − 64, which
    /// stay for the control socket). See docs/protocol.md, "Limits".
    #[arg(long, value_name = "N", help_heading = "Limits", value_parser = at_least_one::<usize>)]
    pub max_connections: Option<usize>,
    /// Most client connections from one container (on its own socket), or from one
    /// host uid on the node's socket, default 64.
    #[arg(long, value_name = "N", help_heading = "Limits", value_parser = at_least_one::<usize>)]
    pub max_conns_per_group: Option<usize>,
    /// Close a connection that has not registered within this many ms (default 5000).
    #[arg(long, value_name = "MS", help_heading = "Limits", value_parser = at_least_one::<u64>)]
    pub register_timeout_ms: Option<u64>,
    /// Close a connection whose frame is not complete this many ms after its first
    /// byte (default 5000).
    #[arg(long, value_name = "MS", help_heading = "Limits", value_parser = at_least_one::<u64>)]
    pub frame_timeout_ms: Option<u64>,
    /// Bytes of partly received frames buffered over all connections (default 64MiB;
    /// config: [arbiter] partial_frame_budget_mib).
    #[arg(long, value_name = "SIZE", help_heading = "Limits", value_parser = positive_size_arg)]
    #[serde(skip)]
    pub partial_frame_budget: Option<u64>,
    /// `--partial-frame-budget` in the file, in MiB.
    #[arg(skip)]
    pub partial_frame_budget_mib: Option<u64>,
    /// Memory the event log may hold over all GPUs (default 64MiB; config: [arbiter]
    /// event_log_mib).
    #[arg(long, value_name = "SIZE", help_heading = "Limits", value_parser = positive_size_arg)]
    #[serde(skip)]
    pub event_log_bytes: Option<u64>,
    /// `--event-log-bytes` in the file, in MiB.
    #[arg(skip)]
    pub event_log_mib: Option<u64>,
    /// Raise RLIMIT_NOFILE (hard and soft) to this at start, for containers that
    /// cannot set it from outside (needs CAP_SYS_RESOURCE). The soft limit is always
    /// raised to the hard one.
    #[arg(
        long,
        value_name = "N",
        env = "KIWI_LIMIT_NOFILE",
        help_heading = "Limits",
        value_parser = at_least_one::<u64>
    )]
    pub limit_nofile: Option<u64>,
    /// The longest a client's swap-out waits for its application to say which of its
    /// memory is dead (the shim's KIWI_HINT_WAIT_MS is clamped to it): the next
    /// tenant waits for that answer. Default 100; 0: never wait.
    #[arg(long, value_name = "MS", help_heading = "Limits")]
    pub max_hint_wait_ms: Option<u64>,
}

impl Default for ArbiterConfig {
    fn default() -> Self {
        Self {
            tq_seconds: Quantum::default(),
            scheduler: SchedulerMode::On,
            grace_ms: 5_000,
            idle_evict_seconds: 30.0,
            reserve_mib: None,
            event_log_capacity: 100_000,
            metrics_addr: None,
            swap_budget: None,
            swap_budget_mib: None,
            swap_pool: SwapPool::Auto,
            swap_pool_floor: None,
            swap_pool_floor_mib: None,
            spill_dir: None,
            spill_budget: None,
            spill_budget_mib: None,
            nvml: Nvml::Auto,
            checkpoint: Checkpoint::Auto,
            max_connections: None,
            max_conns_per_group: None,
            register_timeout_ms: None,
            frame_timeout_ms: None,
            partial_frame_budget: None,
            partial_frame_budget_mib: None,
            event_log_bytes: None,
            event_log_mib: None,
            limit_nofile: None,
            max_hint_wait_ms: None,
        }
    }
}

impl ArbiterConfig {
    /// `cmd` with this section's flags added. None is required: a flag not given
    /// leaves the file's value, or the default.
    pub fn flags(cmd: Command) -> Command {
        let ours: Vec<clap::Id> = Self::augment_args(Command::new("arbiter"))
            .get_arguments()
            .map(|a| a.get_id().clone())
            .collect();
        // The command keeps its own description (clap would put this struct's doc
        // in its place).
        let (about, long_about) = (cmd.get_about().cloned(), cmd.get_long_about().cloned());
        let mut cmd = ours.into_iter().fold(Self::augment_args(cmd), |cmd, id| {
            cmd.mut_arg(id, |a| a.required(false))
        });
        if let Some(about) = about {
            cmd = cmd.about(about);
        }
        if let Some(long_about) = long_about {
            cmd = cmd.long_about(long_about);
        }
        cmd
    }

    /// This section (the defaults, then the file's keys) with every flag of
    /// [`Self::flags`] given in `matches` (or through its environment variable) over
    /// it.
    pub fn merge(mut self, matches: &ArgMatches) -> Result<Self, clap::Error> {
        self.update_from_arg_matches(matches)?;
        Ok(self)
    }

    /// The node's swap budget in bytes; `None`: unlimited (0 says so too).
    pub fn swap_budget_bytes(&self) -> Option<u64> {
        bytes(self.swap_budget, self.swap_budget_mib).filter(|&b| b > 0)
    }

    /// Bytes of the swap pool populated at start (default 0).
    pub fn swap_pool_floor_bytes(&self) -> u64 {
        bytes(self.swap_pool_floor, self.swap_pool_floor_mib).unwrap_or(0)
    }

    /// The disk tier's bound in bytes; `None`: the disk's free space.
    pub fn spill_budget_bytes(&self) -> Option<u64> {
        bytes(self.spill_budget, self.spill_budget_mib)
    }

    /// Bytes of partly received frames; `None`: the arbiter's default.
    pub fn partial_frame_budget_bytes(&self) -> Option<u64> {
        bytes(self.partial_frame_budget, self.partial_frame_budget_mib)
    }

    /// The event log's bound in bytes; `None`: the arbiter's default.
    pub fn event_log_bytes(&self) -> Option<u64> {
        bytes(self.event_log_bytes, self.event_log_mib)
    }

    /// The file's checks of this section beyond each value's own (those keys that
    /// must not be 0, MiB that must fit in bytes).
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.event_log_capacity == 0 {
            return Err("arbiter.event_log_capacity must be at least 1".into());
        }
        for (key, value) in [
            ("max_connections", self.max_connections.map(|v| v as u64)),
            (
                "max_conns_per_group",
                self.max_conns_per_group.map(|v| v as u64),
            ),
            ("register_timeout_ms", self.register_timeout_ms),
            ("frame_timeout_ms", self.frame_timeout_ms),
            ("partial_frame_budget_mib", self.partial_frame_budget_mib),
            ("event_log_mib", self.event_log_mib),
            ("limit_nofile", self.limit_nofile),
        ] {
            if value == Some(0) {
                return Err(format!("arbiter.{key} must be at least 1"));
            }
        }
        for (key, mib) in [
            ("swap_budget_mib", self.swap_budget_mib),
            ("swap_pool_floor_mib", self.swap_pool_floor_mib),
            ("spill_budget_mib", self.spill_budget_mib),
            ("partial_frame_budget_mib", self.partial_frame_budget_mib),
            ("event_log_mib", self.event_log_mib),
        ] {
            if let Some(m) = mib.filter(|m| m.checked_mul(MIB).is_none()) {
                return Err(format!(
                    "[arbiter] {key} = {m} is too large (bytes overflow 64 bits)"
                ));
            }
        }
        Ok(())
    }
}

/// A flag's bytes, else its key's MiB.
fn bytes(flag: Option<u64>, key_mib: Option<u64>) -> Option<u64> {
    flag.or(key_mib.map(|m| m.saturating_mul(MIB)))
}

/// `--nvml` / `[arbiter] nvml`: where the arbiter learns each GPU's UUID and memory.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Nvml {
    /// `libnvidia-ml.so.1` through the dynamic linker; without it, no NVML.
    #[default]
    Auto,
    /// Never use NVML (e.g. a node whose GPUs are simulated).
    Off,
    /// This library, which must load.
    Path(PathBuf),
}

impl std::str::FromStr for Nvml {
    type Err = ValueError;
    fn from_str(s: &str) -> Result<Self, ValueError> {
        match s {
            "auto" => Ok(Nvml::Auto),
            "off" => Ok(Nvml::Off),
            "" => Err(ValueError(
                "nvml must be auto, off or the path of libnvidia-ml.so.1, not \"\"".into(),
            )),
            p => Ok(Nvml::Path(PathBuf::from(p))),
        }
    }
}

impl fmt::Display for Nvml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Nvml::Auto => f.write_str("auto"),
            Nvml::Off => f.write_str("off"),
            Nvml::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

/// `--checkpoint` / `[arbiter] checkpoint`: whole-process eviction through the
/// driver's checkpoint API (driver 570+).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Checkpoint {
    /// Used when `libcuda.so.1` loads and has the API.
    #[default]
    Auto,
    Off,
}

impl std::str::FromStr for Checkpoint {
    type Err = ValueError;
    fn from_str(s: &str) -> Result<Self, ValueError> {
        match s {
            "auto" => Ok(Checkpoint::Auto),
            "off" => Ok(Checkpoint::Off),
            other => Err(ValueError(format!(
                "checkpoint must be \"auto\" or \"off\", not {other:?}"
            ))),
        }
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Checkpoint::Auto => "auto",
            Checkpoint::Off => "off",
        })
    }
}

/// `--swap-pool` / `[arbiter] swap_pool`: the node's swap pool, host memory the
/// arbiter owns and lends to clients for their swap-outs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SwapPool {
    /// Half the host's available memory at start.
    #[default]
    Auto,
    /// No pool: clients swap into their own memory.
    Off,
    /// This many bytes (never 0).
    Size(u64),
}

impl std::str::FromStr for SwapPool {
    type Err = ValueError;
    fn from_str(s: &str) -> Result<Self, ValueError> {
        match s {
            "auto" => Ok(SwapPool::Auto),
            "off" => Ok(SwapPool::Off),
            s => match crate::parse_size(s) {
                Ok(0) => Err(ValueError(
                    "swap_pool is 0; use off to turn the pool off".into(),
                )),
                Ok(n) => Ok(SwapPool::Size(n)),
                Err(e) => Err(ValueError(format!(
                    "swap_pool {s:?}: {e}; use auto, off or a size"
                ))),
            },
        }
    }
}

impl fmt::Display for SwapPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SwapPool::Auto => f.write_str("auto"),
            SwapPool::Off => f.write_str("off"),
            SwapPool::Size(n) => write!(f, "{n}"),
        }
    }
}

macro_rules! string_conversions {
    ($($t:ty),*) => {$(
        impl TryFrom<String> for $t {
            type Error = ValueError;
            fn try_from(s: String) -> Result<Self, ValueError> {
                s.parse()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.to_string()
            }
        }
    )*};
}

string_conversions!(Nvml, Checkpoint, SwapPool);

fn idle_evict_seconds<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = f64::deserialize(d)?;
    parse_idle_evict_value(v).map_err(serde::de::Error::custom)
}

/// Checks an idle-eviction delay in seconds: finite, 0 (off) or more, at most a day.
pub fn parse_idle_evict_value(v: f64) -> Result<f64, ValueError> {
    if !v.is_finite() || v < 0.0 {
        return Err(ValueError(format!(
            "idle_evict_seconds must be 0 (off) or a positive number of seconds, not {v}"
        )));
    }
    if v > 86_400.0 {
        return Err(ValueError(format!(
            "idle_evict_seconds must be at most 86400 seconds (a day), not {v}"
        )));
    }
    Ok(v)
}

/// Parses an idle-eviction delay as a person types it (`30`, `0.5`, `0` for off).
pub fn parse_idle_evict_arg(s: &str) -> Result<f64, ValueError> {
    let v: f64 = s.trim().parse().map_err(|_| {
        ValueError(format!(
            "idle_evict_seconds must be 0 (off) or a positive number of seconds, not {s:?}"
        ))
    })?;
    parse_idle_evict_value(v)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::Config;

    fn file(text: &str) -> ArbiterConfig {
        Config::from_str_at(text, Path::new("c.toml"))
            .unwrap()
            .arbiter
    }

    fn flags(args: &[&str]) -> Result<ArgMatches, clap::Error> {
        ArbiterConfig::flags(Command::new("kiwi-arbiter"))
            .try_get_matches_from(std::iter::once("kiwi-arbiter").chain(args.iter().copied()))
    }

    fn merged(text: &str, args: &[&str]) -> ArbiterConfig {
        file(text).merge(&flags(args).unwrap()).unwrap()
    }

    const FILE: &str = "[arbiter]\ntq_seconds = 2.5\nscheduler = \"off\"\ngrace_ms = 700\n\
        nvml = \"off\"\ncheckpoint = \"off\"\nswap_pool = \"1GiB\"\nswap_budget_mib = 512\n\
        max_connections = 100\nreserve_mib = 64\nidle_evict_seconds = 3\n";

    #[test]
    fn defaults_without_file_or_flags() {
        let a = merged("", &[]);
        assert_eq!(a, ArbiterConfig::default());
        assert_eq!(a.tq_seconds, Quantum::default());
        assert_eq!(a.scheduler, SchedulerMode::On);
        assert_eq!(a.grace_ms, 5_000);
        assert_eq!(a.nvml, Nvml::Auto);
        assert_eq!(a.checkpoint, Checkpoint::Auto);
        assert_eq!(a.swap_pool, SwapPool::Auto);
        assert_eq!(a.swap_budget_bytes(), None);
        assert_eq!(a.max_connections, None);
    }

    #[test]
    fn the_file_beats_the_defaults() {
        let a = merged(FILE, &[]);
        assert_eq!(a.tq_seconds.as_millis(), 2_500);
        assert_eq!(a.scheduler, SchedulerMode::Off);
        assert_eq!(a.grace_ms, 700);
        assert_eq!(a.nvml, Nvml::Off);
        assert_eq!(a.checkpoint, Checkpoint::Off);
        assert_eq!(a.swap_pool, SwapPool::Size(1 << 30));
        assert_eq!(a.swap_budget_bytes(), Some(512 << 20));
        assert_eq!(a.max_connections, Some(100));
        assert_eq!(a.reserve_mib, Some(64));
        assert_eq!(a.idle_evict_seconds, 3.0);
        // Untouched by the file: still the defaults.
        assert_eq!(a.event_log_capacity, 100_000);
        assert_eq!(a.metrics_addr, None);
    }

    #[test]
    fn a_flag_beats_the_file() {
        let a = merged(
            FILE,
            &[
                "--tq",
                "7",
                "--scheduler",
                "on",
                "--grace-ms",
                "900",
                "--nvml",
                "/x/libnvidia-ml.so.1",
                "--checkpoint",
                "auto",
                "--swap-pool",
                "off",
                "--swap-budget",
                "2MiB",
                "--max-connections",
                "9",
                "--idle-evict-seconds",
                "0",
                "--metrics-addr",
                "127.0.0.1:9400",
            ],
        );
        assert_eq!(a.tq_seconds.as_millis(), 7_000);
        assert_eq!(a.scheduler, SchedulerMode::On);
        assert_eq!(a.grace_ms, 900);
        assert_eq!(a.nvml, Nvml::Path("/x/libnvidia-ml.so.1".into()));
        assert_eq!(a.checkpoint, Checkpoint::Auto);
        assert_eq!(a.swap_pool, SwapPool::Off);
        assert_eq!(a.swap_budget_bytes(), Some(2 << 20));
        assert_eq!(a.max_connections, Some(9));
        assert_eq!(a.idle_evict_seconds, 0.0);
        assert_eq!(a.metrics_addr.as_deref(), Some("127.0.0.1:9400"));
        // Keys no flag named keep the file's value.
        assert_eq!(a.reserve_mib, Some(64));
        // A flag of 0 for the budget is unlimited, over the file's.
        let a = merged(FILE, &["--swap-budget", "0"]);
        assert_eq!(a.swap_budget_bytes(), None);
    }

    #[test]
    fn sizes_from_flags_in_bytes_and_from_keys_in_mib() {
        let a = merged(
            "[arbiter]\nswap_pool_floor_mib = 2\nspill_budget_mib = 3\nevent_log_mib = 4\n\
             partial_frame_budget_mib = 5\n",
            &[],
        );
        assert_eq!(a.swap_pool_floor_bytes(), 2 << 20);
        assert_eq!(a.spill_budget_bytes(), Some(3 << 20));
        assert_eq!(a.event_log_bytes(), Some(4 << 20));
        assert_eq!(a.partial_frame_budget_bytes(), Some(5 << 20));
        let a = merged(
            "[arbiter]\nswap_pool_floor_mib = 2\nevent_log_mib = 4\n",
            &[
                "--swap-pool-floor",
                "4096",
                "--event-log-bytes",
                "1KiB",
                "--spill-budget",
                "1GiB",
            ],
        );
        assert_eq!(a.swap_pool_floor_bytes(), 4096);
        assert_eq!(a.event_log_bytes(), Some(1024));
        assert_eq!(a.spill_budget_bytes(), Some(1 << 30));
        // A flag's own name is no key.
        assert!(Config::from_str_at("[arbiter]\nswap_budget = 5\n", Path::new("c")).is_err());
    }

    #[test]
    fn the_environment_counts_as_the_flag() {
        // As KIWI_LIMIT_NOFILE, under a name no other test sets.
        let cmd = || {
            ArbiterConfig::flags(Command::new("kiwi-arbiter"))
                .mut_arg("limit_nofile", |a| a.env("KIWI_CONFIG_TEST_LIMIT_NOFILE"))
        };
        let file = file("[arbiter]\nlimit_nofile = 8192\n");
        let m = cmd().try_get_matches_from(["kiwi-arbiter"]).unwrap();
        assert_eq!(file.clone().merge(&m).unwrap().limit_nofile, Some(8192));
        std::env::set_var("KIWI_CONFIG_TEST_LIMIT_NOFILE", "4096");
        let m = cmd().try_get_matches_from(["kiwi-arbiter"]).unwrap();
        assert_eq!(file.clone().merge(&m).unwrap().limit_nofile, Some(4096));
        let m = cmd()
            .try_get_matches_from(["kiwi-arbiter", "--limit-nofile", "100"])
            .unwrap();
        assert_eq!(file.merge(&m).unwrap().limit_nofile, Some(100));
    }

    #[test]
    fn bad_flag_values_are_one_line_naming_the_flag() {
        for (args, line) in [
            (
                &["--tq", "0"][..],
                "--tq: TQ must be a positive number of seconds, not 0",
            ),
            (
                &["--tq", "1e9"],
                "--tq: TQ must be at most 86400 seconds (a day), not 1000000000",
            ),
            (
                &["--checkpoint", "maybe"],
                "--checkpoint: checkpoint must be \"auto\" or \"off\", not \"maybe\"",
            ),
            (&["--max-connections", "0"], "--max-connections: must be at least 1"),
            (
                &["--swap-pool", "0"],
                "--swap-pool: swap_pool is 0; use off to turn the pool off",
            ),
            (&["--nvml", ""], "--nvml: nvml must be auto, off or the path of libnvidia-ml.so.1, not \"\""),
            (
                &["--swap-budget", "-1"],
                "--swap-budget: not a size: \"-1\" (try 700MiB or 1GiB)",
            ),
            (
                &["--idle-evict-seconds", "-2"],
                "--idle-evict-seconds: idle_evict_seconds must be 0 (off) or a positive number of seconds, not -2",
            ),
        ] {
            let e = flags(args).unwrap_err();
            assert_eq!(crate::flag_error(&e).as_deref(), Some(line), "{args:?}");
        }
        // clap's own refusals stay clap's.
        let e = flags(&["--scheduler", "maybe"]).unwrap_err();
        assert_eq!(crate::flag_error(&e), None);
        assert!(e.to_string().contains("[possible values: on, off]"), "{e}");
        assert_eq!(crate::flag_error(&flags(&["--bogus"]).unwrap_err()), None);
    }

    #[test]
    fn bad_key_values_name_the_file_and_line() {
        for (text, says) in [
            (
                "tq_seconds = 0",
                "TQ must be a positive number of seconds, not 0",
            ),
            (
                "checkpoint = \"maybe\"",
                "checkpoint must be \"auto\" or \"off\"",
            ),
            ("swap_pool = \"lots\"", "swap_pool \"lots\""),
            ("nvml = \"\"", "nvml must be auto, off"),
            (
                "swap_budget_mib = 17592186044416",
                "swap_budget_mib = 17592186044416 is too large",
            ),
        ] {
            let e = Config::from_str_at(
                &format!("socket_dir = \"/x\"\n[arbiter]\n{text}\n"),
                Path::new("/etc/kiwi/k.toml"),
            )
            .unwrap_err();
            let e = crate::one_line(&e);
            assert!(e.starts_with("config file /etc/kiwi/k.toml"), "{e}");
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn the_section_round_trips_through_toml() {
        let a = merged(FILE, &[]);
        let text = toml::to_string(&Config {
            arbiter: a.clone(),
            ..Config::default()
        })
        .unwrap();
        assert_eq!(
            Config::from_str_at(&text, Path::new("c")).unwrap().arbiter,
            a
        );
    }
}
