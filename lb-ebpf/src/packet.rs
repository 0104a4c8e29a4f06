//! Packet access for both program types, so that one parser, one rewrite and one forwarding
//! path serve tc and XDP.
//!
//! Reads and writes are direct packet access, bounds-checked against the linear data: a helper
//! call per field (`bpf_skb_load_bytes` and kin) cost more than the lookups they serve. Headers
//! sit within the first `MAX_HEADER_OFFSET` bytes, which `pull_headers` makes linear in an skb
//! once per packet; an XDP frame is linear. The IPv4 header checksum is updated with RFC 1624
//! arithmetic for both. The TCP/UDP checksum is where they differ: tc must use the kernel's
//! helper, which also keeps the skb's checksum state right (see nat.rs); an XDP frame has no such
//! state, so its checksum is updated with the same arithmetic.
use core::{ffi::c_long, mem};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    helpers::bpf_skb_store_bytes,
    programs::{TcContext, XdpContext},
};

/// Every header field read or written starts below this offset: Ethernet (14), IPv4 with options
/// (60), an ICMP header (8), the quoted IPv4 header with options (60) and its ports (8) end at 150.
/// The bound is also what lets the verifier accept offsets that depend on the IHL.
const MAX_HEADER_OFFSET: usize = 256;

/// Failure of a packet access outside the linear data, as the helpers report it.
const EFAULT: c_long = -14;

/// Makes the first `MAX_HEADER_OFFSET` bytes of the skb (or all of it, if shorter) linear, so
/// that direct access reaches every header. Most packets already are: then it costs nothing.
pub fn pull_headers(ctx: &TcContext) {
    let want = (ctx.len() as usize).min(MAX_HEADER_OFFSET);
    if ctx.data_end() - ctx.data() < want {
        // On failure the accesses beyond the linear part fail, and the packet passes unparsed.
        let _ = ctx.pull_data(want as u32);
    }
}

/// The address of `size_of::<T>()` bytes at `offset` in the linear data `[start, end)`.
#[inline(always)]
fn linear<T>(start: usize, end: usize, offset: usize) -> Result<*mut T, c_long> {
    if offset >= MAX_HEADER_OFFSET {
        return Err(EFAULT);
    }
    let at = start + offset;
    // Kept opaque so that LLVM cannot rewrite the check (`at + 1 > end` into `at >= end`, say)
    // into a form the verifier does not read as a bound on `at`.
    if core::hint::black_box(at + mem::size_of::<T>()) > end {
        return Err(EFAULT);
    }
    Ok(at as *mut T)
}

#[inline(always)]
fn load_linear<T>(start: usize, end: usize, offset: usize) -> Result<T, c_long> {
    let at = linear::<T>(start, end, offset)?;
    // SAFETY: `linear` checked that the bytes lie within the packet; headers are not aligned.
    Ok(unsafe { at.read_unaligned() })
}

#[inline(always)]
fn store_linear<T>(start: usize, end: usize, offset: usize, value: &T) -> Result<(), c_long> {
    let at = linear::<T>(start, end, offset)?;
    // SAFETY: as in `load_linear`; the program owns the packet while it runs.
    unsafe {
        core::ptr::copy_nonoverlapping(
            (value as *const T).cast::<u8>(),
            at.cast::<u8>(),
            mem::size_of::<T>(),
        )
    };
    Ok(())
}

/// A checksum-covered field's change, as the checksum update needs it.
#[derive(Clone, Copy)]
pub struct Change {
    /// The old and new value as they sit in the packet (memory order), in the low `size` bytes.
    pub old: u32,
    pub new: u32,
    /// 2 or 4 bytes.
    pub size: u8,
}

/// How a TCP/UDP checksum treats a change.
#[derive(Clone, Copy)]
pub struct L4Checksum {
    /// The field is an address, covered through the pseudo-header.
    pub pseudo_header: bool,
    /// UDP: a zero checksum means "none" and stays zero; a computed zero is sent as 0xffff.
    pub zero_means_none: bool,
}

pub trait PacketAccess: EbpfContext {
    /// An XDP frame rather than a tc skb.
    const IS_XDP: bool;
    /// Bytes from the Ethernet header to the end of the packet.
    fn len(&self) -> usize;
    fn load<T>(&self, offset: usize) -> Result<T, c_long>;
    fn store<T>(&self, offset: usize, value: &T) -> Result<(), c_long>;
    /// Updates the IPv4 header checksum at `offset` for `change`. The same arithmetic for both
    /// program types, no helper call: an IPv4 header with a valid checksum sums to the same value
    /// after any change, so an skb's checksum state (which covers the header) stays right, as
    /// `bpf_l3_csum_replace` also leaves it.
    fn replace_l3_checksum(&self, offset: usize, change: Change) -> Result<(), c_long> {
        let check: u16 = self.load(offset)?;
        self.store(offset, &updated(check, change))
    }
    /// Updates the TCP/UDP checksum at `offset` for `change`.
    fn replace_l4_checksum(
        &self,
        offset: usize,
        change: Change,
        how: L4Checksum,
    ) -> Result<(), c_long>;
    /// Writes `value` at `offset`, in a field no header checksum covers (IPv6's hop limit): an
    /// skb's checksum state, whose sum covers it, follows the change; an XDP frame has none.
    fn store_uncovered<T>(&self, offset: usize, value: &T) -> Result<(), c_long>;
    /// The interface the packet arrived on.
    fn ingress_ifindex(&self) -> u32;
    /// The length `bpf_fib_lookup` checks against the egress MTU for a packet whose IPv4 total
    /// length is `tot_len`; 0 makes the kernel check the packet itself.
    fn fib_tot_len(&self, tot_len: u16) -> u16;
    /// A GSO packet: an aggregate that the egress segments (tc only).
    fn is_gso(&self) -> bool;
}

impl PacketAccess for TcContext {
    const IS_XDP: bool = false;

    fn len(&self) -> usize {
        TcContext::len(self) as usize
    }

    fn load<T>(&self, offset: usize) -> Result<T, c_long> {
        load_linear(self.data(), self.data_end(), offset)
    }

    fn store<T>(&self, offset: usize, value: &T) -> Result<(), c_long> {
        store_linear(self.data(), self.data_end(), offset, value)
    }

    fn replace_l4_checksum(
        &self,
        offset: usize,
        change: Change,
        how: L4Checksum,
    ) -> Result<(), c_long> {
        let Change { old, new, size } = change;
        let mut flags = u64::from(size);
        if how.pseudo_header {
            flags |= u64::from(BPF_F_PSEUDO_HDR);
        }
        if how.zero_means_none {
            flags |= u64::from(BPF_F_MARK_MANGLED_0);
        }
        self.l4_csum_replace(offset, old.into(), new.into(), flags)
    }

    fn store_uncovered<T>(&self, offset: usize, value: &T) -> Result<(), c_long> {
        // SAFETY: the context's skb and `size_of::<T>()` readable bytes at `value`; the helper
        // checks the offset against the packet.
        let ret = unsafe {
            bpf_skb_store_bytes(
                self.skb.skb.cast(),
                offset as u32,
                (value as *const T).cast(),
                mem::size_of::<T>() as u32,
                u64::from(BPF_F_RECOMPUTE_CSUM),
            )
        };
        if ret == 0 { Ok(()) } else { Err(ret) }
    }

    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: the context pointer is the kernel's __sk_buff for this run, readable throughout.
        unsafe { (*self.skb.skb).ingress_ifindex }
    }

    fn fib_tot_len(&self, _tot_len: u16) -> u16 {
        // The skb knows better than its IPv4 header: a GSO packet (an aggregate of a TSO sender
        // or GRO) is segmented on egress, yet its length says up to 64 KiB; by that the FIB
        // would refuse it, and the stack drop it if masqueraded (a martian source).
        0
    }

    fn is_gso(&self) -> bool {
        // SAFETY: as in `ingress_ifindex`.
        unsafe { (*self.skb.skb).gso_size != 0 }
    }
}

impl PacketAccess for XdpContext {
    const IS_XDP: bool = true;

    fn len(&self) -> usize {
        // The program is not loaded with frags: the frame is linear.
        self.data_end() - self.data()
    }

    fn load<T>(&self, offset: usize) -> Result<T, c_long> {
        load_linear(self.data(), self.data_end(), offset)
    }

    fn store<T>(&self, offset: usize, value: &T) -> Result<(), c_long> {
        store_linear(self.data(), self.data_end(), offset, value)
    }

    fn replace_l4_checksum(
        &self,
        offset: usize,
        change: Change,
        how: L4Checksum,
    ) -> Result<(), c_long> {
        // The whole pseudo-header is in the checksum of a frame: an address change is one more
        // covered field.
        let check: u16 = PacketAccess::load(self, offset)?;
        if how.zero_means_none && check == 0 {
            return Ok(());
        }
        let check = updated(check, change);
        let check = if how.zero_means_none {
            udp_sent(check)
        } else {
            check
        };
        PacketAccess::store(self, offset, &check)
    }

    fn store_uncovered<T>(&self, offset: usize, value: &T) -> Result<(), c_long> {
        PacketAccess::store(self, offset, value)
    }

    fn ingress_ifindex(&self) -> u32 {
        XdpContext::ingress_ifindex(self) as u32
    }

    fn fib_tot_len(&self, tot_len: u16) -> u16 {
        tot_len
    }

    fn is_gso(&self) -> bool {
        false
    }
}

/// RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'), over the changed field's 16-bit words. Ones'
/// complement sums do not depend on byte order, so the words are used as loaded.
pub fn updated(check: u16, change: Change) -> u16 {
    let Change { old, new, size } = change;
    let mut sum = u32::from(!check) + (!old & 0xffff) + (new & 0xffff);
    if size == 4 {
        sum += (!old >> 16) + (new >> 16);
    }
    folded(sum)
}

/// A computed UDP checksum as it is sent: zero means "no checksum" (RFC 768), so a computed zero
/// goes out as 0xffff, its other ones' complement form.
pub fn udp_sent(check: u16) -> u16 {
    if check == 0 { 0xffff } else { check }
}

/// The checksum of the 32-bit sum of 16-bit words `sum`: the ones' complement of its 16-bit
/// ones' complement sum (in the words' byte order).
pub fn folded(sum: u32) -> u16 {
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
