#![no_std]
// The library target only exists so that lb-user can name this crate as a build dependency;
// the programs are the `lb` binary (src/main.rs), built for bpfel-unknown-none.
