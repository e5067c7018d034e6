/* A stranger for tests/auth.rs: a plain UCX program (libucp, no verbs, no ugdr) that knows a
 * ugdr process's worker address and speaks ugdr's wire format (src/engine/wire.rs: active
 * message 0x4755, a 44-byte little-endian header), but not the user's secret.
 *
 *   ucx_stranger ADDRESS_HEX DST_QPN SRC_QPN SRC_LID RADDR RKEY
 *       connects to the worker and sends, as the QP SRC_QPN of port SRC_LID would, an RDMA
 *       WRITE of 64 bytes of 0xee to RADDR under RKEY (sequence 0) and a SEND of 32 bytes
 *       (sequence 1) to QP DST_QPN, three times: with the bare header; with 8 random bytes
 *       after it (a guessed token); and after a forged hello (ugdr's hello layout with a
 *       random MAC), with the token that hello names. Waits until UCX has delivered all of
 *       it (ep flush), prints "sent N messages" and exits 0; exits 1 on a UCX error. */
#include <ucp/api/ucp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#define AM_ID 0x4755
#define HEADER_LEN 44
#define TOKEN_LEN 8
#define HELLO_LEN (4 + 16 + 16 + 32)

static ucp_worker_h worker;

static void die(const char *what, ucs_status_t s)
{
	printf("%s: %s\n", what, ucs_status_string(s));
	exit(1);
}

static void wait_for(void *req, const char *what)
{
	if (req == NULL)
		return;
	if (UCS_PTR_IS_ERR(req))
		die(what, UCS_PTR_STATUS(req));
	ucs_status_t s;
	while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS)
		ucp_worker_progress(worker);
	ucp_request_free(req);
	if (s != UCS_OK)
		die(what, s);
}

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

/* A ugdr header (src/engine/wire.rs) for opcode `op` (1 SEND, 3 WRITE). */
static void header(uint8_t *h, uint8_t op, uint32_t dst, uint32_t src, uint16_t lid,
		   uint32_t seq, uint64_t raddr, uint32_t rkey, uint32_t len)
{
	memset(h, 0, HEADER_LEN);
	h[0] = 1; /* version */
	h[1] = op;
	put32(h + 4, dst);
	put32(h + 8, src);
	h[12] = (uint8_t)lid;
	h[13] = (uint8_t)(lid >> 8);
	put32(h + 16, seq);
	put32(h + 24, (uint32_t)raddr);
	put32(h + 28, (uint32_t)(raddr >> 32));
	put32(h + 32, rkey);
	put32(h + 36, len);
}

static int sent;

static void send_am(ucp_ep_h ep, const uint8_t *hdr, size_t hdr_len, const void *data, size_t len)
{
	ucp_request_param_t p = { .op_attr_mask = 0 };
	wait_for(ucp_am_send_nbx(ep, AM_ID, hdr, hdr_len, data, len, &p), "am_send");
	sent++;
}

/* A WRITE (seq 0) and a SEND (seq 1), with `trailer` (if any) after each header. */
static void attack(ucp_ep_h ep, const uint8_t *trailer, uint32_t dst, uint32_t src, uint16_t lid,
		   uint64_t raddr, uint32_t rkey)
{
	static uint8_t payload[64];
	memset(payload, 0xee, sizeof payload);
	uint8_t h[HEADER_LEN + TOKEN_LEN];
	size_t hl = HEADER_LEN + (trailer ? TOKEN_LEN : 0);
	header(h, 3, dst, src, lid, 0, raddr, rkey, 64);
	if (trailer)
		memcpy(h + HEADER_LEN, trailer, TOKEN_LEN);
	send_am(ep, h, hl, payload, 64);
	header(h, 1, dst, src, lid, 1, 0, 0, 32);
	if (trailer)
		memcpy(h + HEADER_LEN, trailer, TOKEN_LEN);
	send_am(ep, h, hl, payload, 32);
}

static int unhex(const char *s, uint8_t *out, size_t max)
{
	size_t n = strlen(s);
	if (n % 2 || n / 2 > max)
		return -1;
	for (size_t i = 0; i < n / 2; i++) {
		unsigned v;
		if (sscanf(s + 2 * i, "%2x", &v) != 1)
			return -1;
		out[i] = (uint8_t)v;
	}
	return (int)(n / 2);
}

int main(int argc, char **argv)
{
	if (argc != 7) {
		fprintf(stderr, "usage: ucx_stranger ADDRESS_HEX DST_QPN SRC_QPN SRC_LID RADDR RKEY\n");
		return 2;
	}
	static uint8_t address[8192];
	if (unhex(argv[1], address, sizeof address) <= 0) {
		printf("bad address\n");
		return 2;
	}
	uint32_t dst = strtoul(argv[2], NULL, 0), src = strtoul(argv[3], NULL, 0);
	uint16_t lid = (uint16_t)strtoul(argv[4], NULL, 0);
	uint64_t raddr = strtoull(argv[5], NULL, 0);
	uint32_t rkey = strtoul(argv[6], NULL, 0);

	ucp_config_t *config;
	ucs_status_t s = ucp_config_read(NULL, NULL, &config);
	if (s != UCS_OK)
		die("config", s);
	ucp_params_t params = { .field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM };
	ucp_context_h context;
	s = ucp_init(&params, config, &context);
	ucp_config_release(config);
	if (s != UCS_OK)
		die("ucp_init", s);
	ucp_worker_params_t wp = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
				   .thread_mode = UCS_THREAD_MODE_SINGLE };
	if ((s = ucp_worker_create(context, &wp, &worker)) != UCS_OK)
		die("worker", s);
	ucp_ep_params_t ep_params = { .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
				      .address = (const ucp_address_t *)address };
	ucp_ep_h ep;
	if ((s = ucp_ep_create(worker, &ep_params, &ep)) != UCS_OK)
		die("ep_create", s);

	/* The bare header, then a guessed token. */
	attack(ep, NULL, dst, src, lid, raddr, rkey);
	uint8_t token[TOKEN_LEN];
	if (getrandom(token, sizeof token, 0) != sizeof token)
		return 1;
	attack(ep, token, dst, src, lid, raddr, rkey);

	/* A hello in ugdr's layout (magic, GID naming SRC_LID, nonce, MAC) with a made-up MAC. */
	uint8_t hello[HELLO_LEN + TOKEN_LEN];
	if (getrandom(hello, sizeof hello, 0) != sizeof hello)
		return 1;
	memcpy(hello, "UGA1", 4);
	memset(hello + 4, 0, 16);
	hello[4] = 0xfe;
	hello[5] = 0x80;
	hello[12] = 0x02;
	hello[13] = 0x55;
	hello[14] = (uint8_t)(lid >> 8);
	hello[15] = (uint8_t)lid;
	send_am(ep, hello, sizeof hello, NULL, 0);
	attack(ep, hello + HELLO_LEN, dst, src, lid, raddr, rkey);

	ucp_request_param_t fp = { .op_attr_mask = 0 };
	wait_for(ucp_ep_flush_nbx(ep, &fp), "flush");
	printf("sent %d messages\n", sent);
	fflush(stdout);
	ucp_request_param_t cp = { .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
				   .flags = UCP_EP_CLOSE_FLAG_FORCE };
	void *req = ucp_ep_close_nbx(ep, &cp);
	if (req && !UCS_PTR_IS_ERR(req)) {
		while (ucp_request_check_status(req) == UCS_INPROGRESS)
			ucp_worker_progress(worker);
		ucp_request_free(req);
	}
	ucp_worker_destroy(worker);
	ucp_cleanup(context);
	return 0;
}
