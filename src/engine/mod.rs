//! The engine beneath the verbs semantics: one UCP worker per process, the progress thread,
//! addressing, and the message dispatch (docs/design.md). It routes each message by its
//! destination QP number to the [`MessageReceiver`] registered for it, and knows nothing of
//! what the message means to verbs.
//!
//! * [`Engine::get`] starts everything on the first `ibv_open_device`: loads UCX, creates the
//!   context and worker, claims this process's LID in the per-host directory, starts the
//!   progress thread and the LID query service.
//! * Every UCX call runs under the worker lock ([`LockedWorker`]); lock order is
//!   worker → queue pair → completion queue. No UCX call is ever made while a queue-pair lock
//!   is held: UCX may run callbacks (which take those locks) inline in any call, e.g. its
//!   `self` transport delivers a send to a QP of this process before the send returns. Queue
//!   pairs queue their UCX work and start it after unlocking (their outbox).
//! * Only peers that prove the user's secret get this process's address or are heard
//!   ([`auth`]): `dispatch` passes every message through the gate first, and every endpoint
//!   the engine creates opens with a hello.
//! * The progress thread ([`progress`]) keeps completions reaching CQs and completion
//!   channels, peers' messages answered and the QPs' transport timers running while the
//!   application does not call into ugdr at all; how it waits is [`ProgressMode`]
//!   (`UGDR_PROGRESS`). `ibv_poll_cq` also progresses (if the lock is free), for latency.

#![forbid(unsafe_code)]

pub mod address;
pub mod auth;
pub mod direct;
mod dispatch;
mod error;
pub mod multicast;
mod progress;
pub mod wire;

pub use dispatch::{
    ACK_BATCH_POLLS, AckFlush, MessageReceiver, Peer, TIMER_TICK, ack_batch_full, ack_wanted_soon,
    arm_timer, full_batch_cutoff, owe_ack, still_owe_ack, tick_early,
};
pub use error::EngineError;
pub use progress::{ProgressConfig, ProgressMode};

use crate::ucp::{self, AmPayload, Endpoint, LockedWorker, Worker};
use address::{Directory, HostNetwork, LidClaim, Resolved};
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub struct Engine {
    pub worker: Arc<Worker>,
    pub network: HostNetwork,
    pub lid: u16,
    pub gid: [u8; 16],
    directory: Directory,
    claim: LidClaim,
    /// Who may talk to this process (peers that know the user's secret).
    gate: auth::Gate,
    /// Endpoints by remote worker address; a failed endpoint is replaced on next use.
    endpoints: Mutex<HashMap<Vec<u8>, PeerProcess>>,
    qps: DashMap<u32, Arc<dyn MessageReceiver>, FxBuildHasher>,
    /// Serializes QP number allocation (numbers are drawn at random).
    next_qpn: Mutex<()>,
    /// What this process publishes for same-host peers' direct RDMA (None: direct path off).
    pub memory: Option<direct::LocalMemory>,
    pub query_service: Result<u16, String>,
    stopping: Arc<AtomicBool>,
    /// How the progress thread waits for work (`UGDR_PROGRESS`, `UGDR_PROGRESS_SPIN_US`).
    pub progress: ProgressConfig,
    /// What the application's threads tell the progress thread (polls, posts).
    activity: Arc<progress::Activity>,
    progress_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// When a peer process on this host was last found gone (`check_local_peers`).
    local_peer_exit: Mutex<Option<Instant>>,
    /// Failed endpoints replaced in `endpoints` while QPs still used them: closed once unused.
    retired_endpoints: Mutex<Vec<PeerProcess>>,
}

/// A connection to another ugdr process, and its pid when it runs on this host (the engine
/// watches local peers itself: their endpoints have no UCX keepalive).
struct PeerProcess {
    endpoint: Arc<Endpoint>,
    local_pid: Option<i32>,
    /// Its published memory, mapped here (same host, direct path permitted).
    memory: Option<Arc<direct::PeerMemory>>,
}

/// How long a shared-memory FIFO slot stays unwritten before it may be abandoned
/// (`Engine::mend_receive_fifos`): when a local peer exited, from at most
/// [`FIFO_SLOT_EXIT_BEFORE`] before the slot was first seen unwritten; else
/// [`FIFO_SLOT_ABANDONED_ANYWAY`].
const FIFO_SLOT_ABANDONED: Duration = Duration::from_millis(200);
const FIFO_SLOT_EXIT_BEFORE: Duration = Duration::from_secs(1);
const FIFO_SLOT_ABANDONED_ANYWAY: Duration = Duration::from_secs(2);

/// At most this many progress calls deliver what local peers sent before they exited
/// (`Engine::check_local_peers`): a FIFO holds 64 messages per transport.
const EXIT_DRAIN_PROGRESS_MAX: usize = 256;

static ENGINE: OnceLock<Result<Engine, EngineError>> = OnceLock::new();

/// Runs at process exit (registered once, when the engine started): [`Engine::shutdown`].
extern "C" fn shut_down_at_exit() {
    if let Some(e) = Engine::running() {
        e.shutdown();
    }
}

/// How long an exiting process keeps progressing so that its last ACKs leave.
const EXIT_DRAIN: std::time::Duration = std::time::Duration::from_millis(5);

/// The host network as seen before the engine starts (device GUIDs need it, UCX does not).
pub fn host_network() -> &'static HostNetwork {
    static NET: OnceLock<HostNetwork> = OnceLock::new();
    NET.get_or_init(HostNetwork::discover)
}

impl Engine {
    /// The process's engine, started on first use.
    pub fn get() -> Result<&'static Engine, EngineError> {
        let engine = ENGINE
            .get_or_init(|| {
                let started = Engine::start();
                // Whatever started it (a verbs context, an rsocket, the ugdr_* API): the
                // progress thread must stop before UCX's own destructors run at exit.
                if started.is_ok() && !crate::sys::process::at_exit(shut_down_at_exit) {
                    tracing::warn!("cannot register the engine's shutdown at exit");
                }
                started
            })
            .as_ref()
            .map_err(Clone::clone)?;
        if engine.stopping.load(Ordering::Acquire) {
            return Err(EngineError::Stopped);
        }
        Ok(engine)
    }

    /// The engine if something already started it and it is not shutting down.
    pub fn running() -> Option<&'static Engine> {
        ENGINE
            .get()
            .and_then(|e| e.as_ref().ok())
            .filter(|e| !e.stopping.load(Ordering::Acquire))
    }

    fn start() -> Result<Engine, EngineError> {
        let progress = ProgressConfig::from_env().map_err(|e| {
            // Said even with logging off: the device does not open, and this is why.
            eprintln!("ugdr: {e}; ugdr0 does not open");
            EngineError::Config(e)
        })?;
        // UCX's threads start as the worker is made: without the application's signals
        // (`sys::process::with_signals_blocked`).
        let worker = crate::sys::process::with_signals_blocked(|| {
            ucp::Context::new().and_then(Worker::new)
        })?;
        worker.set_am_handler(wire::AM_ID, Box::new(dispatch))?;
        let address = worker.lock().address()?;
        let network = host_network().clone();
        let directory = Directory::open()?;
        let secret = Arc::new(auth::Secret::load()?);
        let proof = auth::entry_proof(&secret, std::process::id() as i32, &address);
        let claim = directory.claim(network.host_tag(), &address, &proof)?;
        let lid = claim.lid;
        let gid = address::port_gid(network.ipv4, lid);
        let gate = auth::Gate::new(Arc::clone(&secret), &address, gid);
        let query_service = match address::bind_query_listener() {
            Ok(listener) => {
                let dir = Directory::open()?;
                let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
                crate::sys::process::spawn_thread("ugdr-lid-query", move || {
                    address::serve_queries(listener, dir, secret)
                })
                .map_err(|e| EngineError::Os(e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
                Ok(port)
            }
            Err(e) => {
                tracing::warn!(
                    "lid query service unavailable: {e}; peers on other hosts cannot find this port"
                );
                Err(e.to_string())
            }
        };
        let progress_worker = Arc::clone(&worker);
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let activity = Arc::new(progress::Activity::default());
        let seen = Arc::clone(&activity);
        let progress_thread = crate::sys::process::spawn_thread("ugdr-progress", move || {
            progress::run(&progress_worker, &stop, &seen, progress)
        })
        .map_err(|e| EngineError::Os(e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
        let memory = if direct::enabled() {
            direct::LocalMemory::new(lid)
                .inspect_err(|e| tracing::debug!("direct path unavailable: {e}"))
                .ok()
        } else {
            None
        };
        tracing::debug!(
            "engine up: lid {lid:#06x} ip {} address {} bytes, progress {}, {} shared-memory \
             receive FIFOs watched",
            network.ipv4,
            address.len(),
            progress.mode.name(),
            worker.watched_fifos()
        );
        Ok(Engine {
            worker,
            network,
            lid,
            gid,
            directory,
            claim,
            gate,
            endpoints: Mutex::new(HashMap::new()),
            qps: DashMap::default(),
            next_qpn: Mutex::new(()),
            memory,
            query_service,
            stopping,
            progress,
            activity,
            progress_thread: Mutex::new(Some(progress_thread)),
            local_peer_exit: Mutex::new(None),
            retired_endpoints: Mutex::new(Vec::new()),
        })
    }

    /// At process exit, before UCX's own destructors run: stops the progress thread, removes
    /// this process's entry from the per-host directory, and keeps the worker locked for good
    /// so that no other thread is inside UCX while the process tears it down.
    pub fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        // The multicast entry goes before the LID (the LID's next owner must not lose its own).
        let groups = self.multicast_withdraw();
        self.directory.release(&self.claim);

        {
            // What a HCA would still do for this process: acknowledge what it delivered.
            let locked = self.worker.lock();
            self.flush_owed_acks(&locked, AckFlush::All);
            self.multicast_shutdown(&locked, &groups);
            let until = std::time::Instant::now() + EXIT_DRAIN;
            while locked.progress() > 0 || std::time::Instant::now() < until {
                if std::time::Instant::now() >= until {
                    break;
                }
            }
        }
        self.worker.signal();
        let handle = self
            .progress_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        std::mem::forget(self.worker.lock());
    }

    /// A QP number not in use in this process (24 bits, never 0 or 1), drawn at random so
    /// that nobody can predict or re-create another process's QP numbers, holding a slot of
    /// the direct-access table when one is free.
    pub fn allocate_qpn(&self) -> u32 {
        let _serial = self.next_qpn.lock().unwrap_or_else(|p| p.into_inner());
        let mut tries = 0;
        loop {
            let n = random_u32() & wire::PSN_MASK;
            if n <= 1 || self.qps.contains_key(&n) {
                continue;
            }
            tries += 1;
            match &self.memory {
                Some(m) if m.qp_slot_free(n) => {
                    m.claim_qp_slot(n);
                    return n;
                }
                // Every slot taken: this QP goes without the direct path.
                Some(_) if tries <= 2 * crate::shared_memory::QP_SLOTS => {}
                _ => return n,
            }
        }
    }

    /// Messages for `qpn` go to `receiver` from now on.
    pub fn register_qp(&self, qpn: u32, receiver: Arc<dyn MessageReceiver>) {
        self.qps.insert(qpn, receiver);
    }

    /// The receiver of QP `qpn`, if it lives in this process.
    fn receiver(&self, qpn: u32) -> Option<Arc<dyn MessageReceiver>> {
        self.qps.get(&qpn).map(|q| Arc::clone(q.value()))
    }

    /// Messages for `qpn` are dropped from now on, and its direct-access slot is free.
    pub fn unregister_qp(&self, qpn: u32) {
        self.qps.remove(&qpn);
        self.multicast_forget_qp(qpn);
        if let Some(m) = &self.memory {
            m.withdraw_qp(qpn);
            m.release_qp_slot(qpn);
        }
    }

    /// Finds the worker address of the port named by `dlid` (or `dgid`). Blocking (it may
    /// ask another host): call without the worker lock.
    pub fn resolve(&self, dlid: u16, dgid: Option<&[u8; 16]>) -> Result<Resolved, EngineError> {
        let secret = self.gate.secret();
        address::resolve(&self.network, &self.directory, secret, dlid, dgid).map_err(|e| {
            tracing::debug!("resolve: {e}");
            EngineError::Unreachable
        })
    }

    /// The endpoint to a remote worker (one per remote worker, shared by its QPs).
    pub fn connect(
        &self,
        locked: &LockedWorker<'_>,
        remote: &Resolved,
        remote_qpn: u32,
    ) -> Result<Peer, EngineError> {
        let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = eps
            .get(&remote.worker_address)
            .filter(|p| !p.endpoint.failed())
        {
            return Ok(Peer {
                endpoint: Arc::clone(&p.endpoint),
                qpn: remote_qpn,
                lid: remote.lid,
                memory: p.memory.clone(),
                remote_host: p.local_pid.is_none(),
            });
        }
        let ep = self.gate.connect(
            locked,
            &remote.worker_address,
            remote.local_pid.is_none(),
            Box::new(endpoint_failed),
        )?;
        let memory = remote.local_pid.and_then(|pid| {
            direct::PeerMemory::open(pid, remote.lid)
                .inspect_err(|e| {
                    tracing::debug!("pid {pid}: direct path not permitted, using messages: {e}")
                })
                .ok()
                .map(Arc::new)
        });
        let replaced = eps.insert(
            remote.worker_address.clone(),
            PeerProcess {
                endpoint: Arc::clone(&ep),
                local_pid: remote.local_pid,
                memory: memory.clone(),
            },
        );
        if let Some(failed) = replaced {
            self.retired_endpoints
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(failed);
        }
        Ok(Peer {
            endpoint: ep,
            qpn: remote_qpn,
            lid: remote.lid,
            memory,
            remote_host: remote.local_pid.is_none(),
        })
    }

    /// Fails the endpoints (and so the QPs) of local peers whose process is gone.
    pub(crate) fn check_local_peers(&self, locked: &LockedWorker<'_>) {
        let dead: Vec<Arc<Endpoint>> = {
            let eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
            eps.values()
                .filter(|p| {
                    !p.endpoint.failed() && p.local_pid.is_some_and(|pid| !address::pid_alive(pid))
                })
                .map(|p| Arc::clone(&p.endpoint))
                .collect()
        };
        if !dead.is_empty() {
            *self
                .local_peer_exit
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            // What a peer sent before it exited (an ACK at its exit, its last SEND) may still
            // wait in this process's FIFO: delivered first, as packets that arrived before a
            // peer's death are. A dead process sends nothing more, so this ends.
            for _ in 0..EXIT_DRAIN_PROGRESS_MAX {
                if locked.progress() == 0 {
                    break;
                }
            }
        }
        for ep in dead {
            ep.mark_failed(
                locked,
                ucp::Error::Status {
                    code: -25,
                    text: "peer process exited".into(),
                },
            );
        }
        self.close_gone_endpoints(locked);
    }

    /// Closes the endpoints of peers that failed (exited, unreachable) once no QP uses them,
    /// and unmaps a same-host peer's direct-path table (~790 KiB of its memfd): a
    /// long-running process (SPDK's target) kept both for every peer that came and went. UCX
    /// lets go of what it attached for the peer (its socket, its shared-memory FIFOs) where
    /// it can (`Endpoint::close`). A failed endpoint that QPs still name stays until they are
    /// destroyed.
    fn close_gone_endpoints(&self, locked: &LockedWorker<'_>) {
        let unused = |p: &PeerProcess| Arc::strong_count(&p.endpoint) == 1;
        let gone: Vec<PeerProcess> = {
            let mut eps = self.endpoints.lock().unwrap_or_else(|p| p.into_inner());
            let mut gone: Vec<PeerProcess> = eps
                .extract_if(|_, p| p.endpoint.failed() && unused(p))
                .map(|(_, p)| p)
                .collect();
            let mut retired = self
                .retired_endpoints
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            gone.extend(retired.extract_if(.., |p| unused(p)));
            gone
        };
        for peer in gone {
            tracing::debug!(
                "closing the endpoint of a peer that is gone{}",
                peer.local_pid
                    .map_or(String::new(), |pid| format!(" (pid {pid})"))
            );
            drop(peer.memory);
            if let Ok(endpoint) = Arc::try_unwrap(peer.endpoint) {
                endpoint.close(locked);
            }
        }
    }

    /// Completes a slot of this process's shared-memory receive FIFOs that a sender took and
    /// will never write, because it died between the two (`ucp::fifo`): without this, the
    /// worker waits for that slot forever and never sees another shared-memory message, from
    /// any process (SPDK's target answered no initiator again after one was killed mid-I/O).
    /// A slot counts as abandoned once it stayed unwritten for [`FIFO_SLOT_ABANDONED`] and a
    /// peer process on this host exited around then, or for [`FIFO_SLOT_ABANDONED_ANYWAY`]
    /// (a sender that is not a known peer; a live sender writes a slot within microseconds,
    /// and one stopped that long between taking and writing one is stopped in a debugger).
    pub(crate) fn mend_receive_fifos(&self, locked: &LockedWorker<'_>) {
        let now = Instant::now();
        let Some(stalled) = locked.stalled_fifo_slot(now) else {
            return;
        };
        let unwritten_for = now.saturating_duration_since(stalled.since);
        if unwritten_for < FIFO_SLOT_ABANDONED {
            return;
        }
        self.check_local_peers(locked);
        let exit = *self
            .local_peer_exit
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let peer_exited = exit.is_some_and(|t| t + FIFO_SLOT_EXIT_BEFORE >= stalled.since);
        if !peer_exited && unwritten_for < FIFO_SLOT_ABANDONED_ANYWAY {
            return;
        }
        if locked.complete_abandoned_fifo_slot(stalled, wire::AM_ID as u16) {
            tracing::warn!(
                "shared memory: a sender took slot {} of this process's receive FIFO and left it \
                 unwritten for {} ms ({}); completed it as an empty message so that what \
                 follows it is received",
                stalled.index,
                unwritten_for.as_millis(),
                if peer_exited {
                    "a peer process on this host exited"
                } else {
                    "no live sender takes that long"
                }
            );
        }
    }

    /// This process's published memory, if the engine runs and the direct path is on.
    pub fn local_memory() -> Option<&'static direct::LocalMemory> {
        Engine::running().and_then(|e| e.memory.as_ref())
    }

    /// Where the secret that peers must prove comes from (`UGDR_SECRET` or the file).
    pub fn secret_origin(&self) -> &str {
        self.gate.secret().origin()
    }

    /// UCX's description of this process's worker: the transports it offers peers.
    pub fn transports(&self) -> String {
        self.worker.lock().info()
    }

    /// Progress from an application thread whose CQ was empty (ibv_poll_cq): skipped when
    /// another thread is already progressing. Once the application has found nothing new
    /// several times in a row, the ACKs owed to peers go out on their own (until then they
    /// ride on the application's next sends).
    pub fn progress_from_app(&self) {
        self.activity.progress_from_app(self, true);
    }

    /// As [`Engine::progress_from_app`], without counting as the application's poll, so that
    /// the progress thread does not step aside: for a blocking rsocket call, which polls once
    /// before it waits on a channel that the progress thread must keep serving.
    pub fn progress_beside_app(&self) {
        self.activity.progress_from_app(self, false);
    }

    /// The application's `ibv_poll_cq` progress calls so far (see [`full_batch_cutoff`]).
    pub fn app_polls(&self) -> u64 {
        self.activity.polls()
    }

    /// The application posted work (an answer is expected soon: the adaptive progress thread
    /// stays awake for it).
    pub fn note_post(&self) {
        self.activity.posted();
    }

    /// The application armed a CQ for a completion event: it sleeps until one comes (see
    /// the adaptive progress thread's rule in `progress.rs`). One that blocks in
    /// `ibv_get_cq_event` first has what reached the process delivered: those completions
    /// are queued before the arming, as a HCA writes a CQE when its packet arrives; taken
    /// in by its next poll instead, each raised an event for a completion that poll
    /// returned, and its next wait found nothing (`ibv_rc_pingpong -t -e` fails on that).
    pub fn note_event_wait(&self) {
        self.activity.armed_for_events();
        if self.activity.blocks_for_events() {
            self.progress_beside_app();
        }
    }

    /// Progress from a thread blocked for a completion event whose wait saw the worker's
    /// event fd become readable: deliver (and acknowledge) now if the worker is free.
    pub fn progress_for_waiter(&self) {
        match self.worker.try_lock() {
            Some(locked) => {
                while locked.progress() > 0 {}
                // The ACKs this delivered owes wait for the application's answer (it is about
                // to be handed an event), or go before this thread waits again
                // (`blocking_for_event`).
                if dispatch::owed_acks_overdue() {
                    self.flush_owed_acks(&locked, AckFlush::Overdue);
                }
                // Leave the fd armed again for the progress thread (or this waiter).
                let _ = locked.arm();
            }
            None => std::thread::yield_now(),
        }
    }

    /// Runs the transport timers of the armed QPs (the progress thread, every
    /// [`TIMER_TICK`]).
    fn tick_timers(&self, locked: &LockedWorker<'_>) {
        let now = std::time::Instant::now();
        let still: Vec<u32> = dispatch::take_armed()
            .into_iter()
            .filter(|&qpn| self.receiver(qpn).is_some_and(|qp| qp.tick(locked, now)))
            .collect();
        dispatch::rearm(still);
    }

    /// An application thread is about to block in `ibv_get_cq_event`: it will not answer
    /// what it was handed, so the ACKs held for that answer go now (unless another thread
    /// progresses; that one sends them).
    pub fn blocking_for_event(&self) {
        self.activity.blocked_for_event();
        if dispatch::owed_acks_due_in().is_some()
            && let Some(locked) = self.worker.try_lock()
        {
            self.flush_owed_acks(&locked, AckFlush::All);
        }
    }

    /// Sends the ACKs the QPs of this process owe their peers: all, or the overdue ones.
    pub fn flush_owed_acks(&self, locked: &LockedWorker<'_>, which: AckFlush) {
        let owed_by = match which {
            AckFlush::All => None,
            AckFlush::Overdue => Some(dispatch::overdue_cutoff()),
        };
        for qpn in dispatch::take_owed_acks() {
            if let Some(qp) = self.receiver(qpn) {
                qp.send_owed_ack(locked, owed_by);
            }
        }
    }

    /// Sends the ACKs of full batches owed since the application's poll numbered `poll` or
    /// earlier (`u64::MAX`: all of them); those not yet due stay listed.
    pub fn flush_full_batches(&self, locked: &LockedWorker<'_>, poll: u64) {
        for qpn in dispatch::take_full_batches() {
            if let Some(qp) = self.receiver(qpn) {
                qp.send_full_batch_ack(locked, poll);
            }
        }
    }
}

/// A peer became unreachable: every QP is told, and those connected through a failed
/// endpoint fail.
fn endpoint_failed(locked: &LockedWorker<'_>, err: ucp::Error) {
    let Some(engine) = Engine::running() else {
        return;
    };
    tracing::debug!("endpoint to a peer failed: {err}");
    let receivers: Vec<Arc<dyn MessageReceiver>> =
        engine.qps.iter().map(|q| Arc::clone(q.value())).collect();
    for qp in receivers {
        qp.peer_failed(locked);
    }
}

/// The active-message handler: routes a message to its queue pair.
fn dispatch(locked: &LockedWorker<'_>, header: &[u8], payload: AmPayload<'_>) -> bool {
    let Some(engine) = Engine::running() else {
        return false;
    };
    // Only messages from endpoints that authenticated (engine/auth.rs) get further, and only
    // those that claim the LID their endpoint's hello proved: a process that knows the
    // secret still cannot pass itself off as another port (QPs trust their peer's LID).
    let Some((header, sender_lid)) = engine.gate.admit(header) else {
        return false;
    };
    if wire::is_bundle_header(header) {
        return deliver_bundle(engine, locked, payload, sender_lid);
    }
    let Some(h) = wire::Header::decode(header) else {
        tracing::warn!(
            "dropping a message with an unknown header ({} bytes)",
            header.len()
        );
        return false;
    };
    deliver(engine, locked, h, payload, sender_lid)
}

/// A bundle (`wire::bundle_header`): its messages, delivered in order as if each had come
/// alone. Nothing of it is kept (a receiver that keeps a message copies it).
fn deliver_bundle(
    engine: &Engine,
    locked: &LockedWorker<'_>,
    payload: AmPayload<'_>,
    sender_lid: u16,
) -> bool {
    let body = match &payload {
        AmPayload::Transient(b) => *b,
        AmPayload::Persistent(data) => data.bytes(),
        // Bundles are sent eager (`Endpoint::am_send_then`, `eager`).
        AmPayload::Rendezvous(_) => {
            tracing::warn!("dropping a bundle sent by rendezvous");
            return false;
        }
    };
    for message in wire::bundle_messages(body) {
        match message {
            Ok((h, bytes)) => {
                deliver(engine, locked, h, AmPayload::Transient(bytes), sender_lid);
            }
            Err(left) => {
                tracing::warn!("dropping the last {left} bytes of a bundle: a bad frame");
            }
        }
    }
    false
}

/// Hands an admitted message to its receiver; true when the payload's data was kept.
/// `sender_lid`: the LID its endpoint proved.
fn deliver(
    engine: &Engine,
    locked: &LockedWorker<'_>,
    h: wire::Header,
    payload: AmPayload<'_>,
    sender_lid: u16,
) -> bool {
    if h.src_lid != sender_lid {
        tracing::debug!(
            "dropping {:?} for qp {:#x} claiming lid {:#06x} from an endpoint of lid {:#06x}",
            h.op,
            h.dst_qpn,
            h.src_lid,
            sender_lid
        );
        return false;
    }
    if h.flags & wire::FLAG_MULTICAST != 0 {
        return engine.multicast_arrived(locked, h, payload);
    }
    let Some(qp) = engine.receiver(h.dst_qpn) else {
        tracing::debug!("dropping {:?} for unknown qp {:#x}", h.op, h.dst_qpn);
        return false;
    };
    match h.op {
        wire::Op::Send | wire::Op::Write | wire::Op::ReadRequest | wire::Op::Atomic => {
            qp.request_arrived(locked, h, payload)
        }
        wire::Op::ReadResponse | wire::Op::AtomicResponse => {
            qp.response_arrived(locked, h, payload)
        }
        wire::Op::Ack => {
            qp.ack_arrived(locked, &h);
            false
        }
    }
}

/// 32 random bits from the OS (QP numbers, starting PSNs: nothing another process can
/// predict). Without an entropy source: a hash of the time under a random hasher key.
pub fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_ok() {
        return u32::from_ne_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish() as u32
}

/// Runs the QPs' transport timers when a tick is due (a few instructions when not).
pub(super) fn tick_if_due(worker: &Worker, next_tick: &mut std::time::Instant) {
    // An RNR NAK's wait ending runs them early (the regular ticks go on as they were). Taken
    // also when no timer runs any more: left set, the progress thread would wait for it
    // without sleeping.
    let early = dispatch::take_early_tick();
    if !dispatch::timers_armed() {
        return;
    }
    let now = std::time::Instant::now();
    if now < *next_tick && !early {
        return;
    }
    if now >= *next_tick {
        *next_tick = now + TIMER_TICK;
    }
    let locked = worker.lock();
    // Answers that already arrived count before any timer expires (this thread may have been
    // kept off the CPU for a while).
    while locked.progress() > 0 {}
    if let Some(engine) = Engine::running() {
        engine.tick_timers(&locked);
    }
}
