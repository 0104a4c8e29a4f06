//! The two bpf(2) commands the bench needs beyond aya: loading a hand-assembled program (the empty
//! classifier B1 subtracts, the XDP_TX generator of B4: two instructions each, not worth an eBPF
//! crate) and BPF_PROG_TEST_RUN with the live-frames flag.
use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd},
};

use nix::libc;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
pub const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
pub const TC_ACT_OK: i32 = 0;

/// `r0 = verdict; exit`.
fn return_only(verdict: i32) -> [u64; 2] {
    const MOV64_IMM_R0: u64 = 0xb7;
    const EXIT: u64 = 0x95;
    [MOV64_IMM_R0 | (u64::from(verdict as u32) << 32), EXIT]
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
    let insns = return_only(verdict);
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
