//! Devices, contexts, ports, GIDs, P_Keys and asynchronous events.

use super::boundary::{Attempt, Fallback, blocking, ffi_boundary, set_errno};
use super::caller::{Caller, export_with_caller};
use super::layout::{ContextShell, DeviceShell};
use super::{ibv_import, passthrough};
use crate::engine::{Engine, host_network};
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::clock;
use crate::fake_verbs::context::{DeviceContext, EventElement};
use crate::fake_verbs::device::{self, DeviceAttributes};
use crate::sys::*;
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use std::os::raw::{c_char, c_int, c_uint};
use std::ptr::{self, null_mut};
use std::sync::{Arc, LazyLock, OnceLock};

static DEVICE: OnceLock<DeviceShell> = OnceLock::new();

/// ugdr's one device, built once: the same pointer in every list (rdma_get_devices relies on it).
pub(crate) fn device() -> &'static DeviceShell {
    DEVICE.get_or_init(|| {
        let mut dev = ibv_device {
            node_type: ibv_node_type::IBV_NODE_CA,
            transport_type: ibv_transport_type::IBV_TRANSPORT_IB,
            ..Default::default()
        };
        copy_str(&mut dev.name, device::DEVICE_NAME);
        copy_str(&mut dev.dev_name, device::DEVICE_DEV_NAME);
        copy_str(
            &mut dev.dev_path,
            &format!("/sys/class/infiniband_verbs/{}", device::DEVICE_DEV_NAME),
        );
        copy_str(
            &mut dev.ibdev_path,
            &format!("/sys/class/infiniband/{}", device::DEVICE_NAME),
        );
        DeviceShell::new(dev)
    })
}

fn copy_str(dst: &mut [c_char], s: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

fn is_our_device(dev: *mut ibv_device) -> bool {
    DEVICE.get().is_some_and(|d| d.as_raw() == dev)
}

fn attributes() -> DeviceAttributes {
    DeviceAttributes::new(host_network().node_guid())
}

/// Device lists ugdr handed out → the real library's list they embed (0 if none).
static LISTS: LazyLock<DashMap<usize, usize, FxBuildHasher>> = LazyLock::new(DashMap::default);

export_with_caller! {
    /// ugdr's device first, then the real library's devices (so a host with HCAs keeps them
    /// usable); a caller whose verbs are the real ones (an application's own UCX, librdmacm,
    /// libibverbs itself: `caller.rs`) gets the real list alone.
    fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device
        => get_device_list_from, caller in "rsi" / "x1"
}

unsafe extern "C" fn get_device_list_from(
    num_devices: *mut c_int,
    caller: Caller,
) -> *mut *mut ibv_device {
    ffi_boundary!("ibv_get_device_list", {
        if let Some(user) = caller.real_verbs_user() {
            tracing::debug!(
                "ibv_get_device_list from {user}: the real libibverbs ({}) answers",
                passthrough::LIBIBVERBS
                    .path()
                    .unwrap_or_else(|| "not loaded".into())
            );
            return match passthrough::ibv_get_device_list() {
                // SAFETY: the real function with the caller's out-parameter.
                Some(real) => unsafe { real(num_devices) },
                None => <*mut *mut ibv_device>::fail(libc::ENOSYS),
            };
        }
        let mut list: Vec<*mut ibv_device> = vec![device().as_raw()];
        let mut real_list: *mut *mut ibv_device = null_mut();
        if let Some(real) = passthrough::ibv_get_device_list() {
            let mut n: c_int = 0;
            // SAFETY: the real function with a valid out-parameter.
            real_list = unsafe { real(&mut n) };
            if !real_list.is_null() {
                for i in 0..usize::try_from(n).unwrap_or(0) {
                    // SAFETY: the real list holds `n` valid entries.
                    list.push(unsafe { *real_list.add(i) });
                }
            }
            tracing::debug!(
                "ibv_get_device_list: ugdr0 and {} real devices",
                list.len() - 1
            );
        }
        let count = list.len() as c_int;
        list.push(null_mut());
        let raw = Box::into_raw(list.into_boxed_slice()) as *mut *mut ibv_device;
        LISTS.insert(raw as usize, real_list as usize);
        if !num_devices.is_null() {
            // SAFETY: caller's out-parameter, checked non-NULL.
            unsafe { *num_devices = count };
        }
        set_errno(0);
        raw
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    ffi_boundary!("ibv_free_device_list", {
        if list.is_null() {
            return;
        }
        match LISTS.remove(&(list as usize)) {
            Some((_, real_list)) => {
                let mut len = 0;
                // SAFETY: our list is NULL-terminated; count it to rebuild the Box.
                while !unsafe { *list.add(len) }.is_null() {
                    len += 1;
                }
                // SAFETY: allocated as a boxed slice of len + 1 entries by ibv_get_device_list.
                drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(list, len + 1)) });
                if real_list != 0
                    && let Some(real) = passthrough::ibv_free_device_list()
                {
                    // SAFETY: the list the real library returned to us.
                    unsafe { real(real_list as *mut *mut ibv_device) };
                }
            }
            None => {
                if let Some(real) = passthrough::ibv_free_device_list() {
                    // SAFETY: not ours, so the real library's.
                    unsafe { real(list) };
                }
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    ffi_boundary!("ibv_get_device_name", {
        if dev.is_null() {
            return <*const c_char>::fail(libc::EINVAL);
        }
        // SAFETY: a device from a device list (ours or the real library's): `name` is inline.
        unsafe { ptr::addr_of!((*dev).name) as *const c_char }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    ffi_boundary!("ibv_get_device_guid", {
        if is_our_device(dev) {
            // __be64: the GUID's bytes in network order.
            return u64::from_ne_bytes(host_network().node_guid());
        }
        match passthrough::ibv_get_device_guid() {
            // SAFETY: a device that is not ours belongs to the real library.
            Some(real) if !dev.is_null() => unsafe { real(dev) },
            _ => u64::fail(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    ffi_boundary!("ibv_get_device_index", {
        if is_our_device(dev) {
            return 0;
        }
        match passthrough::ibv_get_device_index() {
            // SAFETY: a device that is not ours belongs to the real library.
            Some(real) if !dev.is_null() => unsafe { real(dev) },
            _ => -1,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    ffi_boundary!("ibv_open_device", {
        if !is_our_device(dev) {
            return match passthrough::ibv_open_device() {
                // SAFETY: a device that is not ours belongs to the real library.
                Some(real) if !dev.is_null() => unsafe { real(dev) },
                _ => <*mut ibv_context>::fail(libc::ENODEV),
            };
        }
        match open_context(dev) {
            Ok(ctx) => ctx,
            Err(e) => {
                tracing::warn!("ibv_open_device: {e}");
                <*mut ibv_context>::fail(e.errno())
            }
        }
    })
}

fn open_context(dev: *mut ibv_device) -> Result<*mut ibv_context, VerbsError> {
    Engine::get()?;
    debug_assert_eq!(dev, device().as_raw());
    let inner = Arc::new(DeviceContext::new()?);
    let cmd_file = ibv_import::command_file(&inner)?;
    Ok(ibv_import::context_shell(inner, cmd_file))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    ffi_boundary!("ibv_close_device", {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_close_device() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx) },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        // SAFETY: ours (checked), and the application gives it up here.
        unsafe { ContextShell::destroy(ctx) };
        0
    })
}

fn fill_device_attr(out: &mut ibv_device_attr) {
    let a = attributes();
    *out = ibv_device_attr::default();
    copy_str(&mut out.fw_ver, a.fw_ver);
    out.node_guid = u64::from_ne_bytes(a.node_guid);
    out.sys_image_guid = u64::from_ne_bytes(a.sys_image_guid);
    out.max_mr_size = a.max_mr_size;
    out.page_size_cap = a.page_size_cap;
    out.vendor_id = a.vendor_id;
    out.vendor_part_id = a.vendor_part_id;
    out.hw_ver = a.hw_ver;
    out.max_qp = a.max_qp;
    out.max_qp_wr = a.max_qp_wr;
    // Memory windows (type 1 and 2B), LOCAL_INV and SEND_WITH_INV: the memory management
    // extensions (no fast-registration MRs: rdma-core's user space has no verb for them).
    out.device_cap_flags = (ibv_device_cap_flags::IBV_DEVICE_RC_RNR_NAK_GEN.0
        | ibv_device_cap_flags::IBV_DEVICE_PORT_ACTIVE_EVENT.0
        | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW.0
        | ibv_device_cap_flags::IBV_DEVICE_MEM_MGT_EXTENSIONS.0
        | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
        | ibv_device_cap_flags::IBV_DEVICE_XRC.0) as c_uint;
    out.max_mw = crate::fake_verbs::mw::MAX_WINDOWS;
    out.max_sge = a.max_sge;
    out.max_sge_rd = a.max_sge_rd;
    out.max_cq = a.max_cq;
    out.max_cqe = a.max_cqe;
    out.max_mr = a.max_mr;
    out.max_pd = a.max_pd;
    out.max_qp_rd_atom = a.max_qp_rd_atom;
    out.max_res_rd_atom = a.max_qp_rd_atom * a.max_qp;
    out.max_qp_init_rd_atom = a.max_qp_init_rd_atom;
    out.atomic_cap = ibv_atomic_cap::IBV_ATOMIC_HCA;
    out.max_srq = a.max_srq;
    out.max_ah = a.max_ah;
    out.max_mcast_grp = crate::engine::multicast::MAX_GROUPS as c_int;
    out.max_mcast_qp_attach = crate::engine::multicast::MAX_GROUP_QPS as c_int;
    out.max_total_mcast_qp_attach = out.max_mcast_grp * out.max_mcast_qp_attach;
    out.max_srq_wr = a.max_srq_wr;
    out.max_srq_sge = a.max_srq_sge;
    out.max_pkeys = a.max_pkeys;
    out.local_ca_ack_delay = 16;
    out.phys_port_cnt = a.phys_port_cnt;
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    ffi_boundary!("ibv_query_device", {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_query_device() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, attr) },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        if attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        let mut out = ibv_device_attr::default();
        fill_device_attr(&mut out);
        // SAFETY: caller's out-parameter, checked non-NULL.
        unsafe { attr.write(out) };
        0
    })
}

/// `verbs_context.query_device_ex`: writes `attr_size` bytes of an `ibv_device_attr_ex`.
pub(crate) unsafe extern "C" fn query_device_ex_op(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    ffi_boundary!("ibv_query_device_ex", {
        if attr.is_null() || !ContextShell::is_ours(ctx) {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: `input` is NULL or the caller's struct.
        if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
            return c_int::fail(libc::EINVAL);
        }
        let size = std::mem::size_of::<ibv_device_attr>();
        if attr_size < size {
            return c_int::fail(libc::EINVAL);
        }
        let mut out = ibv_device_attr_ex::default();
        fill_device_attr(&mut out.orig_attr);
        out.phys_port_cnt_ex = 1;
        out.odp_caps = ibv_odp_caps {
            general_caps: device::odp::GENERAL_CAPS,
            per_transport_caps: ibv_odp_caps__bindgen_ty_1 {
                rc_odp_caps: device::odp::RC_CAPS,
                uc_odp_caps: device::odp::UC_CAPS,
                ud_odp_caps: device::odp::UD_CAPS,
            },
        };
        out.xrc_odp_caps = device::odp::XRC_CAPS;
        out.completion_timestamp_mask = clock::COMPLETION_TIMESTAMP_MASK;
        out.hca_core_clock = clock::HCA_CORE_CLOCK_KHZ;
        out.max_dm_size = device::MAX_DM_SIZE;
        let n = attr_size.min(std::mem::size_of::<ibv_device_attr_ex>());
        // SAFETY: the caller's buffer holds `attr_size` bytes; we write at most that many.
        unsafe { ptr::copy_nonoverlapping(&out as *const _ as *const u8, attr as *mut u8, n) };
        0
    })
}

/// `IBV_VALUES_MASK_RAW_CLOCK`, the one value `ibv_query_rt_values_ex` knows.
const VALUES_RAW_CLOCK: u32 = 1;

/// `verbs_context.query_rt_values` (the `ibv_query_rt_values_ex` inline): the raw device clock
/// as mlx4/mlx5 report it (`tv_sec` 0, `tv_nsec` the cycle count; one cycle is a nanosecond
/// of CLOCK_MONOTONIC, see `fake_verbs::clock`). Unknown bits in `comp_mask`: EINVAL.
pub(crate) unsafe extern "C" fn query_rt_values_op(
    ctx: *mut ibv_context,
    values: *mut ibv_values_ex,
) -> c_int {
    ffi_boundary!("ibv_query_rt_values_ex", {
        if values.is_null() || !ContextShell::is_ours(ctx) {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's struct, checked non-NULL.
        let v = unsafe { &mut *values };
        if v.comp_mask & !VALUES_RAW_CLOCK != 0 {
            return c_int::fail(libc::EINVAL);
        }
        let asked = v.comp_mask;
        v.comp_mask = 0;
        if asked & VALUES_RAW_CLOCK != 0 {
            v.raw_clock.tv_sec = 0;
            v.raw_clock.tv_nsec = clock::raw_clock() as i64;
            v.comp_mask |= VALUES_RAW_CLOCK;
        }
        0
    })
}

fn port_attributes(engine: &Engine) -> ibv_port_attr {
    ibv_port_attr {
        state: ibv_port_state::IBV_PORT_ACTIVE,
        max_mtu: ibv_mtu::IBV_MTU_4096,
        active_mtu: ibv_mtu::IBV_MTU_4096,
        gid_tbl_len: device::GID_TABLE_LEN,
        port_cap_flags: ibv_port_cap_flags::IBV_PORT_CM_SUP.0,
        max_msg_sz: device::MAX_MSG_SIZE,
        bad_pkey_cntr: 0,
        qkey_viol_cntr: 0,
        pkey_tbl_len: device::PKEY_TABLE_LEN,
        lid: engine.lid,
        sm_lid: engine.lid,
        lmc: 0,
        max_vl_num: 1,
        sm_sl: 0,
        subnet_timeout: 18,
        init_type_reply: 0,
        active_width: 2,  // 4X
        active_speed: 32, // EDR
        phys_state: 5,    // LinkUp
        link_layer: IBV_LINK_LAYER_INFINIBAND.0 as u8,
        flags: 0,
        port_cap_flags2: 0,
    }
}

fn query_port_into(ctx: *mut ibv_context, port: u8, attr: *mut u8, len: usize) -> c_int {
    if attr.is_null() || port != device::PORT_NUM {
        return c_int::fail(libc::EINVAL);
    }
    let engine = match Engine::get() {
        Ok(e) => e,
        Err(e) => return c_int::fail(e.errno()),
    };
    let _ = ctx;
    let out = port_attributes(engine);
    let n = len.min(std::mem::size_of::<ibv_port_attr>());
    // SAFETY: the caller's buffer holds `len` bytes; we write at most that many.
    unsafe { ptr::copy_nonoverlapping(&out as *const _ as *const u8, attr, n) };
    0
}

/// `verbs_context.query_port` (what the `ibv_query_port` macro calls).
pub(crate) unsafe extern "C" fn query_port_op(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    ffi_boundary!("ibv_query_port", {
        query_port_into(ctx, port, attr.cast(), len)
    })
}

/// The exported symbol: rdma-core's compat entry point, called with the 48-byte
/// `_compat_ibv_port_attr` (the first 48 bytes of `ibv_port_attr`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    ffi_boundary!("ibv_query_port", {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_query_port() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port, attr) },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        query_port_into(
            ctx,
            port,
            attr.cast(),
            std::mem::offset_of!(ibv_port_attr, port_cap_flags2),
        )
    })
}

fn our_gid(port: u32, index: i64) -> Result<[u8; 16], c_int> {
    if port != u32::from(device::PORT_NUM) || index != 0 {
        return Err(libc::EINVAL);
    }
    Engine::get().map(|e| e.gid).map_err(|e| e.errno())
}

/// Returns 0, or -1 with errno set (ibv_query_gid(3)).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    ffi_boundary!("ibv_query_gid", on_panic = -1, {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_query_gid() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port, index, gid) },
                _ => {
                    set_errno(libc::EINVAL);
                    -1
                }
            };
        }
        match our_gid(port.into(), index.into()) {
            Ok(g) if !gid.is_null() => {
                // SAFETY: caller's out-parameter, checked non-NULL.
                unsafe { (*gid).raw = g };
                0
            }
            Ok(_) | Err(_) => {
                set_errno(libc::EINVAL);
                -1
            }
        }
    })
}

/// rdma-core's private `ibv_query_gid_type` (imported by ibv_devinfo): IB GIDs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    gid_type: *mut u32,
) -> c_int {
    ffi_boundary!("ibv_query_gid_type", on_panic = -1, {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_query_gid_type() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port, index, gid_type) },
                _ => -1,
            };
        }
        if gid_type.is_null() || our_gid(port.into(), index.into()).is_err() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: caller's out-parameter, checked non-NULL. IBV_GID_TYPE_SYSFS_IB_ROCE_V1 = 0.
        unsafe { *gid_type = 0 };
        0
    })
}

fn gid_entry(gid: [u8; 16]) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid { raw: gid },
        gid_index: 0,
        port_num: u32::from(device::PORT_NUM),
        gid_type: ibv_gid_type::IBV_GID_TYPE_IB.0,
        ndev_ifindex: 0,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    ffi_boundary!("ibv_query_gid_ex", {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::_ibv_query_gid_ex() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe {
                    real(ctx, port, index, entry, flags, entry_size)
                },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        if entry.is_null() || flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
            return c_int::fail(libc::EINVAL);
        }
        match our_gid(port, index.into()) {
            Ok(g) => {
                // SAFETY: caller's out-parameter of at least sizeof(ibv_gid_entry) bytes.
                unsafe { entry.write(gid_entry(g)) };
                0
            }
            Err(e) => c_int::fail(e),
        }
    })
}

/// Returns the number of entries written, or a negative errno.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    ffi_boundary!("ibv_query_gid_table", on_panic = -(libc::EIO as isize), {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::_ibv_query_gid_table() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe {
                    real(ctx, entries, max_entries, flags, entry_size)
                },
                _ => -(libc::EINVAL as isize),
            };
        }
        if entries.is_null() || flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
            return -(libc::EINVAL as isize);
        }
        if max_entries < device::GID_TABLE_LEN as usize {
            return -(libc::EINVAL as isize);
        }
        match our_gid(device::PORT_NUM.into(), 0) {
            Ok(g) => {
                // SAFETY: the caller's array holds at least one entry of `entry_size` bytes.
                unsafe { entries.write(gid_entry(g)) };
                1
            }
            Err(e) => -(e as isize),
        }
    })
}

/// Returns 0, or -1 with errno set (ibv_query_pkey(3)). The one P_Key is the default 0xffff.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    ffi_boundary!("ibv_query_pkey", on_panic = -1, {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_query_pkey() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port, index, pkey) },
                _ => -1,
            };
        }
        if pkey.is_null() || port != device::PORT_NUM || index != 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: caller's out-parameter (__be16), checked non-NULL.
        unsafe { *pkey = device::DEFAULT_PKEY.to_be() };
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_get_pkey_index(ctx: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    ffi_boundary!("ibv_get_pkey_index", on_panic = -1, {
        if !ContextShell::is_ours(ctx) {
            return match passthrough::ibv_get_pkey_index() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port, pkey) },
                _ => -1,
            };
        }
        if port == device::PORT_NUM && u16::from_be(pkey) == device::DEFAULT_PKEY {
            0
        } else {
            set_errno(libc::EINVAL);
            -1
        }
    })
}

/// Blocks until an asynchronous event (unless `async_fd` is non-blocking); 0, or -1. The wait
/// is a cancellation point, as rdma-core's `read()` (see `boundary`).
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    blocking(
        "ibv_get_async_event",
        || -1,
        |_| {
            // SAFETY: ContextShell::from_raw checks ownership first.
            let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
                return match passthrough::ibv_get_async_event() {
                    Some(real) if !ctx.is_null() => Attempt::Outside(Box::new(move || {
                        // SAFETY: not ours, so the real library's context.
                        unsafe { real(ctx, event) }
                    })),
                    _ => Attempt::Done(-1),
                };
            };
            if event.is_null() {
                set_errno(libc::EINVAL);
                return Attempt::Done(-1);
            }
            let context = &shell.inner;
            let ev = match context.try_next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) if context.async_events_nonblocking() => {
                    set_errno(libc::EAGAIN);
                    return Attempt::Done(-1);
                }
                Ok(None) => {
                    return Attempt::Wait {
                        fds: [context.async_fd(), -1],
                        count: 1,
                        timeout_ms: -1,
                    };
                }
                Err(e) => {
                    set_errno(e.errno());
                    return Attempt::Done(-1);
                }
            };
            let mut out = ibv_async_event {
                event_type: ibv_event_type(ev.event_type),
                ..Default::default()
            };
            match EventElement::of(ev.event_type) {
                EventElement::Cq => out.element.cq = ev.element as *mut ibv_cq,
                EventElement::Qp => out.element.qp = ev.element as *mut ibv_qp,
                EventElement::Srq => out.element.srq = ev.element as *mut ibv_srq,
                EventElement::Wq => out.element.wq = ev.element as *mut ibv_wq,
                EventElement::Port => out.element.port_num = ev.element as c_int,
            }
            // SAFETY: caller's out-parameter, checked non-NULL.
            unsafe { event.write(out) };
            Attempt::Done(0)
        },
    )
}

/// Acknowledges an event `ibv_get_async_event` returned: destroying the object it names waits
/// for this (as in rdma-core). Events about the real library's objects go to it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    ffi_boundary!("ibv_ack_async_event", {
        if event.is_null() {
            return;
        }
        // SAFETY: the caller's event, filled by ibv_get_async_event.
        let ev = unsafe { &*event };
        // The handle and the `context` field of the union member the event type uses.
        macro_rules! object {
            ($member:ident) => {
                (
                    ev.element.$member as usize,
                    ev.element.$member.as_ref().map(|o| o.context),
                )
            };
        }
        // SAFETY: reading the union member that matches the event type; the object is alive
        // (its destroy waits for this acknowledgement).
        let (element, context) = unsafe {
            match EventElement::of(ev.event_type.0) {
                EventElement::Cq => object!(cq),
                EventElement::Qp => object!(qp),
                EventElement::Srq => object!(srq),
                EventElement::Wq => object!(wq),
                EventElement::Port => return,
            }
        };
        let Some(context) = context else { return };
        // SAFETY: `context` is the object's own context field.
        match unsafe { ContextShell::from_raw(context) } {
            Some(ours) => ours.inner.ack_event(ev.event_type.0, element),
            None => {
                if let Some(real) = passthrough::ibv_ack_async_event() {
                    // SAFETY: an event about an object of the real library.
                    unsafe { real(event) };
                }
            }
        }
    })
}
