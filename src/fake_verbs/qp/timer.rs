//! The RC requester's transport timer (IBA 9.7.6.1.3, rxe's retransmit timer): a request the
//! responder does not answer within the QP's local ACK timeout (`timeout`: 4.096 µs ×
//! 2^timeout) is sent again, with the same PSN, from the oldest unanswered one on (go back
//! N); after `retry_cnt` such retries without an answer it completes with
//! IBV_WC_RETRY_EXC_ERR, the QP goes to ERR and flushes the rest.
//!
//! UCX loses nothing on a live connection, so a message needs a retransmission only when the
//! responder dropped it (its QP was not in RTR yet, it kept too much already), and the timer's
//! main work is noticing a peer that no longer answers (a cut link: UCX's TCP connection just
//! stalls). Any answer from the peer's responder counts: an ACK (also the re-ACK of a
//! duplicate), an RNR NAK, a READ or atomic response. ugdr acknowledges whole messages, not
//! packets, so a large message may take longer than the timeout to cross: each expiry allows
//! [`MIN_BANDWIDTH`] for the bytes still unanswered on top of the timeout.
//!
//! The engine's progress thread ticks the QPs that armed the timer ([`crate::engine::TIMER_TICK`]),
//! so it runs while the application sleeps or spins.

use super::QueuePair;
use super::queues::{Deferred, Queues};
use crate::engine::wire::psn_before;
use crate::fake_verbs::qp_state::QpState;
use crate::fake_verbs::work::WcStatus;
use crate::ucp::LockedWorker;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The shortest local ACK timeout ugdr applies: its acknowledgements come from the peer's
/// CPU, not from a HCA, so a few milliseconds of silence mean nothing.
const MIN_ACK_TIMEOUT: Duration = Duration::from_millis(20);
/// The local ACK timeout 0 means "infinite" (IBA): such a QP never fails for lack of an
/// answer, but what its responder dropped is still sent again at this pace.
const INFINITE_TIMEOUT_RESEND: Duration = Duration::from_millis(67);
/// The slowest transfer rate a message is granted (bytes per second) before its silence
/// counts against the retry count.
const MIN_BANDWIDTH: u64 = 32 << 20;
/// `rnr_retry` 7 means retry forever (IBA 9.7.5.2.8).
const RNR_RETRY_INFINITE: u8 = 7;

/// The transport timer's state (in the QP's queues).
#[derive(Debug, Default)]
pub(super) struct Timer {
    /// On the engine's list of QPs it ticks.
    pub(super) armed: bool,
    /// When the current wait for an answer started: set by the first tick that sees a
    /// request unanswered, cleared by every answer.
    started: Option<Instant>,
    /// Expirations since the last answer (against `retry_cnt`).
    retries: u8,
    /// RNR NAKs since the responder last acknowledged something new (against `rnr_retry`).
    rnr_retries: u8,
    /// After an RNR NAK: when to send again (the responder's RNR timer), from which PSN.
    rnr_resend: Option<(Instant, u32)>,
    /// A resend stopped at this PSN, a message UCX was still sending: it goes on from there
    /// once UCX is done with that one (`note_in_ucx`).
    resend_from: Option<u32>,
    /// The timer or the RNR count failed the QP: the owner (rdma_cm) is told once the lock is
    /// released.
    pub(super) failed: bool,
}

impl Timer {
    /// An answer from the peer's responder: the wait starts over.
    pub(super) fn answered(&mut self) {
        self.started = None;
        self.retries = 0;
    }

    /// The responder acknowledged something new: it is not stuck on a receive any more.
    pub(super) fn progressed(&mut self) {
        self.answered();
        self.rnr_retries = 0;
    }

    /// After an RNR NAK: whether `rnr_retry` allows another try.
    pub(super) fn rnr_retry_allowed(&mut self, rnr_retry: u8) -> bool {
        self.answered();
        if rnr_retry >= RNR_RETRY_INFINITE {
            return true;
        }
        self.rnr_retries = self.rnr_retries.saturating_add(1);
        self.rnr_retries <= rnr_retry
    }

    /// An RNR NAK for `psn` whose responder asks for `delay` before the next try: from `psn`
    /// on, everything unanswered is sent again then (the earliest PSN NAKed wins).
    pub(super) fn resend_after_rnr(&mut self, psn: u32, delay: Duration) {
        let at = Instant::now() + delay;
        self.rnr_resend = Some(match self.rnr_resend {
            Some((t, p)) if psn_before(p, psn) => (t, p),
            _ => (at, psn),
        });
        // Then, not at the next tick of the timer (10 ms): a HCA sends again once the RNR
        // timer ran out (`ib_send_bw -t 512 -s 256K`: ~240 MB/s while each wait took a tick).
        crate::engine::tick_early(delay);
    }

    /// Back to a QP that sent nothing yet (RESET, and RTS from RTR).
    pub(super) fn restart(&mut self) {
        *self = Timer {
            armed: self.armed,
            ..Timer::default()
        };
    }
}

/// Why messages are sent again, and from where.
#[derive(Clone, Copy, Debug)]
enum Resend {
    /// The ACK timeout expired: every unanswered message.
    Timeout,
    /// An RNR NAK's wait is over: from the PSN it named.
    AfterRnr(u32),
    /// UCX is done with the message a resend stopped at: from it.
    Continued(u32),
}

/// The RNR NAK timer an RNR NAK carries (the responder's `min_rnr_timer`, IBA 9.7.5.2.8's
/// encoding: 1 is 0.01 ms … 31 is 491.52 ms, 0 is 655.36 ms); codes above 31 read as 31.
pub(super) fn rnr_delay(code: u32) -> Duration {
    const MICROS: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(u64::from(MICROS[code.min(31) as usize]))
}

/// How long the requester waits for an answer: 4.096 µs × 2^`code` (at least
/// [`MIN_ACK_TIMEOUT`]), plus [`MIN_BANDWIDTH`]'s time for `bytes` still unanswered.
fn ack_timeout(code: u8, bytes: u64) -> Duration {
    let base = match code {
        0 => INFINITE_TIMEOUT_RESEND,
        c => Duration::from_nanos(4096u64 << c.min(31)).max(MIN_ACK_TIMEOUT),
    };
    base + Duration::from_nanos(bytes.saturating_mul(1_000_000_000) / MIN_BANDWIDTH)
}

impl QueuePair {
    /// A message that waits for an answer went out: the engine ticks this QP's timer.
    pub(super) fn run_timer(&self, q: &mut Queues) {
        if !q.timer.armed {
            q.timer.armed = true;
            crate::engine::arm_timer(self.qp_num);
        }
    }

    /// One tick of the transport timer (the engine's progress thread). Returns whether it
    /// keeps running.
    pub fn tick(self: &Arc<Self>, locked: &LockedWorker<'_>, now: Instant) -> bool {
        let (running, failed) = self.locked_then_send(locked, |q| {
            let running = self.tick_locked(q, now);
            (running, std::mem::take(&mut q.timer.failed))
        });
        if failed {
            self.transport_failed();
        }
        running
    }

    fn tick_locked(&self, q: &mut Queues, now: Instant) -> bool {
        // Messages the send queue holds back were never sent: none is waited for (behind a
        // READ whose answer is still landing they were the first unanswered, and expired).
        let (first, bytes) = q
            .begun()
            .filter(|e| e.unanswered())
            .fold((None, 0u64), |(first, bytes), e| {
                (first.or(Some(e.seq)), bytes + u64::from(e.byte_len))
            });
        let sending = matches!(q.state, QpState::Rts | QpState::Sqd) && q.peer.is_some();
        let Some(first) = first.filter(|_| sending) else {
            if sending && !q.held.is_empty() {
                // Only held messages wait: nothing expires, and the timer, armed when they were
                // posted, keeps ticking, so that each is timed from the tick after its release.
                q.timer.answered();
                return true;
            }
            q.timer.armed = false;
            q.timer.answered();
            q.timer.rnr_resend = None;
            return false;
        };
        // An RNR NAK's wait is over: what it named and everything after it go again, as a
        // HCA resends after its RNR NAK timer (no transport retry is counted: the responder
        // answered).
        if let Some((at, from)) = q.timer.rnr_resend {
            if now >= at {
                q.timer.rnr_resend = None;
                q.timer.started = Some(now);
                self.retransmit(q, Resend::AfterRnr(from));
                return true;
            }
            // Ticked early for another QP's wait: this one's is still to end.
            crate::engine::tick_early(at - now);
        }
        let Some(started) = q.timer.started else {
            q.timer.started = Some(now);
            return true;
        };
        if now.duration_since(started) < ack_timeout(q.attrs.timeout, bytes) {
            return true;
        }
        if q.attrs.timeout != 0 && q.timer.retries >= q.attrs.retry_cnt {
            tracing::debug!(
                "qp {:#x}: psn {first:#x} unanswered after {} retries: transport retry counter exceeded",
                self.qp_num,
                q.timer.retries
            );
            q.timer.armed = false;
            q.timer.failed = true;
            self.fail_entry(q, first, WcStatus::RetryExcErr);
            return false;
        }
        if q.attrs.timeout != 0 {
            q.timer.retries += 1;
        }
        q.timer.started = Some(now);
        self.retransmit(q, Resend::Timeout);
        true
    }

    /// Sends every unanswered message again (from PSN `from` on, if given), oldest first, with
    /// its PSN, as a HCA goes back to the PSN it resends from. It stops at a message UCX is
    /// still sending, and goes on from there once UCX is done with it (`note_in_ucx`): the
    /// responder may drop that one (it came while the responder waited for an earlier PSN).
    /// Sending what follows it first left it to the ACK timeout, which grows with the bytes
    /// in flight (`ib_send_bw -t 512 -s 256K`: 4 s stalls after RNR NAKs).
    fn retransmit(&self, q: &mut Queues, why: Resend) {
        let Some(peer) = &q.peer else { return };
        let from = match why {
            Resend::Timeout => None,
            Resend::AfterRnr(p) | Resend::Continued(p) => Some(p),
        };
        let mut sent = 0u32;
        q.timer.resend_from = None;
        // Messages the send queue holds back were never sent: they go when it moves on.
        let held_from = q.first_held();
        for e in
            q.sq.iter()
                .filter(|e| e.unanswered() && from.is_none_or(|p| !psn_before(e.seq, p)))
        {
            if Some(e.seq) == held_from {
                break;
            }
            if e.in_ucx > 0 {
                q.timer.resend_from = Some(e.seq);
                break;
            }
            let Some((header, payload)) = e.resend.clone() else {
                continue;
            };
            q.outbox.push(Deferred::Send {
                endpoint: Arc::clone(&peer.endpoint),
                header,
                payload,
                data_seq: Some(e.seq),
            });
            sent += 1;
        }
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let why = match why {
            Resend::Timeout => format!("no answer in time (retry {})", q.timer.retries),
            Resend::AfterRnr(p) => format!("RNR NAK for psn {p:#x}"),
            Resend::Continued(p) => format!("UCX done with psn {p:#x}"),
        };
        match q.timer.resend_from {
            Some(p) => tracing::debug!(
                "qp {:#x}: {why}: {sent} message(s) sent again, the rest once UCX is done with psn {p:#x}",
                self.qp_num
            ),
            None => tracing::debug!("qp {:#x}: {why}: {sent} message(s) sent again", self.qp_num),
        }
    }

    /// A message of this QP entered UCX (`+1`) or UCX finished with it (`-1`). A WR that
    /// failed or was flushed meanwhile completes once UCX is done with its buffers
    /// (`release_send_completions`).
    pub(super) fn note_in_ucx(self: &Arc<Self>, locked: &LockedWorker<'_>, seq: u32, d: i16) {
        self.locked_then_send(locked, |q| {
            let Some(e) = q.sq.iter_mut().find(|e| e.seq == seq) else {
                return;
            };
            e.in_ucx += d;
            if e.in_ucx > 0 {
                return;
            }
            let resend = q.timer.resend_from == Some(seq);
            if e.outcome.is_some() {
                self.release_send_completions(q);
            }
            if resend
                && matches!(q.state, QpState::Rts | QpState::Sqd)
                && q.peer.as_ref().is_some_and(|p| !p.endpoint.failed())
            {
                // A resend stopped here: it goes on (`retransmit`).
                self.retransmit(q, Resend::Continued(seq));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnr_delay_decodes_the_ib_rnr_timer_and_bounds_foreign_codes() {
        assert_eq!(rnr_delay(12), Duration::from_micros(640));
        assert_eq!(rnr_delay(1), Duration::from_micros(10));
        assert_eq!(rnr_delay(0), Duration::from_micros(655_360));
        assert_eq!(rnr_delay(31), Duration::from_micros(491_520));
        // A peer's header may carry anything: above 31 reads as 31.
        assert_eq!(rnr_delay(u32::MAX), rnr_delay(31));
    }

    #[test]
    fn ack_timeout_follows_the_ib_formula_above_the_floor() {
        // ibv_rc_pingpong's 14: 4.096 µs × 2^14 ≈ 67 ms.
        assert_eq!(ack_timeout(14, 0), Duration::from_nanos(4096 << 14));
        assert_eq!(ack_timeout(1, 0), MIN_ACK_TIMEOUT);
        assert_eq!(ack_timeout(0, 0), INFINITE_TIMEOUT_RESEND);
        assert_eq!(ack_timeout(31, 0), Duration::from_nanos(4096 << 31));
        // A 32 MiB message in flight adds a second.
        assert_eq!(
            ack_timeout(14, 32 << 20),
            Duration::from_nanos(4096 << 14) + Duration::from_secs(1)
        );
    }

    #[test]
    fn rnr_retry_seven_is_forever_others_count() {
        let mut t = Timer::default();
        for _ in 0..1000 {
            assert!(t.rnr_retry_allowed(7));
        }
        let mut t = Timer::default();
        assert!(t.rnr_retry_allowed(2));
        assert!(t.rnr_retry_allowed(2));
        assert!(!t.rnr_retry_allowed(2));
        // New progress gives the full count back.
        t.progressed();
        assert!(t.rnr_retry_allowed(2));
        let mut t = Timer::default();
        assert!(!t.rnr_retry_allowed(0));
    }
}
