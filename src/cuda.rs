//! Asking the CUDA driver whether an address is GPU memory, so `ugdr_reg_mr` can refuse a
//! device pointer cleanly (EOPNOTSUPP) instead of handing it to a host-only transport.
//!
//! The driver (`libcuda.so.1`, or `UGDR_CUDA_LIBRARY`, which tests point at a stand-in) is
//! loaded on the first question and kept. Without it no address is GPU memory: a process
//! cannot hold a device pointer without the driver loaded. The driver is asked with
//! `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`, which works without a current
//! context (unified addressing); `cuInit(0)` first, which is idempotent.

use std::os::raw::{c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `CUresult CUDAAPI cuInit(unsigned int Flags)`.
type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
/// `CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
/// CUdeviceptr ptr)`; `CUdeviceptr` is `unsigned long long` (the `_v2` ABI).
type CuPointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;

const CUDA_SUCCESS: c_int = 0;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `CUmemorytype`.
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMORYTYPE_ARRAY: c_uint = 3;

struct Driver {
    _library: libloading::Library,
    pointer_get_attribute: CuPointerGetAttribute,
}

fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref()
}

fn load() -> Option<Driver> {
    let name = std::env::var_os("UGDR_CUDA_LIBRARY").unwrap_or_else(|| "libcuda.so.1".into());
    // SAFETY: loading the CUDA driver runs its constructors, as in any CUDA program.
    let library = match unsafe { libloading::Library::new(&name) } {
        Ok(l) => l,
        Err(e) => {
            tracing::debug!(
                "cuda: {} not loaded ({e}): no GPU memory to detect",
                name.to_string_lossy()
            );
            return None;
        }
    };
    // SAFETY: the symbols have the C signatures declared above (cuda.h).
    let init: CuInit = *unsafe { library.get::<CuInit>(b"cuInit\0") }.ok()?;
    // SAFETY: as above.
    let pointer_get_attribute: CuPointerGetAttribute =
        *unsafe { library.get::<CuPointerGetAttribute>(b"cuPointerGetAttribute\0") }.ok()?;
    // SAFETY: cuInit takes flags (must be 0) and may be called any number of times.
    let status = unsafe { init(0) };
    if status != CUDA_SUCCESS {
        tracing::debug!("cuda: cuInit failed ({status}): no GPU memory to detect");
        return None;
    }
    Some(Driver {
        _library: library,
        pointer_get_attribute,
    })
}

/// True when the CUDA driver says `addr` is device (or array) memory.
pub fn is_device_memory(addr: u64) -> bool {
    let Some(d) = driver() else {
        return false;
    };
    let mut kind: c_uint = 0;
    // SAFETY: `kind` is a valid out-parameter of the size the MEMORY_TYPE attribute writes
    // (a CUmemorytype, 4 bytes); the driver only looks the address up, it does not access it.
    let status = unsafe {
        (d.pointer_get_attribute)(
            (&mut kind as *mut c_uint).cast(),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    status == CUDA_SUCCESS && matches!(kind, CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_ARRAY)
}
