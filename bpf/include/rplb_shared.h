/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * ReusePortLB: every type, constant, map and program name that crosses the kernel/user line.
 *
 * Included by bpf/reuseport_select.bpf.c and imported by Swift through the BPFKernelABI module,
 * so there is exactly one definition of each. The hash below is the one the kernel program
 * computes; Swift calls the same inline function to answer "which member owns this source?".
 */
#ifndef REUSEPORTLB_SHARED_H
#define REUSEPORTLB_SHARED_H

#include <linux/types.h>

/* Bumped whenever a map layout or the meaning of a config field changes: a member of another
 * layout version refuses to join a group created by this one instead of misreading its maps. */
#define RPLB_LAYOUT_VERSION 6

/* The largest group the program serves: the size of the counter map, and the bound of the
 * kernel program's slot scan. */
#define RPLB_MAX_MEMBERS 256

/* Maglev lookup table size: a prime, about 256 entries per member at the largest group, so
 * the share of any member differs from 1/N by well under one percent. */
#define RPLB_TABLE_SIZE 65537

/* How many rehashes the program tries when a source's slot is empty before it scans the
 * slots in order. Each probe is an independent hash, so a dead member's sources spread over
 * the live members in proportion to their table share. */
#define RPLB_MAX_PROBES 16

/* Program and map names, as the ELF object defines them (the identifiers are used by the BPF
 * source, the strings by userspace to find and pin them). Map names are at most 15 bytes. */
#define RPLB_PROG_SELECT        rplb_select
#define RPLB_PROG_SELECT_NAME   "rplb_select"
#define RPLB_MAP_MEMBERS        rplb_members
#define RPLB_MAP_MEMBERS_NAME   "rplb_members"
#define RPLB_MAP_CONFIG         rplb_config
#define RPLB_MAP_CONFIG_NAME    "rplb_config"
#define RPLB_MAP_TABLE          rplb_table
#define RPLB_MAP_TABLE_NAME     "rplb_table"
#define RPLB_MAP_OUTCOMES       rplb_outcomes
#define RPLB_MAP_OUTCOMES_NAME  "rplb_outcomes"
#define RPLB_MAP_DELIVERED      rplb_delivered
#define RPLB_MAP_DELIVERED_NAME "rplb_delivered"
#define RPLB_MAP_RR             rplb_rr
#define RPLB_MAP_RR_NAME        "rplb_rr"
#define RPLB_MAP_QUIC_IDS       rplb_quic_ids
#define RPLB_MAP_QUIC_IDS_NAME  "rplb_quic_ids"
#define RPLB_MAP_QUIC_CONFIG      rplb_quic_cfg
#define RPLB_MAP_QUIC_CONFIG_NAME "rplb_quic_cfg"

/* QUIC-LB server IDs the members registered (RPLB_MAP_QUIC_IDS: server ID, zero-padded to 16
 * octets, to its owner); a member may register several. */
#define RPLB_MAX_SERVER_IDS 4096
struct rplb_server_id {
	__u8 bytes[16];
};
/* Who registered a server ID: the slot the program selects, and the registering socket's cookie
 * (userspace only: a registration whose socket no longer holds the slot is stale). */
struct rplb_server_owner {
	__u32 slot;
	__u32 reserved;
	__u64 cookie;
};

/* How a group spreads datagrams over its members. Chosen by the group's creator. */
enum rplb_policy {
	/* every datagram of one source address to one member (consistent table) */
	RPLB_POLICY_SOURCE_IP = 0,
	/* each datagram to the next member, per CPU: spreads a single heavy sender */
	RPLB_POLICY_ROUND_ROBIN = 1,
	/* every datagram of one source address and port to one member (consistent table) */
	RPLB_POLICY_FIVE_TUPLE = 2,
	RPLB_POLICY_COUNT = 3,
};

/* What happened to one datagram in the program. Deliveries (the first two) are counted per
 * member in the delivered map at RPLB_DELIVERED_KEY(slot, outcome), so a datagram costs one
 * counter update; the others in the outcomes map. */
enum rplb_outcome {
	/* delivered to the member its policy chose first */
	RPLB_OUTCOME_SELECTED = 0,
	/* that member's slot was empty: delivered to another live member (sticky per source) */
	RPLB_OUTCOME_FAILED_OVER = 1,
	/* no live member in the map: left to the kernel's own SO_REUSEPORT hash (still delivered) */
	RPLB_OUTCOME_FALLBACK = 2,
	/* the source address could not be read: left to the kernel's hash (still delivered) */
	RPLB_OUTCOME_UNPARSED = 3,
	/* the program was loaded without settings (capacity 0): left to the kernel's hash */
	RPLB_OUTCOME_NO_CONFIG = 4,
	/* QUIC-LB groups (rplb_quic_config.server_id_length > 0), one of these per datagram besides
	 * its delivery: its destination connection ID named a live member's server ID (delivered
	 * to that member) */
	RPLB_OUTCOME_QUIC_ROUTED = 5,
	/* an Initial or 0-RTT packet whose client-chosen ID names no member: the policy chose */
	RPLB_OUTCOME_QUIC_FALLBACK = 6,
	/* a server-chosen ID whose server ID no live member holds (none registered it, or its
	 * member's slot is empty): the policy chose */
	RPLB_OUTCOME_QUIC_UNKNOWN = 7,
	/* not a QUIC packet of the group's config ID, or too short: the policy chose */
	RPLB_OUTCOME_QUIC_UNDECODABLE = 8,
	RPLB_OUTCOME_COUNT = 9,
};

/* Key of the per-CPU delivered map: one counter per slot and delivery outcome. */
#define RPLB_DELIVERED_KEY(slot, outcome) ((slot) * 2 + (outcome))
#define RPLB_DELIVERED_ENTRIES (RPLB_MAX_MEMBERS * 2)

/* The group's settings: the program's read-only global (set before load) and the single entry
 * of the config map (what later members check their settings against). */
struct rplb_config {
	__u32 layout_version; /* RPLB_LAYOUT_VERSION of the creator */
	__u32 policy;         /* enum rplb_policy */
	__u32 capacity;       /* slots in the members map, 1...RPLB_MAX_MEMBERS */
	__u32 table_size;     /* entries of the lookup table in use, <= RPLB_TABLE_SIZE */
	__u32 seed;           /* hash seed chosen by userspace */
	__u32 steering_override; /* enum rplb_override: 0 while this group's program is attached */
};

/* A QUIC-LB group's configuration (plaintext server IDs): the program's second read-only
 * global and the single entry of RPLB_MAP_QUIC_CONFIG (what later members check theirs
 * against). All zero: the group does not route by connection ID. Apart from rplb_config, whose
 * size older members read into. */
struct rplb_quic_config {
	__u32 server_id_length; /* octets of server ID, 1...15 */
	__u32 nonce_length;     /* octets of nonce after it, 4...18 */
	__u32 config_id;        /* the config rotation codepoint, 0...6 */
	__u32 reserved;
};

/* The program's read-only global (its .rodata holds this alone): the group's settings and its
 * QUIC-LB configuration. */
struct rplb_program_settings {
	struct rplb_config config;
	struct rplb_quic_config quic;
};

/* Written into the config map by a member that was explicitly forced to replace the group's
 * eBPF program (userspace only: the program never reads it), so every other member can report
 * the steering really in force. A member that attaches the program again resets it. */
enum rplb_override {
	RPLB_OVERRIDE_NONE = 0,
	RPLB_OVERRIDE_CLASSIC_BPF = 1,
	RPLB_OVERRIDE_KERNEL_HASH = 2,
};

/* Murmur3-style 32-bit hash over up to four 32-bit words (an IPv4 address is one word, an
 * IPv6 address four, a port is mixed in as one more word by the caller). Words are taken as
 * they lie in memory (network order), on both sides, so the result is the same in the kernel
 * and in userspace on one host. */
static inline __u32 rplb_rotl32(__u32 x, __u32 r)
{
	return (x << r) | (x >> (32 - r));
}

static inline __u32 rplb_mix_word(__u32 h, __u32 w)
{
	w *= 0xcc9e2d51U;
	w = rplb_rotl32(w, 15);
	w *= 0x1b873593U;
	h ^= w;
	h = rplb_rotl32(h, 13);
	return h * 5 + 0xe6546b64U;
}

static inline __u32 rplb_finish(__u32 h, __u32 length)
{
	h ^= length;
	h ^= h >> 16;
	h *= 0x85ebca6bU;
	h ^= h >> 13;
	h *= 0xc2b2ae35U;
	h ^= h >> 16;
	return h;
}

/* Hash of a source: `nwords` is 1 (IPv4) or 4 (IPv6); `extra` is the source port for the
 * five-tuple policy and 0 otherwise; `probe` selects an independent hash for each failover
 * probe (0 for the first choice). */
static inline __u32 rplb_source_hash(const __u32 *words, __u32 nwords, __u32 extra,
				     __u32 seed, __u32 probe)
{
	__u32 h = seed ^ (probe * 0x9e3779b9U);
	h = rplb_mix_word(h, words[0]);
	if (nwords == 4) {
		h = rplb_mix_word(h, words[1]);
		h = rplb_mix_word(h, words[2]);
		h = rplb_mix_word(h, words[3]);
	}
	if (extra != 0)
		h = rplb_mix_word(h, extra);
	return rplb_finish(h, nwords * 4);
}

/* Maps a 32-bit hash onto [0, size) without a division (Lemire's multiply-shift reduction):
 * the kernel's hot path avoids a divide, and userspace calls the same function. */
static inline __u32 rplb_reduce(__u32 hash, __u32 size)
{
	return (__u32)(((__u64)hash * size) >> 32);
}

#endif /* REUSEPORTLB_SHARED_H */
