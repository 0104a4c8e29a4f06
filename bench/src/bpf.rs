//! The two bpf(2) commands the bench needs beyond aya: loading a hand-assembled program (the empty
//! classifier B1 subtracts, B4's XDP_TX generator: a few instructions each, not worth an eBPF
//! crate) and BPF_PROG_TEST_RUN with the live-frames flag.
use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd},
};

use nix::libc;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
pub const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
pub const BPF_PROG_TYPE_XDP: u32 = 6;
pub const TC_ACT_OK: i32 = 0;
pub const XDP_DROP: i32 = 1;
pub const XDP_TX: i32 = 3;
/// BPF_PROG_TEST_RUN of an XDP program: the frames its verdict sends out are really sent.
pub const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

const LDX_W: u8 = 0x61;
const ST_W: u8 = 0x62;
const MOV64_REG: u8 = 0xbf;
const MOV64_IMM: u8 = 0xb7;
const ADD64_IMM: u8 = 0x07;
const JGT_REG: u8 = 0x2d;
const EXIT: u8 = 0x95;

/// One instruction: opcode, destination and source registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | u64::from(dst | src << 4) << 8
        | u64::from(off as u16) << 16
        | u64::from(imm as u32) << 32
}

/// `r0 = verdict; exit`.
fn return_only(verdict: i32) -> Vec<u64> {
    vec![insn(MOV64_IMM, 0, 0, 0, verdict), insn(EXIT, 0, 0, 0, 0)]
}

/// XDP: writes `header` (a multiple of 4 bytes) over the start of the frame, then XDP_TX; a
/// shorter frame is dropped. Live frames recycle their pages, and a receiver that rewrites the
/// frame in place (veth hands the page to the stack, the datapath's NAT edits it) would
/// otherwise send its own output next time round.
fn write_header_and_tx(header: &[u8]) -> Vec<u64> {
    assert!(header.len().is_multiple_of(4));
    let stores: Vec<u64> = header
        .chunks(4)
        .enumerate()
        .map(|(i, word)| {
            let imm = i32::from_le_bytes(word.try_into().expect("4 bytes"));
            insn(ST_W, 2, 0, (i * 4) as i16, imm)
        })
        .collect();
    let mut insns = vec![
        // r2 = ctx->data, r3 = ctx->data_end; r4 = r2 + len; if r4 > r3 goto drop.
        insn(LDX_W, 2, 1, 0, 0),
        insn(LDX_W, 3, 1, 4, 0),
        insn(MOV64_REG, 4, 2, 0, 0),
        insn(ADD64_IMM, 4, 0, 0, header.len() as i32),
        insn(JGT_REG, 4, 3, stores.len() as i16 + 2, 0),
    ];
    insns.extend(stores);
    insns.extend(return_only(XDP_TX));
    insns.extend(return_only(XDP_DROP));
    insns
}

#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a #[repr(C)] prefix of union bpf_attr for `cmd`, valid for its size;
    // the pointers in it outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

/// Loads a program that only returns `verdict`.
pub fn load_return_only(prog_type: u32, verdict: i32) -> io::Result<OwnedFd> {
    load(prog_type, &return_only(verdict))
}

/// Loads the XDP program of [`write_header_and_tx`].
pub fn load_xdp_generator(header: &[u8]) -> io::Result<OwnedFd> {
    load(BPF_PROG_TYPE_XDP, &write_header_and_tx(header))
}

fn load(prog_type: u32, insns: &[u64]) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut attr = ProgLoadAttr {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..Default::default()
    };
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub struct TestRun<'a> {
    pub data: &'a [u8],
    pub ctx: Option<&'a [u8]>,
    pub repeat: u32,
    pub flags: u32,
    pub batch_size: u32,
}

/// BPF_PROG_TEST_RUN; returns (return value, kernel-measured ns per run).
pub fn test_run(prog: BorrowedFd<'_>, run: &TestRun<'_>) -> io::Result<(u32, u32)> {
    let (ctx_in, ctx_size_in) = run
        .ctx
        .map_or((0, 0), |ctx| (ctx.as_ptr() as u64, ctx.len() as u32));
    let mut attr = TestRunAttr {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: run.data.len() as u32,
        data_in: run.data.as_ptr() as u64,
        repeat: run.repeat,
        ctx_size_in,
        ctx_in,
        flags: run.flags,
        batch_size: run.batch_size,
        ..Default::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok((attr.retval, attr.duration))
}
