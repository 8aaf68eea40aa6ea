// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * sk_reuseport program of ReusePortLB: picks the member socket of a SO_REUSEPORT UDP group
 * for each datagram.
 *
 * sourceIP / fiveTuple: hash the source (address, or address and port) with the group's seed
 * into a Maglev table over all slots. If that slot is empty (its process died or left), rehash
 * with the next probe number, then scan the slots in order: every source still lands on exactly
 * one live member, and returns to its own slot as soon as a socket fills it again.
 * roundRobin: a per-CPU counter walks the slots, skipping empty ones.
 *
 * QUIC-LB (rplb_settings.quic.server_id_length > 0): before the policy, the server ID in the
 * datagram's QUIC destination connection ID (plaintext, draft-ietf-quic-load-balancers) is
 * looked up among the IDs the members registered; a match goes to that member, anything else
 * to the policy.
 *
 * Nothing is dropped: when no member can be selected the program returns SK_PASS without a
 * selection, and the kernel's own hash delivers the datagram. Every outcome is counted.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "rplb_shared.h"

struct {
	__uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
	__uint(max_entries, RPLB_MAX_MEMBERS); /* set to the group's capacity before load */
	__type(key, __u32);
	__type(value, __u64);
} RPLB_MAP_MEMBERS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rplb_config);
} RPLB_MAP_CONFIG SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RPLB_TABLE_SIZE);
	__type(key, __u32);
	__type(value, __u32);
} RPLB_MAP_TABLE SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RPLB_OUTCOME_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} RPLB_MAP_OUTCOMES SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RPLB_DELIVERED_ENTRIES);
	__type(key, __u32);
	__type(value, __u64);
} RPLB_MAP_DELIVERED SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} RPLB_MAP_RR SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, RPLB_MAX_SERVER_IDS);
	__type(key, struct rplb_server_id);
	__type(value, struct rplb_server_owner);
} RPLB_MAP_QUIC_IDS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rplb_quic_config);
} RPLB_MAP_QUIC_CONFIG SEC(".maps");

/* The group's settings, written by its creator before load (bpf_map__set_initial_value on
 * .rodata) and frozen: the verifier then prunes the other policies' code. The config map holds
 * the same values for the members that join later. */
const volatile struct rplb_program_settings rplb_settings = {};

static __always_inline void count_outcome(__u32 outcome)
{
	__u64 *value = bpf_map_lookup_elem(&RPLB_MAP_OUTCOMES, &outcome);
	if (value)
		*value += 1;
}

/* Selects `slot` if a live socket holds it; counts the delivery to that member under
 * `outcome` (RPLB_OUTCOME_SELECTED or RPLB_OUTCOME_FAILED_OVER): one update per datagram. */
static __always_inline int try_slot(struct sk_reuseport_md *md, __u32 slot, __u32 outcome)
{
	if (bpf_sk_select_reuseport(md, &RPLB_MAP_MEMBERS, &slot, 0) != 0)
		return 0;
	__u32 key = RPLB_DELIVERED_KEY(slot, outcome);
	__u64 *value = bpf_map_lookup_elem(&RPLB_MAP_DELIVERED, &key);
	if (value)
		*value += 1;
	return 1;
}

/* State of one slot scan, shared with its bpf_loop callback. Every field is 8 bytes and
 * written whole, so no store is narrower than the stack slot it lands in. */
struct scan_state {
	struct sk_reuseport_md *md;
	__u64 start;
	__u64 capacity;
	__u64 found;
};

static long scan_step(__u32 i, void *data)
{
	struct scan_state *state = data;
	__u32 slot = (__u32)state->start + i;
	if (slot >= (__u32)state->capacity)
		slot -= (__u32)state->capacity;
	if (try_slot(state->md, slot, RPLB_OUTCOME_FAILED_OVER)) {
		state->found = 1;
		return 1; /* stop */
	}
	return 0;
}

/* Walks all slots once, starting at `start`; the first live one wins (a failover).
 * bpf_loop, not a for loop: a verifier without CAP_PERFMON (CAP_BPF alone) refuses the
 * open-coded scan ("infinite loop detected"), since it cannot tell its iterations apart.
 * Not inlined: its own stack frame holds the spilled context pointer, so no later narrow store
 * of the caller reuses that slot (refused without CAP_PERFMON as a corrupted spilled pointer). */
static __noinline int scan_slots(struct sk_reuseport_md *md, __u32 start, __u32 capacity)
{
	struct scan_state state = { .md = md, .start = start, .capacity = capacity, .found = 0 };
	if (capacity > RPLB_MAX_MEMBERS)
		return 0;
	bpf_loop(capacity, scan_step, &state, 0);
	return state.found;
}

static __always_inline int select_round_robin(struct sk_reuseport_md *md, __u32 capacity)
{
	__u32 zero = 0;
	__u32 *next = bpf_map_lookup_elem(&RPLB_MAP_RR, &zero);
	if (!next)
		return 0;
	__u32 start = *next % capacity;
	*next = start + 1;
	if (try_slot(md, start, RPLB_OUTCOME_SELECTED))
		return 1;
	return scan_slots(md, start, capacity);
}

/* One table probe: selects the slot the source's `probe`-th hash names, if it is live. */
static __always_inline int try_probe(struct sk_reuseport_md *md, const __u32 *words, __u32 nwords,
				     __u32 port, __u32 seed, __u32 table_size, __u32 probe,
				     __u32 *hash)
{
	*hash = rplb_source_hash(words, nwords, port, seed, probe);
	__u32 index = rplb_reduce(*hash, table_size);
	__u32 *slot = bpf_map_lookup_elem(&RPLB_MAP_TABLE, &index);
	return slot && try_slot(md, *slot, probe == 0 ? RPLB_OUTCOME_SELECTED : RPLB_OUTCOME_FAILED_OVER);
}

static __always_inline int select_by_source(struct sk_reuseport_md *md, __u32 policy,
					    __u32 capacity, __u32 table_size, __u32 seed)
{
	__u32 words[4] = {};
	__u32 nwords;
	__u32 port = 0;

	if (md->eth_protocol == bpf_htons(ETH_P_IP)) {
		if (bpf_skb_load_bytes_relative(md, 12, words, 4, BPF_HDR_START_NET))
			goto unparsed;
		nwords = 1;
	} else if (md->eth_protocol == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes_relative(md, 8, words, 16, BPF_HDR_START_NET))
			goto unparsed;
		nwords = 4;
	} else {
		goto unparsed;
	}
	if (policy == RPLB_POLICY_FIVE_TUPLE) {
		/* data starts at the UDP header: the source port is its first two bytes */
		__u8 *data = md->data;
		if (data + 2 > (__u8 *)md->data_end)
			goto unparsed;
		port = (__u32)data[0] << 8 | data[1];
	}

	/* The first probe outside the loop: the common case, with probe 0 folded in. */
	__u32 hash = 0;
	if (try_probe(md, words, nwords, port, seed, table_size, 0, &hash))
		return 1;
	/* Unrolled for the same reason as scan_slots: no back edge for the verifier to judge. */
#pragma unroll
	for (__u32 probe = 1; probe < RPLB_MAX_PROBES; probe++) {
		if (try_probe(md, words, nwords, port, seed, table_size, probe, &hash))
			return 1;
	}
	return scan_slots(md, rplb_reduce(hash, capacity), capacity);

unparsed:
	count_outcome(RPLB_OUTCOME_UNPARSED);
	return -1;
}

/* QUIC-LB: the member whose registered server ID the datagram's destination connection ID
 * carries. Returns 1 when it was selected (counted routed), 0 when the policy must choose (with
 * the QUIC outcome counted: a registered ID whose member's slot is empty counts unknown).
 * md->data is the UDP header: the QUIC packet is at 8. */
static __always_inline int select_by_connection_id(struct sk_reuseport_md *md, __u32 id_length,
						   __u32 nonce_length, __u32 config_id)
{
	__u8 head[6] = {};
	__u32 id_offset;
	int client_chosen = 0;

	if (id_length == 0 || id_length > 15)
		goto undecodable;
	if (bpf_skb_load_bytes(md, 8, head, 2))
		goto undecodable;
	if (head[0] & 0x80) {
		/* Long header: version (4 octets), then the destination ID's length and the ID. */
		if (bpf_skb_load_bytes(md, 8, head, 6))
			goto undecodable;
		__u32 version = (__u32)head[1] << 24 | (__u32)head[2] << 16 | (__u32)head[3] << 8 | head[4];
		__u32 type = (head[0] >> 4) & 3;
		if (version == 0)
			goto undecodable; /* version negotiation */
		if (version == 1)
			client_chosen = type == 0 || type == 1;          /* v1 Initial, 0-RTT */
		else if (version == 0x6b3343cf)
			client_chosen = type == 1 || type == 2;          /* v2 Initial, 0-RTT */
		else
			client_chosen = 1; /* another version: a client's first packet (version negotiation follows) */
		if (head[5] < 1 + id_length + nonce_length)
			goto fallback;
		id_offset = 8 + 6;
	} else {
		id_offset = 8 + 1;
	}
	__u8 first = 0;
	if (bpf_skb_load_bytes(md, id_offset, &first, 1))
		goto fallback;
	if ((__u32)(first >> 5) != config_id)
		goto fallback;
	/* A short header does not say its ID's length: the configuration's must be there whole. */
	__u8 last = 0;
	if (bpf_skb_load_bytes(md, id_offset + id_length + nonce_length, &last, 1))
		goto fallback;
	struct rplb_server_id key = {};
	if (bpf_skb_load_bytes(md, id_offset + 1, key.bytes, id_length & 15))
		goto fallback;
	struct rplb_server_owner *owner = bpf_map_lookup_elem(&RPLB_MAP_QUIC_IDS, &key);
	if (!owner || !try_slot(md, owner->slot, RPLB_OUTCOME_SELECTED)) {
		count_outcome(client_chosen ? RPLB_OUTCOME_QUIC_FALLBACK : RPLB_OUTCOME_QUIC_UNKNOWN);
		return 0;
	}
	count_outcome(RPLB_OUTCOME_QUIC_ROUTED);
	return 1;

fallback:
	if (client_chosen) {
		count_outcome(RPLB_OUTCOME_QUIC_FALLBACK);
		return 0;
	}
undecodable:
	count_outcome(RPLB_OUTCOME_QUIC_UNDECODABLE);
	return 0;
}

SEC("sk_reuseport")
int RPLB_PROG_SELECT(struct sk_reuseport_md *md)
{
	/* read once: volatile keeps clang from folding the zero initialiser */
	__u32 policy = rplb_settings.config.policy;
	__u32 capacity = rplb_settings.config.capacity;
	__u32 table_size = rplb_settings.config.table_size;
	__u32 seed = rplb_settings.config.seed;
	if (capacity == 0 || capacity > RPLB_MAX_MEMBERS || table_size == 0 || table_size > RPLB_TABLE_SIZE) {
		count_outcome(RPLB_OUTCOME_NO_CONFIG);
		return SK_PASS;
	}
	__u32 quic_id_length = rplb_settings.quic.server_id_length;
	if (quic_id_length != 0 &&
	    select_by_connection_id(md, quic_id_length, rplb_settings.quic.nonce_length, rplb_settings.quic.config_id))
		return SK_PASS;
	int selected;
	if (policy == RPLB_POLICY_ROUND_ROBIN)
		selected = select_round_robin(md, capacity);
	else
		selected = select_by_source(md, policy, capacity, table_size, seed);
	if (selected == 0)
		count_outcome(RPLB_OUTCOME_FALLBACK);
	/* SK_PASS without a successful selection: the kernel's reuseport hash picks the socket */
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
