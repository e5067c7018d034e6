//! `ucp_ep`: a connection to a remote worker, and active-message send.

use super::Error;
use super::memory::{AppSpan, Hold, SpanList, gather_into, hold_all, total_len};
use super::worker::{LockedWorker, Worker};
use crate::sys::{self, ucs};
use smallvec::SmallVec;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Bytes a send carries by value: small ones (inline data, atomic operands and answers) live
/// in place, without a heap allocation.
pub type OwnedBytes = SmallVec<[u8; 64]>;

/// What a send carries after its header.
#[derive(Default)]
pub enum SendPayload {
    #[default]
    None,
    /// Application memory (checked spans); must stay valid until the send completes.
    Spans(SpanList),
    /// Bytes ugdr owns (inline data, replies); kept alive by the request.
    Owned(OwnedBytes),
    /// Bytes ugdr owns with application spans spliced in between them, sent as one gather
    /// list: the spans' bytes go to UCX by reference, not copied (several messages' payloads
    /// in one send). Boxed: it is large, and every payload moves as often as a message does.
    Spliced(Box<Spliced>),
}

/// Owned bytes with application spans spliced in at given offsets: the message is
/// `bytes[..at_0]`, span 0, `bytes[at_0..at_1]`, span 1, …, `bytes[at_last..]`. Built in order
/// with [`Spliced::extend_from_slice`] and [`Spliced::push_span`].
#[derive(Clone, Default)]
pub struct Spliced {
    bytes: OwnedBytes,
    spans: SmallVec<[(usize, AppSpan); SPLICED_SPANS_MAX]>,
}

/// The most spans [`Spliced`] sends by reference in one message. A gather list of `k` spans
/// is at most `2k + 1` IOV entries, and UCX sends a message in one piece only when its IOV
/// fits the transport's (its AM header takes one more entry; ugdr raises TCP's limit from 6
/// to 16, `Ucx::context_options`): beyond that UCX cuts the message into fragments that the
/// receiver must copy back together.
pub const SPLICED_SPANS_MAX: usize = 7;

impl Spliced {
    pub fn with_capacity(bytes: usize) -> Spliced {
        Spliced {
            bytes: OwnedBytes::with_capacity(bytes),
            ..Spliced::default()
        }
    }

    /// Appends owned bytes.
    pub fn extend_from_slice(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
    }

    /// Appends an application span by reference; false (nothing appended) once
    /// [`SPLICED_SPANS_MAX`] are in.
    pub fn push_span(&mut self, span: AppSpan) -> bool {
        if self.spans.len() == SPLICED_SPANS_MAX {
            return false;
        }
        if !span.is_empty() {
            self.spans.push((self.bytes.len(), span));
        }
        true
    }

    /// Appends a payload: each of its spans of at least `by_reference_from` bytes by
    /// reference while there is room for it, the rest copied.
    pub fn push_payload(&mut self, payload: &SendPayload, by_reference_from: usize) {
        match payload {
            SendPayload::Spans(spans) => {
                for span in spans {
                    if span.len() < by_reference_from || !self.push_span(*span) {
                        super::memory::gather_append(std::slice::from_ref(span), &mut self.bytes);
                    }
                }
            }
            other => other.append_to(&mut self.bytes),
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len() + self.by_reference()
    }

    /// The bytes sent by reference (the spans').
    pub fn by_reference(&self) -> usize {
        self.spans().map(AppSpan::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spliced application spans, in order.
    fn spans(&self) -> impl Iterator<Item = &AppSpan> {
        self.spans.iter().map(|(_, s)| s)
    }

    /// All of it copied into one buffer (spans whose region died read as zeros).
    fn gathered(&self) -> OwnedBytes {
        let mut out = OwnedBytes::with_capacity(self.len());
        for piece in pieces(&self.bytes, &self.spans) {
            match piece {
                Piece::Bytes(b) => out.extend_from_slice(b),
                Piece::Span(s) => super::memory::gather_append(std::slice::from_ref(s), &mut out),
            }
        }
        out
    }
}

/// The pieces of a spliced message in order: ranges of `bytes` and the spans spliced in at
/// their offsets (none empty).
fn pieces<'a>(
    bytes: &'a [u8],
    spans: &'a [(usize, AppSpan)],
) -> impl Iterator<Item = Piece<'a>> + 'a {
    let ends = spans
        .iter()
        .map(|(at, span)| (*at, Some(span)))
        .chain(std::iter::once((bytes.len(), None)));
    let mut from = 0;
    ends.flat_map(move |(at, span)| {
        let before = &bytes[from..at];
        from = at;
        [
            (!before.is_empty()).then_some(Piece::Bytes(before)),
            span.filter(|s| !s.is_empty()).map(Piece::Span),
        ]
    })
    .flatten()
}

/// One piece of a [`Spliced`] message.
enum Piece<'a> {
    Bytes(&'a [u8]),
    Span(&'a AppSpan),
}

impl Clone for SendPayload {
    /// Spans and bytes are plain data: copied as slices (an RC send keeps a copy of its
    /// payload description for retransmission, once per WR), not element by element.
    fn clone(&self) -> Self {
        match self {
            SendPayload::None => SendPayload::None,
            SendPayload::Spans(spans) => SendPayload::Spans(SpanList::from_slice(spans)),
            SendPayload::Owned(bytes) => SendPayload::Owned(OwnedBytes::from_slice(bytes)),
            SendPayload::Spliced(spliced) => SendPayload::Spliced(spliced.clone()),
        }
    }
}

impl SendPayload {
    /// The bytes it carries.
    pub fn len(&self) -> usize {
        match self {
            SendPayload::None => 0,
            SendPayload::Spans(spans) => total_len(spans),
            SendPayload::Owned(bytes) => bytes.len(),
            SendPayload::Spliced(spliced) => spliced.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether UCX reads application memory to send it.
    pub fn reads_app(&self) -> bool {
        match self {
            SendPayload::Spans(_) => true,
            SendPayload::Spliced(spliced) => !spliced.spans.is_empty(),
            SendPayload::None | SendPayload::Owned(_) => false,
        }
    }

    /// Appends its bytes to `out` (spans whose region died read as zeros, as they would
    /// on the wire).
    pub fn append_to(&self, out: &mut OwnedBytes) {
        match self {
            SendPayload::None => {}
            SendPayload::Spans(spans) => super::memory::gather_append(spans, out),
            SendPayload::Owned(bytes) => out.extend_from_slice(bytes),
            SendPayload::Spliced(spliced) => out.extend_from_slice(&spliced.gathered()),
        }
    }
}

/// What runs when an endpoint fails (under the worker lock, from progress).
pub type ErrorHandler = Box<dyn Fn(&LockedWorker<'_>, Error) + Send + Sync>;

struct EndpointShared {
    failed: AtomicBool,
    on_error: ErrorHandler,
    worker: *const Worker,
}

/// A UCP endpoint to one remote worker.
///
/// Every active message sent on it carries the endpoint's *header trailer* (given at
/// connect, possibly empty) after the header the caller passes: bytes the receiver's handler
/// sees at the end of every header from this endpoint (the engine's authentication token).
///
/// Endpoints to other hosts use UCX's peer-failure mode, so a dead peer surfaces as an error.
/// UCX 1.13 offers that mode only on transports with keepalive (TCP), so endpoints to this
/// host skip it to get shared memory and CMA; the engine watches those peers' pids instead.
pub struct Endpoint {
    handle: NonNull<sys::ucp_ep>,
    /// UCX's error-handler argument: freed only once UCX destroyed the ep (a forced `close`);
    /// otherwise it stays allocated with the ep, so that UCX never calls back into freed
    /// memory.
    shared: ManuallyDrop<Box<EndpointShared>>,
    closed: bool,
    /// Created in UCX's peer-failure mode (only such an ep may be closed by force).
    peer_failure_mode: bool,
    worker: Arc<Worker>,
    trailer: SmallVec<[u8; 16]>,
}

/// A header with the endpoint's trailer appended (what UCX sends as the AM header).
type FullHeader = SmallVec<[u8; 64]>;

// SAFETY: the endpoint is only used through LockedWorker (the worker lock serializes UCX).
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

/// Runs when the send completes locally (buffers reusable), under the worker lock.
pub type SendDone = Box<dyn FnOnce(&LockedWorker<'_>, Result<(), Error>) + Send>;

/// What UCX may keep of a pending send: the header, the IOV, owned bytes, and what runs when
/// it completes. Pooled per worker ([`Worker::take_send_buffer`]).
pub(super) struct SendRequest {
    worker: *const Worker,
    header: FullHeader,
    iov: SmallVec<[sys::ucp_dt_iov_t; 4]>,
    owned: OwnedBytes,
    /// The payload spans' regions, held until UCX is done with them.
    held: SmallVec<[Hold; 4]>,
    done: Option<SendDone>,
}

impl SendRequest {
    pub(super) fn new(worker: &Worker) -> Box<SendRequest> {
        Box::new(SendRequest {
            worker,
            header: SmallVec::new(),
            iov: SmallVec::new(),
            owned: OwnedBytes::new(),
            held: SmallVec::new(),
            done: None,
        })
    }

    /// Empties the buffer for its next send.
    pub(super) fn clear(&mut self) {
        self.header.clear();
        self.iov.clear();
        self.owned.clear();
        self.held.clear();
        self.done = None;
    }
}

/// Whether a send finished inside the call or will call back from progress.
#[derive(Debug, PartialEq, Eq)]
pub enum SendState {
    Done,
    Pending,
}

impl Endpoint {
    /// Connects to the worker whose packed address is `remote`. `on_error` runs (under the
    /// lock, from progress) if the connection fails later. Every message sent on the
    /// endpoint carries `header_trailer` after its header.
    pub fn connect(
        locked: &LockedWorker<'_>,
        remote: &[u8],
        peer_failure_mode: bool,
        on_error: ErrorHandler,
        header_trailer: &[u8],
    ) -> Result<Arc<Endpoint>, Error> {
        let worker = locked.worker();
        let shared = Box::new(EndpointShared {
            failed: AtomicBool::new(false),
            on_error,
            worker,
        });
        let params = sys::ucp_ep_params {
            field_mask: (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE.0
                | sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER.0)
                as u64,
            address: remote.as_ptr() as *const sys::ucp_address_t,
            err_mode: if peer_failure_mode {
                sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler {
                cb: Some(endpoint_error_callback),
                arg: &*shared as *const EndpointShared as *mut c_void,
            },
            ..Default::default()
        };
        let mut handle: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: lock held; `remote` is a packed worker address from a peer (UCX validates
        // it); the error-handler arg lives in the returned Endpoint's Box, which is freed only
        // once the ep is closed (`close`, `Drop`).
        Error::check(unsafe {
            worker
                .api()
                .ucp_ep_create(worker.raw(), &params, &mut handle)
        })?;
        let handle = NonNull::new(handle)
            .ok_or_else(|| Error::from_status(sys::ucs_status_t::UCS_ERR_NO_MEMORY))?;
        // The Arc<Worker> keeps the worker alive for as long as the endpoint.
        let worker_arc = worker_arc(worker);
        Ok(Arc::new(Endpoint {
            handle,
            shared: ManuallyDrop::new(shared),
            closed: false,
            peer_failure_mode,
            worker: worker_arc,
            trailer: SmallVec::from_slice(header_trailer),
        }))
    }

    /// Closes the endpoint of a peer that is gone: by force where UCX allows it (peer-failure
    /// mode: nothing is flushed, pending sends complete with an error, the ep is destroyed in
    /// the call), else by flushing, which UCX finishes in later progress calls (UCX refuses to
    /// force the others; a flush to a peer that died with sends pending never ends). UCX then
    /// lets go of what it held for the peer (its socket, the shared-memory FIFOs it attached),
    /// except, on one host, for an ep the peer's UCX connected back to, which UCX 1.13 keeps
    /// until the worker goes. Nothing runs UCX's progress here: no callback runs inside.
    pub fn close(mut self, locked: &LockedWorker<'_>) {
        let _ = locked;
        let api = self.worker.api();
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
            flags: if self.peer_failure_mode {
                sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE.0
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: lock held; the ep is this endpoint's alone (`self` is consumed), closed once.
        let ret = unsafe { api.ucp_ep_close_nbx(self.handle.as_ptr(), &param) };
        if ucs::ptr_is_err(ret) {
            // Not closed: UCX keeps the ep, and its error-handler argument stays (Drop).
            tracing::debug!(
                "ucx: closing an endpoint failed: {}",
                Error::from_status(ucs::ptr_status(ret))
            );
            return;
        }
        if ucs::ptr_is_ptr(ret) {
            // SAFETY: the request ucp_ep_close_nbx returned, freed once: UCX releases it when
            // the flush ends.
            unsafe { api.ucp_request_free(ret) };
        }
        // Forced, UCX destroyed the ep. Flushed, it may keep it (see above), so the
        // error-handler argument must outlive it: it stays allocated.
        self.closed = self.peer_failure_mode && !ucs::ptr_is_ptr(ret);
    }

    /// True once the peer was found unreachable.
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    /// Marks the peer unreachable (the engine saw it die) and runs the error handler once.
    pub fn mark_failed(&self, locked: &LockedWorker<'_>, why: Error) {
        if !self.shared.failed.swap(true, Ordering::AcqRel) {
            (self.shared.on_error)(locked, why);
        }
    }

    /// Sends active message `id` with `header` (then the endpoint's trailer) and `payload`.
    /// The header is copied; payload spans must stay valid until `done` runs. When the send
    /// finishes inside this call, returns `SendState::Done` and does not call `done`.
    ///
    /// No allocation once the worker's pool of send buffers is warm: a small message is
    /// tried with UCX's short protocol (nothing to keep); otherwise the header, the IOV, owned
    /// bytes and the spans' holds go into a pooled buffer that UCX may keep if the send stays
    /// pending, with one UCX call, and `done` is boxed only then.
    pub fn am_send<F>(
        &self,
        locked: &LockedWorker<'_>,
        id: u32,
        header: &[u8],
        payload: SendPayload,
        done: F,
    ) -> Result<SendState, Error>
    where
        F: FnOnce(&LockedWorker<'_>, Result<(), Error>) + Send + 'static,
    {
        self.am_send_then(locked, id, header, payload, || done, false)
    }

    /// As [`Endpoint::am_send`], with the completion callback made by `make_done` only when
    /// UCX keeps the send pending: a send its short protocol finishes inside the call (most
    /// small ones) builds none. `eager`: never by rendezvous, the receiver gets the whole
    /// message in its handler, whatever its size (UCX sends a large one in fragments).
    pub fn am_send_then<G, F>(
        &self,
        locked: &LockedWorker<'_>,
        id: u32,
        header: &[u8],
        payload: SendPayload,
        make_done: G,
        eager: bool,
    ) -> Result<SendState, Error>
    where
        G: FnOnce() -> F,
        F: FnOnce(&LockedWorker<'_>, Result<(), Error>) + Send + 'static,
    {
        let flags = if eager {
            sys::ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER.0
        } else {
            0
        };
        // A small message of application spans is copied out first (at most 256 bytes, on
        // the stack), each span under its hold, and UCX's short protocol sends the copy: no
        // list of holds is built and none outlives the copy (scripts/instructions 64:
        // ~4,650 -> ~4,500 per SEND). UCX copies it once more into its FIFO either way.
        if let SendPayload::Spans(spans) = &payload {
            let body = total_len(spans);
            if header.len() + self.trailer.len() + body <= IMMEDIATE_MAX {
                let mut staged = [0u8; IMMEDIATE_MAX];
                let n = gather_into(spans, &mut staged[..body]);
                if let Some(done_now) = self.send_immediate(id, header, &staged[..n]) {
                    return done_now;
                }
            }
        }
        // Application spans stay held while UCX may read them; spans whose region died since
        // they were checked read as zeros (see `memory`).
        let (payload, held) = match payload {
            SendPayload::Spans(spans) => match hold_all(&spans) {
                Some(held) => (SendPayload::Spans(spans), held),
                None => (
                    SendPayload::Owned(OwnedBytes::from_elem(0, total_len(&spans))),
                    SmallVec::new(),
                ),
            },
            // Spans are sent by reference only while all of them are held; else all copied.
            SendPayload::Spliced(spliced) => match hold_all(spliced.spans()) {
                Some(held) => (SendPayload::Spliced(spliced), held),
                None => (SendPayload::Owned(spliced.gathered()), SmallVec::new()),
            },
            other => (other, SmallVec::new()),
        };
        let len = header.len() + self.trailer.len() + payload.len();
        let bytes: Option<&[u8]> = match &payload {
            SendPayload::None => Some(&[]),
            SendPayload::Owned(b) => Some(b),
            // Tried above if short enough (UCX had no room then): sent from a pooled buffer.
            SendPayload::Spans(_) | SendPayload::Spliced(_) => None,
        };
        if len <= IMMEDIATE_MAX
            && let Some(bytes) = bytes
            && let Some(done_now) = self.send_immediate(id, header, bytes)
        {
            return done_now;
        }
        let mut req = self.worker.take_send_buffer(locked);
        let r = &mut *req;
        r.header.extend_from_slice(header);
        r.header.extend_from_slice(&self.trailer);
        r.held = held;
        match payload {
            SendPayload::None => {}
            SendPayload::Spans(spans) => r.iov.extend(spans_iov(&spans)),
            SendPayload::Owned(bytes) => {
                // The bytes live in the (boxed) buffer now: point at them there.
                r.owned = bytes;
                r.iov.extend(bytes_iov(&r.owned));
            }
            SendPayload::Spliced(spliced) => {
                let Spliced { bytes, spans } = *spliced;
                // The owned bytes move into the (boxed) buffer first, then the IOV points at
                // them there; the spans stay where they are.
                r.owned = bytes;
                r.iov
                    .extend(pieces(&r.owned, &spans).map(|piece| match piece {
                        Piece::Bytes(b) => sys::ucp_dt_iov_t {
                            buffer: b.as_ptr() as *mut c_void,
                            length: b.len(),
                        },
                        Piece::Span(s) => sys::ucp_dt_iov_t {
                            buffer: s.as_ptr() as *mut c_void,
                            length: s.len(),
                        },
                    }));
            }
        }
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_CALLBACK.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_USER_DATA.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_DATATYPE.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
            flags,
            cb: sys::ucp_request_param_t__bindgen_ty_1 {
                send: Some(send_callback),
            },
            user_data: &mut *req as *mut SendRequest as *mut c_void,
            ..Default::default()
        };
        let (datatype, buf, count) = buffer_of(&req.iov);
        let param = sys::ucp_request_param_t { datatype, ..param };
        let (hdr, hdr_len) = (req.header.as_ptr() as *const c_void, req.header.len());
        // SAFETY: the worker lock is held (`locked`); header and iov live in the boxed buffer,
        // which stays put (leaked to the callback) while the send is pending; payload spans
        // are valid per SendPayload's contract.
        let ret = unsafe {
            self.worker.api().ucp_am_send_nbx(
                self.handle.as_ptr(),
                id,
                hdr,
                hdr_len,
                buf,
                count,
                &param,
            )
        };
        if ucs::ptr_is_ptr(ret) {
            // Pending: UCX calls send_callback from a later progress, which needs the worker
            // lock this thread holds, so `done` is in place before it can run.
            req.done = Some(Box::new(make_done()));
            self.worker.count_pending_send(locked, false);
            let _ = Box::into_raw(req); // reclaimed by send_callback
            return Ok(SendState::Pending);
        }
        self.worker.return_send_buffer(locked, req);
        if ucs::ptr_is_err(ret) {
            Err(Error::from_status(ucs::ptr_status(ret)))
        } else {
            Ok(SendState::Done)
        }
    }
}

impl Endpoint {
    /// A send UCX can finish inside the call (its short protocol) needs nothing kept alive:
    /// try that first for small messages. None when UCX could not (then nothing was sent).
    fn send_immediate(
        &self,
        id: u32,
        header: &[u8],
        payload: &[u8],
    ) -> Option<Result<SendState, Error>> {
        // Header and trailer side by side on the stack (the common case: 48 + 8 bytes), with
        // no vector to build for them or for the one payload buffer.
        let mut joined = [0u8; 64];
        let spilled: FullHeader;
        let n = header.len() + self.trailer.len();
        let full: &[u8] = if n <= joined.len() {
            joined[..header.len()].copy_from_slice(header);
            joined[header.len()..n].copy_from_slice(&self.trailer);
            &joined[..n]
        } else {
            spilled = header.iter().chain(&self.trailer).copied().collect();
            &spilled
        };
        let iov = bytes_iov(payload);
        let (datatype, buf, count) = buffer_of(iov.as_slice());
        let immediate = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_DATATYPE.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL.0,
            datatype,
            ..Default::default()
        };
        // SAFETY: the caller holds the worker lock (am_send's `locked`); header, iov and the
        // payload they point to outlive the call, and with FORCE_IMM_CMPL UCX either completes
        // inside it or fails without keeping them.
        let ret = unsafe {
            self.worker.api().ucp_am_send_nbx(
                self.handle.as_ptr(),
                id,
                full.as_ptr() as *const c_void,
                full.len(),
                buf,
                count,
                &immediate,
            )
        };
        if ret.is_null() {
            Some(Ok(SendState::Done))
        } else if ucs::ptr_is_err(ret)
            && ucs::ptr_status(ret) != sys::ucs_status_t::UCS_ERR_NO_RESOURCE
        {
            Some(Err(Error::from_status(ucs::ptr_status(ret))))
        } else {
            None
        }
    }
}

/// The IOV entries of a payload's non-empty spans.
fn spans_iov(spans: &[AppSpan]) -> impl Iterator<Item = sys::ucp_dt_iov_t> + '_ {
    spans
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| sys::ucp_dt_iov_t {
            buffer: s.as_ptr() as *mut c_void,
            length: s.len(),
        })
}

/// The IOV entry of owned bytes (none when empty).
fn bytes_iov(bytes: &[u8]) -> Option<sys::ucp_dt_iov_t> {
    (!bytes.is_empty()).then_some(sys::ucp_dt_iov_t {
        buffer: bytes.as_ptr() as *mut c_void,
        length: bytes.len(),
    })
}

/// Messages up to this size (header included) are first tried with UCX's short protocol,
/// which completes inside the call: shared memory's limit is a little below this (ugdr sets
/// 256-byte FIFO elements, `Ucx::context_options`), TCP's far above. Larger ones go straight
/// to one pooled send.
const IMMEDIATE_MAX: usize = 256;

/// UCX's buffer description for a gather list: one segment goes as a contiguous buffer (so
/// small messages can use UCX's short protocol, which IOVs cannot), several as an IOV.
pub(crate) fn buffer_of(iov: &[sys::ucp_dt_iov_t]) -> (sys::ucp_datatype_t, *const c_void, usize) {
    match iov {
        [] => (ucs::dt_make_contig(1), std::ptr::null(), 0),
        [one] => (
            ucs::dt_make_contig(1),
            one.buffer as *const c_void,
            one.length,
        ),
        many => (
            ucs::dt_make_iov(),
            many.as_ptr() as *const c_void,
            many.len(),
        ),
    }
}

fn worker_arc(worker: &Worker) -> Arc<Worker> {
    // Workers are always created inside an Arc (Worker::new); rebuild one from the reference.
    let raw = worker as *const Worker;
    // SAFETY: `raw` points into a live Arc<Worker> allocation (Worker::new returns only Arcs);
    // increment first so the new Arc owns its own count.
    unsafe {
        Arc::increment_strong_count(raw);
        Arc::from_raw(raw)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.closed {
            // SAFETY: dropped once, here; UCX is done with the ep, and so with its argument.
            unsafe { ManuallyDrop::drop(&mut self.shared) };
        }
    }
}

unsafe extern "C" fn send_callback(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: user_data is the Box leaked by am_send, reclaimed exactly once here.
        let mut req = unsafe { Box::from_raw(user_data as *mut SendRequest) };
        // SAFETY: the worker outlives its requests; callbacks run inside progress (lock held).
        let worker = unsafe { &*req.worker };
        let locked = LockedWorker::assume_held(worker);
        let result = if status == sys::ucs_status_t::UCS_OK {
            Ok(())
        } else {
            Err(Error::from_status(status))
        };
        // SAFETY: request returned by ucp_am_send_nbx, freed once.
        unsafe { worker.api().ucp_request_free(request) };
        worker.count_pending_send(&locked, true);
        if let Some(done) = req.done.take() {
            done(&locked, result);
        }
        worker.return_send_buffer(&locked, req);
    }));
}

unsafe extern "C" fn endpoint_error_callback(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: arg is the EndpointShared owned by the live Endpoint.
        let shared = unsafe { &*(arg as *const EndpointShared) };
        if shared.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: the worker outlives its endpoints; runs inside progress (lock held).
        let worker = unsafe { &*shared.worker };
        let locked = LockedWorker::assume_held(worker);
        (shared.on_error)(&locked, Error::from_status(status));
    }));
}

impl Endpoint {
    /// UCX's description of the lanes and transports this endpoint uses
    /// (`ucp_ep_print_info`), for debugging.
    pub fn transport_info(&self, locked: &LockedWorker<'_>) -> String {
        let _ = locked;
        // SAFETY: lock held; UCX writes to the stream it is given.
        super::worker::capture_stream(|file| unsafe {
            self.worker
                .api()
                .ucp_ep_print_info(self.handle.as_ptr(), file)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::memory::HostBuffer;
    use super::*;

    /// The pieces as (by reference, bytes), to compare with what was pushed.
    fn pieces_of(s: &Spliced) -> Vec<(bool, Vec<u8>)> {
        pieces(&s.bytes, &s.spans)
            .map(|p| match p {
                Piece::Bytes(b) => (false, b.to_vec()),
                Piece::Span(span) => (true, crate::ucp::gather(std::slice::from_ref(span))),
            })
            .collect()
    }

    #[test]
    fn a_spliced_message_keeps_its_order_and_sends_only_large_spans_by_reference() {
        let big = [7u8; 8];
        let small = [5u8; 2];
        let other = [9u8; 8];
        let mut s = Spliced::with_capacity(16);
        s.extend_from_slice(b"ab");
        let payload = SendPayload::Spans(SpanList::from_slice(&[
            AppSpan::of_owned(&big),
            AppSpan::of_owned(&small),
        ]));
        s.push_payload(&payload, 4);
        s.push_payload(&SendPayload::Spans([AppSpan::of_owned(&other)].into()), 4);
        s.extend_from_slice(b"z");
        s.push_payload(&SendPayload::Owned(OwnedBytes::from_slice(b"xy")), 4);
        assert_eq!(
            pieces_of(&s),
            vec![
                (false, b"ab".to_vec()),
                (true, big.to_vec()),
                (false, small.to_vec()),
                (true, other.to_vec()),
                (false, b"zxy".to_vec()),
            ]
        );
        assert_eq!((s.len(), s.by_reference()), (23, 16));
        let whole: Vec<u8> = [&b"ab"[..], &big, &small, &other, b"zxy"].concat();
        assert_eq!(s.gathered().to_vec(), whole);
        let mut appended = OwnedBytes::new();
        SendPayload::Spliced(Box::new(s)).append_to(&mut appended);
        assert_eq!(appended.to_vec(), whole);
    }

    #[test]
    fn spans_past_the_limit_are_copied_and_a_span_at_the_start_has_no_empty_piece() {
        let data: Vec<[u8; 4]> = (0..SPLICED_SPANS_MAX as u8 + 3).map(|i| [i; 4]).collect();
        let mut s = Spliced::default();
        for d in &data {
            s.push_payload(&SendPayload::Spans([AppSpan::of_owned(d)].into()), 1);
        }
        let got = pieces_of(&s);
        assert_eq!(got.len(), SPLICED_SPANS_MAX + 1, "{got:?}");
        assert!(got[..SPLICED_SPANS_MAX].iter().all(|(by_ref, _)| *by_ref));
        assert_eq!(
            got[SPLICED_SPANS_MAX],
            (false, data[SPLICED_SPANS_MAX..].concat())
        );
        assert_eq!(s.by_reference(), SPLICED_SPANS_MAX * 4);
        assert_eq!(s.gathered().to_vec(), data.concat());
        assert!(!s.push_span(AppSpan::of_owned(&data[0])));
    }

    #[test]
    fn a_payload_stays_small_to_move() {
        // Every WR's payload moves several times between post and send (a 640-byte one
        // showed up as three `memcpy`s per WR in SPDK's target).
        assert!(std::mem::size_of::<SendPayload>() <= 96);
    }

    #[test]
    fn a_spliced_span_whose_region_died_reads_as_zeros_when_copied() {
        let buf = HostBuffer::new(16).unwrap();
        let region = buf.region(0, 16).unwrap();
        let span = region.span(region.addr(), 16).unwrap();
        crate::ucp::scatter(&[span], &[7u8; 16]);
        let mut s = Spliced::default();
        s.extend_from_slice(&[1]);
        assert!(s.push_span(span));
        assert_eq!(s.gathered()[1..].to_vec(), vec![7u8; 16]);
        assert!(s.spans().all(|s| s.hold().is_some()));
        drop(region);
        assert!(s.spans().any(|s| s.hold().is_none()), "sent copied, then");
        assert_eq!(s.gathered().to_vec(), [&[1u8][..], &[0u8; 16]].concat());
    }
}
