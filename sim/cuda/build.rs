//! Gives the cdylib the soname of the real driver, so programs linked with
//! `-lcuda` against it record `libcuda.so.1` as they would against NVIDIA's.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
