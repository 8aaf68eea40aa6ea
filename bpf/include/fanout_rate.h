/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * Abuse protection in the tc and xdp programs: per-source limits and the amplification cap.
 *
 * Per-source limits in the tc and xdp programs (`rate_limit`, listeners with
 * FANOUT_LISTENER_RATE): each source prefix of a listener has a datagram and a byte bucket, kept
 * as GCRA theoretical arrival times (struct fanout_rate_config says how) in the listener's own
 * LRU hash of `max_sources` entries. The userspace kinds' twin is
 * Sources/FanoutCore/Balancing/SourceRateLimiter.swift.
 *
 * One bucket per source for every CPU, changed with compare-and-exchange (no lock, no per-CPU
 * copy): a source whose flows the NIC spreads over several queues gets its rate once, not once
 * per CPU. A source not in the map yet is a new source: the listener's new-source ceiling is
 * charged (its TAT is in the configuration's array entry), then its entry made. Sources in the
 * listener's `allow` prefixes (an LPM trie) are never limited.
 *
 * The charge of the datagram the xdp program then passes to tc (tc decides again) is kept in a
 * per-CPU record, and given back (fanout_rate_refund) so the datagram is charged once.
 *
 * The amplification cap of nat listeners (`amplification`, FANOUT_LISTENER_AMP): per client
 * (address and port, as the association), the payload bytes it sent and those sent back to it.
 * A reply is checked before it is routed (fanout_amp_capped) and charged where it leaves
 * (fanout_amp_note, from the decision's sent()): a reply the xdp program passes to tc is charged
 * once, by tc.
 */
#ifndef FANOUT_RATE_H
#define FANOUT_RATE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "fanout_shared.h"
#include "parse.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_rate_config);
} FANOUT_MAP_RATE_CONFIGS SEC(".maps");

/* The inner map template: userspace makes one LRU hash per rate_limit listener with
 * max_entries = rate_limit.max_sources. */
struct fanout_rate_bucket_map {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(struct fanout_rate_key));
	__uint(value_size, sizeof(struct fanout_rate_bucket));
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__array(values, struct fanout_rate_bucket_map);
} FANOUT_MAP_RATE_BUCKETS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, FANOUT_RATE_ALLOW_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct fanout_rate_allow_key);
	__type(value, __u8);
} FANOUT_MAP_RATE_ALLOW SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_rate_stats);
} FANOUT_MAP_RATE_STATS SEC(".maps");

/* Per CPU: the last charge (the xdp program gives it back when it passes the datagram to tc). */
struct fanout_rate_charge {
	struct fanout_rate_key key;
	__u32 listener;
	__u32 charged;
	__u64 datagram_cost;
	__u64 byte_cost;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_rate_charge);
} fanout_ratex SEC(".maps");

/* Moves `tat` on by `cost` if that stays within `tolerance` of `now`: 1 when charged. A few
 * tries against other CPUs' charges of the same source; after them a conforming datagram is
 * charged with an atomic add (it may overcharge by the race it lost: the safe side), never
 * refused for the contention. (A TAT never wraps: rate_give_back stops at 0.) */
static __always_inline int rate_charge(__u64 *tat, __u64 cost, __u64 tolerance, __u64 now)
{
	__u64 old = 0, next = 0;
#pragma clang loop unroll(full)
	for (int attempt = 0; attempt < 4; attempt++) {
		old = *(volatile __u64 *)tat;
		next = (old > now ? old : now) + cost;
		if (next - now > tolerance)
			return 0;
		if (__sync_val_compare_and_swap(tat, old, next) == old)
			return 1;
	}
	__sync_fetch_and_add(tat, cost);
	return 1;
}

/* Gives a charge of `cost` back: `tat` moves back by it, never below 0 (an entry the LRU made
 * anew under it holds a small TAT). */
static __always_inline void rate_give_back(__u64 *tat, __u64 cost)
{
#pragma clang loop unroll(full)
	for (int attempt = 0; attempt < 4; attempt++) {
		__u64 old = *(volatile __u64 *)tat;
		__u64 back = old > cost ? old - cost : 0;
		if (__sync_val_compare_and_swap(tat, old, back) == old)
			return;
	}
}

/* Counts a datagram dropped for `listener`'s rates (`new_source`: above the new-source ceiling). */
static __always_inline void rate_count(__u32 listener, __u32 length, int new_source)
{
	struct fanout_rate_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_RATE_STATS, &listener);
	if (!stats)
		return;
	if (new_source)
		stats->new_sources_refused++;
	else
		stats->limited++;
	stats->limited_bytes += length;
}

/* Whether listener `listener`'s datagram of `length` payload bytes from p->saddr goes over its
 * source's rates: 1 (counted, to be dropped) or 0 (charged, or not limited). A global function,
 * verified once; its frame still counts toward the 512-byte stack of the call chain. */
__noinline int fanout_rate_limited(struct packet *p, __u32 listener, __u32 length)
{
	if (!p || listener >= FANOUT_MAX_LISTENERS)
		return 0;
	__u32 id = listener;
	struct fanout_rate_config *config = bpf_map_lookup_elem(&FANOUT_MAP_RATE_CONFIGS, &id);
	void *buckets = bpf_map_lookup_elem(&FANOUT_MAP_RATE_BUCKETS, &id);
	__u32 zero = 0;
	struct fanout_rate_charge *charge = bpf_map_lookup_elem(&fanout_ratex, &zero);
	if (!config || !buckets || !charge)
		return 0;
	charge->charged = 0;
	if (config->has_allow) {
		struct fanout_rate_allow_key allow = {};
		allow.prefixlen = 32 + 128;
		allow.listener = id;
		source_as_ipv6(p, allow.addr);
		if (bpf_map_lookup_elem(&FANOUT_MAP_RATE_ALLOW, &allow))
			return 0;
	}
	struct fanout_rate_key *key = &charge->key;
	/* An IPv4-mapped IPv6 source is keyed as the IPv4 address it is (as the userspace kinds do). */
	int mapped = p->family != AF_INET && p->saddr[0] == 0 && p->saddr[1] == 0 && p->saddr[2] == bpf_htonl(0xffff);
	if (p->family == AF_INET || mapped) {
		key->addr[0] = 0;
		key->addr[1] = 0;
		key->addr[2] = bpf_htonl(0xffff);
		key->addr[3] = p->saddr[mapped ? 3 : 0] & config->ipv4_mask;
	} else {
		key->addr[0] = p->saddr[0] & config->ipv6_mask[0];
		key->addr[1] = p->saddr[1] & config->ipv6_mask[1];
		key->addr[2] = p->saddr[2] & config->ipv6_mask[2];
		key->addr[3] = p->saddr[3] & config->ipv6_mask[3];
	}
	__u64 now = bpf_ktime_get_ns();
	struct fanout_rate_bucket *bucket = bpf_map_lookup_elem(buckets, key);
	if (!bucket) {
		if (config->new_source_interval &&
		    !rate_charge(&config->new_source_tat, config->new_source_interval, config->new_source_tolerance, now)) {
			rate_count(id, length, 1);
			return 1;
		}
		struct fanout_rate_bucket fresh = {};
		/* Another CPU may have made it meanwhile: then its entry is the one charged. */
		bpf_map_update_elem(buckets, key, &fresh, BPF_NOEXIST);
		bucket = bpf_map_lookup_elem(buckets, key);
		if (!bucket)
			return 0;
	}
	__u64 datagram_cost = config->datagram_interval;
	__u64 byte_cost = 0;
	if (datagram_cost && !rate_charge(&bucket->datagram_tat, datagram_cost, config->datagram_tolerance, now))
		goto limited;
	if (config->bytes_per_second) {
		/* Rounded up: at rates above 1e9 bytes/s a datagram still costs what it should, or more. */
		byte_cost = ((__u64)length * 1000000000ull + config->bytes_per_second - 1) / config->bytes_per_second;
		if (!rate_charge(&bucket->byte_tat, byte_cost, config->byte_tolerance, now)) {
			/* The datagram's charge goes back: it is not sent. */
			if (datagram_cost)
				rate_give_back(&bucket->datagram_tat, datagram_cost);
			goto limited;
		}
	}
	charge->listener = id;
	charge->datagram_cost = datagram_cost;
	charge->byte_cost = byte_cost;
	charge->charged = 1;
	return 0;

limited:
	__sync_fetch_and_add(&bucket->limited, 1);
	rate_count(id, length, 0);
	return 1;
}

/* Gives back this CPU's last charge (the xdp program passes the datagram to tc, which decides
 * and charges again). */
static __always_inline void fanout_rate_refund(void)
{
	__u32 zero = 0;
	struct fanout_rate_charge *charge = bpf_map_lookup_elem(&fanout_ratex, &zero);
	if (!charge || !charge->charged)
		return;
	charge->charged = 0;
	__u32 id = charge->listener;
	void *buckets = bpf_map_lookup_elem(&FANOUT_MAP_RATE_BUCKETS, &id);
	if (!buckets)
		return;
	struct fanout_rate_bucket *bucket = bpf_map_lookup_elem(buckets, &charge->key);
	if (!bucket)
		return;
	if (charge->datagram_cost)
		rate_give_back(&bucket->datagram_tat, charge->datagram_cost);
	if (charge->byte_cost)
		rate_give_back(&bucket->byte_tat, charge->byte_cost);
}

/* The amplification cap. */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_amp_config);
} FANOUT_MAP_AMP_CONFIGS SEC(".maps");

struct fanout_amp_client_map {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(struct fanout_amp_key));
	__uint(value_size, sizeof(struct fanout_amp_client));
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__array(values, struct fanout_amp_client_map);
} FANOUT_MAP_AMP_CLIENTS SEC(".maps");

/* Counts a reply (or a later fragment of one) of `listener` the cap dropped. */
static __always_inline void fanout_amp_count(__u32 listener, __u32 length)
{
	struct fanout_rate_stats *stats = listener < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_RATE_STATS, &listener) : NULL;
	if (stats) {
		stats->amplification_capped++;
		stats->amplification_capped_bytes += length;
	}
}

/* The client's entry key: the reply's destination, or the client datagram's source. */
static __always_inline void amp_key(struct packet *p, int reply, struct fanout_amp_key *key)
{
	__u32 *addr = reply ? p->daddr : p->saddr;
	key->addr[0] = addr[0];
	key->addr[1] = p->family == AF_INET ? 0 : addr[1];
	key->addr[2] = p->family == AF_INET ? 0 : addr[2];
	key->addr[3] = p->family == AF_INET ? 0 : addr[3];
	key->port = reply ? p->dport : p->sport;
	key->family = p->family;
	key->pad = 0;
}

/* A reply of listener `listener` with `length` payload bytes toward its client: 1 when it
 * would take the bytes sent back to a client not yet validated past the factor (counted, to be
 * dropped), 0 when it may go (then charged at its send, fanout_amp_note), -1 when no cap applies
 * (no amplification, a client the map does not know, or a validated one). */
__noinline int fanout_amp_capped(struct packet *p, __u32 listener, __u32 length)
{
	if (!p || listener >= FANOUT_MAX_LISTENERS)
		return -1;
	__u32 id = listener;
	struct fanout_amp_config *config = bpf_map_lookup_elem(&FANOUT_MAP_AMP_CONFIGS, &id);
	if (!config || !config->factor)
		return -1;
	void *clients = bpf_map_lookup_elem(&FANOUT_MAP_AMP_CLIENTS, &id);
	if (!clients)
		return -1;
	struct fanout_amp_key key = {};
	amp_key(p, 1, &key);
	struct fanout_amp_client *client = bpf_map_lookup_elem(clients, &key);
	if (!client || client->validated)
		return -1;
	if (client->bytes_out + length <= (__u64)config->factor * client->bytes_in)
		return 0;
	fanout_amp_count(id, length);
	return 1;
}

/* A datagram of listener `listener` left: a client's (`reply` 0: its bytes in, an exchange
 * when a reply went to it since its last one) or a reply to it (its bytes out). */
__noinline int fanout_amp_note(struct packet *p, __u32 listener, __u32 length, __u32 reply)
{
	if (!p || listener >= FANOUT_MAX_LISTENERS)
		return 0;
	__u32 id = listener;
	struct fanout_amp_config *config = bpf_map_lookup_elem(&FANOUT_MAP_AMP_CONFIGS, &id);
	if (!config || !config->factor)
		return 0;
	void *clients = bpf_map_lookup_elem(&FANOUT_MAP_AMP_CLIENTS, &id);
	if (!clients)
		return 0;
	struct fanout_amp_key key = {};
	amp_key(p, reply, &key);
	struct fanout_amp_client *client = bpf_map_lookup_elem(clients, &key);
	if (reply) {
		if (client && !client->validated) {
			__sync_fetch_and_add(&client->bytes_out, length);
			client->replied = 1;
		}
		return 0;
	}
	if (!client) {
		struct fanout_amp_client fresh = {};
		fresh.bytes_in = length;
		if (bpf_map_update_elem(clients, &key, &fresh, BPF_NOEXIST) == 0)
			return 0;
		client = bpf_map_lookup_elem(clients, &key);
		if (!client)
			return 0;
	}
	__sync_fetch_and_add(&client->bytes_in, length);
	if (client->replied) {
		client->replied = 0;
		__u32 exchanges = client->exchanges + 1;
		client->exchanges = exchanges;
		if (config->validated_after && exchanges >= config->validated_after)
			client->validated = 1;
	}
	return 0;
}

#endif /* FANOUT_RATE_H */
