//! The header of every ugdr message (one UCP active message, id [`AM_ID`]).
//!
//! Fixed 44 bytes, little endian, versioned by the first byte:
//!
//! | off | size | field |
//! |----:|-----:|-------|
//! | 0 | 1 | version ([`VERSION`]) |
//! | 1 | 1 | opcode ([`Op`]) |
//! | 2 | 1 | flags ([`FLAG_SOLICITED`], [`FLAG_IMM`]) |
//! | 3 | 1 | status (0, or the NAK syndrome of an ACK, [`Nak`]) |
//! | 4 | 4 | destination QP number |
//! | 8 | 4 | source QP number |
//! | 12 | 2 | source LID |
//! | 14 | 1 | service level (UD) |
//! | 15 | 1 | hints ([`HINT_ACK_MAY_WAIT`]; 0 from a requester that gives none) |
//! | 16 | 4 | packet sequence number: 24 bits, per QP connection, from the requester's `sq_psn` (which the responder's `rq_psn` must match) |
//! | 20 | 4 | immediate data (as posted: network byte order) |
//! | 24 | 8 | remote address (RDMA operations) |
//! | 32 | 4 | rkey (RDMA operations; a SEND with [`FLAG_INV`]: the key to invalidate) |
//! | 36 | 4 | length (RDMA READ: bytes requested) |
//! | 40 | 4 | piggybacked ACK: every message of the reverse direction up to this sequence number was delivered (valid with [`FLAG_ACK`]); in an XRC request, the XRC SRQ number ([`Header::xrc_srqn`]) |
//!
//! An XRC request (from an XRC_SEND QP: SEND, WRITE, READ or atomic) names the XRC SRQ at the
//! target, as IBA's XRCETH does, in the slot of the piggybacked ACK: an XRC_SEND QP only
//! requests (it never executes a request, so it never owes an ACK), and an XRC target QP only
//! answers. Every other field means what it means for RC (a WRITE's `rkey` is the rkey).
//!
//! A UD SEND ([`FLAG_DATAGRAM`]) reuses the fields RDMA operations need and datagrams do not:
//! `rkey` is the Q_Key, and with [`FLAG_GRH`] (the sender's address handle had a GRH)
//! `remote_addr` is the sender's IPv4 address (bits 0..32, which with the source LID gives its
//! GID), the flow label (bits 32..52) and the traffic class (bits 56..64), and `status` is the
//! hop limit: what the receiver writes into the 40-byte GRH area of the receive buffer.
//! With [`FLAG_MULTICAST`] the payload starts with the group's MGID (the GRH's destination).

/// The active-message id all ugdr traffic uses.
pub const AM_ID: u32 = 0x4755; // "GU"
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 44;

pub const FLAG_SOLICITED: u8 = 1 << 0;
pub const FLAG_IMM: u8 = 1 << 1;
/// `ack_seq` carries a cumulative acknowledgement of the reverse direction.
pub const FLAG_ACK: u8 = 1 << 2;
/// A UD datagram: no sequence, no acknowledgement, Q_Key in `rkey`.
pub const FLAG_DATAGRAM: u8 = 1 << 3;
/// The datagram's sender used a GRH (its fields ride in `remote_addr` and `status`).
pub const FLAG_GRH: u8 = 1 << 4;
/// A UC message: no acknowledgement, dropped when it finds no receive.
pub const FLAG_UNRELIABLE: u8 = 1 << 5;
/// A SEND_WITH_INV: `rkey` is the responder's memory window to invalidate.
pub const FLAG_INV: u8 = 1 << 6;
/// A UD datagram to a multicast group (destination QPN 0xFFFFFF): the payload starts with
/// the group's 16-byte MGID, and the receiving process hands the rest to each of its QPs
/// attached to the group (`engine::multicast`).
pub const FLAG_MULTICAST: u8 = 1 << 7;

/// In `hints` of a SEND or WRITE: no completion at the requester waits for this message's
/// acknowledgement (an unsignaled WR), so the responder need not send one of its own for it:
/// it rides on the next message back, goes with a batch of deliveries, or at the latest after
/// the engine's longest ACK wait ([`super::dispatch::OWED_ACK_MAX_WAIT`]). Without it (a
/// signaled WR, or a requester that gives no hints) the ACK goes as soon as the responder
/// runs out of work, as IBA's AckReq asks. A responder faster than its requester ran out of
/// work after nearly every message of a stream of unsignaled 64-byte SENDs (perftest's
/// default: one WR in 100 signaled) and sent an ACK for each: under callgrind a fifth of the
/// requester's instructions went to them.
pub const HINT_ACK_MAY_WAIT: u8 = 1 << 0;

/// Message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// SEND or SEND_WITH_IMM: consumes a receive at the destination QP.
    Send = 1,
    /// Acknowledges every message up to and including `seq` (status 0), or refuses `seq`
    /// (status = a [`Nak`] syndrome).
    Ack = 2,
    /// RDMA WRITE (with [`FLAG_IMM`]: WRITE_WITH_IMM, which consumes a receive) of the payload
    /// to `remote_addr` under `rkey`.
    Write = 3,
    /// RDMA READ of `length` bytes at `remote_addr` under `rkey`.
    ReadRequest = 4,
    /// The data of READ `seq`.
    ReadResponse = 5,
    /// An atomic on the 8 bytes at `remote_addr` (`status`: [`ATOMIC_FETCH_ADD`] or
    /// [`ATOMIC_CMP_SWAP`]); the payload is compare_add and swap, little endian.
    Atomic = 6,
    /// The original 8 bytes of atomic `seq`.
    AtomicResponse = 7,
}

pub const ATOMIC_FETCH_ADD: u8 = 1;
pub const ATOMIC_CMP_SWAP: u8 = 2;
/// In a [`Op::Write`]'s `status`: an ATOMIC WRITE, whose 8-byte payload is stored at the
/// aligned `remote_addr` in one indivisible write (not split as a WRITE may be).
pub const ATOMIC_WRITE: u8 = 3;

/// Why a responder refused a message (carried in an ACK's status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Nak {
    /// The receive buffer was too small or malformed (requester: REM_INV_REQ_ERR).
    InvalidRequest = 1,
    /// The responder failed locally, e.g. a bad lkey in its receive WR (requester: REM_OP_ERR).
    RemoteOperational = 2,
    /// Remote access violation (requester: REM_ACCESS_ERR).
    RemoteAccess = 3,
    /// Receiver not ready (RNR NAK): `seq` waits for a receive WR (or was dropped for lack of
    /// one). It acknowledges nothing (ugdr's responder may hold earlier requests); the
    /// requester counts it against `rnr_retry` (7 = forever), else RNR_RETRY_EXC_ERR.
    ReceiverNotReady = 4,
}

impl Nak {
    pub fn from_raw(v: u8) -> Option<Nak> {
        Some(match v {
            1 => Nak::InvalidRequest,
            2 => Nak::RemoteOperational,
            3 => Nak::RemoteAccess,
            4 => Nak::ReceiverNotReady,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    pub flags: u8,
    pub status: u8,
    pub dst_qpn: u32,
    pub src_qpn: u32,
    pub src_lid: u16,
    pub sl: u8,
    pub hints: u8,
    pub seq: u32,
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub length: u32,
    pub ack_seq: u32,
}

impl Header {
    pub fn new(op: Op, dst_qpn: u32, src_qpn: u32, src_lid: u16, seq: u32) -> Header {
        Header {
            op,
            flags: 0,
            status: 0,
            dst_qpn,
            src_qpn,
            src_lid,
            sl: 0,
            hints: 0,
            seq,
            imm_data: 0,
            remote_addr: 0,
            rkey: 0,
            length: 0,
            ack_seq: 0,
        }
    }

    /// The XRC SRQ an XRC request names (see the module comment); None when the slot
    /// carries an ACK instead, which no XRC request does.
    pub fn xrc_srqn(&self) -> Option<u32> {
        (self.flags & FLAG_ACK == 0).then_some(self.ack_seq)
    }

    /// Names the XRC SRQ at the target of an XRC request (no piggybacked ACK then).
    pub fn set_xrc_srqn(&mut self, srqn: u32) {
        self.flags &= !FLAG_ACK;
        self.ack_seq = srqn;
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = VERSION;
        b[1] = self.op as u8;
        b[2] = self.flags;
        b[3] = self.status;
        b[4..8].copy_from_slice(&self.dst_qpn.to_le_bytes());
        b[8..12].copy_from_slice(&self.src_qpn.to_le_bytes());
        b[12..14].copy_from_slice(&self.src_lid.to_le_bytes());
        b[14] = self.sl;
        b[15] = self.hints;
        b[16..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..24].copy_from_slice(&self.imm_data.to_le_bytes());
        b[24..32].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.rkey.to_le_bytes());
        b[36..40].copy_from_slice(&self.length.to_le_bytes());
        b[40..44].copy_from_slice(&self.ack_seq.to_le_bytes());
        b
    }

    /// None for a short header, another version or an unknown opcode.
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < HEADER_LEN || b[0] != VERSION {
            return None;
        }
        let op = match b[1] {
            1 => Op::Send,
            2 => Op::Ack,
            3 => Op::Write,
            4 => Op::ReadRequest,
            5 => Op::ReadResponse,
            6 => Op::Atomic,
            7 => Op::AtomicResponse,
            _ => return None,
        };
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Some(Header {
            op,
            flags: b[2],
            status: b[3],
            dst_qpn: u32_at(4),
            src_qpn: u32_at(8),
            src_lid: u16::from_le_bytes([b[12], b[13]]),
            sl: b[14],
            hints: b[15],
            seq: u32_at(16),
            imm_data: u32_at(20),
            remote_addr: u64::from_le_bytes(b[24..32].try_into().ok()?),
            rkey: u32_at(32),
            length: u32_at(36),
            ack_seq: u32_at(40),
        })
    }
}

/// A *bundle*: several small messages to one peer process in one UCP active message, so that a WR list costs one UCX send — over TCP one `sendmsg` and one
/// segment — instead of one per WR (SPDK posts ten WRs in a list). Its AM header is a
/// [`HEADER_LEN`]-byte bundle header (version, [`BUNDLE_MARK`] where a message's opcode is,
/// then zeros; the endpoint's token follows, as on every message); its body is the messages in order, each framed as
/// a 4-byte little-endian payload length, its own header, then the payload. The receiver
/// delivers them in that order, as if each had come alone. Bundles go eager, never by
/// rendezvous.
pub const BUNDLE_MARK: u8 = 0xb0;
/// The bytes one message adds to a bundle besides its payload.
pub const BUNDLE_FRAME: usize = 4 + HEADER_LEN;
/// A bundle's body stays below this: up to 64 KiB of a WR list (the rest of a list of SPDK's
/// target, say) goes as one UCX send.
pub const BUNDLE_MAX: usize = 65536 - 256;
/// The first bundle of a WR list stays below this. UCX delivers a message whole, so a bundle's
/// first messages wait for its last bytes: a small first bundle lets the peer start on the
/// list while the rest is on its way. Measured across two namespaces (`scripts/spdk --netns`,
/// SPDK's randrw q16): every bundle up to 64 KiB ~205k IOPS; up to 20 KiB ~255k, but
/// `ib_send_bw -l 8 -s 8192` then fell from ~3.2 to ~2.0 GB/s; the first up to 20 KiB and
/// the rest up to 64 KiB: ~258k and ~2.8 GB/s. (8 KiB: ~190k; UCX's segment size,
/// `UCX_TCP_TX_SEG_SIZE`, changed none of these.) A first bundle of 32–36 KiB did no better
/// then because a full batch of 16 deliveries sent its ACK alone in the middle of delivering
/// it; since that ACK waits for the application's answer (`engine::ACK_BATCH_POLLS`), 36 KiB
/// carries about eight of SPDK's I/Os per `sendmsg`, as its NVMe/TCP does: 0.12–0.13 `sendmsg`
/// per I/O on each side instead of 0.20–0.22, and more IOPS in 12 of 15 alternating pairs of
/// runs (in the last four, 15 s each, 12–37% more: 176–229k against 157–170k);
/// `ib_send_bw -l 8 -s 8192` and bdevperf's 4 KiB verify unchanged within their noise.
pub const FIRST_BUNDLE_MAX: usize = 36 << 10;

/// How a WR list's messages go out, in order, as ranges of their indices, each one UCX send:
/// consecutive messages that may travel together (`bundle`: toward a peer on another host)
/// and go to the same peer process (`to`) as one bundle while its framed size stays within
/// [`FIRST_BUNDLE_MAX`] for the list's first send and [`BUNDLE_MAX`] after it; any other
/// message alone (a one-message range). Each item is a message's payload length, whether it
/// may be bundled, and its peer.
pub fn bundle_plan<P: PartialEq>(
    messages: impl IntoIterator<Item = (usize, bool, P)>,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut messages = messages.into_iter().enumerate().peekable();
    // Small until the list's first send, so that the peer starts on the list early.
    let mut limit = FIRST_BUNDLE_MAX;
    std::iter::from_fn(move || {
        let (start, (len, bundle, to)) = messages.next()?;
        let mut end = start + 1;
        let mut bytes = BUNDLE_FRAME + len;
        if bundle && bytes <= limit {
            while let Some((_, (len, true, next_to))) = messages.peek()
                && *next_to == to
                && bytes + BUNDLE_FRAME + len <= limit
            {
                bytes += BUNDLE_FRAME + len;
                end += 1;
                messages.next();
            }
        }
        limit = BUNDLE_MAX;
        Some(start..end)
    })
}

/// The AM header of a bundle.
pub fn bundle_header() -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0] = VERSION;
    b[1] = BUNDLE_MARK;
    b
}

/// Whether `b` (an admitted AM header) is a bundle header.
pub fn is_bundle_header(b: &[u8]) -> bool {
    b.len() == HEADER_LEN && b[0] == VERSION && b[1] == BUNDLE_MARK
}

/// The frame of one message in a bundle's body; its `payload_len` bytes follow.
pub fn bundle_frame(header: &Header, payload_len: usize) -> [u8; BUNDLE_FRAME] {
    let mut frame = [0u8; BUNDLE_FRAME];
    frame[..4].copy_from_slice(&(payload_len as u32).to_le_bytes());
    frame[4..].copy_from_slice(&header.encode());
    frame
}

/// Spans of application memory of at least this many bytes go into a bundle by reference
/// (UCX's `sendmsg` gathers them), smaller ones are copied into it: an IOV entry costs about
/// what copying a few hundred bytes does, and a bundle has room for only
/// `ucp::SPLICED_SPANS_MAX` of them.
pub const BUNDLE_SPLICE_MIN: usize = 1024;

/// The messages of a bundle's body, in order; a malformed frame (a bad header, a length past
/// the end) ends the walk (`Err`: what was left).
pub fn bundle_messages(body: &[u8]) -> impl Iterator<Item = Result<(Header, &[u8]), usize>> {
    let mut rest = body;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let parsed = (rest.len() >= BUNDLE_FRAME)
            .then(|| {
                let len = u32::from_le_bytes(rest[..4].try_into().ok()?) as usize;
                let header = Header::decode(&rest[4..BUNDLE_FRAME])?;
                let end = BUNDLE_FRAME.checked_add(len).filter(|&e| e <= rest.len())?;
                Some((header, end))
            })
            .flatten();
        match parsed {
            Some((header, end)) => {
                let payload = &rest[BUNDLE_FRAME..end];
                rest = &rest[end..];
                Some(Ok((header, payload)))
            }
            None => {
                let left = rest.len();
                rest = &[];
                Some(Err(left))
            }
        }
    })
}

/// Packet sequence numbers are 24 bits, as InfiniBand's (`sq_psn`, `rq_psn`).
pub const PSN_MASK: u32 = 0x00ff_ffff;

/// `psn + n` in the 24-bit sequence space.
pub fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// The PSN before `psn`.
pub fn psn_prev(psn: u32) -> u32 {
    psn_add(psn, PSN_MASK)
}

/// `a` comes before `b` in the 24-bit sequence space (wrapping; half of it lies behind `b`).
pub fn psn_before(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) & PSN_MASK >= 1 << 23
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranges `bundle_plan` makes of messages (payload length, may be bundled, peer).
    fn plan(messages: &[(usize, bool, u8)]) -> Vec<std::ops::Range<usize>> {
        bundle_plan(messages.iter().copied()).collect()
    }

    #[test]
    fn a_list_goes_as_a_small_first_bundle_then_full_ones() {
        assert!(plan(&[]).is_empty());
        assert_eq!(plan(&[(64, true, 0)]), vec![0..1]);
        // 4 KiB payloads: eight framed fit the first 36 KiB, fifteen each bundle after it.
        let framed = BUNDLE_FRAME + 4096;
        assert_eq!(FIRST_BUNDLE_MAX / framed, 8);
        assert_eq!(BUNDLE_MAX / framed, 15);
        let list = vec![(4096, true, 0); 40];
        assert_eq!(plan(&list), vec![0..8, 8..23, 23..38, 38..40]);
    }

    #[test]
    fn a_message_that_may_not_be_bundled_goes_alone_and_ends_the_bundle_before_it() {
        let list = [
            (64, true, 0),
            (64, true, 0),
            (64, false, 0),
            (64, true, 0),
            (64, true, 0),
        ];
        assert_eq!(plan(&list), vec![0..2, 2..3, 3..5]);
        // Toward a peer on this host nothing is bundled.
        assert_eq!(plan(&[(64, false, 0); 3]), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn a_message_too_large_for_a_bundle_goes_alone_and_lifts_the_first_send_limit() {
        let big = FIRST_BUNDLE_MAX; // framed, above the first limit, within the later one
        assert_eq!(
            plan(&[(big, true, 0), (64, true, 0), (64, true, 0)]),
            vec![0..1, 1..3]
        );
        // After the first send a bundle may take it.
        assert_eq!(
            plan(&[(64, false, 0), (big, true, 0), (64, true, 0)]),
            vec![0..1, 1..3]
        );
        let huge = BUNDLE_MAX; // above every limit once framed
        assert_eq!(
            plan(&[(64, true, 0), (huge, true, 0), (64, true, 0)]),
            vec![0..1, 1..2, 2..3]
        );
    }

    #[test]
    fn a_bundle_goes_to_one_peer() {
        let list = [(64, true, 1), (64, true, 1), (64, true, 2), (64, true, 1)];
        assert_eq!(plan(&list), vec![0..2, 2..3, 3..4]);
    }

    #[test]
    fn header_round_trips_every_field() {
        let mut h = Header::new(Op::Send, 0xabcdef, 0x123456, 0x0102, 0xfffffffe);
        h.flags = FLAG_IMM | FLAG_SOLICITED;
        h.status = 3;
        h.imm_data = 0xdeadbeef;
        h.remote_addr = 0x1122334455667788;
        h.rkey = 0x99aabbcc;
        h.length = 4096;
        h.ack_seq = 0x0bad_cafe;
        h.sl = 9;
        h.hints = HINT_ACK_MAY_WAIT;
        let b = h.encode();
        assert_eq!(b[0], VERSION);
        assert_eq!(b[15], HINT_ACK_MAY_WAIT);
        assert_eq!(Header::decode(&b), Some(h));
    }

    #[test]
    fn an_xrc_request_names_its_srq_only_without_an_ack() {
        let mut h = Header::new(Op::Write, 1, 2, 3, 4);
        h.flags = FLAG_ACK | FLAG_IMM;
        h.ack_seq = 9;
        assert_eq!(h.xrc_srqn(), None, "the slot carries an ACK");
        h.set_xrc_srqn(0x00ab_cdef);
        assert_eq!(h.flags, FLAG_IMM);
        let back = Header::decode(&h.encode()).expect("decodes");
        assert_eq!(back.xrc_srqn(), Some(0x00ab_cdef));
    }

    #[test]
    fn decode_refuses_short_foreign_and_unknown() {
        let b = Header::new(Op::Ack, 1, 2, 3, 4).encode();
        assert!(Header::decode(&b[..HEADER_LEN - 1]).is_none());
        let mut other = b;
        other[0] = VERSION + 1;
        assert!(Header::decode(&other).is_none());
        let mut unknown = b;
        unknown[1] = 0x7f;
        assert!(Header::decode(&unknown).is_none());
    }

    #[test]
    fn a_bundle_gives_back_its_messages_in_order_and_stops_at_a_bad_frame() {
        let a = Header::new(Op::Send, 1, 2, 3, 4);
        let mut b = Header::new(Op::ReadRequest, 5, 6, 7, 8);
        b.length = 4096;
        let mut body = crate::ucp::OwnedBytes::new();
        body.extend_from_slice(&bundle_frame(&a, 3));
        body.extend_from_slice(b"abc");
        body.extend_from_slice(&bundle_frame(&b, 0));
        let got: Vec<_> = bundle_messages(&body).collect();
        assert_eq!(got, vec![Ok((a, &b"abc"[..])), Ok((b, &[][..]))]);
        assert!(is_bundle_header(&bundle_header()));
        assert!(!is_bundle_header(&a.encode()));
        // A length past the end, or a header that does not decode, ends the walk.
        let mut long = crate::ucp::OwnedBytes::new();
        long.extend_from_slice(&bundle_frame(&a, 10));
        long.extend_from_slice(b"abc");
        let got: Vec<_> = bundle_messages(&long).collect();
        assert_eq!(got, vec![Err(BUNDLE_FRAME + 3)]);
        let mut bad = body.clone();
        bad[5] = 0x7f; // the first message's opcode
        assert_eq!(
            bundle_messages(&bad).collect::<Vec<_>>(),
            vec![Err(body.len())]
        );
    }

    #[test]
    fn sequence_comparison_wraps_at_24_bits() {
        assert!(psn_before(1, 2));
        assert!(!psn_before(2, 1));
        assert!(!psn_before(5, 5));
        assert!(psn_before(PSN_MASK, 0));
        assert!(!psn_before(0, PSN_MASK));
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_prev(0), PSN_MASK);
        // Half the space lies behind, half ahead.
        assert!(psn_before(0x80_0000, 0));
        assert!(!psn_before(0x7f_ffff, 0));
    }

    #[test]
    fn every_nak_round_trips() {
        for n in [
            Nak::InvalidRequest,
            Nak::RemoteOperational,
            Nak::RemoteAccess,
            Nak::ReceiverNotReady,
        ] {
            assert_eq!(Nak::from_raw(n as u8), Some(n));
        }
        assert_eq!(Nak::from_raw(0), None);
        assert_eq!(Nak::from_raw(5), None);
    }
}
