//! Registers the `kiwi` runtime with containerd and docker, and takes it out again:
//! the logic behind `kiwictl install containerd|docker` and `kiwictl uninstall`.
//!
//! * `containerd` — pure, format-preserving edits of containerd's `config.toml`
//!   (versions 1, 2 and 3), with marker comments that make uninstall exact.
//! * `docker` — pure edits of docker's `daemon.json`.
//! * `cli` — clap argument structs and the entry points `run_install` /
//!   `run_uninstall` that read, diff, back up and write the files.
//!
//! This crate never restarts a daemon and never touches any other file.

pub mod cli;
pub mod containerd;
pub mod docker;
pub mod error;
mod marker;

pub use cli::{
    run_install, run_install_to, run_uninstall, run_uninstall_to, InstallArgs, InstallTarget,
    UninstallArgs, UninstallTarget,
};
pub use containerd::{
    install_containerd, install_containerd_drop_in, uninstall_containerd, ConfigVersion,
    ContainerdOptions,
};
pub use docker::{install_docker, uninstall_docker, DockerOptions, DockerUndo};
pub use error::EditError;
