//! The three BPF link operations that aya 0.14 does not offer on a pinned link of any type:
//! opening it, reading what it is attached to, and swapping its program in place.
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

use aya_obj::generated::{bpf_cmd, bpf_link_type};

/// What a link is attached to, from the kernel's `bpf_link_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkTarget {
    /// A TCX or XDP link on this interface; 0 once the interface is gone.
    Interface(u32),
    /// A cgroup link on the cgroup of this id (its cgroup2 inode number).
    Cgroup(u64),
    Other,
}

/// `bpf_link_info`'s common head and the start of its per-type union, which holds the
/// interface index (TCX, XDP) or the cgroup id (cgroup) first. The kernel fills what fits.
#[repr(C)]
#[derive(Default)]
struct LinkInfo {
    link_type: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    target: [u8; 32],
}

/// `union bpf_attr` for BPF_OBJ_GET.
#[repr(C)]
#[derive(Default)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
}

/// `union bpf_attr` for BPF_OBJ_GET_INFO_BY_FD.
#[repr(C)]
#[derive(Default)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// `union bpf_attr` for BPF_LINK_UPDATE.
#[repr(C)]
#[derive(Default)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

fn bpf<T>(cmd: bpf_cmd, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is the #[repr(C)] prefix of `union bpf_attr` this command reads, and its
    // size is passed; the kernel treats the missing tail as zero.
    let ret = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_bpf,
            cmd as i64,
            std::ptr::from_mut(attr),
            std::mem::size_of::<T>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens the object pinned at `path` (a link here).
pub fn open_pinned(path: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        ..Default::default()
    };
    let fd = bpf(bpf_cmd::BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// What link `fd` is attached to.
pub fn target(fd: BorrowedFd<'_>) -> io::Result<LinkTarget> {
    let mut info = LinkInfo::default();
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: std::mem::size_of::<LinkInfo>() as u32,
        info: std::ptr::from_mut(&mut info) as u64,
    };
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let [a, b, c, d, e, f, g, h, ..] = info.target;
    Ok(match info.link_type {
        t if t == bpf_link_type::BPF_LINK_TYPE_TCX as u32
            || t == bpf_link_type::BPF_LINK_TYPE_XDP as u32 =>
        {
            LinkTarget::Interface(u32::from_ne_bytes([a, b, c, d]))
        }
        t if t == bpf_link_type::BPF_LINK_TYPE_CGROUP as u32 => {
            LinkTarget::Cgroup(u64::from_ne_bytes([a, b, c, d, e, f, g, h]))
        }
        _ => LinkTarget::Other,
    })
}

/// Swaps the program of link `link` for `program`, atomically: every packet or socket call
/// meets either the old program or the new one.
pub fn replace_program(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: program.as_raw_fd() as u32,
        ..Default::default()
    };
    bpf(bpf_cmd::BPF_LINK_UPDATE, &mut attr).map(drop)
}
