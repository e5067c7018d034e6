//! `ucp_context` and `ucp_worker`, the worker lock, active-message receive and waiting.

use super::Error;
use super::endpoint::SendRequest;
use super::fifo::{self, ReceiveFifos};
use super::library::Ucx;
use super::memory::{AppSpan, Hold, hold_all};
use crate::sys::{self, ucs};
use smallvec::SmallVec;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// A UCP context with the features ugdr uses (active messages, RMA, atomics, wakeup).
pub struct Context {
    handle: NonNull<sys::ucp_context>,
    pub(crate) ucx: &'static Ucx,
}

// SAFETY: a ucp_context is shared by workers of any thread (UCX documents the context as
// thread-safe once created); ugdr only creates workers from it.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates the context.
unsafe impl Sync for Context {}

impl Context {
    pub fn new() -> Result<Arc<Context>, Error> {
        super::library::mark_process_multithreaded();
        let ucx = Ucx::get()?;
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL env prefix and file name mean "UCX_ variables"; `config` is an out-param.
        Error::check(unsafe {
            ucx.api
                .ucp_config_read(ptr::null(), ptr::null(), &mut config)
        })?;
        for (name, value) in ucx.context_options() {
            // SAFETY: a configuration from ucp_config_read; UCX copies both strings.
            let status = unsafe {
                ucx.api
                    .ucp_config_modify(config, name.as_ptr(), value.as_ptr())
            };
            if status != sys::ucs_status_t::UCS_OK {
                tracing::warn!("ucx: cannot set {name:?}={value:?} (status {})", status.0);
            }
        }
        let params = sys::ucp_params {
            field_mask: (sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES.0
                | sys::ucp_params_field::UCP_PARAM_FIELD_MT_WORKERS_SHARED.0
                | sys::ucp_params_field::UCP_PARAM_FIELD_NAME.0) as u64,
            features: (sys::ucp_feature::UCP_FEATURE_AM.0
                | sys::ucp_feature::UCP_FEATURE_RMA.0
                | sys::ucp_feature::UCP_FEATURE_AMO32.0
                | sys::ucp_feature::UCP_FEATURE_AMO64.0
                | sys::ucp_feature::UCP_FEATURE_WAKEUP.0) as u64,
            mt_workers_shared: 1,
            name: c"ugdr".as_ptr(),
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: ucp_init is the inline wrapper of ucp_init_version with the header's version;
        // params and config are valid for the call; `handle` is an out-param.
        let status = unsafe {
            ucx.api.ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut handle,
            )
        };
        // SAFETY: config came from ucp_config_read and is released exactly once.
        unsafe { ucx.api.ucp_config_release(config) };
        Error::check(status)?;
        let handle = NonNull::new(handle)
            .ok_or_else(|| Error::from_status(sys::ucs_status_t::UCS_ERR_NO_MEMORY))?;
        Ok(Arc::new(Context { handle, ucx }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: created by ucp_init, cleaned up once; every worker holds an Arc<Context>.
        unsafe { self.ucx.api.ucp_cleanup(self.handle.as_ptr()) }
    }
}

/// Data of an incoming active message.
pub enum AmPayload<'a> {
    /// Bytes valid only during the handler.
    Transient(&'a [u8]),
    /// Bytes UCX keeps for ugdr if the handler returns `true` (then release with
    /// [`LockedWorker::release`] or read them with [`AmData::bytes`]).
    Persistent(AmData),
    /// A rendezvous message of the given length: fetch it with [`LockedWorker::receive`], or
    /// drop it with [`LockedWorker::release`].
    Rendezvous(AmData),
}

/// A message body UCX holds for ugdr (eager data kept past its handler, or a rendezvous
/// descriptor). Must be passed to [`LockedWorker::release`] or [`LockedWorker::receive`].
#[derive(Debug)]
#[must_use]
pub struct AmData {
    desc: NonNull<c_void>,
    len: usize,
    rendezvous: bool,
}

// SAFETY: the descriptor is an opaque UCX pointer, only dereferenced by UCX under the worker lock.
unsafe impl Send for AmData {}

impl AmData {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_rendezvous(&self) -> bool {
        self.rendezvous
    }

    /// The bytes of a persistent eager message (empty for a rendezvous descriptor).
    pub fn bytes(&self) -> &[u8] {
        if self.rendezvous {
            return &[];
        }
        // SAFETY: UCX keeps persistent AM data valid until ucp_am_data_release, which consumes self.
        unsafe { std::slice::from_raw_parts(self.desc.as_ptr() as *const u8, self.len) }
    }
}

/// What the engine does with an incoming active message. Returns `true` when it kept the
/// payload's [`AmData`] (UCX must then keep the data).
pub type AmHandler = dyn Fn(&LockedWorker<'_>, &[u8], AmPayload<'_>) -> bool + Send + Sync;

struct HandlerSlot {
    worker: *const Worker,
    handler: Box<AmHandler>,
}

/// Most send buffers a worker keeps for reuse (as many as sends usually pending at once).
const SEND_POOL_MAX: usize = 1024;

/// A UCP worker in `UCS_THREAD_MODE_SERIALIZED`, with the lock that serializes it.
pub struct Worker {
    handle: NonNull<sys::ucp_worker>,
    lock: Mutex<()>,
    /// Send buffers for reuse (touched only under `lock`, so its own lock is never contended).
    /// Boxed: UCX keeps pointers into a pending send's buffer, which must not move.
    #[allow(clippy::vec_box)]
    send_pool: Mutex<Vec<Box<SendRequest>>>,
    /// Sends UCX has not finished (changed under `lock` only; read without it).
    sends_pending: AtomicUsize,
    /// The progress thread sleeps on the event fd (see `note_sleeping`).
    progress_sleeping: AtomicBool,
    event_fd: RawFd,
    handlers: OnceLock<Box<HandlerSlot>>,
    /// The worker's own shared-memory receive FIFOs (touched only under `lock`).
    fifos: Mutex<ReceiveFifos>,
    context: Arc<Context>,
}

// SAFETY: every UCX call on the worker goes through a LockedWorker, which holds `lock`
// (or is the handler's view of the progress call that holds it). ucp_worker_signal, the one
// call made without it, is documented as thread-safe.
unsafe impl Send for Worker {}
// SAFETY: as above.
unsafe impl Sync for Worker {}

/// Proof that the caller holds the worker's lock: every UCX operation takes one.
pub struct LockedWorker<'w> {
    worker: &'w Worker,
    _guard: Option<MutexGuard<'w, ()>>,
}

impl Worker {
    pub fn new(context: Arc<Context>) -> Result<Arc<Worker>, Error> {
        let api = &context.ucx.api;
        let params = sys::ucp_worker_params {
            field_mask: sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64,
            thread_mode: sys::ucs_thread_mode_t::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = ptr::null_mut();
        let geometry = super::library::shared_memory_fifo_geometry();
        let before = geometry.map(|_| fifo::mappings()).unwrap_or_default();
        // SAFETY: context is live (held by the Arc); params valid for the call.
        Error::check(unsafe {
            api.ucp_worker_create(context.handle.as_ptr(), &params, &mut handle)
        })?;
        let fifos = match geometry {
            Some(_) => ReceiveFifos::created_between(
                &before,
                &fifo::mappings(),
                &super::ucx_version().unwrap_or_default(),
                geometry,
            ),
            None => ReceiveFifos::unwatched(),
        };
        let handle = NonNull::new(handle)
            .ok_or_else(|| Error::from_status(sys::ucs_status_t::UCS_ERR_NO_MEMORY))?;
        let mut event_fd: i32 = -1;
        // SAFETY: worker just created; out-param.
        let status = unsafe { api.ucp_worker_get_efd(handle.as_ptr(), &mut event_fd) };
        if let Err(e) = Error::check(status) {
            // SAFETY: destroy the worker we created and nobody else has seen.
            unsafe { api.ucp_worker_destroy(handle.as_ptr()) };
            return Err(e);
        }
        Ok(Arc::new(Worker {
            handle,
            lock: Mutex::new(()),
            send_pool: Mutex::new(Vec::new()),
            sends_pending: AtomicUsize::new(0),
            progress_sleeping: AtomicBool::new(false),
            event_fd,
            handlers: OnceLock::new(),
            fifos: Mutex::new(fifos),
            context,
        }))
    }

    /// How many of its shared-memory receive FIFOs the worker watches for slots that a dead
    /// sender abandoned (0 where UCX's layout is unknown or the user sized them).
    pub fn watched_fifos(&self) -> usize {
        self.fifos.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The file descriptor that becomes readable when the worker has work (after `arm`).
    pub fn event_fd(&self) -> RawFd {
        self.event_fd
    }

    /// How many sends UCX holds unfinished: one waiting for room in a peer's shared-memory
    /// FIFO goes out only from a later progress call, and nothing makes the event fd readable
    /// when the room comes (the peer signals new messages, not freed slots).
    pub fn sends_pending(&self) -> usize {
        self.sends_pending.load(Ordering::Relaxed)
    }

    /// A send went pending, or one `finished`; under the lock only, so a plain
    /// load and store suffice. The first one pending wakes a progress thread that sleeps on
    /// the event fd: it looks at pending sends on a short timer, which it set before it slept
    /// only if some were pending then.
    pub(super) fn count_pending_send(&self, locked: &LockedWorker<'_>, finished: bool) {
        let _ = locked;
        let before = self.sends_pending.load(Ordering::Relaxed);
        let n = if finished {
            before.saturating_sub(1)
        } else {
            before + 1
        };
        self.sends_pending.store(n, Ordering::Relaxed);
        if before == 0 && n == 1 && self.progress_sleeping.load(Ordering::Relaxed) {
            self.signal();
        }
    }

    /// The progress thread is about to sleep on the event fd (`true`, under the lock, with the
    /// pending sends it saw), or woke (`false`).
    pub fn note_sleeping(&self, sleeping: bool) {
        self.progress_sleeping.store(sleeping, Ordering::Relaxed);
    }

    pub fn lock(&self) -> LockedWorker<'_> {
        let guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        LockedWorker {
            worker: self,
            _guard: Some(guard),
        }
    }

    pub fn try_lock(&self) -> Option<LockedWorker<'_>> {
        match self.lock.try_lock() {
            Ok(g) => Some(LockedWorker {
                worker: self,
                _guard: Some(g),
            }),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(LockedWorker {
                worker: self,
                _guard: Some(p.into_inner()),
            }),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// A cleared send buffer from the pool (or a new one).
    pub(super) fn take_send_buffer(&self, locked: &LockedWorker<'_>) -> Box<SendRequest> {
        let _ = locked; // the pool is used under the worker lock only
        self.send_pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_else(|| SendRequest::new(self))
    }

    /// Gives a send buffer back to the pool (kept up to [`SEND_POOL_MAX`] of them).
    pub(super) fn return_send_buffer(&self, locked: &LockedWorker<'_>, mut req: Box<SendRequest>) {
        let _ = locked;
        req.clear();
        let mut pool = self.send_pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < SEND_POOL_MAX {
            pool.push(req);
        }
    }

    /// Wakes a thread blocked on [`Worker::event_fd`]; safe from any thread without the lock.
    pub fn signal(&self) {
        // SAFETY: ucp_worker_signal is documented as thread-safe.
        let _ = unsafe { self.context.ucx.api.ucp_worker_signal(self.handle.as_ptr()) };
    }

    pub(crate) fn raw(&self) -> sys::ucp_worker_h {
        self.handle.as_ptr()
    }

    pub(crate) fn api(&self) -> &sys::UcxLibrary {
        &self.context.ucx.api
    }

    /// Installs the handler for active-message id `id` (once per worker).
    pub fn set_am_handler(self: &Arc<Self>, id: u32, handler: Box<AmHandler>) -> Result<(), Error> {
        let slot = Box::new(HandlerSlot {
            worker: Arc::as_ptr(self),
            handler,
        });
        let arg = &*slot as *const HandlerSlot as *mut c_void;
        if self.handlers.set(slot).is_err() {
            return Err(Error::from_status(
                sys::ucs_status_t::UCS_ERR_ALREADY_EXISTS,
            ));
        }
        let param = sys::ucp_am_handler_param {
            field_mask: (sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID.0
                | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB.0
                | sys::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG.0)
                as u64,
            id,
            flags: 0,
            cb: Some(am_recv_callback),
            arg,
        };
        let locked = self.lock();
        // SAFETY: the slot lives in `self.handlers` for the worker's life, so `arg` stays valid.
        Error::check(unsafe {
            self.api()
                .ucp_worker_set_am_recv_handler(locked.worker.raw(), &param)
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: created by ucp_worker_create, destroyed once; endpoints hold Arc<Worker>.
        unsafe { self.api().ucp_worker_destroy(self.handle.as_ptr()) }
    }
}

/// Runs inside ucp_worker_progress, i.e. while some thread holds the worker lock.
unsafe extern "C" fn am_recv_callback(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `arg` is the HandlerSlot installed by set_am_handler, alive as long as the worker.
        let slot = unsafe { &*(arg as *const HandlerSlot) };
        // SAFETY: the slot's worker outlives its handlers (the slot is owned by the worker).
        let worker = unsafe { &*slot.worker };
        // The progress call that runs this callback holds the lock on the worker's behalf.
        let locked = LockedWorker::assume_held(worker);
        let header = if header_length == 0 || header.is_null() {
            &[][..]
        } else {
            // SAFETY: UCX passes a header of `header_length` bytes valid during the callback.
            unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
        };
        // SAFETY: UCX always passes a valid param.
        let attr = unsafe { (*param).recv_attr };
        let rndv = attr & sys::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_RNDV.0 as u64 != 0;
        let persistent = attr & sys::ucp_am_recv_attr_t::UCP_AM_RECV_ATTR_FLAG_DATA.0 as u64 != 0;
        let payload = match NonNull::new(data) {
            Some(desc) if rndv => AmPayload::Rendezvous(AmData {
                desc,
                len: length,
                rendezvous: true,
            }),
            Some(desc) if persistent => AmPayload::Persistent(AmData {
                desc,
                len: length,
                rendezvous: false,
            }),
            Some(p) => {
                // SAFETY: eager data of `length` bytes valid during the callback.
                AmPayload::Transient(unsafe {
                    std::slice::from_raw_parts(p.as_ptr() as *const u8, length)
                })
            }
            None => AmPayload::Transient(&[]),
        };
        (slot.handler)(&locked, header, payload)
    }));
    match outcome {
        Ok(true) => sys::ucs_status_t::UCS_INPROGRESS,
        Ok(false) => sys::ucs_status_t::UCS_OK,
        Err(_) => {
            tracing::error!("panic in active-message handler; message dropped");
            sys::ucs_status_t::UCS_OK
        }
    }
}

type ReceiveDone = Box<dyn FnOnce(&LockedWorker<'_>, Result<usize, Error>) + Send>;

struct ReceiveRequest {
    worker: *const Worker,
    iov: Vec<sys::ucp_dt_iov_t>,
    /// The destination spans' regions, held until UCX is done writing.
    _held: SmallVec<[Hold; 4]>,
    /// Where the data goes (and is dropped) when a destination region died meanwhile.
    _discard: Vec<u8>,
    done: ReceiveDone,
}

impl<'w> LockedWorker<'w> {
    /// The view of a worker from inside one of its callbacks, which only run inside
    /// `progress`, while the thread that called it holds the lock.
    pub(crate) fn assume_held(worker: &'w Worker) -> LockedWorker<'w> {
        LockedWorker {
            worker,
            _guard: None,
        }
    }

    pub fn worker(&self) -> &'w Worker {
        self.worker
    }

    /// The oldest slot of the worker's shared-memory FIFOs that a sender took and has not
    /// written, with since when it is seen so (`fifo::ReceiveFifos::stalled`).
    pub fn stalled_fifo_slot(&self, now: std::time::Instant) -> Option<fifo::Stalled> {
        let mut fifos = self.worker.fifos.lock().unwrap_or_else(|p| p.into_inner());
        fifos.stalled(now)
    }

    /// Completes a slot that a dead sender abandoned as an empty active message for `am_id`,
    /// so that the worker receives what follows it (`fifo::ReceiveFifos::complete_abandoned`).
    pub fn complete_abandoned_fifo_slot(&self, stalled: fifo::Stalled, am_id: u16) -> bool {
        let mut fifos = self.worker.fifos.lock().unwrap_or_else(|p| p.into_inner());
        fifos.complete_abandoned(stalled, am_id)
    }

    /// One pass of `ucp_worker_progress`; returns the number of events it processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the lock is held (self is the proof).
        unsafe { self.worker.api().ucp_worker_progress(self.worker.raw()) }
    }

    /// UCX's description of this worker: its address and the transports (devices) it offers
    /// peers (`ucp_worker_print_info`).
    pub fn info(&self) -> String {
        let ctx = self.worker.context.handle.as_ptr();
        // SAFETY: lock held; the context outlives the worker; UCX writes to the given stream.
        let resources =
            capture_stream(|file| unsafe { self.worker.api().ucp_context_print_info(ctx, file) });
        // SAFETY: as above.
        let worker = capture_stream(|file| unsafe {
            self.worker
                .api()
                .ucp_worker_print_info(self.worker.raw(), file)
        });
        resources + &worker
    }

    /// Arms the event fd; `false` means events are pending (progress again before sleeping).
    pub fn arm(&self) -> bool {
        // SAFETY: lock held.
        let status = unsafe { self.worker.api().ucp_worker_arm(self.worker.raw()) };
        status == sys::ucs_status_t::UCS_OK
    }

    /// The worker's address, to publish for peers.
    pub fn address(&self) -> Result<Vec<u8>, Error> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: lock held; out-params.
        Error::check(unsafe {
            self.worker
                .api()
                .ucp_worker_get_address(self.worker.raw(), &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` bytes at `addr`; copied, then released once.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: as above.
        unsafe {
            self.worker
                .api()
                .ucp_worker_release_address(self.worker.raw(), addr)
        };
        Ok(bytes)
    }

    /// Gives a kept message body back to UCX.
    pub fn release(&self, data: AmData) {
        // SAFETY: lock held; `data` came from this worker's handler and is consumed here.
        unsafe {
            self.worker
                .api()
                .ucp_am_data_release(self.worker.raw(), data.desc.as_ptr())
        }
    }

    /// Fetches a rendezvous message into `dest` with `ucp_am_recv_data_nbx`. `Ok(true)`: the
    /// data is in place already and `done` is not called; `Ok(false)`: `done` runs from
    /// progress (under the lock) once it is. May be called from the message's own handler.
    /// `dest` must hold `data.len()` bytes, a length the sender chose: UCX aborts the process
    /// (an assertion in ucp_am.c) when the buffer is smaller, so callers check it first.
    pub fn receive_rendezvous(
        &self,
        data: AmData,
        dest: &[AppSpan],
        done: ReceiveDone,
    ) -> Result<bool, Error> {
        // The destinations stay held while UCX writes them; if one's region died since it was
        // checked, the message is received into a buffer of ours and dropped (see `memory`).
        let (held, mut discard, dead) = match hold_all(dest) {
            Some(held) => (held, Vec::new(), false),
            None => (SmallVec::new(), vec![0u8; data.len], true),
        };
        let iov: Vec<sys::ucp_dt_iov_t> = if dead {
            vec![sys::ucp_dt_iov_t {
                buffer: discard.as_mut_ptr() as *mut c_void,
                length: discard.len(),
            }]
        } else {
            dest.iter()
                .filter(|s| !s.is_empty())
                .map(|s| sys::ucp_dt_iov_t {
                    buffer: s.as_ptr() as *mut c_void,
                    length: s.len(),
                })
                .collect()
        };
        let mut req = Box::new(ReceiveRequest {
            worker: self.worker,
            iov,
            _held: held,
            _discard: discard,
            done,
        });
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_CALLBACK.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_USER_DATA.0
                | sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_DATATYPE.0,
            cb: sys::ucp_request_param_t__bindgen_ty_1 {
                recv_am: Some(receive_callback),
            },
            user_data: &mut *req as *mut ReceiveRequest as *mut c_void,
            ..Default::default()
        };
        let (datatype, buf, count) = super::endpoint::buffer_of(&req.iov);
        let param = sys::ucp_request_param_t { datatype, ..param };
        let buf = buf as *mut c_void;
        // SAFETY: lock held; `data` is a rendezvous descriptor from this worker, consumed here;
        // the iov array lives in `req` (leaked to the callback when pending) and the spans it
        // names are registered memory (AppSpan's contract).
        let ret = unsafe {
            self.worker.api().ucp_am_recv_data_nbx(
                self.worker.raw(),
                data.desc.as_ptr(),
                buf,
                count,
                &param,
            )
        };
        if ucs::ptr_is_ptr(ret) {
            let _ = Box::into_raw(req); // reclaimed by receive_callback
            Ok(false)
        } else if ucs::ptr_is_err(ret) {
            Err(Error::from_status(ucs::ptr_status(ret)))
        } else {
            Ok(true)
        }
    }
}

unsafe extern "C" fn receive_callback(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user_data: *mut c_void,
) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: user_data is the Box leaked by LockedWorker::receive, reclaimed exactly once.
        let req = unsafe { Box::from_raw(user_data as *mut ReceiveRequest) };
        // SAFETY: the worker outlives its requests; this runs inside progress (lock held).
        let worker = unsafe { &*req.worker };
        let locked = LockedWorker::assume_held(worker);
        let result = if status == sys::ucs_status_t::UCS_OK {
            Ok(length)
        } else {
            Err(Error::from_status(status))
        };
        (req.done)(&locked, result);
        // SAFETY: the request handle was returned by ucp_am_recv_data_nbx and is freed once.
        unsafe { worker.api().ucp_request_free(request) };
    }));
}

/// Runs `print` with a temporary `FILE*` and returns what it wrote (UCX's `*_print_info`).
pub(crate) fn capture_stream(print: impl FnOnce(*mut sys::FILE)) -> String {
    // SAFETY: tmpfile returns a FILE* or NULL; closed below.
    let file = unsafe { libc::tmpfile() };
    if file.is_null() {
        return String::new();
    }
    print(file.cast());
    let mut out = Vec::new();
    // SAFETY: rewind and read back what was written, then close the FILE* once.
    unsafe {
        libc::rewind(file);
        let mut buf = [0u8; 4096];
        loop {
            let n = libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), file);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        libc::fclose(file);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Blocks until one of `fds` is readable or `timeout_ms` passes (-1: no timeout).
/// Returns the indices of the readable fds.
pub fn wait_readable(fds: &[RawFd], timeout_ms: i32) -> Vec<usize> {
    let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
    wait_readable_within(fds, timeout)
}

/// [`wait_readable`] with a timeout finer than a millisecond.
pub fn wait_readable_for(fds: &[RawFd], timeout: Duration) -> Vec<usize> {
    wait_readable_within(fds, Some(timeout))
}

fn wait_readable_within(fds: &[RawFd], timeout: Option<Duration>) -> Vec<usize> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: pfds is a valid array of `len` pollfd structs; `ts_ptr` is NULL or points to
    // `ts`, alive during the call; no signal mask is changed.
    let n = unsafe {
        libc::ppoll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            ts_ptr,
            std::ptr::null(),
        )
    };
    if n <= 0 {
        return Vec::new();
    }
    pfds.iter()
        .enumerate()
        .filter(|(_, p)| p.revents != 0)
        .map(|(i, _)| i)
        .collect()
}
