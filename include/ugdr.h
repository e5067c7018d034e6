/*
 * ugdr.h - the ugdr_* API: a small verbs-like interface, carried by libugdr.so over the same
 * engine (UCX) as its ibv_* functions.
 *
 *   cc app.c $(pkg-config --cflags --libs ugdr)    (see README.md, "The ugdr_* C API")
 *
 * Return convention (as libibverbs):
 *   - functions returning a pointer return NULL with errno set on failure;
 *   - functions returning int return 0, or a positive errno value (errno is set too);
 *   - ugdr_poll_cq returns the number of completions (>= 0), or a negative errno value;
 *   - ugdr_post_send/ugdr_post_recv set *bad_wr to the first WR that could not be posted;
 *     the WRs before it stay posted;
 *   - ugdr_modify_qp is all or nothing: on failure the QP is unchanged;
 *   - out-parameters are written only on success.
 *
 * Deviations from the seed specification (ugdr-api-spec.txt), each because the spec's text
 * cannot compile or cannot work as written:
 *   1. `#define UGDR_DEVICE_NAME_MAX 64` and `#define UGDR_MAX_GPUS_PER_DEV 16` (the spec's
 *      `= ` is a typo); every struct and enum definition ends with `;`.
 *   2. `enum ugdr_access_flags` (spec: `ugdr_accsee_flags`), with UGDR_ACCESS_REMOTE_WRITE and
 *      UGDR_ACCESS_REMOTE_READ added; ugdr_reg_mr takes it as `int access` (the spec's
 *      `enum ibv_access_flags` would need <infiniband/verbs.h>).
 *   3. Types written as C needs them: `struct ugdr_cq *` (spec: `ugdr_cq*`), `uint32_t`
 *      (spec: `uint32`); the caps struct of ugdr_qp_init_attr stays anonymous, so
 *      attr.max_send_wr, attr.max_recv_wr and attr.max_sge work (C11; in C++ an extension
 *      that g++ and clang++ accept, marked __extension__ for -Wpedantic). `enum ugdr_qp_type
 *      { UGDR_QPT_RC }` names the value of `int qp_type`.
 *   4. struct ugdr_wc names its enum fields: `enum ugdr_wc_status status; enum ugdr_wc_opcode
 *      opcode;` (spec: unnamed), with `enum ugdr_wc_opcode` added and ugdr_wc_status extended
 *      (LOC_PROT, WR_FLUSH, REM_ACCESS, GENERAL).
 *   5. struct ugdr_send_wr gains `struct ugdr_send_wr *next;` after wr_id (the spec's bad_wr
 *      implies lists; ugdr_recv_wr already has next).
 *   6. struct ugdr_mr is public with the spec's commented-out fields; the other objects are
 *      opaque.
 *   7. Addressing, which the spec leaves out: struct ugdr_addr (UGDR_ADDR_LEN opaque bytes, to
 *      copy over any out-of-band channel), ugdr_query_addr(), ugdr_qp_num(), `struct
 *      ugdr_addr dest_addr` in struct ugdr_qp_attr after dest_qp_num, and enum
 *      ugdr_qp_attr_mask.
 *   8. ugdr_close_device takes the struct ugdr_context * to close (the spec passes the
 *      device, which cannot say which of its open contexts to close), and
 *      ugdr_free_device_list() frees what ugdr_get_device_list() returned.
 *   9. RDMA WRITE and READ work (the spec: "not yet"), and num_sge/max_sge may exceed 1.
 *
 * Beyond the spec:
 *   - ugdr_get_device_list() returns one device per NUMA node of the host, named "ugdr<node>",
 *     each listing in gpus[] the NVIDIA GPUs (PCI vendor 0x10de, display class) attached to
 *     that node, numbered in PCI bus order (as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them);
 *     num_gpu = 0 where there are none. A GPU whose node the kernel does not know is listed
 *     on the first device. UGDR_SYSFS_ROOT replaces /sys. All devices reach the same port:
 *     one address per process.
 *   - ugdr_reg_mr fails with EOPNOTSUPP on GPU memory (when libcuda.so.1 is present it is
 *     asked), and with EFAULT on memory that is not mapped (or not writable when the access
 *     flags let ugdr write it); it never touches the memory to decide.
 */
#ifndef UGDR_H
#define UGDR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define UGDR_DEVICE_NAME_MAX 64
#define UGDR_MAX_GPUS_PER_DEV 16
#define UGDR_ADDR_LEN 32

/* ------------------------------------------------------------------ control */

struct ugdr_device {
	char name[UGDR_DEVICE_NAME_MAX];
	int numa_node;
	int num_gpu;
	int gpus[UGDR_MAX_GPUS_PER_DEV];
};

struct ugdr_context;
struct ugdr_pd;
struct ugdr_cq;
struct ugdr_qp;

struct ugdr_mr {
	struct ugdr_context *context;
	struct ugdr_pd *pd;
	void *addr;
	size_t length;
	uint32_t handle;
	uint32_t lkey;
	uint32_t rkey;
};

enum ugdr_access_flags {
	UGDR_ACCESS_LOCAL_WRITE = 1,
	UGDR_ACCESS_REMOTE_WRITE = (1 << 1), /* needs UGDR_ACCESS_LOCAL_WRITE too */
	UGDR_ACCESS_REMOTE_READ = (1 << 2)
};

/* A process's address: opaque bytes, valid for the life of the process. */
struct ugdr_addr {
	uint8_t raw[UGDR_ADDR_LEN];
};

enum ugdr_qp_type {
	UGDR_QPT_RC
};

struct ugdr_qp_init_attr {
	void *qp_context;
	struct ugdr_cq *send_cq;
	struct ugdr_cq *recv_cq;
#if defined(__cplusplus) && defined(__GNUC__)
	__extension__ /* anonymous structs are standard C11, an extension in C++ */
#endif
	struct {
		uint32_t max_send_wr;
		uint32_t max_recv_wr;
		uint32_t max_sge; /* per send and per receive WR */
	};
	int qp_type;    /* UGDR_QPT_RC */
	int sq_sig_all; /* nonzero: every send WR completes with a ugdr_wc */
};

enum ugdr_qp_state {
	UGDR_QPS_RESET,
	UGDR_QPS_INIT,
	UGDR_QPS_RTR,
	UGDR_QPS_RTS,
	UGDR_QPS_ERR
};

/*
 * Transitions (anything else is EINVAL and changes nothing):
 *   RESET -> INIT  UGDR_QP_STATE
 *   INIT  -> RTR   UGDR_QP_STATE | UGDR_QP_DEST_QPN | UGDR_QP_DEST_ADDR
 *   RTR   -> RTS   UGDR_QP_STATE
 *   any   -> ERR   UGDR_QP_STATE (outstanding WRs complete with UGDR_WC_WR_FLUSH_ERR)
 * UGDR_QP_CUR_STATE may be added to any of them; cur_qp_state must then be the QP's state.
 */
enum ugdr_qp_attr_mask {
	UGDR_QP_STATE = 1,
	UGDR_QP_CUR_STATE = 2,
	UGDR_QP_DEST_QPN = 4,
	UGDR_QP_DEST_ADDR = 8
};

struct ugdr_qp_attr {
	enum ugdr_qp_state qp_state;
	enum ugdr_qp_state cur_qp_state;
	uint32_t dest_qp_num;       /* the peer's ugdr_qp_num() */
	struct ugdr_addr dest_addr; /* the peer's ugdr_query_addr() */
};

enum ugdr_wc_status {
	UGDR_WC_SUCCESS = 0,
	UGDR_WC_LOC_LEN_ERR,    /* a message longer than the receive buffers */
	UGDR_WC_LOC_PROT_ERR,   /* an lkey, PD or local access check failed */
	UGDR_WC_WR_FLUSH_ERR,   /* the QP went to ERR before the WR finished */
	UGDR_WC_REM_ACCESS_ERR, /* the peer refused an RDMA access (rkey, range, access) */
	UGDR_WC_GENERAL_ERR     /* anything else (peer gone, peer's receive failed, ...) */
};

enum ugdr_wc_opcode {
	UGDR_WC_SEND,
	UGDR_WC_RDMA_WRITE,
	UGDR_WC_RDMA_READ,
	UGDR_WC_RECV
};

struct ugdr_wc {
	uint64_t wr_id;
	enum ugdr_wc_status status;
	enum ugdr_wc_opcode opcode;
	uint32_t byte_len; /* bytes received, read or sent; 0 unless status is SUCCESS */
	uint32_t qp_num;   /* the local QP */
};

struct ugdr_device **ugdr_get_device_list(int *num_devices);
void ugdr_free_device_list(struct ugdr_device **list);
struct ugdr_context *ugdr_open_device(struct ugdr_device *device);
int ugdr_close_device(struct ugdr_context *ctx);
int ugdr_query_addr(struct ugdr_context *ctx, struct ugdr_addr *addr_out);
struct ugdr_pd *ugdr_alloc_pd(struct ugdr_context *ctx);
struct ugdr_mr *ugdr_reg_mr(struct ugdr_pd *pd, void *addr, size_t length, int access);
struct ugdr_cq *ugdr_create_cq(struct ugdr_context *ctx, int cqe);
struct ugdr_qp *ugdr_create_qp(struct ugdr_pd *pd, struct ugdr_qp_init_attr *init_attr);
uint32_t ugdr_qp_num(const struct ugdr_qp *qp);
int ugdr_modify_qp(struct ugdr_qp *qp, struct ugdr_qp_attr *attr, int attr_mask);
int ugdr_destroy_qp(struct ugdr_qp *qp);
int ugdr_destroy_cq(struct ugdr_cq *cq);
int ugdr_dereg_mr(struct ugdr_mr *mr);
int ugdr_dealloc_pd(struct ugdr_pd *pd);
int ugdr_poll_cq(struct ugdr_cq *cq, int num_entries, struct ugdr_wc *wc);

/* ------------------------------------------------------------------ data */

enum ugdr_wr_opcode {
	UGDR_WR_SEND,
	UGDR_WR_RDMA_WRITE, /* rdma.remote_addr/rkey: a peer MR with UGDR_ACCESS_REMOTE_WRITE */
	UGDR_WR_RDMA_READ   /* rdma.remote_addr/rkey: a peer MR with UGDR_ACCESS_REMOTE_READ */
};

struct ugdr_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

enum ugdr_send_flags {
	UGDR_SEND_SIGNALED = 1,
	UGDR_SEND_INLINE = (1 << 1) /* SEND and RDMA WRITE, up to 1024 bytes; lkeys unused */
};

struct ugdr_recv_wr {
	uint64_t wr_id;
	struct ugdr_recv_wr *next;
	struct ugdr_sge *sg_list;
	int num_sge;
};

struct ugdr_send_wr {
	uint64_t wr_id;
	struct ugdr_send_wr *next;
	struct ugdr_sge *sg_list;
	int num_sge;
	enum ugdr_wr_opcode opcode;
	uint32_t send_flags;
	struct {
		uint64_t remote_addr;
		uint32_t rkey;
	} rdma;
};

int ugdr_post_recv(struct ugdr_qp *qp, struct ugdr_recv_wr *wr, struct ugdr_recv_wr **bad_wr);
int ugdr_post_send(struct ugdr_qp *qp, struct ugdr_send_wr *wr, struct ugdr_send_wr **bad_wr);

#ifdef __cplusplus
}
#endif

#endif /* UGDR_H */
