//! The declaration list against NVIDIA's real `cuda.h` (fetched by
//! `scripts/fetch-cuda-h.sh`, preprocessed by gcc as an application would see it:
//! default, per-thread default stream, and the driver's internal view that declares
//! every legacy symbol). Nothing escapes the gate unnoticed:
//!
//! - every function taking a `CUdeviceptr`, `CUarray`, `CUstream`, `CUgraphExec` or
//!   `CUmemGenericAllocationHandle` (by value or through a pointer) is classified in
//!   `exports.rs` (a new `cuda.h` that adds one fails here until it is);
//! - every launch, copy, memset, prefetch and stream memory operation is gated;
//! - every export's declared signature has `cuda.h`'s arity and compatible types.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::symbols::{lookup, Class, SYMBOLS};

/// The kinds of argument that reach device memory or queued work.
const KINDS: [&str; 5] = [
    "CUdeviceptr",
    "CUarray",
    "CUstream",
    "CUgraphExec",
    "CUmemGenericAllocationHandle",
];

/// Names that submit work by their family: these must all be `submit`.
pub fn is_work(name: &str) -> bool {
    [
        "cuLaunch",
        "cuGraphLaunch",
        "cuGraphUpload",
        "cuMemcpy",
        "cuMemset",
        "cuMemPrefetch",
        "cuMemBatchDecompress",
        "cuStreamWaitValue",
        "cuStreamWriteValue",
        "cuStreamBatchMemOp",
    ]
    .iter()
    .any(|p| name.starts_with(p))
}

/// `cuda.h`'s functions returning `CUresult`: name → parameter declarations.
/// `None` when gcc is missing outside CI (the test is then skipped).
fn cuda_h() -> Option<&'static BTreeMap<String, Vec<String>>> {
    static H: OnceLock<Option<BTreeMap<String, Vec<String>>>> = OnceLock::new();
    H.get_or_init(|| {
        if !kiwi_tests::require_tool("gcc") {
            return None;
        }
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = Command::new("sh")
            .arg(root.join("scripts/fetch-cuda-h.sh"))
            .output()
            .expect("run fetch-cuda-h.sh");
        assert!(
            out.status.success(),
            "fetch-cuda-h.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let include = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let src = std::env::temp_dir().join(format!("kiwi-cuda-h-{}.c", std::process::id()));
        std::fs::write(&src, "#include <cuda.h>\n").unwrap();
        let mut all = BTreeMap::new();
        for define in [
            "-DKIWI_DEFAULT",
            "-DCUDA_API_PER_THREAD_DEFAULT_STREAM",
            "-D__CUDA_API_VERSION_INTERNAL",
        ] {
            let out = Command::new("gcc")
                .args(["-E", "-P", "-I", &include, define])
                .arg(&src)
                .output()
                .expect("gcc -E");
            assert!(
                out.status.success(),
                "gcc -E cuda.h ({define}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            all.extend(prototypes(&String::from_utf8_lossy(&out.stdout)));
        }
        let _ = std::fs::remove_file(&src);
        assert!(all.len() > 500, "only {} functions parsed", all.len());
        Some(all)
    })
    .as_ref()
}

/// Every `CUresult cuX(params);` declaration of preprocessed C.
fn prototypes(c: &str) -> BTreeMap<String, Vec<String>> {
    let flat = c.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = BTreeMap::new();
    let mut rest = flat.as_str();
    while let Some(at) = rest.find("CUresult cu") {
        rest = &rest[at + "CUresult ".len()..];
        let Some(open) = rest.find('(') else { break };
        let name = rest[..open].trim();
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let mut depth = 0;
        let mut close = None;
        for (i, ch) in rest[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(close) = close else { break };
        // A declaration, not a definition (cuda.h has a static inline wrapper or two).
        if rest[close + 1..].trim_start().starts_with(';') {
            let params = rest[open + 1..close].trim();
            let params = if params == "void" || params.is_empty() {
                Vec::new()
            } else {
                params.split(',').map(|p| p.trim().to_string()).collect()
            };
            out.insert(name.to_string(), params);
        }
        rest = &rest[close..];
    }
    out
}

fn takes_a_kind(params: &[String]) -> bool {
    params.iter().any(|p| {
        p.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| KINDS.contains(&w))
    })
}

/// Whether Rust parameter type `rust` (as `stringify!` wrote it) is ABI-compatible
/// with C parameter declaration `c` (`const CUDA_MEMCPY3D *pCopy`).
fn compatible(c: &str, rust: &str) -> bool {
    let rust_ptr = rust.starts_with('*') || rust == "Opaque";
    if c.contains('*') {
        return rust_ptr;
    }
    let words: Vec<&str> = c.split_whitespace().filter(|w| *w != "const").collect();
    let ty = if words.len() > 1 {
        words[..words.len() - 1].join(" ")
    } else {
        words.join(" ")
    };
    let want: &[&str] = match ty.as_str() {
        "size_t" => &["usize"],
        "unsigned int" => &["Uint", "u32"],
        "cuuint32_t" => &["u32", "Uint"],
        "int" => &["c_int"],
        "unsigned char" => &["u8"],
        "unsigned short" => &["u16"],
        "cuuint64_t" | "unsigned long long" => &["u64"],
        "CUdeviceptr"
        | "CUdeviceptr_v1"
        | "CUdevice"
        | "CUmemLocation"
        | "CUipcMemHandle"
        | "CUmemGenericAllocationHandle" => return rust == ty,
        // Handles: pointers in C.
        "CUstream" | "CUcontext" | "CUfunction" | "CUgraphExec" | "CUgraph" | "CUmemoryPool"
        | "CUarray" | "CUhostFn" | "CUevent" | "CUstreamCallback" | "CUmodule" | "CUlibrary"
        | "CUkernel" => return rust == ty || rust_ptr,
        // Any other CU type by value is an enum: 32 bits.
        t if t.starts_with("CU") && !t.starts_with("CUDA_") => &["c_int", "Uint", "u32"],
        _ => return false,
    };
    want.contains(&rust)
}

#[test]
fn cuda_h_functions_on_memory_streams_graphs_and_vmm_handles_are_all_classified() {
    let Some(h) = cuda_h() else { return };
    let unclassified: Vec<&str> = h
        .iter()
        .filter(|(_, p)| takes_a_kind(p))
        .map(|(n, _)| n.as_str())
        .filter(|n| !SYMBOLS.iter().any(|s| s.name() == *n))
        .collect();
    let n = h.values().filter(|p| takes_a_kind(p)).count();
    assert!(n > 250, "only {n} functions take one of {KINDS:?}");
    assert!(
        unclassified.is_empty(),
        "cuda.h functions taking one of {KINDS:?} that shim/src/exports.rs does not classify \
         (declare each as submit, hook, pass or driver, with a reason for pass/driver): {unclassified:?}"
    );
}

#[test]
fn every_cuda_h_launch_copy_memset_and_stream_memory_operation_is_gated() {
    let Some(h) = cuda_h() else { return };
    let ungated: Vec<&str> = h
        .keys()
        .map(String::as_str)
        .filter(|n| is_work(n))
        .filter(|n| lookup(n.as_bytes()).is_none_or(|i| SYMBOLS[i].class != Class::Submit))
        .collect();
    assert!(ungated.is_empty(), "cuda.h work not gated: {ungated:?}");
}

#[test]
fn every_declaration_matches_cuda_h() {
    let Some(h) = cuda_h() else { return };
    for s in &SYMBOLS {
        let Some(c) = h.get(s.name()) else {
            panic!("{} is not a cuda.h function", s.name());
        };
        if !s.exported() {
            continue;
        }
        assert_eq!(
            c.len(),
            s.params.len(),
            "{}: cuda.h has {c:?}, exports.rs {:?}",
            s.name(),
            s.params
        );
        for (cp, rp) in c.iter().zip(s.params) {
            assert!(
                compatible(cp, rp),
                "{}: parameter `{cp}` declared as `{rp}`",
                s.name()
            );
        }
    }
}

#[test]
fn the_header_parser_reads_what_cuda_h_writes() {
    let h = prototypes(
        "__attribute__((deprecated)) CUresult cuCtxDetach(CUcontext ctx); \
         CUresult cuCtxSynchronize(void); \
         static inline CUresult cuX_ptsz(int a) { return cuX(a); } \
         CUresult cuMemcpyHtoA_v2(CUarray dstArray, size_t dstOffset, const void *srcHost, size_t n);",
    );
    assert_eq!(h["cuCtxDetach"], vec!["CUcontext ctx"]);
    assert!(h["cuCtxSynchronize"].is_empty());
    assert!(!h.contains_key("cuX_ptsz"));
    assert!(takes_a_kind(&h["cuMemcpyHtoA_v2"]));
    assert!(!takes_a_kind(&h["cuCtxDetach"]));
    assert!(compatible("const void *srcHost", "*const c_void"));
    assert!(compatible("size_t dstOffset", "usize"));
    assert!(!compatible("size_t dstOffset", "Uint"));
    assert!(compatible("CUarray dstArray", "CUarray"));
    assert!(compatible(
        "CUmemAllocationGranularity_flags option",
        "c_int"
    ));
    assert!(!compatible("CUdeviceptr_v1 dst", "CUdeviceptr"));
}
