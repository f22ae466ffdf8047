//! Fuzz harnesses (stable Rust, proptest) for the safetensors and GGUF header readers, which read
//! files a user points `plan` at. See fuzz/README.md.

#[path = "../../../fuzz/support.rs"]
mod fuzz_support;

use fuzz_support::fuzz;

#[test]
fn fuzz_safetensors_header() {
    fuzz("safetensors", |data| {
        let _ = headroom_inspect::safetensors::read_header(data, "fuzz.safetensors");
        Ok(())
    });
}

#[test]
fn fuzz_gguf_header() {
    fuzz("gguf", |data| {
        let _ = headroom_inspect::gguf::read_gguf(data, "fuzz.gguf");
        Ok(())
    });
}
