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
const MAX_OPTION_WORDS: usize = 10;

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

/// The window scale option of `packet`, a SYN or SYN-ACK (`tcp::WSCALE_NONE` without one).
// A frame of its own: its 40-byte buffer is needed only for the few SYNs.
#[inline(never)]
pub fn window_scale<P: PacketAccess>(ctx: &P, packet: &Packet) -> u8 {
    let mut options = [0u8; MAX_OPTION_WORDS * 4];
    let data_offset: u8 = ctx.load(packet.l4 + 12).unwrap_or(0);
    let len = (usize::from(data_offset >> 4) * 4).saturating_sub(TCP_FIXED_HLEN);
    for word in 0..MAX_OPTION_WORDS {
        if word * 4 >= len {
            break;
        }
        // Options are whole words (the data offset counts words).
        let Ok(value) = ctx.load::<[u8; 4]>(packet.l4 + TCP_FIXED_HLEN + word * 4) else {
            break;
        };
        options[word * 4..word * 4 + 4].copy_from_slice(&value);
    }
    lb_common::tcp::window_scale(&options, len)
}
