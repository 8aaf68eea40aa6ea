/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * QUIC-LB routing in the tc and xdp programs (draft-ietf-quic-load-balancers; `quic_lb`): the
 * backend a QUIC datagram's destination connection ID names, for listeners with
 * FANOUT_LISTENER_QUIC. The ID is found as Sources/ReusePortLB/QUICLB.swift's QUICHeader finds it
 * (a long header gives its length; a short header's is the configuration's, chosen by the ID's
 * first octet), its server ID read in plaintext, decrypted with one AES-128 block (16 octets of
 * server ID and nonce), or through the four-pass Feistel network, each pass an AES-128 encryption
 * by the kernel's crypto kfuncs (fanout_quic_keys.h). The server ID is looked up among the
 * set's backends (FANOUT_MAP_QUIC_IDS).
 *
 * The caller's decision then sends the datagram there (a nat listener's client is associated
 * with that backend), or by the listener's policy for every other outcome; the outcome is counted
 * where the program finishes the datagram (an xdp program that passes it to tc leaves the count
 * to tc).
 *
 * Two builds of each program: with the crypto kfuncs (fanout_quic_keys.h: a map of kernel crypto
 * contexts, a kptr whose type only kernels 6.10+ know, so the map cannot even be made on older
 * ones), and without (FANOUT_NO_QUIC_CRYPTO: bpf/tc_fanout_plain.bpf.c, xdp_fanout_plain.bpf.c),
 * loaded where the kernel lacks them: plaintext server IDs only.
 *
 * Reads the packet through hook_load_bytes (the program's: bpf_skb_load_bytes or
 * bpf_xdp_load_bytes) into a per-CPU scratch area, so the decision's stack stays as it was.
 * Include after FANOUT_CTX is defined (fanout_decide.h does).
 */
#ifndef FANOUT_QUIC_H
#define FANOUT_QUIC_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"

#ifndef FANOUT_CTX
#error "define FANOUT_CTX before including fanout_quic.h"
#endif

#define QUIC_VERSION_1 0x00000001u
#define QUIC_VERSION_2 0x6b3343cfu
/* The longest connection ID read: a first octet and at most 19 of server ID and nonce. */
#define QUIC_ID_MAX 20

/* Per CPU: what the decision reads and works on, off the stack (the tc decision leaves about
 * 160 bytes of the 512 to this step, xdp's less): the first octets of the datagram, the connection ID, the
 * Feistel halves, the cipher's block, and the server ID found (the key of
 * FANOUT_MAP_QUIC_IDS). */
struct fanout_quic_scratch {
	__u8 head[8];
	__u8 id[32];
	__u8 halves[32]; /* the Feistel halves: left at 0, right at 16 */
	__u8 block[16];  /* the cipher's, in place */
	struct fanout_quic_id_key key;
	__u32 length;           /* octets of server ID and nonce */
	__u32 server_id_length;
	__u32 half;             /* octets of a Feistel half */
	__u32 offset;           /* of the connection ID in the packet */
	__u32 client_chosen;    /* an Initial's or 0-RTT's ID, or of another version */
	__u32 set;              /* map keys: the set key, the key slot */
	__u32 slot;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_quic_scratch);
} fanout_quicx SEC(".maps");

static __always_inline long hook_load_bytes(FANOUT_CTX *ctx, __u32 offset, void *to, __u32 length);

/* With an odd length the left half keeps the middle octet's high nibble, the right its low one. */
static __always_inline void quic_clear(struct fanout_quic_scratch *s)
{
	if (s->length & 1) {
		s->halves[(s->half - 1) & 15] &= 0xf0;
		s->halves[16] &= 0x0f;
	}
}

#ifndef FANOUT_NO_QUIC_CRYPTO
/* Decrypts the connection ID in s->id (its first octet, then s->length octets of server ID and
 * nonce) in place with `key`: one AES-128 block when they are 16 octets, else the four-pass
 * Feistel network (each pass: the other half ^= AES(this half zero-padded, the length at octet
 * 14, the pass at 15)), three passes only when the server ID lies in the left half (the nonce is
 * then left as it was). 0, or < 0 when the kernel refused.
 *
 * Its state is in the scratch area and the cipher works in place on s->block: the decisions of tc
 * and xdp leave little of the 512 bytes of stack to this step (fanout_quic_decrypt). */
static __always_inline int quic_decrypt(struct bpf_crypto_ctx *key, struct fanout_quic_scratch *s)
{
	struct bpf_dynptr block, iv;
	if (!key || !s)
		return -1;
	bpf_dynptr_from_mem(s->block, sizeof(s->block), 0, &block);
	/* ecb(aes) takes no IV: an empty one (the kfunc wants a dynptr). */
	bpf_dynptr_from_mem(s->block, 0, 0, &iv);
	__u32 length = s->length;
	if (length == 16) {
		__builtin_memcpy(s->block, s->id + 1, 16);
		if (bpf_crypto_decrypt(key, &block, &block, &iv) < 0)
			return -1;
		__builtin_memcpy(s->id + 1, s->block, 16);
		return 0;
	}
	__u32 half = (length + 1) / 2;
	if (half < 3 || half > 10)
		return -1;
	s->half = half;
#pragma clang loop unroll(disable)
	for (int i = 0; i < 16; i++) {
		s->halves[i] = i < half ? s->id[(1 + i) & 31] : 0;
		s->halves[16 + i] = i < half ? s->id[(1 + length - half + i) & 31] : 0;
	}
	quic_clear(s);
#pragma clang loop unroll(disable)
	for (__u32 pass = 4; pass >= 1; pass--) {
		if (pass == 1 && s->server_id_length <= s->length / 2)
			break;
		/* Passes 4 and 2 read the right half into the left; 3 and 1 the left into the right. */
		__u32 from = pass & 1 ? 0 : 16;
#pragma clang loop unroll(disable)
		for (int i = 0; i < 16; i++)
			s->block[i] = i < s->half ? s->halves[(from + i) & 31] : 0;
		s->block[14] = s->length;
		s->block[15] = pass;
		if (bpf_crypto_encrypt(key, &block, &block, &iv) < 0)
			return -1;
#pragma clang loop unroll(disable)
		for (int i = 0; i < 10; i++)
			if (i < s->half)
				s->halves[(16 - from + i) & 31] ^= s->block[i];
		quic_clear(s);
	}
	half = s->half;
	__u32 odd = s->length & 1;
	/* The plaintext back: left, then right (with an odd length their shared middle octet once). */
#pragma clang loop unroll(disable)
	for (int i = 0; i < 10; i++)
		if (i < half)
			s->id[(1 + i) & 31] = s->halves[i];
	if (odd)
		s->id[half & 31] = s->halves[(half - 1) & 15] | s->halves[16];
#pragma clang loop unroll(disable)
	for (int i = 0; i < 10; i++)
		if (i + odd < half)
			s->id[(1 + half + i) & 31] = s->halves[16 + ((i + odd) & 15)];
	return 0;
}

#endif /* FANOUT_NO_QUIC_CRYPTO */

/* The connection ID's offset in the packet into s->offset and whether the client chose it into
 * s->client_chosen (Initial and 0-RTT of QUIC v1 and v2, long headers of other versions), its
 * first octet into s->head[6]; the outcome when it cannot be read, else FANOUT_QUIC_ROUTED (go
 * on). */
static __always_inline int quic_find_id(FANOUT_CTX *ctx, struct fanout_quic_scratch *s, __u32 payload)
{
	s->client_chosen = 0;
	if (hook_load_bytes(ctx, payload, s->head, 2) < 0)
		return FANOUT_QUIC_UNDECODABLE;
	if (!(s->head[0] & 0x80)) {
		/* A short header: the ID follows at once, its length is its configuration's. */
		s->head[6] = s->head[1];
		s->offset = payload + 1;
		return FANOUT_QUIC_ROUTED;
	}
	if (hook_load_bytes(ctx, payload, s->head, 7) < 0)
		return FANOUT_QUIC_UNDECODABLE;
	__u32 version = ((__u32)s->head[1] << 24) | ((__u32)s->head[2] << 16) | ((__u32)s->head[3] << 8) | s->head[4];
	if (version == 0 || s->head[5] == 0) /* version negotiation, or no ID */
		return FANOUT_QUIC_UNDECODABLE;
	__u32 type = (s->head[0] >> 4) & 3;
	if (version == QUIC_VERSION_1)
		s->client_chosen = type == 0 || type == 1;
	else if (version == QUIC_VERSION_2)
		s->client_chosen = type == 1 || type == 2;
	else
		s->client_chosen = 1;
	s->offset = payload + 6;
	return FANOUT_QUIC_ROUTED;
}

/* The outcome once s->key.server_id holds the server ID (zero-padded): FANOUT_QUIC_ROUTED with
 * the backend of the set at s->set that owns it in `chosen`. */
static __always_inline int quic_owner(struct fanout_quic_scratch *s, struct fanout_backend *chosen)
{
	s->key.set = s->set;
	__u32 *index = bpf_map_lookup_elem(&FANOUT_MAP_QUIC_IDS, &s->key);
	struct fanout_set *backends = bpf_map_lookup_elem(&FANOUT_MAP_SETS, &s->set);
	if (!index || !backends || *index >= backends->count || *index >= FANOUT_MAX_BACKENDS)
		return s->client_chosen ? FANOUT_QUIC_FALLBACK : FANOUT_QUIC_UNKNOWN_SERVER_ID;
	*chosen = backends->backends[*index & (FANOUT_MAX_BACKENDS - 1)];
	return FANOUT_QUIC_ROUTED;
}

/* The server ID of s->id's plaintext (after its first octet) into s->key.server_id, zero-padded. */
static __always_inline void quic_server_id(struct fanout_quic_scratch *s)
{
#pragma clang loop unroll(disable)
	for (int i = 0; i < 16; i++)
		s->key.server_id[i] = i < s->server_id_length ? s->id[(1 + i) & 31] : 0;
}

/* The outcome for a quic_lb listener's datagram; FANOUT_QUIC_ROUTED with the backend its
 * connection ID names in `chosen` (from the set at `set`, id * 2 + generation), or
 * FANOUT_QUIC_ENCRYPTED: the ID is read into the scratch area and fanout_quic_decrypt goes on
 * (called by the decision, not from here: each of the two takes its stack next to the
 * decision's, not on top of the other's). Verified once (a global function); its pointer
 * arguments are checked as the verifier requires. Its state is in the scratch area. */
__noinline int fanout_quic_route(FANOUT_CTX *ctx, struct packet *p, __u32 set, struct fanout_backend *chosen)
{
	if (!ctx || !p || !chosen || set >= FANOUT_MAX_LISTENERS * 2 || !p->has_udp)
		return FANOUT_QUIC_UNDECODABLE;
	__u32 zero = 0;
	struct fanout_quic_scratch *s = bpf_map_lookup_elem(&fanout_quicx, &zero);
	if (!s)
		return FANOUT_QUIC_UNDECODABLE;
	s->set = set;
	struct fanout_quic_configs *configs = bpf_map_lookup_elem(&FANOUT_MAP_QUIC_CONFIGS, &s->set);
	if (!configs)
		return FANOUT_QUIC_UNDECODABLE;
	int found = quic_find_id(ctx, s, p->l4 + 8);
	if (found != FANOUT_QUIC_ROUTED)
		return found;
	/* The ID's first octet: its config ID in the top three bits. A long header's ID must be at
	 * least as long as its configuration says (a short header's is taken to be). */
	__u32 config_id = (s->head[6] >> 5) & 7;
	struct fanout_quic_config *config = &configs->configs[config_id];
	s->server_id_length = config->server_id_length;
	s->length = config->server_id_length + config->nonce_length;
	s->slot = s->set * FANOUT_QUIC_CONFIGS + config_id;
	__u32 read = 1 + s->length;
	if (!s->server_id_length || s->server_id_length > 15 || read < 6 || read > QUIC_ID_MAX ||
	    ((s->head[0] & 0x80) && s->head[5] < read) || hook_load_bytes(ctx, s->offset, s->id, read) < 0)
		return s->client_chosen ? FANOUT_QUIC_FALLBACK : FANOUT_QUIC_UNDECODABLE;
	if (config->cipher != FANOUT_QUIC_PLAINTEXT) {
#ifdef FANOUT_NO_QUIC_CRYPTO
		/* This program has no crypto (the kernel has no BPF crypto kfuncs): userspace refuses
		 * an encrypted configuration here, so none is written. */
		return s->client_chosen ? FANOUT_QUIC_FALLBACK : FANOUT_QUIC_UNDECODABLE;
#else
		return FANOUT_QUIC_ENCRYPTED;
#endif
	}
	quic_server_id(s);
	return quic_owner(s, chosen);
}

#ifndef FANOUT_NO_QUIC_CRYPTO
/* fanout_quic_route's FANOUT_QUIC_ENCRYPTED: the ID in the scratch area decrypted with its
 * configuration's key, and its outcome as fanout_quic_route's. A global function too. */
__noinline int fanout_quic_decrypt(struct fanout_backend *chosen)
{
	if (!chosen)
		return FANOUT_QUIC_UNDECODABLE;
	__u32 zero = 0;
	struct fanout_quic_scratch *s = bpf_map_lookup_elem(&fanout_quicx, &zero);
	if (!s)
		return FANOUT_QUIC_UNDECODABLE;
	struct fanout_quic_key *entry = bpf_map_lookup_elem(&FANOUT_MAP_QUIC_KEYS, &s->slot);
	if (!entry || !bpf_crypto_encrypt || !bpf_crypto_decrypt)
		return s->client_chosen ? FANOUT_QUIC_FALLBACK : FANOUT_QUIC_UNDECODABLE;
	struct bpf_crypto_ctx *key = entry->ctx;
	if (!key || quic_decrypt(key, s) < 0)
		return s->client_chosen ? FANOUT_QUIC_FALLBACK : FANOUT_QUIC_UNDECODABLE;
	quic_server_id(s);
	return quic_owner(s, chosen);
}
#endif /* FANOUT_NO_QUIC_CRYPTO */

/* Counts a quic_lb listener's outcome (FANOUT_QUIC_NONE: not one). */
static __always_inline void count_quic(__u32 id, __u8 outcome)
{
	if (outcome >= FANOUT_QUIC_OUTCOMES || id >= FANOUT_MAX_LISTENERS)
		return;
	struct fanout_quic_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_QUIC_STATS, &id);
	if (stats)
		stats->outcomes[outcome]++;
}

#endif /* FANOUT_QUIC_H */
