//! Compiles the kubelet device plugin API (`proto/api.proto`) into Rust.
//!
//! `protox` is a protobuf compiler written in Rust, so `cargo build` alone works on a
//! fresh machine: no `protoc` has to be installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/api.proto");
    let fds = protox::compile(["api.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
