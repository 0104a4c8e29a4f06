//! TCP connection tracking as Linux's conntrack does it (`nf_conntrack_proto_tcp.c`): the state
//! machine of its `tcp_conntracks` table, and its window check (`tcp_in_window`) for the
//! segments that change the state. Pure functions, shared by the datapath and host tests.
//!
//! Each direction of a connection has its own conntrack entry, which holds that direction's
//! [`TcpWindow`]: what it has sent and what it has announced it will receive. A packet updates
//! only its own direction's window, so the established path touches one entry; the other
//! direction's is read only for the segments whose state change the window check guards (RST,
//! FIN).

use crate::valid::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// The states, numbered as Linux's `enum tcp_conntrack` (`conntrack -L` shows the same names).
pub const NONE: u8 = 0;
/// A SYN seen from the client.
pub const SYN_SENT: u8 = 1;
/// The SYN-ACK seen: the handshake's last ACK is awaited.
pub const SYN_RECV: u8 = 2;
pub const ESTABLISHED: u8 = 3;
/// A FIN seen from one side (either).
pub const FIN_WAIT: u8 = 4;
/// The first FIN was acknowledged: one side still sends.
pub const CLOSE_WAIT: u8 = 5;
/// FINs seen from both sides: the last ACK is awaited.
pub const LAST_ACK: u8 = 6;
pub const TIME_WAIT: u8 = 7;
/// Reset.
pub const CLOSE: u8 = 8;
/// A SYN seen from the server after the client's: a simultaneous open.
pub const SYN_SENT2: u8 = 9;
const STATES: usize = 10;

/// What a segment does to the connection (Linux's sIV, sIG and new states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The connection moves to (or stays in) this state.
    To(u8),
    /// The segment may be valid for the endpoints though not for our view (a SYN to an
    /// established connection, a retransmitted SYN-ACK): it passes and changes nothing.
    Ignore,
    /// The segment is not valid in this state (an ACK before the SYN-ACK, a FIN during the
    /// handshake): it changes nothing. Linux marks it INVALID; we pass it, as it cannot harm the
    /// connection's state.
    Invalid,
}

const IV: u8 = 0xfe;
const IG: u8 = 0xff;
const S_SS: u8 = SYN_SENT;
const S_SR: u8 = SYN_RECV;
const S_ES: u8 = ESTABLISHED;
const S_FW: u8 = FIN_WAIT;
const S_CW: u8 = CLOSE_WAIT;
const S_LA: u8 = LAST_ACK;
const S_TW: u8 = TIME_WAIT;
const S_CL: u8 = CLOSE;
const S_S2: u8 = SYN_SENT2;

/// Which flags matter to the state machine, in Linux's order (`enum tcp_bit_set`).
const SYN_SET: usize = 0;
const SYNACK_SET: usize = 1;
const FIN_SET: usize = 2;
const ACK_SET: usize = 3;
const RST_SET: usize = 4;
const NONE_SET: usize = 5;

/// Linux's `tcp_conntracks` (as of 6.x): `[direction][flags][state]`, direction 0 the original
/// (client → service) and 1 the reply.
#[rustfmt::skip]
const TRANSITIONS: [[[u8; STATES]; 6]; 2] = [
    [
        //        NO    SS    SR    ES    FW    CW    LA    TW    CL    S2
        /*syn*/ [S_SS, S_SS, IG,   IG,   IG,   IG,   IG,   S_SS, S_SS, S_S2],
        /*sa */ [IV,   IV,   S_SR, IV,   IV,   IV,   IV,   IV,   IV,   S_SR],
        /*fin*/ [IV,   IV,   S_FW, S_FW, S_LA, S_LA, S_LA, S_TW, S_CL, IV],
        /*ack*/ [S_ES, IV,   S_ES, S_ES, S_CW, S_CW, S_TW, S_TW, S_CL, IV],
        /*rst*/ [IV,   S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL],
        /*non*/ [IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV],
    ],
    [
        //        NO    SS    SR    ES    FW    CW    LA    TW    CL    S2
        /*syn*/ [IV,   S_S2, IV,   IV,   IV,   IV,   IV,   IV,   IV,   S_S2],
        /*sa */ [IV,   S_SR, S_SR, IG,   IG,   IG,   IG,   IG,   IG,   S_SR],
        /*fin*/ [IV,   IV,   S_FW, S_FW, S_LA, S_LA, S_LA, S_TW, S_CL, IV],
        /*ack*/ [IV,   IG,   S_SR, S_ES, S_CW, S_CW, S_TW, S_TW, S_CL, IG],
        /*rst*/ [IV,   S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL, S_CL],
        /*non*/ [IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV,   IV],
    ],
];

/// Linux's `get_conntrack_index`.
const fn flag_set(flags: u8) -> usize {
    if flags & TCP_RST != 0 {
        RST_SET
    } else if flags & TCP_SYN != 0 {
        if flags & TCP_ACK != 0 {
            SYNACK_SET
        } else {
            SYN_SET
        }
    } else if flags & TCP_FIN != 0 {
        FIN_SET
    } else if flags & TCP_ACK != 0 {
        ACK_SET
    } else {
        NONE_SET
    }
}

/// What a segment with TCP `flags` does to a connection in `state`; `reply`: it travels from the
/// server to the client.
pub fn step(state: u8, reply: bool, flags: u8) -> Step {
    let Some(row) = TRANSITIONS[reply as usize].get(flag_set(flags)) else {
        return Step::Invalid;
    };
    match row.get(state as usize) {
        Some(&IG) => Step::Ignore,
        Some(&IV) | None => Step::Invalid,
        Some(&next) => Step::To(next),
    }
}

/// The state of a connection opened by a segment with `flags` from the client; `None` for those
/// that open none (a RST, FIN or SYN-ACK of no connection). An ACK picks up a connection whose
/// start we missed (Linux's `nf_conntrack_tcp_loose`, on by default).
pub fn opening_state(flags: u8) -> Option<u8> {
    match step(NONE, false, flags) {
        Step::To(state) => Some(state),
        Step::Ignore | Step::Invalid => None,
    }
}

/// A client's SYN on the tuple of a connection in `state` opens a new connection, replacing it
/// (Linux: TIME_WAIT and CLOSE, RFC 1122's reopening from TIME-WAIT).
pub fn reopens(state: u8, reply: bool, flags: u8) -> bool {
    !reply
        && flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN
        && (state == TIME_WAIT || state == CLOSE)
}

/// Whether a segment moving a connection from `state` to `next` is the client's ACK that
/// completes the handshake: the window check guards it too (the ACK must acknowledge the
/// SYN-ACK), or a blind ACK would establish a connection opened by a spoofed SYN.
pub const fn completes_handshake(state: u8, reply: bool, next: u8) -> bool {
    state == SYN_RECV && !reply && next == ESTABLISHED
}

/// Whether the window check guards the state change of a segment with `flags`: a RST or a FIN
/// injected from outside must not close a connection unless it lies in the window.
pub const fn checks_window(flags: u8) -> bool {
    flags & (TCP_RST | TCP_FIN) != 0
}

/// `wscale` of a window whose option was not seen (a connection picked up mid-stream, or
/// carried over from an agent that did not track windows): windows are read with the largest
/// scale, so that the bound errs towards accepting.
pub const WSCALE_UNKNOWN: u8 = 0xff;
/// `wscale` of a SYN without the option.
pub const WSCALE_NONE: u8 = 0xfe;
/// RFC 7323's largest shift.
pub const WSCALE_MAX: u8 = 14;

/// The TCP header fields the tracking reads, host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    pub flags: u8,
    /// Payload bytes.
    pub len: u32,
}

impl Segment {
    /// The sequence number after the segment (SYN and FIN count one each).
    pub const fn end(&self) -> u32 {
        self.seq
            .wrapping_add(self.len)
            .wrapping_add((self.flags & TCP_SYN != 0) as u32)
            .wrapping_add((self.flags & TCP_FIN != 0) as u32)
    }
}

/// `a` comes after `b` in sequence space (modulo 2^32).
const fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Linux's `MAXACKWINDOW`: how far below the receiver's end an ACK may be.
const MIN_ACK_WINDOW: u32 = 66_000;

/// One direction's sequence space, kept in that direction's conntrack entry (Linux's
/// `ip_ct_tcp_state`, cut to what the check of RST and FIN needs, in 8 bytes: the conntrack entry
/// must stay small for the programs' stack).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TcpWindow {
    /// The sequence number after the last byte this direction sent (`td_end`).
    pub end: u32,
    /// The largest window this direction announced after its SYN, as it sits in the header
    /// (`td_maxwin` before scaling); 0: nothing learned yet, and the window check passes every
    /// segment.
    pub max_window: u16,
    /// The shift of this direction's windows (its SYN's option), or `WSCALE_*`.
    pub wscale: u8,
    pub _pad: u8,
}

impl TcpWindow {
    /// The window of the SYN (or SYN-ACK) that opens this direction, with the window scale
    /// option it carried. Its window size is learned from the next segments: a SYN's is not
    /// scaled, theirs are.
    pub const fn opened(syn: &Segment, wscale: u8) -> Self {
        TcpWindow {
            end: syn.end(),
            max_window: 0,
            wscale,
            _pad: 0,
        }
    }

    /// The shift this direction's windows take, once the SYN-ACK settled whether both sides
    /// scale.
    const fn shift(&self) -> u8 {
        match self.wscale {
            WSCALE_UNKNOWN => WSCALE_MAX,
            WSCALE_NONE => 0,
            shift if shift > WSCALE_MAX => WSCALE_MAX,
            shift => shift,
        }
    }

    /// The largest window this direction announced, in bytes.
    const fn scaled_window(&self) -> u32 {
        (self.max_window as u32) << self.shift()
    }

    /// RFC 7323: windows are scaled only when both SYNs carried the option. Called on both
    /// directions' windows once the SYN-ACK is seen.
    pub fn agree_scaling(original: &mut TcpWindow, reply: &mut TcpWindow) {
        if original.wscale == WSCALE_NONE || reply.wscale == WSCALE_NONE {
            original.wscale = WSCALE_NONE;
            reply.wscale = WSCALE_NONE;
        }
    }

    /// Learns from a segment this direction sent (not a SYN: `opened` takes those).
    pub fn learn(&mut self, segment: &Segment) {
        let end = segment.end();
        if self.max_window == 0 || after(end, self.end) {
            self.end = end;
        }
        let window = if segment.window == 0 {
            1
        } else {
            segment.window
        };
        if window > self.max_window {
            self.max_window = window;
        }
    }

    /// The ACK bound of Linux's `tcp_in_window` for the handshake's last ACK, sent to
    /// `receiver` (the SYN-ACK's direction), before either window is learned: it acknowledges
    /// the SYN-ACK or less, within MIN_ACK_WINDOW of it. A blind guess of a spoofed client
    /// passes once in about 65,000.
    pub fn acknowledged_by(receiver: &TcpWindow, segment: &Segment) -> bool {
        segment.flags & TCP_ACK != 0
            && !after(segment.ack, receiver.end)
            && after(
                segment.ack,
                receiver.end.wrapping_sub(MIN_ACK_WINDOW).wrapping_sub(1),
            )
    }

    /// Linux's `tcp_in_window` for a segment this direction (`self`) sends to `receiver`: its
    /// sequence numbers overlap what the receiver can have announced, and its ACK what the
    /// receiver sent. The upper bound is the receiver's largest window past what this direction
    /// sent (Linux keeps the receiver's highest ACK plus window, which lies below it). Passes
    /// when either side's window is not known yet.
    pub fn in_window(&self, receiver: &TcpWindow, segment: &Segment) -> bool {
        if self.max_window == 0 || receiver.max_window == 0 {
            return true;
        }
        let receiver_window = receiver.scaled_window();
        let (mut seq, mut end) = (segment.seq, segment.end());
        // A segment without data is checked by its ACK only; a RST always by its sequence.
        if seq == end && segment.flags & TCP_RST == 0 {
            seq = self.end;
            end = self.end;
        }
        let seq_ok = !after(seq, self.end.wrapping_add(receiver_window))
            && after(end, self.end.wrapping_sub(receiver_window).wrapping_sub(1));
        // Without ACK (or a RST+ACK of 0, from stacks that set the flag without a value) there
        // is no ACK to check.
        let has_ack =
            segment.flags & TCP_ACK != 0 && !(segment.flags & TCP_RST != 0 && segment.ack == 0);
        let own_window = self.scaled_window();
        let ack_window = if own_window > MIN_ACK_WINDOW {
            own_window
        } else {
            MIN_ACK_WINDOW
        };
        let ack_ok = !has_ack
            || (!after(segment.ack, receiver.end)
                && after(
                    segment.ack,
                    receiver.end.wrapping_sub(ack_window).wrapping_sub(1),
                ));
        seq_ok && ack_ok
    }
}

/// The window scale option of a SYN whose `len` bytes of TCP options `word(i)` reads, four at
/// a time from byte `4 * i` (the datapath reads them from the packet): its shift, or
/// `WSCALE_UNKNOWN`. The option is looked for where stacks put it, behind a NOP that aligns it
/// to a word (Linux, the BSDs and Windows all do): a walk of the options' kinds and lengths, as
/// Linux's `tcp_options` does, is more than the verifier accepts. Not found there, the
/// window's scale is unknown, and read as the largest: the window check errs towards passing.
pub fn window_scale(len: usize, word: impl Fn(usize) -> Option<[u8; 4]>) -> u8 {
    const NOP: u8 = 1;
    const WINDOW: u8 = 3;
    const WINDOW_LEN: u8 = 3;
    /// The most option words a TCP header holds.
    const MAX_WORDS: usize = 10;
    for i in 0..MAX_WORDS {
        if (i + 1) * 4 > len {
            break;
        }
        match word(i) {
            Some([NOP, WINDOW, WINDOW_LEN, shift]) => {
                return if shift > WSCALE_MAX {
                    WSCALE_MAX
                } else {
                    shift
                };
            }
            Some(_) => {}
            None => break,
        }
    }
    WSCALE_UNKNOWN
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::valid::TCP_PSH;

    const ORIGINAL: bool = false;
    const REPLY: bool = true;

    fn walk(start: u8, segments: &[(bool, u8)]) -> u8 {
        segments.iter().fold(start, |state, &(reply, flags)| {
            match step(state, reply, flags) {
                Step::To(next) => next,
                Step::Ignore | Step::Invalid => state,
            }
        })
    }

    #[test]
    fn the_handshake_establishes_on_the_clients_ack() {
        let syn = opening_state(TCP_SYN).unwrap();
        assert_eq!(syn, SYN_SENT);
        assert_eq!(step(syn, REPLY, TCP_SYN | TCP_ACK), Step::To(SYN_RECV));
        // The SYN-ACK alone does not establish (it did, for 6 h, before).
        assert_eq!(step(SYN_RECV, REPLY, TCP_ACK), Step::To(SYN_RECV));
        assert_eq!(step(SYN_RECV, ORIGINAL, TCP_ACK), Step::To(ESTABLISHED));
        assert_eq!(step(SYN_SENT, ORIGINAL, TCP_SYN), Step::To(SYN_SENT));
        assert_eq!(step(SYN_SENT, ORIGINAL, TCP_ACK), Step::Invalid);
        assert_eq!(step(SYN_SENT, REPLY, TCP_SYN), Step::To(SYN_SENT2));
        assert_eq!(
            step(SYN_SENT2, REPLY, TCP_SYN | TCP_ACK),
            Step::To(SYN_RECV)
        );
    }

    #[test]
    fn only_a_syn_or_an_ack_opens_a_connection() {
        assert_eq!(opening_state(TCP_SYN), Some(SYN_SENT));
        assert_eq!(opening_state(TCP_ACK | TCP_PSH), Some(ESTABLISHED));
        for flags in [
            TCP_RST,
            TCP_RST | TCP_ACK,
            TCP_FIN | TCP_ACK,
            TCP_SYN | TCP_ACK,
            0,
        ] {
            assert_eq!(opening_state(flags), None, "{flags:#x}");
        }
    }

    #[test]
    fn a_half_close_stays_open_until_both_sides_fin() {
        // The client shuts down writing; the server acknowledges and goes on sending.
        let half = walk(
            ESTABLISHED,
            &[(ORIGINAL, TCP_FIN | TCP_ACK), (REPLY, TCP_ACK)],
        );
        assert_eq!(half, CLOSE_WAIT);
        assert_eq!(
            walk(half, &[(REPLY, TCP_ACK | TCP_PSH), (ORIGINAL, TCP_ACK)]),
            CLOSE_WAIT
        );
        let last = walk(half, &[(REPLY, TCP_FIN | TCP_ACK)]);
        assert_eq!(last, LAST_ACK);
        assert_eq!(walk(last, &[(ORIGINAL, TCP_ACK)]), TIME_WAIT);
        // The server closing first goes the same way.
        let closed = walk(
            ESTABLISHED,
            &[
                (REPLY, TCP_FIN | TCP_ACK),
                (ORIGINAL, TCP_FIN | TCP_ACK),
                (REPLY, TCP_ACK),
            ],
        );
        assert_eq!(closed, TIME_WAIT);
    }

    #[test]
    fn a_rst_closes_from_any_state_and_a_syn_reopens_only_closed_ones() {
        for state in [
            SYN_SENT,
            SYN_RECV,
            ESTABLISHED,
            FIN_WAIT,
            CLOSE_WAIT,
            LAST_ACK,
            TIME_WAIT,
        ] {
            assert_eq!(step(state, REPLY, TCP_RST), Step::To(CLOSE));
            assert_eq!(step(state, ORIGINAL, TCP_RST | TCP_ACK), Step::To(CLOSE));
        }
        assert_eq!(step(ESTABLISHED, ORIGINAL, TCP_SYN), Step::Ignore);
        assert!(reopens(TIME_WAIT, ORIGINAL, TCP_SYN));
        assert!(reopens(CLOSE, ORIGINAL, TCP_SYN));
        assert!(!reopens(ESTABLISHED, ORIGINAL, TCP_SYN));
        assert!(!reopens(CLOSE, REPLY, TCP_SYN));
        assert!(!reopens(CLOSE, ORIGINAL, TCP_SYN | TCP_ACK));
        // A state no build writes changes nothing.
        assert_eq!(step(200, ORIGINAL, TCP_ACK), Step::Invalid);
    }

    /// A connection whose client sent SYN seq 1000 (scale 7) and whose server answered SYN-ACK
    /// seq 5000 (scale 7), then 100 bytes each way.
    fn windows() -> (TcpWindow, TcpWindow) {
        let syn = Segment {
            seq: 1000,
            ack: 0,
            window: 64240,
            flags: TCP_SYN,
            len: 0,
        };
        let mut client = TcpWindow::opened(&syn, 7);
        let syn_ack = Segment {
            seq: 5000,
            ack: 1001,
            window: 65160,
            flags: TCP_SYN | TCP_ACK,
            len: 0,
        };
        let mut server = TcpWindow::opened(&syn_ack, 7);
        TcpWindow::agree_scaling(&mut client, &mut server);
        client.learn(&Segment {
            seq: 1001,
            ack: 5001,
            window: 502,
            flags: TCP_ACK,
            len: 100,
        });
        server.learn(&Segment {
            seq: 5001,
            ack: 1101,
            window: 509,
            flags: TCP_ACK,
            len: 100,
        });
        (client, server)
    }

    #[test]
    fn windows_follow_what_each_side_sent_and_announced() {
        let (mut client, server) = windows();
        assert_eq!(
            (client.end, client.max_window, client.scaled_window()),
            (1101, 502, 502 << 7)
        );
        assert_eq!((server.end, server.max_window), (5101, 509));
        client.learn(&Segment {
            seq: 1001,
            ack: 5101,
            window: 400,
            flags: TCP_ACK,
            len: 0,
        });
        assert_eq!(
            (client.end, client.max_window),
            (1101, 502),
            "old data and a smaller window"
        );
    }

    #[test]
    fn a_rst_counts_only_inside_the_window() {
        let (client, server) = windows();
        let rst = |seq| Segment {
            seq,
            ack: 0,
            window: 0,
            flags: TCP_RST,
            len: 0,
        };
        // At the next byte, or anywhere the receiver may accept.
        assert!(client.in_window(&server, &rst(1101)));
        assert!(client.in_window(&server, &rst(1101 + 50_000)));
        assert!(server.in_window(&client, &rst(5101)));
        // Beyond the receiver's window, far behind, or anywhere else.
        assert!(!client.in_window(&server, &rst(1101 + (509 << 7) + 1)));
        assert!(!client.in_window(&server, &rst(1101u32.wrapping_sub((509 << 7) + 10))));
        assert!(!client.in_window(&server, &rst(0x8000_0000)));
        assert!(!server.in_window(&client, &rst(12_345_678)));
        // A RST+ACK must also acknowledge something the receiver sent.
        let rst_ack = |ack| Segment {
            seq: 1101,
            ack,
            window: 0,
            flags: TCP_RST | TCP_ACK,
            len: 0,
        };
        assert!(client.in_window(&server, &rst_ack(5101)));
        assert!(!client.in_window(&server, &rst_ack(5102)));
        assert!(client.in_window(&server, &rst_ack(0)));
    }

    /// The handshake's last ACK is checked as any segment: it must acknowledge the SYN-ACK.
    #[test]
    fn the_handshake_ack_must_acknowledge_the_syn_ack() {
        assert!(completes_handshake(SYN_RECV, ORIGINAL, ESTABLISHED));
        assert!(!completes_handshake(SYN_RECV, REPLY, SYN_RECV));
        assert!(!completes_handshake(ESTABLISHED, ORIGINAL, ESTABLISHED));
        let syn_ack = Segment {
            seq: 5000,
            ack: 1001,
            window: 65160,
            flags: TCP_SYN | TCP_ACK,
            len: 0,
        };
        let server = TcpWindow::opened(&syn_ack, 7);
        let ack = |ack| Segment {
            seq: 1001,
            ack,
            window: 502,
            flags: TCP_ACK,
            len: 0,
        };
        assert!(TcpWindow::acknowledged_by(&server, &ack(5001)));
        assert!(TcpWindow::acknowledged_by(
            &server,
            &ack(5001u32.wrapping_sub(65_000))
        ));
        assert!(
            !TcpWindow::acknowledged_by(&server, &ack(5002)),
            "beyond it"
        );
        assert!(
            !TcpWindow::acknowledged_by(&server, &ack(0x9000_0000)),
            "a blind guess"
        );
        let no_ack = Segment {
            flags: 0,
            ..ack(5001)
        };
        assert!(!TcpWindow::acknowledged_by(&server, &no_ack));
    }

    #[test]
    fn a_fin_counts_only_inside_the_window() {
        let (client, server) = windows();
        let fin = |seq| Segment {
            seq,
            ack: 5101,
            window: 502,
            flags: TCP_FIN | TCP_ACK,
            len: 0,
        };
        assert!(client.in_window(&server, &fin(1101)));
        assert!(!client.in_window(&server, &fin(0x9000_0000)));
    }

    #[test]
    fn unknown_windows_accept_until_learned() {
        let (client, _) = windows();
        let unknown = TcpWindow {
            wscale: WSCALE_UNKNOWN,
            ..TcpWindow::default()
        };
        let rst = Segment {
            seq: 0x8000_0000,
            ack: 0,
            window: 0,
            flags: TCP_RST,
            len: 0,
        };
        assert!(client.in_window(&unknown, &rst));
        assert!(unknown.in_window(&client, &rst));
        // The handshake alone teaches no window size: a SYN's is not scaled.
        let syn = Segment {
            seq: 1,
            ack: 0,
            window: 1000,
            flags: TCP_SYN,
            len: 0,
        };
        assert!(TcpWindow::opened(&syn, 7).in_window(&client, &rst));
        // Learned from the first segment, with the largest scale: the bound errs wide.
        let mut picked_up = unknown;
        picked_up.learn(&Segment {
            seq: 7000,
            ack: 1101,
            window: 10,
            flags: TCP_ACK,
            len: 0,
        });
        assert_eq!(picked_up.scaled_window(), 10 << WSCALE_MAX);
        assert_eq!(picked_up.end, 7000);
    }

    #[test]
    fn scaling_needs_both_sides() {
        let syn = Segment {
            seq: 1,
            ack: 0,
            window: 1000,
            flags: TCP_SYN,
            len: 0,
        };
        let mut client = TcpWindow::opened(&syn, 7);
        let mut server = TcpWindow::opened(
            &Segment {
                flags: TCP_SYN | TCP_ACK,
                ..syn
            },
            WSCALE_NONE,
        );
        TcpWindow::agree_scaling(&mut client, &mut server);
        assert_eq!(client.wscale, WSCALE_NONE);
        client.learn(&Segment {
            seq: 2,
            ack: 2,
            window: 2000,
            flags: TCP_ACK,
            len: 0,
        });
        assert_eq!(client.scaled_window(), 2000);
    }

    #[test]
    fn sequence_numbers_wrap() {
        let syn = Segment {
            seq: u32::MAX - 10,
            ack: 0,
            window: 1000,
            flags: TCP_SYN,
            len: 0,
        };
        let mut client = TcpWindow::opened(&syn, WSCALE_NONE);
        client.learn(&Segment {
            seq: u32::MAX - 9,
            ack: 1,
            window: 1000,
            flags: TCP_ACK,
            len: 100,
        });
        assert_eq!(client.end, 90);
    }

    #[test]
    fn the_window_scale_option_is_found_where_stacks_put_it() {
        let scale = |options: &[u8], len: usize| {
            window_scale(len, |i| options.get(i * 4..i * 4 + 4)?.try_into().ok())
        };
        // Linux's SYN: MSS, SACK permitted, timestamps, NOP, window scale 7.
        let mut linux = [
            2, 4, 5, 180, 4, 2, 8, 10, 1, 2, 3, 4, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        assert_eq!(scale(&linux, linux.len()), 7);
        // Windows': MSS, NOP, window scale 8, NOP, NOP, SACK permitted.
        assert_eq!(scale(&[2, 4, 5, 180, 1, 3, 3, 8, 1, 1, 4, 2], 12), 8);
        // Cut before the option, or without it: unknown, read as the largest.
        assert_eq!(scale(&linux, 16), WSCALE_UNKNOWN);
        assert_eq!(scale(&linux[..18], 20), WSCALE_UNKNOWN);
        assert_eq!(scale(&[2, 4, 5, 180], 4), WSCALE_UNKNOWN);
        assert_eq!(scale(&[], 0), WSCALE_UNKNOWN);
        // A shift beyond RFC 7323's is capped.
        linux[19] = 30;
        assert_eq!(scale(&linux, 20), WSCALE_MAX);
    }
}
