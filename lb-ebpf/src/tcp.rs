//! The TCP header fields connection tracking reads (`lb_common::tcp`): the segment's sequence
//! numbers and window, and a SYN's window scale option.
use lb_common::{Counter, tcp::Segment};

use crate::{
    packet::PacketAccess,
    parse::{ETH_HLEN, Packet},
};

/// Sequence number, acknowledgment number, data offset and flags, window: the TCP header from
/// its fifth byte.
#[repr(C)]
#[derive(Clone, Copy)]
struct SequenceFields {
    seq: u32,
    ack: u32,
    data_offset: u8,
    flags: u8,
    window: u16,
}

const SEQUENCE_FIELDS_OFFSET: usize = 4;
const TCP_FIXED_HLEN: usize = 20;
/// The data offset's byte.
const DATA_OFFSET: usize = 12;

/// The segment of `packet`, a TCP packet that carries its header (not a later fragment).
pub fn segment<P: PacketAccess>(ctx: &P, packet: &Packet) -> Result<Segment, Counter> {
    let fields: SequenceFields = ctx
        .load(packet.l4 + SEQUENCE_FIELDS_OFFSET)
        .map_err(|_| Counter::PassedUnparsed)?;
    let headers = (packet.l4 - ETH_HLEN) + usize::from(fields.data_offset >> 4) * 4;
    Ok(Segment {
        seq: u32::from_be(fields.seq),
        ack: u32::from_be(fields.ack),
        window: u16::from_be(fields.window),
        flags: fields.flags,
        len: u32::from(packet.tot_len).saturating_sub(headers as u32),
    })
}

/// The window scale option of `packet`, a SYN or SYN-ACK (see `lb_common::tcp::window_scale`).
// A frame of its own: only the few SYNs look at their options.
#[inline(never)]
pub fn window_scale<P: PacketAccess>(ctx: &P, packet: &Packet) -> u8 {
    let data_offset: u8 = ctx.load(packet.l4 + DATA_OFFSET).unwrap_or(0);
    let len = (usize::from(data_offset >> 4) * 4).saturating_sub(TCP_FIXED_HLEN);
    let options = packet.l4 + TCP_FIXED_HLEN;
    lb_common::tcp::window_scale(len, |i| ctx.load::<[u8; 4]>(options + i * 4).ok())
}
