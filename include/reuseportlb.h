// SPDX-License-Identifier: Apache-2.0
/*
 * ReusePortLB C API: join a SO_REUSEPORT UDP group whose datagrams are steered by source
 * address (or round robin, or five-tuple) by an sk_reuseport program, from a C collector.
 *
 *   cc app.c $(pkg-config --cflags --libs reuseportlb)
 *
 * Every call returns 0 (or a value) on success and a negative errno-style code on failure
 * (-EINVAL for a NULL member handle); calls that take `error`/`error_size` write a message that
 * names the problem and its fix, cut to fit the buffer: a buffer of REUSEPORTLB_ERROR_MAX bytes
 * holds every message whole.
 *
 * The library's SONAME is libreuseportlb.so.0 (make install puts libreuseportlb.so.0 and the
 * libreuseportlb.so link to it in $(PREFIX)/lib).
 */
#ifndef REUSEPORTLB_H
#define REUSEPORTLB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* How the group spreads datagrams (the group's creator chooses; values match the kernel's). */
enum reuseportlb_policy {
	REUSEPORTLB_SOURCE_IP = 0,   /* every datagram of one source address to one member */
	REUSEPORTLB_ROUND_ROBIN = 1, /* each datagram to the next member: spreads a heavy sender */
	REUSEPORTLB_FIVE_TUPLE = 2,  /* every datagram of one source address and port to one member */
};

/* Size of an error buffer that holds any message whole (longer ones do not exist; a shorter
 * buffer gets the message cut, always NUL-terminated). */
#define REUSEPORTLB_ERROR_MAX 1024

/* Pass as `slot` to take the lowest free slot. */
#define REUSEPORTLB_ANY_SLOT (-1)

/* One member of a group: an opaque handle. */
typedef struct reuseportlb_member reuseportlb_member;

/* The kernel program's counters for the whole group (eBPF steering only). */
struct reuseportlb_counters {
	uint64_t selected;    /* delivered to the member the policy chose first */
	uint64_t failed_over; /* that member was gone: delivered to another live member */
	uint64_t fallback;    /* no live member: left to the kernel's hash (still delivered) */
	uint64_t unparsed;    /* source unreadable: left to the kernel's hash */
	uint64_t no_config;   /* group config missing: left to the kernel's hash */
};

/* Joins the group ip:port (IPv4 or IPv6 text, not scoped; port 1...65535) at `slot` (or
 * REUSEPORTLB_ANY_SLOT) of a group of `capacity` slots with `policy`. On success stores the
 * member in *member and returns 0; -EINVAL for port 0, a bad address, policy or slot. */
int reuseportlb_join(const char *ip, uint16_t port, int slot, unsigned int capacity,
		     enum reuseportlb_policy policy, reuseportlb_member **member,
		     char *error, size_t error_size);

/* Takes `slot` over from the member holding it (zero-loss handover): new datagrams of that slot
 * come to the new member at once; the old one sees reuseportlb_is_replaced() return 1, reads
 * until its queue is empty (reuseportlb_queued_bytes() == 0) and leaves. */
int reuseportlb_takeover(const char *ip, uint16_t port, int slot, unsigned int capacity,
			 enum reuseportlb_policy policy, reuseportlb_member **member,
			 char *error, size_t error_size);

/* The member's bound UDP socket: receive on it with recv/recvmmsg. Do not close it. */
int reuseportlb_socket(const reuseportlb_member *member);

/* The member's slot. */
int reuseportlb_slot(const reuseportlb_member *member);

/* "ebpf", "classicBPF" or "kernelHash": the steering in force for the group (a member forced
 * in without eBPF may have replaced the group's program). NULL for a NULL member. */
const char *reuseportlb_steering(const reuseportlb_member *member);

/* 1 once another member took this slot over, 0 otherwise, -EINVAL for a NULL member. */
int reuseportlb_is_replaced(const reuseportlb_member *member);

/* Bytes queued on the socket for reading (>= 0), or a negative errno. */
int64_t reuseportlb_queued_bytes(const reuseportlb_member *member);

/* Fills *counters; -EOPNOTSUPP without eBPF steering. */
int reuseportlb_counters(const reuseportlb_member *member, struct reuseportlb_counters *counters);

/* Stores in *slot the slot that receives datagrams of source_ip (and, for a five-tuple group,
 * source_port; other policies ignore it) now; -ENOENT if no member is live, -EINVAL for a bad
 * address, -EOPNOTSUPP without eBPF steering or for round robin. */
int reuseportlb_owner(const reuseportlb_member *member, const char *source_ip, uint16_t source_port,
		      int *slot);

/* Takes the member's slot out of selection, for a leave that loses nothing: its sources fail
 * over to the live members at once and what is queued stays on the socket. Blocks for a grace
 * period of the kernel (membarrier(2) MEMBARRIER_CMD_GLOBAL, milliseconds; 50 ms where the kernel
 * refuses it), after which a datagram the kernel steered to this member just before is queued
 * on its socket. Then read until reuseportlb_queued_bytes() returns 0 and nothing new arrived
 * for ~100 ms, and call
 * reuseportlb_leave(). Returns 0 (also if the slot was already taken over or withdrawn),
 * -EOPNOTSUPP with classic BPF or kernel-hash steering (no slot to withdraw: the member keeps its
 * share until reuseportlb_seal() takes the socket out of the kernel's group), or a negative
 * errno. */
int reuseportlb_withdraw(reuseportlb_member *member);

/* Stops the kernel delivering any new datagram to the member's socket, whatever steers the
 * group, so its close loses nothing: a close takes the socket out of the kernel's reuseport
 * group before it unhashes it, and a datagram whose lookup meets it in between is freed with the
 * socket, uncounted. Call it once the socket is out of selection (after reuseportlb_withdraw(),
 * or once reuseportlb_is_replaced()), read until reuseportlb_queued_bytes() returns 0, then
 * reuseportlb_leave(); a member that answers from its socket drains first, seals, and reads once
 * more. A member still in its slot leaves selection with the seal (its sources fail over). It binds the socket to interface index 2147483647
 * (SO_BINDTOIFINDEX), which no device has, and blocks for a grace period of the kernel, like
 * reuseportlb_withdraw(). Sends from a sealed socket fail (ENODEV for IPv4, ENETUNREACH for
 * IPv6). Returns 0 (also when sealed already), -EPERM when the socket is bound to a device
 * already and the process lacks CAP_NET_RAW, or a negative errno. */
int reuseportlb_seal(reuseportlb_member *member);

/* The group's NetFlow v9 / IPFIX template store (eBPF steering, pinned beside the group): every
 * member passes each datagram it receives to reuseportlb_templates_learn(); a member that meets
 * a data set whose template it does not know asks reuseportlb_templates_lookup(), so exporters
 * it takes over from another member decode at once. The last member to leave removes it. */
typedef struct reuseportlb_templates reuseportlb_templates;
/* What the store did, for this process. */
struct reuseportlb_template_counters {
	uint64_t written;           /* templates and options templates written */
	uint64_t withdrawn;         /* deleted by an IPFIX withdrawal */
	uint64_t refused_too_large; /* larger than REUSEPORTLB_TEMPLATE_MAX bytes: not stored */
	uint64_t refused_full;      /* the store was full: not stored */
	uint64_t failed;            /* writes or deletes the kernel refused otherwise */
	uint64_t malformed;         /* version 9/10 datagrams whose sets do not add up */
	uint64_t found;             /* lookups answered */
	uint64_t missing;           /* lookups that found nothing */
};
/* The largest template record the store holds, in bytes. */
#define REUSEPORTLB_TEMPLATE_MAX 1020
/* Opens (or creates) the store of the member's group. -EOPNOTSUPP (with the reason in `error`)
 * when the member does not use eBPF steering in a pinned group. */
int reuseportlb_templates_open(reuseportlb_member *member, reuseportlb_templates **store,
			       char *error, size_t error_size);
/* Stores the templates the datagram defines and deletes those it withdraws (IPFIX); `exporter`
 * is its source (struct sockaddr_in or sockaddr_in6, as recvfrom/recvmmsg give it). Returns how
 * many templates were written or deleted (0 for data alone or not NetFlow v9/IPFIX), -EINVAL for
 * a NULL store or another address family. */
int reuseportlb_templates_learn(reuseportlb_templates *store, const void *datagram, size_t length,
				const void *exporter);
/* Copies the record of template `template_id` of the exporter (its address, version 9 or 10,
 * observation domain or source ID) into `record` and sets *options (may be NULL) to 1 for an
 * options template. Returns the record's length, -ENOENT if none is stored, -ENOSPC if
 * record_size is too small (REUSEPORTLB_TEMPLATE_MAX always fits), -EINVAL for bad arguments. */
int reuseportlb_templates_lookup(reuseportlb_templates *store, const void *exporter, uint16_t version,
				 uint32_t domain, uint16_t template_id, void *record, size_t record_size,
				 int *options);
/* Fills *counters; -EINVAL for NULL. */
int reuseportlb_templates_counters(const reuseportlb_templates *store,
				   struct reuseportlb_template_counters *counters);
/* Closes this process's handle (the store stays with the group) and frees it (NULL: nothing). */
void reuseportlb_templates_close(reuseportlb_templates *store);
/* QUIC-LB (draft-ietf-quic-load-balancers): how QUIC servers put a server ID into the
 * connection IDs they issue. A group created with one (reuseportlb_join_quic) sends a datagram
 * whose destination connection ID carries a member's server ID to that member, from any source
 * address (a client that changed address keeps its server); the others (a client's first
 * packets, unknown IDs) go by the group's policy. The group's sk_reuseport program reads
 * plaintext server IDs: the group's configuration has no key. The encoder below takes keys too
 * (for servers behind udp-fanout's quic_lb). The group's policy is sourceIP or fiveTuple (round
 * robin would spread a client's first flight): -EOPNOTSUPP otherwise. */
struct reuseportlb_quic_lb {
	uint8_t config_id;        /* 0...6: the top three bits of each connection ID */
	uint8_t server_id_length; /* 1...15 octets */
	uint8_t nonce_length;     /* 4...18 octets; with server_id_length at most 19 */
	const uint8_t *key;       /* 16 octets (AES-128), or NULL: plaintext server IDs */
};
/* The longest connection ID the encoder writes (QUIC v1's limit). */
#define REUSEPORTLB_CONNECTION_ID_MAX 20
/* Joins as reuseportlb_join does, in a group that routes by connection ID under `quic` (which
 * must match the group's), and registers `server_id` (quic->server_id_length octets; NULL:
 * none) for the member's slot. eBPF steering only: -EOPNOTSUPP without CAP_BPF or with a key. */
int reuseportlb_join_quic(const char *ip, uint16_t port, int slot, unsigned int capacity,
			  enum reuseportlb_policy policy, const struct reuseportlb_quic_lb *quic,
			  const uint8_t *server_id, reuseportlb_member **member,
			  char *error, size_t error_size);
/* Takes `slot` over as reuseportlb_takeover does, in a QUIC-LB group: the server IDs registered
 * for the slot stay with it (the new process serves their connections); registers `server_id`
 * too (NULL: none). A member that joins an empty slot instead drops its last holder's IDs. */
int reuseportlb_takeover_quic(const char *ip, uint16_t port, int slot, unsigned int capacity,
			      enum reuseportlb_policy policy, const struct reuseportlb_quic_lb *quic,
			      const uint8_t *server_id, reuseportlb_member **member,
			      char *error, size_t error_size);
/* Registers one more server ID for the member's slot; -EEXIST if a live member holds it,
 * -EINVAL for a group without QUIC-LB or an ID of another length. */
int reuseportlb_quic_register(reuseportlb_member *member, const uint8_t *server_id, size_t length,
			      char *error, size_t error_size);
/* Takes back a server ID this member registered: its datagrams go by the policy. -ENOENT if
 * the member did not register it (or was replaced), -EINVAL for bad arguments. */
int reuseportlb_quic_withdraw(reuseportlb_member *member, const uint8_t *server_id, size_t length);
/* Writes a connection ID naming `server_id` with `nonce` (random; with a key, never repeated)
 * into connection_id (size at least 1 + server_id_length + nonce_length, which it returns);
 * the first octet carries the config ID and the length of the rest. -EINVAL (message in
 * `error`) for a configuration out of the draft's ranges, -ENOSPC for a short buffer. */
int reuseportlb_quic_encode(const struct reuseportlb_quic_lb *quic, const uint8_t *server_id,
			    const uint8_t *nonce, uint8_t *connection_id, size_t size,
			    char *error, size_t error_size);
/* Copies the server ID a connection ID carries into server_id and returns its length;
 * -ENOENT if the ID is shorter than the configuration's or of another config ID, -EINVAL for a
 * bad configuration, -ENOSPC for a short buffer. */
int reuseportlb_quic_decode(const struct reuseportlb_quic_lb *quic, const uint8_t *connection_id,
			    size_t length, uint8_t *server_id, size_t size);
/* The group program's QUIC-LB outcomes (besides struct reuseportlb_counters' deliveries). */
struct reuseportlb_quic_counters {
	uint64_t routed;            /* the ID named a registered member */
	uint64_t fallback;          /* an Initial or 0-RTT packet's client-chosen ID: the policy chose */
	uint64_t unknown_server_id; /* a server ID no live member holds: the policy chose */
	uint64_t undecodable;       /* not QUIC of the group's config ID, or too short: the policy chose */
};
/* Fills *counters; -EOPNOTSUPP without eBPF steering. */
int reuseportlb_quic_counters(const reuseportlb_member *member, struct reuseportlb_quic_counters *counters);

/* Leaves the group (closes the socket; the last member out removes the group's pins) and frees
 * the handle (NULL: nothing). Whatever is still queued on the socket is dropped: call reuseportlb_withdraw()
 * and drain first. */
void reuseportlb_leave(reuseportlb_member *member);

#ifdef __cplusplus
}
#endif

#endif
